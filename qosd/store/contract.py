"""The one declaration of what qosd/store/redis.py and the Lua scripts exchange.

Script arguments and replies are flat positional lists: Redis passes ``ARGV`` as
strings and returns a Lua table as an array. Counting positions by hand on both
sides would let one side move unseen, so each list is declared once, here:

- a layout is a ``NamedTuple``: its fields, in order, are the positions. redis.py
  builds arguments by keyword and reads replies by name through them;
- codes (reasons, statuses, settlement states) come from the enums below, the
  domain's where the domain has one (:class:`qosd.model.Reason`,
  :class:`qosd.model.WaiterState`);
- ``scripts/gen_lua_contract.py`` writes the same facts as Lua constants into
  ``lua/_contract.lua`` (``REASON_RATE_LIMITED``, ``STATUS_ADMITTED``,
  ``CLASS_ARGS``, ``ARG_CLASS_RATE``, ...) and as tables into docs/design.md, and
  fails with ``--check`` when either checked-in copy differs from this module.

Lua positions are 1-based within their layout, so a script reads a field as
``ARGV[a + ARG_CLASS_RATE]`` where ``a`` counts the values before the layout, and
writes one as ``reply[n + REPLY_DECISION_STATUS]``.

A packed layout (``PACKED``: the pool's and each class's policy, and one record per
request of a batch) travels as one argument, its fields joined by
``FIELD_SEPARATOR``: the Lua reads it with
``record(ARGV[a + ARG_REQUEST_RECORD])`` (lua/pool/args.lua) and a field as
``r[ARG_REQUEST_LEASE_ID]``; ``REQUEST_ARGS`` is 1.
Encoding each field as a RESP argument of its own was a quarter of the daemon's
Python per Acquire (docs/performance.md); one string per record is a join, and the
policy's is made once per policy.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

from qosd.model import Reason, WaiterState

# -- codes ---------------------------------------------------------------------------


@enum.unique
class Status(enum.IntEnum):
    """A call's status in acquire and pump replies (``STATUS_*`` in Lua).

    A pump reports a waiter's state, so those values are :class:`WaiterState`'s;
    acquire adds the two answers a new request can get besides admission.
    """

    REJECTED = 0
    ADMITTED = WaiterState.ADMITTED
    QUEUED = 2
    WAITING = WaiterState.WAITING
    GONE = WaiterState.GONE
    HELD = WaiterState.HELD
    LATE = WaiterState.LATE
    # The request id names another request's lease, or its place in a queue: a second
    # request under one id is refused, never run on the first one's lease.
    DUPLICATE = 7


class Settled(enum.StrEnum):
    """A release's status (``SETTLED_*`` in Lua): strings, as they read in MONITOR."""

    RELEASED = "released"
    AGAIN = "again"  # settled before: the first answer again
    EXPIRED = "expired"
    UNKNOWN = "unknown"


@enum.unique
class Take(enum.IntEnum):
    """How an admission is paid for (``TAKE_*`` in Lua; 0: it cannot be, now)."""

    OWN = 1  # from the class's own tokens (or, above its burst, from a full bucket)
    BORROW = 2  # its own, then the pool's shared tokens
    OVER = 3  # a GPU-gated pool's admission over the class's share, into bounded debt


#: The scripts' tunables: numbers that shape behaviour but no layout.
TUNABLES: tuple[tuple[str, int, str], ...] = (
    ("SWEEP_SECONDS", 64, "seconds of lease expiries one pool call ends, at most"),
    ("WAITER_PAGE", 8, "queue entries read at a time while looking for a class's head"),
    ("WAITER_LOOKAHEAD", 64, "blocked entries looked past for a class's head, at most"),
    ("MAX_ADMITTED_PER_PUMP", 64, "waiters one pump admits, at most"),
    ("ROOM_RETRY_MS", 50, "a GPU-gated refusal's retry-after: room comes with no refill"),
    ("LONG_PREFILL_RETRY_MS", 1000, "a long prompt's retry-after: gaps are unpredictable"),
    ("TOP_PEAK_RESERVE_PCT", 50, "the most of the bound the top class's peak demand keeps free, %"),
    ("MIN_PREFILL_SHARE_PCT", 5, "the least prefill share a decode model leaves lower classes, %"),
)

