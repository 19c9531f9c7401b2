"""Budget arithmetic: the single definition both stores follow.

A pool has a capacity in tokens per second. Each class has an assured share of it, a
token bucket that refills at ``rate`` up to ``burst``; no other class can touch it.
What a full class bucket cannot hold overflows into the pool's *shared* tokens,
together with any capacity no class is assured, up to ``shared_burst``. A class that
may borrow takes from its own bucket first and from the shared tokens after.
Together, classes never admit more than the pool's capacity (plus bursts), and an
idle class's share is never lost while another class wants it.

The embedded store calls these functions. The Redis store's Lua scripts
(``store/lua/_pool.lua``) restate them line for line: Lua cannot import Python. What
holds the two equal: the argument and reply layouts and the codes are declared once
(``store/contract.py``, generated into ``lua/_contract.lua``); the differential test
(``tests/test_differential.py``) drives both stores through the same random
sequences and compares every answer and the state after each step; and the
conformance suite runs the same tests against both. Change one, change the other,
and run the differential test (docs/testing.md).

Rules for taking ``cost`` tokens from class c (after refill):

1. ``cost > max_cost`` is never admitted (COST_EXCEEDS_BURST).
2. From its own bucket when it holds the cost.
3. Otherwise, if the class may borrow and the shared tokens are not reserved for a
   waiter of higher or equal priority, when own plus shared tokens cover the cost:
   the own bucket is emptied (never below zero) and the shared tokens pay the rest.
4. Otherwise a cost above the burst (allowed up to ``max_cost``) is taken from a
   full bucket, leaving it in debt, to be repaid from refill.

Settlement moves the class bucket by ``charged - actual``; what a refund lifts
above the burst overflows into the shared tokens, like refill.

A *GPU-gated* pool (``max_in_flight`` or ``max_in_flight_tokens`` set) admits by
what its servers can take instead, and the buckets decide the order:

1. ``cost > max_cost`` is never admitted, as above; nobody overtakes their class.
2. A request needs *room*: the leases in flight plus this one within the bound,
   in requests and in prompt plus expected output tokens, less ``top_reserve`` of it
   for classes below the top one, and the prompts admitted predicted to be prefilled
   within ``prefill_backlog_us`` (``prefill_lead_us``: in real time for the top
   class, at the prefill share below it), and,
   below the top class, the servers not past their own reported load
   (``servers_full``) (``has_room``; a request alone in an idle pool always fits).
3. Its *standing* is within its share when its own bucket covers it (or is full, for
   a cost above the burst), over its share otherwise; then its effective rank (aging
   promotes a waiter at most to the rank below the top class: ``gated_rank``), then
   the higher class, then its arrival. It is admitted only when no waiter of another
   class stands better. (So across classes aging only lifts a waiter over classes
   below its own; a class's progress under contention comes from its floor.)
4. Within its share it pays from its own bucket (into debt, for a cost above the
   burst); over it, with shared tokens, else into debt on its own bucket (OVER),
   never below minus one burst. So while the servers have room and
   anyone waits, the pool admits: nobody times out for lack of budget, and a class
   that used more than its share recently goes after those that did not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from qosd.policy import ClassPolicy, PoolPolicy

OWN = 1
BORROW = 2
OVER = 3  # a GPU-gated pool's admission over the class's share, into bounded debt


#: Most seconds of expiries one call ends (_pool.lua's sweep): a pool idle for long
#: catches up over its next calls.
SWEEP_SECONDS = 64


@dataclass(slots=True)
class InFlight:
    """Leases admitted and neither released nor expired, per class: what status
    reports in O(classes), and what admission that sees the GPU's state reads.

    ``tokens`` are each lease's prompt plus expected output tokens as estimated at
    admission: the KV cache the request holds on its server, whatever its cost's
    weights. A lease counts from its admission until it is released, or until the
    second of store time its expiry falls in has passed. ``expiring`` files the
    leases by that second, so the sweep can end what expires without reading any.
    """

    count: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    expiring: dict[int, dict[str, list[float]]] = field(default_factory=dict)  # [count, tokens]
    first_second: int | None = None  # the oldest second in ``expiring`` not swept yet
    last_second: int | None = None  # the newest

    def total(self) -> int:
        return sum(self.count.values())

    def copy(self) -> InFlight:
        return InFlight(
            dict(self.count),
            dict(self.tokens),
            {s: {c: list(v) for c, v in e.items()} for s, e in self.expiring.items()},
            self.first_second,
            self.last_second,
        )


def lease_started(flight: InFlight, cls: str, tokens: float, expiry_us: int) -> None:
    flight.count[cls] = flight.count.get(cls, 0) + 1
    flight.tokens[cls] = flight.tokens.get(cls, 0.0) + tokens
    second = expiry_us // 1_000_000
    counts = flight.expiring.setdefault(second, {}).setdefault(cls, [0, 0.0])
    counts[0] += 1
    counts[1] += tokens
    if flight.first_second is None or second < flight.first_second:
        flight.first_second = second
    if flight.last_second is None or second > flight.last_second:
        flight.last_second = second


def lease_ended(flight: InFlight, cls: str, tokens: float, expiry_us: int, now_us: int) -> None:
    """A release before the lease's expiry second has passed; later ones were swept.
    A lease its second's bucket does not hold (admitted before this accounting
    existed) changes nothing."""
    second = expiry_us // 1_000_000
    if second < now_us // 1_000_000:
        return
    counts = flight.expiring.get(second, {}).get(cls)
    if counts is None or counts[0] <= 0:
        return
    counts[0] -= 1
    counts[1] = max(0.0, counts[1] - tokens)
    if counts[0] == 0:
        del flight.expiring[second][cls]
        if not flight.expiring[second]:
            del flight.expiring[second]
    flight.count[cls] = max(0, flight.count.get(cls, 0) - 1)
    flight.tokens[cls] = max(0.0, flight.tokens.get(cls, 0.0) - tokens)


def end_expired(flight: InFlight, now_us: int) -> None:
    """Ends the leases whose expiry second has passed, SWEEP_SECONDS at a time; once
    the newest such second has passed, everything left in flight has expired."""
    now_s = now_us // 1_000_000
    first = flight.first_second
    if first is None or first >= now_s:
        return
    assert flight.last_second is not None
    if flight.last_second < now_s:
        flight.count = dict.fromkeys(flight.count, 0)
        flight.tokens = dict.fromkeys(flight.tokens, 0.0)
        flight.expiring.clear()
        flight.first_second = flight.last_second = None
        return
    last = min(now_s - 1, first + SWEEP_SECONDS - 1)
    for second in range(first, last + 1):
        for cls, (count, tokens) in flight.expiring.pop(second, {}).items():
            flight.count[cls] = max(0, flight.count.get(cls, 0) - int(count))
            flight.tokens[cls] = max(0.0, flight.tokens.get(cls, 0.0) - tokens)
    flight.first_second = last + 1


@dataclass(slots=True)
class PoolState:
    tokens: dict[str, float]  # per class
    shared: float
    updated_us: int
    capacity: float  # the admitted rate the SLO loop set, tokens per second
    admitted: float = 0.0  # tokens admitted since the pool's state was created
    in_flight: InFlight = field(default_factory=InFlight)
    # Prompts longer than this (tokens) wait for a gap in the top class's traffic; the
    # SLO loop learns it from reports (qosd.stall). 0: no such rule.
    long_prefill_tokens: float = 0.0
    # The SLO loop's prefill model (c, a, b: c + a n + b n^2 ms for n prompt tokens;
    # qosd.stall), and a GPU-gated pool's prefill backlog by it, as two clocks (store
    # time, us; prefill_started): where the prompts admitted so far end at the prefill
    # share's pace (the lower classes' clock), and in real prefill time (the top
    # class's).
    prefill_model: tuple[float, float, float] | None = None
    prefill_until_us: int = 0
    prefill_real_until_us: int = 0
    # The servers' own load, aggregated over their latest reads (servers_load): the
    # requests they hold waiting, summed, and the largest KV cache usage (None: none
    # said), as of server_load_at_us (store time; 0: never).
    server_waiting: int | None = None
    server_kv_usage: float | None = None
    server_load_at_us: int = 0


def fresh_state(pool: PoolPolicy, now_us: int, *, lost: bool = False) -> PoolState:
    """A pool never touched is full everywhere. One whose state was ``lost`` (its
    store came back empty) starts empty and refills at its rate: the lost state held
    the charges of leases still running on the servers, and the rate an operator or
    the SLO loop had set, which the leader restores only after the loss is seen; a
    full burst at the configured rate would be handed out at once, to everyone.
    _pool.lua restates it; the embedded store never loses its state."""
    return PoolState(
        tokens={cls.name: 0.0 if lost else cls.burst for cls in pool.classes},
        shared=0.0 if lost else pool.shared_burst,
        updated_us=now_us,
        capacity=pool.capacity,
    )


def refill(state: PoolState, pool: PoolPolicy, now_us: int) -> None:
    """Refills every class, in place; overflow from full classes goes to shared."""
    elapsed_us = now_us - state.updated_us
    if elapsed_us <= 0:
        return  # a clock that stepped back refills nothing and keeps the stamp
    shared = state.shared
    for cls in pool.classes:
        tokens = state.tokens[cls.name] + cls.rate * elapsed_us / 1e6
        if tokens > cls.burst:
            shared += tokens - cls.burst
            tokens = cls.burst
        state.tokens[cls.name] = tokens
    state.shared = min(pool.shared_burst, shared + pool.free_rate * elapsed_us / 1e6)
    state.updated_us = now_us


def how_to_take(state: PoolState, cls: ClassPolicy, cost: float, shared_open: bool) -> int:
    """OWN, BORROW, or 0 when the cost cannot be covered now.

    Own tokens first; then shared ones; a cost above the burst goes into debt from a
    full bucket only when shared tokens cannot cover it, since debt slows the class
    down later and shared tokens do not.
    """
    own = state.tokens[cls.name]
    if own >= cost:
        return OWN
    if shared_open and cls.can_borrow and max(own, 0.0) + state.shared >= cost:
        return BORROW
    if own >= min(cost, cls.burst):
        return OWN
    return 0


def prefill_us(model: tuple[float, float, float], input_tokens: int) -> float:
    c, a, b = model
    return (c + input_tokens * (a + b * input_tokens)) * 1000


def prefill_started(state: PoolState, pool: PoolPolicy, input_tokens: int, now_us: int) -> None:
    """A GPU-gated pool admitted a prompt: its servers prefill it after those before
    (unchunked, a prefill runs before any decode step), so the backlog grows by it,
    on two clocks.

    - The share clock counts each prefill at 1 / ``prefill_share`` of its time: it is
      where the backlog would end if the servers spent only that share of their time
      prefilling. Classes below the top one are admitted while it is within the bound,
      so their prompts leave the rest of the time to decoding.
    - The real clock counts each prefill at its time: a server that prefills first
      runs waiting prompts back to back, so this is when a prompt admitted now starts.
      The top class is admitted while it is within the bound. (The share clock would
      overstate its wait: after a 4 s prefill it still leads by 4 s when the servers
      are done, and held the top class for seconds with the GPU idle of prefill.)"""
    if state.prefill_model is not None:
        work_us = prefill_us(state.prefill_model, input_tokens)
        start = max(now_us, state.prefill_until_us)
        state.prefill_until_us = int(start + work_us / pool.prefill_share)
        start = max(now_us, state.prefill_real_until_us)
        state.prefill_real_until_us = int(start + work_us)


def has_room(
    state: PoolState, pool: PoolPolicy, cls: ClassPolicy, tokens: float, now_us: int
) -> bool:
    """Whether a GPU-gated pool's servers can take one more request of ``cls``
    holding ``tokens`` (its prompt plus expected output: its KV cache), now. Classes
    below the top one leave ``top_reserve`` of the bound to it. With a prefill model
    learned, the prompts admitted must also be prefilled within the pool's
    ``prefill_backlog_us`` (``prefill_lead_us``): on a prefill-bound server the KV
    cache holds tens of seconds of prefill, and a request admitted behind them waits
    at the server, in its first-come order, instead of in qosd's, in priority order."""
    flight = state.in_flight
    count = flight.total()
    if count == 0:
        return True  # alone in an idle pool: always, whatever its size
    if (
        state.prefill_model is not None
        and pool.prefill_backlog_us > 0
        and prefill_lead_us(state, cls, now_us) > pool.prefill_backlog_us
    ):
        return False
    if cls.rank != 0 and servers_full(state, pool, now_us):
        return False
    share = 1.0 if cls.rank == 0 else 1.0 - pool.top_reserve
    if pool.max_in_flight > 0 and count + 1 > pool.max_in_flight * share:
        return False
    return not (
        pool.max_in_flight_tokens > 0
        and sum(flight.tokens.values()) + tokens > pool.max_in_flight_tokens * share
    )


