"""Domain types shared by the admission logic and both bucket stores.

``Reason`` and ``Outcome`` are the client's (``qosd_client.types``), defined once for
both sides; they mirror the wire enums value for value (a test holds them equal), so
the gRPC layer passes them through as plain integers with no translation table.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qosd_client.types import Outcome, PassStats, Reason

if TYPE_CHECKING:
    from qosd.policy import ClassPolicy

# Defined once, in the client; the daemon imports them here.
__all__ = ["Outcome", "PassStats", "Reason"]


def new_daemon_id() -> str:
    """Names one daemon process in the shared queues, the leader lease and traces."""
    return os.urandom(6).hex()


# 64 random bits per process keep tokens of different replicas apart; a counter keeps
# this process's tokens apart. Cheaper than fresh randomness on every Acquire.
_TOKEN_PROCESS = os.urandom(8).hex()
_token_counter = itertools.count()


def new_lease_token() -> str:
    """A unique lease token: epoch second (8 hex digits), process id (16), counter.

    The second lets the Redis store file leases into one hash per second (see
    acquire.lua); it is a filing label only, never used in budget arithmetic, so a
    replica's clock skew cannot change a decision.
    """
    return f"{int(time.time()) & 0xFFFFFFFF:08x}{_TOKEN_PROCESS}{next(_token_counter):x}"


def lease_issued_s(lease_id: str) -> int | None:
    """The epoch second a lease was admitted in, from its token (``new_lease_token``);
    None for an id that carries none."""
    token = lease_id.rpartition(":")[2]
    try:
        return int(token[:8], 16)
    except ValueError:
        return None


#: Prefix of a lease admitted while the store was down (fail_mode: open): nothing to settle.
FAIL_OPEN_MARK = "open-"


# Not frozen, and only here: a frozen dataclass sets each field through
# object.__setattr__, and at 0.6-0.9 us a construction that was 2.5 us of every
# Acquire (docs/performance.md). Treat it as immutable all the same.
@dataclass(slots=True)
class AdmissionRequest:
    """One request for admission, as every door builds it, valid by construction
    (``qosd.doors.request.RequestRules.acquire``).

    ``max_wait_ms`` is the caller's own cap on its wait (None: its class's);
    ``deadline_s`` how long the caller waits for an answer (None: no deadline);
    ``lease_ttl_ms`` overrides ``lease.ttl_s`` for callers that never release (Envoy's
    protocol has no Release); ``slo_*`` are the request's own objectives. With
    ``estimated`` the token counts are the door's estimates, not the caller's word:
    such a request is never refused as too large for its class on them alone (it is
    charged at most what its class can hold, and Release settles the real usage).
    """

    pool: str
    qos_class: str
    tenant: str
    model: str
    request_id: str
    input_tokens: int
    expected_output_tokens: int
    ttft_ms: float  # the TTFT objective its queue entry is due by (0: none)
    max_wait_ms: int | None = None
    deadline_s: float | None = None
    lease_ttl_ms: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    estimated: bool = False


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    """One Release, valid by construction (``qosd.doors.request.RequestRules.release``)."""

    lease_id: str
    policy: ClassPolicy
    fail_open: bool  # admitted while the store was down: nothing was charged
    input_tokens: int | None  # None keeps the estimate
    output_tokens: int | None
    outcome: Outcome
    # An admission nobody holds, to be undone (``Admission.undo_later``): one the
    # store may have made though its answer never came, or one its caller left.
    undo: LeaseSpec | None = None
    # The admission whose request id this release frees: its request failed on its
    # way (the upstream broke off or went silent) or its caller left, and the retry
    # under the same id (the SDKs', Envoy's) is a new try of it.
    frees_request_of: LeaseSpec | None = None


@dataclass(slots=True)  # not frozen: a hot-path type (see AdmissionRequest)
class LeaseSpec:
    """What a store needs to create a lease for one admission."""

    lease_id: str
    request_id: str
    tenant: str
    input_tokens: int
    output_tokens: int
    weight: float
    ttl_ms: int
    # The token counts are the door's estimates: charged at most what the class can
    # hold (acquire.lua), so an estimate alone never refuses a request as too large.
    estimated: bool = False


@dataclass(slots=True)  # not frozen: a hot-path type (see AdmissionRequest)
class BucketDecision:
    """A store's answer to one take attempt.

    ``queued`` means neither admitted nor rejected: the request now waits in its
    class's queue (see ``qosd.waiting``), under the id ``lease_field``. ``charged`` is
    the request's cost, as the scripts price it.
    """

    admitted: bool
    reason: Reason
    lease_id: str
    charged: float
    remaining: float
    retry_after_ms: int
    lease_ttl_ms: int
    queued: bool = False
    # The request id names another request's lease or place in a queue (no decision).
    duplicate: bool = False
    # The class's bucket at the admitted rate (with ``remaining``), and the requests
    # the pool's in-flight bound has room for and the bound (-1: no bound), after this
    # answer; 0 when the store was not reached.
    burst: float = 0.0
    rate: float = 0.0
    requests_left: int = -1
    requests_bound: int = -1


def lease_field(lease_id: str) -> str:
    """``class:token`` of a lease id ``pool:class:token``: a lease's (and waiter's) id."""
    return lease_id.partition(":")[2]


@dataclass(frozen=True, slots=True)
class Waiter:
    """A queued request, as its daemon holds it while it waits."""

    qos_class: str
    cost: float
    lease: LeaseSpec

    @property
    def id(self) -> str:
        return lease_field(self.lease.lease_id)


class WaiterState(enum.IntEnum):
    ADMITTED = 1
    WAITING = 3
    GONE = 4  # dropped by the store: taken for a dead daemon's, or long expired
    HELD = 5  # still waiting: a long prompt held for a gap in the top class's traffic
    LATE = 6  # dropped: admitted now, it would miss its TTFT objective


@dataclass(frozen=True, slots=True)
class PumpResult:
    state: WaiterState
    decision: BucketDecision | None  # set when ADMITTED
    granted: int = 0  # ADMITTED: the order the pump granted it in, from 1


@dataclass(frozen=True, slots=True)
class ClassStatus:
    tokens: float
    waiting: int
    oldest_wait_ms: int  # how long the longest waiter has waited; 0 when none
    rate: float  # assured tokens per second at the pool's admitted rate now
    burst: float
    in_flight: int = 0  # leases admitted, neither released nor expired
    in_flight_tokens: float = 0.0  # their prompt plus expected output tokens (KV)


@dataclass(frozen=True, slots=True)
class TenantStatus:
    """One tenant of a class that shares by tokens, as the store holds it now."""

    qos_class: str
    tenant: str
    counter: float | None  # tokens charged per unit of weight; None: idle, none kept
    served_tokens: float  # prompt plus output tokens admitted while live
    waiting: int  # its waiters in the class's queue


@dataclass(frozen=True, slots=True)
class PassRead:
    """One server's :class:`PassStats` as the store keeps it, stamped (Redis time, ms)."""

    at_ms: int
    server: str
    passes: int
    prefill_tokens: int
    decode_tokens: int
    step_ms: float

    @staticmethod
    def encode(stats: PassStats, server: str) -> str:
        """What the store keeps of one server's read (``report.lua`` stamps it)."""
        return (
            f"{stats.passes}|{stats.prefill_tokens}|{stats.decode_tokens}|{stats.step_ms!r}|"
            f"{server}"
        )

    @classmethod
    def decode(cls, raw: str) -> PassRead:
        """Reads ``report.lua``'s stamp and :meth:`encode`'s form."""
        at, passes, prefill, decode, step, server = raw.split("|", 5)
        return cls(int(at), server, int(passes), int(prefill), int(decode), float(step))


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One model server's gauges at one read (ReportRequest.loads): requests it holds
    waiting, and the share of its KV cache in use; None: not known. ``passes``: what
    its passes carried since its previous read, where its metrics say."""

    server: str
    waiting: int | None
    kv_usage: float | None
    passes: PassStats | None = None


@dataclass(frozen=True, slots=True)
class PoolStatus:
    shared_tokens: float
    classes: dict[str, ClassStatus]
    capacity: float  # the admitted rate the SLO loop set (or the configured one)
    admitted_tokens: float  # tokens admitted since the pool's state was created
    now_ms: int  # the store's clock
    long_prefill_tokens: float = 0.0  # longer prompts wait for a gap (0: no rule)
    # Predicted prefill admitted and not yet done, ms (GPU-gated pools with a model).
    prefill_backlog_ms: float = 0.0
    # The servers' load, as budget.servers_load judges it now (None: not known).
    server_waiting: int | None = None
    server_kv_usage: float | None = None
    shared_burst: float = 0.0  # the most the shared tokens hold at the admitted rate

    @property
    def active_leases(self) -> int:
        """Leases of the pool neither released nor expired (fleet-wide with Redis)."""
        return sum(cls.in_flight for cls in self.classes.values())


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """What the SLO loop keeps per pool in the store, so a new leader carries on."""

    capacity: float  # the admitted rate now, tokens per second
    pinned: bool
    changed_ms: int  # store time of the last change; 0: never
    reason: str
    changed_from: float
    changed_by: str
    probe_step: float  # the next growth's size, relative; 0: not set yet
    probe_wait: int  # cooldowns of good evidence needed before the next probe
    last_good: float  # the rate before the last growth: where a failed probe returns
    direction: int  # of the last move: -1 down, 1 up, 0 none yet
    ceiling: float  # the rate a probe last failed at; 0: none known
    # The pool state's epoch, set when the state was created ('' while it never was):
    # a different one means the store lost the pool's state, and this record with it.
    epoch: str = ""
    # The state's epoch when this record was written ('' never): equal to ``epoch``
    # when it was written since the state was last made anew.
    record_epoch: str = ""


@dataclass(frozen=True, slots=True)
class PrefillLearned:
    """What the SLO loop learned of a pool's prefill (qosd.control.prefill), for the
    store, which derives the long-prefill threshold from it (prefill.lua)."""

    model: tuple[float, float, float] | None  # (c, a, b): c + a n + b n^2 ms; None: none
    tolerance_ms: float | None  # the stall the top class absorbs; None: not known
    usual_tokens: float  # the pool's usual prompt length: the threshold's floor
    fallback_tokens: float = 0.0  # the threshold without model or tolerance; 0: none
    # The decode step by batch size (qosd.control.decode): (base, per sequence) ms;
    # None: none learned, and the stores keep the configured prefill share.
    decode: tuple[float, float] | None = None
    # The pool's servers chunk prefill: the pass that prefills a prompt also decodes.
    chunked: bool = False
    # Each of the pool's classes' TPOT target, ms, in the pool's class order (0: none):
    # what the stores keep every stream in flight within, by the decode model.
    tpot_targets_ms: tuple[float, ...] = ()
    # The stall the top class absorbs when nothing else is in prefill ahead of its
    # next prompt (qosd.control.prefill.idle_tolerance_ms); None: not known.
    idle_tolerance_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Adjustment:
    """One change of a pool's admitted rate, as the history keeps it."""

    at_ms: int
    changed_from: float
    changed_to: float
    reason: str
    by: str