#: ARGV position, in every pool script, of the number of calls in the batch
#: (qosd/store/batching.py puts it first); the pool's policy follows it.
ARG_CALLS = 1

#: What joins the fields of a packed record (a value never holds it: names are
#: checked free of control characters where they enter, numbers are digits).
FIELD_SEPARATOR = "\x1f"

# -- argument layouts ----------------------------------------------------------------


class PoolArgs(NamedTuple):
    """The pool's policy as configured, after the number of calls."""

    capacity: str
    burst_s: str  # of the shared tokens
    stale_after_ms: int
    class_count: int
    lease_ttl_ms: int  # the default: its expiry second is read with the state
    max_in_flight: str  # 0: none; this or the next makes the pool GPU-gated
    max_in_flight_tokens: str  # 0: none
    top_reserve: str
    top_peak_half_life_us: int  # 0: the reserve is top_reserve alone
    prefill_backlog_us: str  # 0: none
    prefill_share: str
    max_server_waiting: int  # -1: none
    max_kv_cache_usage: str  # 0: none
    server_load_max_age_us: int
    # 1: the servers take the top class's prompts before the others' (priority
    # scheduling, and chunked, a cap on one prompt's tokens per pass), so the top class
    # waits behind its own prefill alone; 0: behind every prompt admitted before it.
    servers_by_priority: int
    # > 0: and they chunk prefill under a cap on one prompt's tokens per pass, so the
    # prompts in prefill share every pass rather than go one after another: a new
    # top-class prompt prefills beside the top class's backlog, each prompt there
    # costing it this many times its own prefill (policy.SHARED_PASS_STRETCH); 0: no.
    shared_pass_stretch: str
    # What a request costs: (prompt + output_weight x output tokens) x class weight
    # (formulas.lua: formula.cost, the one statement of the rule).
    output_weight: str
    # Servers that prefill oldest first: the most of the time lower classes' prompts
    # may keep the top class's next prompt waiting past the backlog bound (1: no limit),
    # and how much of that time may be spent at once after a quiet spell.
    top_blocked_share: str
    top_blocked_burst_us: int
    # The servers the prompts are spread over, each taking the next from the earliest
    # free: so many real prefill clocks (`Bt` the earliest, `Bs` the others).
    servers: int


class ClassArgs(NamedTuple):
    """One class's policy; one per class, in priority order, after the pool's."""

    name: str
    rate: str
    burst: str
    max_cost: str
    can_borrow: int  # 1 or 0
    max_queue: int
    aging_ms: int
    tenant_rate: str
    tenant_burst: str
    floor_rate: str
    burst_s: str  # 0: the burst is fixed
    tenant_share: str
    # > 0: the class's tenants share it by tokens (fairness: vtc), each tenant's
    # counter kept this long after its last charge; 0: first come, first served.
    fair_idle_ms: int


class EpochArgs(NamedTuple):
    """After the classes: the pool's epoch as the caller last saw it ('' when it saw
    none: a state found missing while one was known was lost, and starts empty) and
    the nonce a new epoch takes."""

    known: str
    nonce: str


class AcquireArgs(NamedTuple):
    """acquire.lua's own arguments, once per batch."""

    deadline_us: str  # of Redis time; 0: none. A batch run later changes nothing
    daemon: str