def passes_reserve(cls: ClassPolicy, ahead: ClassPolicy, ahead_has_room: bool) -> bool:
    """Whether a request of ``cls`` may be admitted before ``ahead``, a waiter of
    another class that stands better, in a GPU-gated pool. A waiter without room
    holds the pool's room for itself, so that a stream of small requests cannot
    starve a large one; but the top class's reserve (``top_reserve``) is room no
    other class may use, so a waiter of a lower class that has no room does not hold
    it: the top class goes past it into the reserve (its own room checked as usual).
    Without this, a P1 within its share at the head of a full pool would hold every
    P0 arrival past its max wait, the reserve standing empty."""
    return cls.rank == 0 and ahead.rank != 0 and not ahead_has_room


def servers_load(
    reads: Iterable[tuple[int, int | None, float | None]], now_us: int, max_age_us: int
) -> tuple[int | None, float | None]:
    """The pool's servers' load from each one's latest ``(at_us, waiting, kv_usage)``:
    the waiting requests summed and the largest KV usage over reads within
    ``max_age_us`` (a server that stopped reporting stops counting); None where no
    fresh read said."""
    waiting: int | None = None
    kv_usage: float | None = None
    for at_us, server_waiting, server_kv in reads:
        if now_us - at_us > max_age_us:
            continue
        if server_waiting is not None:
            waiting = (waiting or 0) + server_waiting
        if server_kv is not None:
            kv_usage = server_kv if kv_usage is None else max(kv_usage, server_kv)
    return waiting, kv_usage