@dataclass(frozen=True, slots=True)
class Settlement:
    """The result of releasing a lease."""

    already_released: bool
    charged: float
    adjustment: float
    remaining: float


@dataclass(frozen=True, slots=True)
class UsageReport:
    """Actual usage of a leased request. None keeps the estimate for that part."""

    input_tokens: int | None
    output_tokens: int | None
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Sample:
    """One validated latency sample, ready to store. Latencies are in milliseconds.

    ``slo_ttft_ms`` and ``slo_tpot_ms`` are the objectives the request itself stated
    (``AcquireRequest.slo_ttft_ms``, forwarded to the model server); None: its
    class's (``qosd.control.windows.request_objectives``).
    """

    pool: str
    qos_class: str
    tenant: str
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    input_tokens: int
    output_tokens: int
    status: Outcome
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def encode(self) -> str:
        """Compact form stored in window lists: ``ttft|tpot|e2e|in|out|status|tenant``,
        then ``|slo:<ttft>:<tpot>`` when the request stated objectives.

        Stores prefix it with their own timestamp (``ms|``); empty means not measured
        (or, in the ``slo:`` part, not stated). The objectives come after the tenant so
        that a daemon of an earlier version, which splits off the tenant as the rest
        of the line, still reads the sample (it only sees a longer tenant). A tenant
        may hold ``|`` itself, so a sample whose tenant does always ends in the part,
        and ``StoredSample.decode`` can take the last ``|`` field for it. (Only a sample
        of an earlier version whose tenant itself ended in ``|slo:<n>:<n>`` would be
        misread.)
        """
        fields = (
            _fmt(self.ttft_ms),
            _fmt(self.tpot_ms),
            _fmt(self.e2e_ms),
            str(self.input_tokens),
            str(self.output_tokens),
            str(int(self.status)),
            self.tenant,
        )
        if self.slo_ttft_ms is None and self.slo_tpot_ms is None and "|" not in self.tenant:
            return "|".join(fields)
        return "|".join((*fields, f"{_SLO_MARK}{_fmt(self.slo_ttft_ms)}:{_fmt(self.slo_tpot_ms)}"))