class RequestArgs(NamedTuple):
    """One request of an acquire batch."""

    qos_class: str
    lease_id: str
    field: str  # "<class>:<token>": the lease's field, and its waiter id
    ttl_ms: int
    keep_ms: int  # how long the lease hash must live
    weight: str
    input_tokens: int
    output_tokens: int
    wait_ms: int  # 0: answer now; the class's max wait, as the caller capped it
    # The request's TTFT objective, ms ('0': none). With the pool's prefill model it
    # sets the wait: the slack, up to wait_cap_ms (qosd/store/lua/pool/deadline.lua).
    ttft_ms: str
    wait_cap_ms: int  # the longest the caller allows (its max wait or deadline)
    has_request: int  # 1: a request-id key follows the lease hash in KEYS
    has_tenant: int  # 1: then a tenant bucket key
    # What the request charges its tenant's counter, in a class whose tenants share
    # it by tokens (then the counter's key follows); '0': the class does not.
    fair_charge: str
    # 1: the token counts are the door's estimates; the cost is then at most the
    # class's max_cost, so that an estimate alone never refuses a request as too large
    estimated: int


class PumpArgs(NamedTuple):
    """pump.lua's own arguments."""

    daemon: str
    deadline_us: str  # 0: none; a pump run later admits nobody


class WaiterArgs(NamedTuple):
    """One waiter of the pumping daemon."""

    field: str  # the waiter id
    qos_class: str
    lease_id: str
    ttl_ms: int
    keep_ms: int
    weight: str
    input_tokens: int
    output_tokens: int
    has_request: int
    has_tenant: int
    # As CancelArgs: what to give the tenant's counter back if the waiter is dropped
    # (late, or gone) rather than admitted; its key follows the others; '0': none.
    fair_refund: str


class CancelArgs(NamedTuple):
    """One waiter to take out of its queue."""

    field: str
    qos_class: str
    # A class that shares by tokens: the charge to give its tenant's counter back if
    # the waiter was still waiting (its counter's key in KEYS); '0': none.
    fair_refund: str
    # 1: the waiter's request-id key is in KEYS (before its tenant's counter), freed
    # if it still names the waiter, so that the retry its refusal invites is admitted
    has_request: int = 0


class ReleaseArgs(NamedTuple):
    """One release of a release batch."""

    qos_class: str
    field: str
    input_tokens: int | str  # '' keeps the estimate
    output_tokens: int | str  # '' keeps the estimate
    outcome: int
    # 1: undo an admission whose caller left, refunding the whole charge
    exact: int
    # 1: the request-id key follows the lease hash, and is freed for a retry (an
    # undo's, or a release of a request that failed on its way)
    has_request: int
    # A class that shares by tokens: "<per prompt token>|<per output token>" its
    # tenant's counter is charged (its key follows the lease hash); '': none.
    fair_charges: str


class AdjustArgs(NamedTuple):
    """adjust.lua's own arguments: the cooldown, then the new control record."""

    cooldown_ms: int
    force: int  # 1: a pin or unpin, past the cooldown and the pin
    capacity: str
    reason: str
    changed_by: str
    probe_step: str
    probe_wait: int
    last_good: str
    direction: int
    pinned: int
    ceiling: str


class LeadArgs(NamedTuple):
    """lead.lua's arguments."""

    daemon: str
    lease_ms: int  # 0: hand the lease back if held


class LoadArgs(NamedTuple):
    """load.lua's arguments, before one ServerLoadArgs per server."""

    max_age_us: int  # older reads are dropped, and not counted
    expire_ms: int  # of the servers hash


class TenantArgs(NamedTuple):
    """tenants.lua's arguments: one per tenant asked about."""

    digest: str  # tenant_digest() of its name


class ServerLoadArgs(NamedTuple):
    server: str
    waiting: int | str  # '' unknown
    kv_usage: str  # '' unknown


class PrefillArgs(NamedTuple):
    """prefill.lua's arguments: what the SLO loop learned of a pool's prefill."""

    usual_tokens: str  # the pool's usual prompt length: the threshold's floor
    tolerance_ms: str  # the stall the top class absorbs; '': not known
    fallback_tokens: str  # the threshold without a model or tolerance; 0: none
    model: str  # "c|a|b" (formulas.lua); '': none
    # "base|per_sequence|chunked|target_1|...|target_n": the decode step by batch, ms,
    # 1 where the pass that prefills also decodes (chunked prefill), else 0, and each
    # class's TPOT target, ms, in the pool's class order (0: none); '': none
    decode: str
    # The stall the top class absorbs when nothing else is in prefill: the idle
    # threshold's (waiters.lua: held_for_gap); '': not known
    idle_tolerance_ms: str