def servers_full(state: PoolState, pool: PoolPolicy, now_us: int) -> bool:
    """Whether the pool's servers, by their own latest fresh reports, hold more
    waiting requests than ``max_server_waiting`` or a KV cache at or above
    ``max_kv_cache_usage``: then classes below the top one get no room, whatever
    the leases in flight say."""
    if now_us - state.server_load_at_us > pool.server_load_max_age_us:
        return False
    waiting, kv_usage = state.server_waiting, state.server_kv_usage
    if pool.max_server_waiting >= 0 and waiting is not None and waiting > pool.max_server_waiting:
        return True
    return (
        pool.max_kv_cache_usage > 0
        and kv_usage is not None
        and (kv_usage >= pool.max_kv_cache_usage)
    )


def prefill_lead_us(state: PoolState, cls: ClassPolicy, now_us: int) -> int:
    """How far ahead of now the prefill backlog that ``cls`` is admitted by runs:
    the real clock for the top class (its requests wait behind at most the bound of
    prefill, and the others' share never blocks it), the share clock below it
    (``prefill_started``)."""
    until = state.prefill_real_until_us if cls.rank == 0 else state.prefill_until_us
    return until - now_us


def held_for_gap(
    state: PoolState, pool: PoolPolicy, cls: ClassPolicy, input_tokens: int, top_waiting: int
) -> bool:
    """Whether a prompt must wait for a gap in the top class's traffic: it is of
    another class, longer than the learned threshold, so its prefill would stall an
    unchunked server for longer than the top class's requests can absorb, and that
    class has requests in flight or waiting."""
    limit = state.long_prefill_tokens
    top = pool.classes[0].name
    if limit <= 0 or input_tokens <= limit or cls.name == top:
        return False  # the top class's own long prompts only trade one of its requests
    return state.in_flight.count.get(top, 0) > 0 or top_waiting > 0