_SLO_MARK = "slo:"


@dataclass(frozen=True, slots=True)
class StoredSample:
    """A sample read back from a window, with the store's timestamp."""

    at_ms: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    input_tokens: int
    output_tokens: int
    status: Outcome
    tenant: str
    slo_ttft_ms: float | None = None  # the request's own objectives, when it stated them
    slo_tpot_ms: float | None = None

    @classmethod
    def decode(cls, raw: str) -> StoredSample:
        """Reads ``Sample.encode``'s form, and that of earlier versions (no ``slo:``)."""
        at, ttft, tpot, e2e, inp, out, status, rest = raw.split("|", 7)
        tenant, slo_ttft, slo_tpot = rest, None, None
        if "|" in rest:
            head, _, last = rest.rpartition("|")
            objectives = _parse_objectives(last)
            if objectives is not None:
                tenant, (slo_ttft, slo_tpot) = head, objectives
        return cls(
            at_ms=int(at),
            ttft_ms=_parse(ttft),
            tpot_ms=_parse(tpot),
            e2e_ms=_parse(e2e),
            input_tokens=int(inp),
            output_tokens=int(out),
            status=Outcome(int(status)),
            tenant=tenant,
            slo_ttft_ms=slo_ttft,
            slo_tpot_ms=slo_tpot,
        )


def _fmt(value: float | None) -> str:
    return "" if value is None else repr(float(value))


def _parse(raw: str) -> float | None:
    return None if raw == "" else float(raw)


def _parse_objectives(field: str) -> tuple[float | None, float | None] | None:
    """``slo:<ttft>:<tpot>``; None when the field is not one (a tenant's own ``|``)."""
    if not field.startswith(_SLO_MARK):
        return None
    parts = field[len(_SLO_MARK) :].split(":")
    if len(parts) != 2:
        return None
    try:
        return _parse(parts[0]), _parse(parts[1])
    except ValueError:
        return None


class LeaseNotFound(LookupError):
    """The lease id is unknown: never issued, or forgotten after its tombstone time."""


class LeaseExpired(LookupError):
    """The lease outlived its TTL; its estimated charge stood as the final charge."""

    def __init__(self, lease_id: str, charged: float) -> None:
        super().__init__(
            f"lease {lease_id} expired before it was released; its estimated charge of "
            f"{charged:g} tokens stood as the final charge"
        )
        self.charged = charged


class StoreUnavailable(ConnectionError):
    """The shared store did not answer within its timeout, or is known to be down."""