class ReportArgs(NamedTuple):
    """report.lua's arguments, before one SampleArgs per sample."""

    window_size: int
    expire_ms: int


class SampleArgs(NamedTuple):
    key_index: int  # the sample's window key, 1-based in KEYS
    sample: str


# -- reply layouts -------------------------------------------------------------------


class AcquireHeader(NamedTuple):
    """What an acquire batch's reply starts with."""

    now_us: str  # Redis time
    epoch: str  # '' while the state was never written


class Decision(NamedTuple):
    """One request's answer (acquire), or one waiter's (pump: reason and
    retry_after_ms are 0)."""

    status: int  # Status
    reason: int  # Reason
    lease_id: str
    charged: str
    remaining: str
    retry_after_ms: int  # when queued: the wait granted, ms (its max wait from now)
    lease_ttl_ms: int
    # The class's bucket at the admitted rate, after the answer (with ``remaining``):
    # what the proxy's rate-limit headers show (x-ratelimit-*-tokens).
    burst: str
    rate: str
    requests: str  # "<left>|<bound>" of the in-flight bound after the answer; '': none
    # pump: the order this pump granted the waiter in, from 1 (0: not granted). The
    # daemon answers its waiters in this order, so that their requests reach the
    # servers in the order their prefill was predicted. acquire: 0.
    granted: int


class Cancelled(NamedTuple):
    removed: int  # 1 if it was still waiting


class Settlement(NamedTuple):
    """One release's answer."""

    status: str  # Settled
    charged: str  # the final charge
    adjustment: str
    remaining: str  # class tokens after


class StatusHead(NamedTuple):
    """What status.lua's reply starts with."""

    now_us: str
    shared: str
    capacity: str  # the admitted rate R
    admitted: str  # tokens admitted so far
    long_prefill: str  # 0: none
    # The prefill admitted ahead, by the pool's prefill model on the real clock: us of
    # work not yet done (0: none, or no model; GPU-gated pools only)
    prefill_backlog_us: str
    shared_burst: str  # the most the shared tokens hold at R (allocation.lua)


class StatusClass(NamedTuple):
    """One class's part of a status reply, in priority order."""

    tokens: str
    waiting: int
    oldest_us: str  # enqueue time of the waiter at the head (earliest due); '' when none
    rate: str  # at R
    burst: str
    in_flight: int
    in_flight_tokens: str


class StatusServers(NamedTuple):
    """What status.lua's reply ends with: the servers' load, '' when not known."""

    waiting: str
    kv_usage: str


class TenantStatus(NamedTuple):
    """tenants.lua's reply, one per tenant asked about."""

    counter: str  # '' while the tenant is idle (no counter kept)
    served: str  # prompt plus output tokens admitted while live, settled at Release
    waiting: int  # its waiters in the class's queue


class ControlReply(NamedTuple):
    """control.lua's reply: Redis time, the state's R and K, the control hash's fields
    in CONTROL_HASH order ('' where unset), then the state's epoch E."""

    now_ms: str
    rate: str  # R
    written_under: str  # K
    pinned: str
    changed_ms: str
    reason: str
    changed_from: str
    changed_by: str
    probe_step: str
    probe_wait: str
    last_good: str
    direction: str
    ceiling: str
    recorded_under: str
    record_epoch: str
    epoch: str


class Adjusted(NamedTuple):
    """adjust.lua's reply: {1, changed_ms} when applied, {0, 'pinned' | 'cooldown'}."""

    applied: int
    detail: str


# -- the declaration -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Layout:
    """One positional list, named for Lua: ``ARG_<NAME>_<FIELD>`` (or ``REPLY_...``)
    for each field's position, ``<NAME>_ARGS`` (or ``<NAME>_FIELDS``) for its size."""

    name: str
    kind: Literal["ARG", "REPLY"]
    shape: type[tuple[Any, ...]]
    where: str  # for the docs: the script(s) and where in the list it sits

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.shape._fields)  # type: ignore[attr-defined]

    @property
    def size_name(self) -> str:
        return f"{self.name}_{'ARGS' if self.kind == 'ARG' else 'FIELDS'}"

    def position_name(self, field: str) -> str:
        return f"{self.kind}_{self.name}_{field.upper()}"