def gated_rank(cls: ClassPolicy, effective: int) -> int:
    """A waiter's rank in a GPU-gated pool's order: its effective rank (aging), but a
    waiter of any class but the top one never reaches the top class's rank. There the
    servers' room is the one thing contested, so a waiter promoted to rank 0 would
    take every slot before the top class's own requests (whose max wait is short);
    promoted to rank 1 it still catches up with the classes between, FIFO."""
    return effective if cls.rank == 0 else max(effective, 1)


def within_share(state: PoolState, cls: ClassPolicy, cost: float) -> bool:
    """A GPU-gated pool's standing: the class's own bucket covers the cost (or is
    full, for a cost above the burst)."""
    return state.tokens[cls.name] >= min(cost, cls.burst)


def gated_how(state: PoolState, pool: PoolPolicy, cls: ClassPolicy, cost: float) -> int:
    """How a GPU-gated pool's admission pays: within its share, from its own bucket
    (a cost above the burst, from a full bucket, carries its whole debt, so the
    class's share is counted right however large its requests); over its share, with
    shared tokens, else into debt of at most one burst (room nobody of better
    standing wanted is not held against the class for long). 0: it may not go over
    its share yet: on servers that do not chunk prefill, room is known only once
    the prefill backlog can be predicted, so until a prefill model is learned the
    buckets' rates alone bound what goes over them (shared tokens included)."""
    own = state.tokens[cls.name]
    if own >= min(cost, cls.burst):
        return OWN
    if cls.can_borrow and max(own, 0.0) + state.shared >= cost:
        return BORROW
    if pool.prefill_backlog_us > 0 and state.prefill_model is None:
        return 0
    return OVER