LAYOUTS: tuple[Layout, ...] = (
    Layout("POOL", "ARG", PoolArgs, "pool scripts: ARGV after the number of calls"),
    Layout("CLASS", "ARG", ClassArgs, "pool scripts: one per class, after POOL"),
    Layout("EPOCH", "ARG", EpochArgs, "pool scripts: after the classes"),
    Layout("ACQUIRE", "ARG", AcquireArgs, "acquire.lua: after EPOCH"),
    Layout("REQUEST", "ARG", RequestArgs, "acquire.lua: one per request, after ACQUIRE"),
    Layout("PUMP", "ARG", PumpArgs, "pump.lua: after EPOCH"),
    Layout("WAITER", "ARG", WaiterArgs, "pump.lua: one per waiter, after PUMP"),
    Layout("CANCEL", "ARG", CancelArgs, "cancel.lua: one per waiter, after EPOCH"),
    Layout("RELEASE", "ARG", ReleaseArgs, "release.lua: one per release, after EPOCH"),
    Layout("ADJUST", "ARG", AdjustArgs, "adjust.lua: after EPOCH"),
    Layout("LEAD", "ARG", LeadArgs, "lead.lua: ARGV"),
    Layout("LOAD", "ARG", LoadArgs, "load.lua: ARGV"),
    Layout("SERVER", "ARG", ServerLoadArgs, "load.lua: one per server, after LOAD"),
    Layout("PREFILL", "ARG", PrefillArgs, "prefill.lua: ARGV"),
    Layout("REPORT", "ARG", ReportArgs, "report.lua: ARGV"),
    Layout("SAMPLE", "ARG", SampleArgs, "report.lua: one per sample, after REPORT"),
    Layout("TENANT", "ARG", TenantArgs, "tenants.lua: one per tenant asked about"),
    Layout("HEADER", "REPLY", AcquireHeader, "acquire.lua: first"),
    Layout("DECISION", "REPLY", Decision, "acquire.lua: one per request; pump.lua: per waiter"),
    Layout("CANCELLED", "REPLY", Cancelled, "cancel.lua: one per waiter"),
    Layout("SETTLEMENT", "REPLY", Settlement, "release.lua: one per release"),
    Layout("STATUS", "REPLY", StatusHead, "status.lua: first"),
    Layout("STATUS_CLASS", "REPLY", StatusClass, "status.lua: one per class"),
    Layout("STATUS_SERVERS", "REPLY", StatusServers, "status.lua: last"),
    Layout("TENANT_STATUS", "REPLY", TenantStatus, "tenants.lua: one per tenant asked"),
    Layout("CONTROL", "REPLY", ControlReply, "control.lua"),
    Layout("ADJUSTED", "REPLY", Adjusted, "adjust.lua"),
)

#: Each script's ARGV, in order: "CALLS" is ARGV[ARG_CALLS], the number of calls
#: (for status and adjust 0: they take no list); a layout marked "*" repeats, once
#: per class for CLASS, once per call (or server, or sample) for the others.
SCRIPT_ARGS: dict[str, tuple[str, ...]] = {
    "acquire": ("CALLS", "POOL", "CLASS*", "EPOCH", "ACQUIRE", "REQUEST*"),
    "pump": ("CALLS", "POOL", "CLASS*", "EPOCH", "PUMP", "WAITER*"),
    "cancel": ("CALLS", "POOL", "CLASS*", "EPOCH", "CANCEL*"),
    "release": ("CALLS", "POOL", "CLASS*", "EPOCH", "RELEASE*"),
    "status": ("CALLS", "POOL", "CLASS*", "EPOCH"),
    "adjust": ("CALLS", "POOL", "CLASS*", "EPOCH", "ADJUST"),
    "control": (),
    "lead": ("LEAD",),
    "load": ("LOAD", "SERVER*"),
    "report": ("REPORT", "SAMPLE*"),
    "tenants": ("TENANT*",),
    "prefill": ("PREFILL",),
}

#: Codes the scripts return, by Lua prefix. The domain enums are the source.
CODES: tuple[tuple[str, type[enum.Enum]], ...] = (
    ("REASON", Reason),
    ("STATUS", Status),
    ("SETTLED", Settled),
    ("TAKE", Take),
)


@dataclass(frozen=True, slots=True)
class HashField:
    """A field of a hash the scripts keep, for the docs (and, for the control hash,
    the order control.lua reads it in)."""

    key: str
    meaning: str


#: The pool state hash, ``qosd:{pool}:state``: fields read and written by the pool
#: prelude, lua/pool/ (P and M by prefill.lua; Sw, Sk, St by load.lua).
STATE_HASH: tuple[HashField, ...] = (
    HashField("u", "last update, us of Redis TIME"),
    HashField("s", "shared tokens"),
    HashField("R", "admitted rate the SLO loop or a pin set; absent: as configured"),
    HashField("a", "tokens admitted so far, for the loop's utilization"),
    HashField("K", "the configured capacity R was written under (R scales with it)"),
    HashField("xo", "the oldest second of `x:<second>`; the sweep ends them"),
    HashField("xn", "the newest such second"),
    HashField(
        "x:<second>",
        "leases in flight whose expiry falls in that second of Redis "
        "time: `class|count|tokens|class...`",
    ),
    HashField("P", "long-prefill threshold the SLO loop learned, prompt tokens; absent: none"),
    HashField("M", "its prefill model `c|a|b`: c + a n + b n² ms"),
    HashField(
        "B", "when, by M, the prompts admitted so far are prefilled at the prefill share's pace, us"
    ),
    HashField("Sw", "the servers' waiting requests, summed (load.lua)"),
    HashField("Sk", "the servers' largest KV cache usage (load.lua)"),
    HashField("St", "when the servers' load was read, us (load.lua)"),
    HashField("Bt", "as B, in real prefill time"),
    HashField(
        "E",
        "the pool's epoch `<Redis time, us>-<nonce>`: set when the state is made, never changed",
    ),
    HashField(
        "Tp",
        "the top class's peak demand `count|tokens|us` (in flight plus waiting) and when "
        "it was set; it decays by its half-life from then",
    ),
    HashField("Bp", "as Bt, the top class's prompts alone (servers that schedule by priority)"),
    HashField(
        "D",
        "its decode model `base|per_sequence|chunked|target...`: a step of B sequences "
        "takes base + per_sequence B ms; chunked 1 where a prefill pass also decodes; "
        "each class's TPOT target, ms, in class order (0: none)",
    ),
    HashField(
        "Bb",
        "when the lower classes' prompts have paid for the time they kept the top class "
        "blocked, at its blocked share's pace, us (servers that prefill oldest first)",
    ),
    HashField(
        "Pi",
        "the idle threshold, prompt tokens: a longer prompt than P but not than this is "
        "not held while no prefill is admitted ahead; absent: none",
    ),
    HashField(
        "Bs",
        "the other servers' prefill clocks, as Bt, `us|us...` (pools of more than one "
        "server): Bt is the earliest free",
    ),
    HashField("t:<class>", "class tokens"),
    HashField("w:<class>", "waiters queued"),
    HashField("n:<class>", "leases in flight: admitted, neither released nor expired"),
    HashField("c:<class>", "their estimated prompt plus output tokens (KV cache)"),
    HashField(
        "v:<class>",
        "a class that shares by tokens: its virtual time, the start of the last request "
        "admitted (tenants.lua)",
    ),
)