def take(state: PoolState, cls: ClassPolicy, cost: float, how: int) -> None:
    state.admitted += cost
    if how == OWN:
        state.tokens[cls.name] -= cost
        return
    if how == OVER:
        tokens = state.tokens[cls.name]
        state.tokens[cls.name] = max(tokens - cost, min(tokens, -cls.burst))
        return
    own = max(state.tokens[cls.name], 0.0)
    state.tokens[cls.name] -= own
    state.shared -= cost - own


def settle(state: PoolState, pool: PoolPolicy, cls: ClassPolicy, delta: float) -> None:
    """Applies ``actual - charged`` (already bounded by the caller) to the class."""
    tokens = state.tokens[cls.name] - delta
    if tokens > cls.burst:
        state.shared = min(pool.shared_burst, state.shared + tokens - cls.burst)
        tokens = cls.burst
    state.tokens[cls.name] = tokens


def retry_after_ms(state: PoolState, pool: PoolPolicy, cls: ClassPolicy, cost: float) -> int:
    """When the cost could be covered if nobody else took tokens meanwhile."""
    own = state.tokens[cls.name]
    waits = [(min(cost, cls.burst) - own) * 1000 / cls.rate] if cls.rate > 0 else []
    if cls.can_borrow:
        # Shared tokens grow with capacity no class is assured and with the refill of
        # classes that are full now (their refill overflows).
        inflow = pool.free_rate + sum(
            c.rate for c in pool.classes if c.name != cls.name and state.tokens[c.name] >= c.burst
        )
        missing = cost - max(own, 0.0) - state.shared
        own_refill = cls.rate if own < cls.burst else 0.0
        if inflow + own_refill > 0:
            waits.append(missing * 1000 / (inflow + own_refill))
    if not waits:
        return 60_000
    return max(1, math.ceil(min(waits)))


def effective_rank(cls: ClassPolicy, waited_us: int) -> int:
    """A waiter moves up one rank per ``aging_ms`` waited (0: never), to rank 0 at most."""
    if cls.aging_ms <= 0 or waited_us <= 0:
        return cls.rank
    return max(0, cls.rank - waited_us // (cls.aging_ms * 1000))


@dataclass(slots=True)
class TenantBucket:
    """A plain token bucket: one tenant's ceiling within a class (tenant_max_share)."""

    tokens: float
    updated_us: int


def tenant_refilled(
    bucket: TenantBucket | None, now_us: int, rate: float, burst: float
) -> TenantBucket:
    if bucket is None:
        return TenantBucket(burst, now_us)
    elapsed_us = now_us - bucket.updated_us
    if elapsed_us <= 0:
        return TenantBucket(bucket.tokens, bucket.updated_us)
    return TenantBucket(min(burst, bucket.tokens + elapsed_us * rate / 1e6), now_us)


def tenant_allows(bucket: TenantBucket, cost: float, burst: float) -> bool:
    return bucket.tokens >= min(cost, burst)


def tenant_wait_ms(bucket: TenantBucket, cost: float, rate: float, burst: float) -> int:
    return max(1, math.ceil((min(cost, burst) - bucket.tokens) * 1000 / rate)) if rate > 0 else 1