#: The SLO loop's record, ``qosd:{pool}:control``, in the order control.lua reads it
#: (ControlReply's fields from ``pinned`` to ``record_epoch``).
CONTROL_HASH: tuple[HashField, ...] = (
    HashField("p", "pinned (1)"),
    HashField("c", "last change, ms"),
    HashField("r", "reason"),
    HashField("f", "the rate before"),
    HashField("b", "by"),
    HashField("s", "probe step"),
    HashField("w", "probe wait"),
    HashField("g", "the rate to undo to"),
    HashField("d", "last direction"),
    HashField("h", "ceiling"),
    HashField("k", "the configured capacity f, g and h were written under"),
    HashField("e", "the state's epoch (E) when written"),
)

LAYOUT_BY_NAME = {layout.name: layout for layout in LAYOUTS}

_CONTROL_FROM = ControlReply._fields.index("pinned")
assert len(ControlReply._fields) == _CONTROL_FROM + len(CONTROL_HASH) + 1, (
    "ControlReply must hold R, K, every control hash field and E"
)

#: Layouts that travel packed, one argument a record (see the module's docstring).
PACKED = frozenset({"POOL", "CLASS", "REQUEST", "RELEASE"})

#: Lists of hash field names the scripts take whole (``unpack(CONTROL_HASH)``).
FIELD_LISTS: tuple[tuple[str, tuple[HashField, ...]], ...] = (("CONTROL_HASH", CONTROL_HASH),)

# -- reading replies -----------------------------------------------------------------

_Shape = TypeVar("_Shape", bound=tuple[Any, ...])


def size(shape: type[tuple[Any, ...]]) -> int:
    """How many values one record of a layout takes."""
    return len(shape._fields)  # type: ignore[attr-defined]


def record(shape: type[_Shape], reply: Sequence[Any], start: int = 0) -> _Shape:
    """The record of ``shape`` at ``start`` in a reply."""
    return shape._make(reply[start : start + size(shape)])  # type: ignore[attr-defined, no-any-return]


def records(
    shape: type[_Shape], reply: Sequence[Any], count: int, start: int = 0
) -> Iterator[_Shape]:
    """``count`` consecutive records of ``shape`` from ``start`` in a reply."""
    width = size(shape)
    for at in range(start, start + count * width, width):
        yield shape._make(reply[at : at + width])  # type: ignore[attr-defined]


def pack(values: tuple[Any, ...]) -> str:
    """A packed layout's record as the one argument it travels as."""
    return FIELD_SEPARATOR.join(map(str, values))


def unpack(shape: type[_Shape], packed: str | bytes) -> _Shape:
    """``pack``'s record back (as sent: text, or the bytes a policy is cached as),
    every field as its text."""
    text = packed.decode() if isinstance(packed, bytes) else packed
    return shape._make(text.split(FIELD_SEPARATOR))  # type: ignore[attr-defined, no-any-return]


def lua_constants() -> list[tuple[str, str, str]]:
    """Every Lua constant the declaration defines: (name, Lua literal, comment)."""
    constants: list[tuple[str, str, str]] = []
    for prefix, codes in CODES:
        for member in codes:
            value = member.value
            literal = f"'{value}'" if isinstance(value, str) else str(int(value))
            constants.append(
                (f"{prefix}_{member.name}", literal, f"{codes.__name__}.{member.name}")
            )
    for name, value, comment in TUNABLES:
        constants.append((name, str(value), comment))
    constants.append(("ARG_CALLS", str(ARG_CALLS), "ARGV of the number of calls (pool scripts)"))
    for layout in LAYOUTS:
        if layout.name in PACKED:  # one argument, the record; positions within it
            constants.append((layout.size_name, "1", f"{layout.shape.__name__}, packed"))
            constants.append((f"ARG_{layout.name}_RECORD", "1", "the packed record"))
        else:
            constants.append((layout.size_name, str(len(layout.fields)), layout.shape.__name__))
        for position, field in enumerate(layout.fields, start=1):
            constants.append((layout.position_name(field), str(position), ""))
    for name, fields in FIELD_LISTS:
        listed = ", ".join(f"'{field.key}'" for field in fields)
        constants.append((name, "{" + listed + "}", ""))
    return constants
