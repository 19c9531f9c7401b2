"""In-process store: the same semantics as the Redis store, for one daemon alone.

It lets a newcomer run ``qosd serve`` on a bare machine, and it is the reference the
conformance suite holds the Lua scripts to: each method below restates one script
(``acquire``: acquire.lua, ``pump``: pump.lua, and so on; the shared parts are
``_pool.lua``'s). Every operation runs without an await in the middle, so on one
event loop it is atomic exactly as a script is. Nothing is shared between processes
and nothing survives a restart.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from qosd import budget
from qosd.model import (
    Adjustment,
    BucketDecision,
    ClassStatus,
    ControlRecord,
    LeaseExpired,
    LeaseNotFound,
    LeaseSpec,
    PoolStatus,
    PumpResult,
    Reason,
    Sample,
    ServerLoad,
    Settlement,
    StoredSample,
    UsageReport,
    Waiter,
    WaiterState,
)
from qosd.policy import ClassPolicy, PoolPolicy, class_in, effective_pool
from qosd.store.epochs import EpochWatch, ResetListener

_SWEEP_INTERVAL_US = 1_000_000
_LOOKAHEAD = 64  # as _pool.lua: blocked waiters looked past per class for a head
_MAX_ADMITTED_PER_PUMP = 64  # as pump.lua


#: What a GPU-gated pool's refusal suggests as retry-after: it waits for room, and no
#: refill says when that comes; and a long prompt's, held for a gap. As acquire.lua.
ROOM_RETRY_MS = 50
LONG_PREFILL_RETRY_MS = 1000


def monotonic_us() -> int:
    return time.monotonic_ns() // 1000


def _server_status(state: budget.PoolState | None, pool: PoolPolicy, now_us: int) -> dict[str, Any]:
    """PoolStatus's server fields: the servers' load while fresh, else unknown."""
    if state is None or now_us - state.server_load_at_us > pool.server_load_max_age_us:
        return {"server_waiting": None, "server_kv_usage": None}
    return {"server_waiting": state.server_waiting, "server_kv_usage": state.server_kv_usage}


def _standing(
    state: budget.PoolState, cls: ClassPolicy, cost: float, rank: int
) -> tuple[int, int, int]:
    """A GPU-gated pool's order: within its share first, then by rank (budget.gated_rank
    of its effective rank), then the higher class."""
    within = 0 if budget.within_share(state, cls, cost) else 1
    return (within, budget.gated_rank(cls, rank), cls.rank)


@dataclass(slots=True)
class _Lease:
    weight: float
    input_tokens: int
    output_tokens: int
    charged: float
    expires_us: int
    released: bool = False
    final: float = 0.0
    adjustment: float = 0.0


@dataclass(slots=True)
class _Queued:
    enqueued_us: int
    deadline_us: int
    daemon: str
    cost: float
    blocked_until_us: int = 0
    input_tokens: int = 0
    kv_tokens: int = 0  # prompt plus expected output: what it holds once admitted


@dataclass(slots=True)
class _Head:
    id: str
    cls: ClassPolicy
    record: _Queued
    rank: int


@dataclass(slots=True)
class _Pool:
    state: budget.PoolState
    # One FIFO per class: dicts keep insertion order.
    queues: dict[str, dict[str, _Queued]] = field(default_factory=dict)
    # Set when the state is created, as _pool.lua's E; never lost here, so it never
    # changes, and a pool's state always starts full (budget.fresh_state).
    epoch: str = field(default_factory=lambda: uuid.uuid4().hex)


class EmbeddedStore:
    def __init__(
        self,
        tombstone_ms: int,
        stale_after_ms: int = 500,
        clock: Callable[[], int] = monotonic_us,
    ) -> None:
        self._tombstone_us = tombstone_ms * 1000
        self._stale_after_us = stale_after_ms * 1000
        self._clock = clock
        self._pools: dict[str, _Pool] = {}
        self._control: dict[str, ControlRecord] = {}
        self._history: dict[str, deque[Adjustment]] = {}
        self._daemons: dict[str, int] = {}
        self._tenants: dict[tuple[str, str, str], budget.TenantBucket] = {}
        self._leases: dict[str, _Lease] = {}
        self._requests: dict[tuple[str, str], tuple[str, float, int]] = {}
        self._windows: dict[tuple[str, str], deque[str]] = {}
        # Per pool, each server's latest load: (at_us, waiting, kv_usage).
        self._server_reads: dict[str, dict[str, tuple[int, int | None, float | None]]] = {}
        # Every lease has the same TTL, so creation order is expiry order: the sweep
        # only ever looks at the front of these queues.
        self._lease_order: deque[tuple[int, str]] = deque()
        self._request_order: deque[tuple[int, tuple[str, str]]] = deque()
        self._next_sweep_us = 0
        self._epochs = EpochWatch()  # as the Redis store's; it never sees a change

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    def add_reset_listener(self, listener: ResetListener) -> None:
        self._epochs.add_listener(listener)

    # -- shared parts (_pool.lua) ---------------------------------------------------

    def _pool(self, pool: PoolPolicy, now_us: int) -> tuple[_Pool, PoolPolicy]:
        """The pool's record, refilled to now, and its policy at the admitted rate."""
        record = self._pools.get(pool.name)
        if record is None:
            record = _Pool(budget.fresh_state(pool, now_us))
            self._pools[pool.name] = record
        for cls in pool.classes:
            record.queues.setdefault(cls.name, {})
        effective = effective_pool(pool, record.state.capacity)
        budget.refill(record.state, effective, now_us)
        budget.end_expired(record.state.in_flight, now_us)
        return record, effective

    @staticmethod
    def _held(record: _Pool, pool: PoolPolicy, cls: ClassPolicy, input_tokens: int) -> bool:
        top_waiting = len(record.queues[pool.classes[0].name])
        return budget.held_for_gap(record.state, pool, cls, input_tokens, top_waiting)

    def _daemon_alive(self, daemon: str, now_us: int) -> bool:
        return self._daemons.get(daemon, 0) >= now_us - self._stale_after_us

    def _heads(self, record: _Pool, pool: PoolPolicy, now_us: int) -> list[_Head]:
        heads: list[_Head] = []
        for cls in pool.classes:
            queue = record.queues[cls.name]
            dead: list[str] = []
            blocked = 0
            for waiter_id, waiter in queue.items():
                if (
                    not self._daemon_alive(waiter.daemon, now_us)
                    or waiter.deadline_us + self._stale_after_us < now_us
                ):
                    dead.append(waiter_id)
                elif waiter.blocked_until_us <= now_us and not self._held(
                    record, pool, cls, waiter.input_tokens
                ):
                    rank = budget.effective_rank(cls, now_us - waiter.enqueued_us)
                    heads.append(_Head(waiter_id, cls, waiter, rank))
                    break
                else:
                    blocked += 1
                    if blocked >= _LOOKAHEAD:
                        break
            for waiter_id in dead:
                del queue[waiter_id]
        heads.sort(key=lambda head: (head.rank, head.record.enqueued_us))
        return heads

    def _has_live_waiter(
        self, record: _Pool, pool: PoolPolicy, cls: ClassPolicy, now_us: int
    ) -> bool:
        """A waiter of the class that is not stepping aside for its tenant's ceiling."""
        if not record.queues[cls.name]:
            return False
        return any(head.cls.name == cls.name for head in self._heads(record, pool, now_us))

    def _shared_open_for(
        self, record: _Pool, pool: PoolPolicy, cls: ClassPolicy, now_us: int
    ) -> bool:
        if not any(queue for name, queue in record.queues.items() if name != cls.name):
            return True
        return not any(
            head.cls.name != cls.name and head.rank <= cls.rank and head.cls.can_borrow
            for head in self._heads(record, pool, now_us)
        )

    def _gated_how(
        self,
        record: _Pool,
        pool: PoolPolicy,
        cls: ClassPolicy,
        cost: float,
        kv_tokens: int,
        now_us: int,
    ) -> int:
        """A GPU-gated pool's answer for a new request: how it pays, or 0 to wait
        (budget.py, rules for GPU-gated pools)."""
        state = record.state
        if self._has_live_waiter(record, pool, cls, now_us):  # FIFO: no overtaking
            return 0
        if not budget.has_room(state, pool, cls, kv_tokens, now_us):
            return 0
        mine = _standing(state, cls, cost, cls.rank)
        for head in self._heads(record, pool, now_us):
            if (
                head.cls.name != cls.name
                and _standing(state, head.cls, head.record.cost, head.rank) <= mine
                and not budget.passes_reserve(
                    cls,
                    head.cls,
                    budget.has_room(state, pool, head.cls, head.record.kv_tokens, now_us),
                )
            ):
                return 0  # someone stands better, or as well and came first
        return budget.gated_how(state, pool, cls, cost)

    def _tenant(
        self, pool: PoolPolicy, cls: ClassPolicy, tenant: str, now_us: int
    ) -> budget.TenantBucket:
        key = (pool.name, cls.name, tenant)
        bucket = budget.tenant_refilled(
            self._tenants.get(key), now_us, cls.tenant_rate, cls.tenant_burst
        )
        self._tenants[key] = bucket
        return bucket

    def _add_lease(
        self, pool: PoolPolicy, record: _Pool, cls: str, cost: float, lease: LeaseSpec, now_us: int
    ) -> int:
        expires_us = now_us + lease.ttl_ms * 1000
        budget.lease_started(
            record.state.in_flight, cls, lease.input_tokens + lease.output_tokens, expires_us
        )
        if pool.gated:
            budget.prefill_started(record.state, pool, lease.input_tokens, now_us)
        self._leases[lease.lease_id] = _Lease(
            weight=lease.weight,
            input_tokens=lease.input_tokens,
            output_tokens=lease.output_tokens,
            charged=cost,
            expires_us=expires_us,
        )
        self._lease_order.append((expires_us + self._tombstone_us, lease.lease_id))
        if lease.request_id:
            key = (pool.name, lease.request_id)
            self._requests[key] = (lease.lease_id, cost, expires_us)
            self._request_order.append((expires_us, key))
        return expires_us

    # -- acquire.lua ----------------------------------------------------------------

    async def acquire(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        cost: float,
        lease: LeaseSpec,
        wait_ms: int,
        daemon_id: str,
    ) -> BucketDecision:
        now_us = self._clock()
        if now_us >= self._next_sweep_us:
            self._sweep(now_us)
        record, pool = self._pool(pool, now_us)
        cls = class_in(pool, cls.name)
        state = record.state

        def answer(
            reason: Reason, retry_ms: int = 0, admitted: bool = False, queued: bool = False
        ) -> BucketDecision:
            return BucketDecision(
                admitted=admitted,
                reason=reason,
                lease_id=lease.lease_id if admitted or queued else "",
                charged=cost,
                remaining=state.tokens[cls.name],
                retry_after_ms=retry_ms,
                lease_ttl_ms=lease.ttl_ms if admitted else 0,
                queued=queued,
            )

        if lease.request_id:
            prior = self._requests.get((pool.name, lease.request_id))
            if prior is not None and prior[2] - now_us >= 1000:  # as acquire.lua: >= 1 ms
                return BucketDecision(
                    admitted=True,
                    reason=Reason.NONE,
                    lease_id=prior[0],
                    charged=prior[1],
                    remaining=state.tokens[cls.name],
                    retry_after_ms=0,
                    lease_ttl_ms=(prior[2] - now_us) // 1000,
                    replayed=True,
                )
        if cost > cls.max_cost:
            return answer(Reason.COST_EXCEEDS_BURST)
        queue = record.queues[cls.name]
        how = 0
        held = self._held(record, pool, cls, lease.input_tokens)
        if held:
            pass  # waits for a gap in the top class's traffic
        elif pool.gated:
            kv_tokens = lease.input_tokens + lease.output_tokens
            how = self._gated_how(record, pool, cls, cost, kv_tokens, now_us)
        elif not self._has_live_waiter(record, pool, cls, now_us):  # FIFO: no overtaking
            shared_open = (
                cls.can_borrow
                and state.tokens[cls.name] < cost
                and self._shared_open_for(record, pool, cls, now_us)
            )
            how = budget.how_to_take(state, cls, cost, shared_open)
        tenant = None
        tenant_wait_ms = 0
        if how and cls.tenant_rate > 0:
            tenant = self._tenant(pool, cls, lease.tenant, now_us)
            if not budget.tenant_allows(tenant, cost, cls.tenant_burst):
                tenant_wait_ms = budget.tenant_wait_ms(
                    tenant, cost, cls.tenant_rate, cls.tenant_burst
                )
                how = 0
        if how:
            budget.take(state, cls, cost, how)
            if tenant is not None:
                tenant.tokens -= cost
            self._add_lease(pool, record, cls.name, cost, lease, now_us)
            return answer(Reason.NONE, admitted=True)
        # Queue only a request whose wait could cover the refill it needs if nobody
        # else took tokens meanwhile; any other is told at once.
        if held and wait_ms <= 0:
            return answer(Reason.LONG_PREFILL, LONG_PREFILL_RETRY_MS)
        if pool.gated or held:  # waits for room, a gap, its turn: no refill predicts
            retry_ms = max(ROOM_RETRY_MS, tenant_wait_ms)
            if wait_ms <= 0:
                return answer(Reason.RATE_LIMITED, retry_ms)
        else:
            retry_ms = max(budget.retry_after_ms(state, pool, cls, cost), tenant_wait_ms)
        if wait_ms <= 0 or (not pool.gated and not held and retry_ms > wait_ms):
            return answer(Reason.RATE_LIMITED, retry_ms)
        if len(queue) >= cls.max_queue:
            return answer(Reason.QUEUE_FULL, retry_ms)
        queue[lease.lease_id.partition(":")[2]] = _Queued(
            enqueued_us=now_us,
            deadline_us=now_us + wait_ms * 1000,
            daemon=daemon_id,
            cost=cost,
            blocked_until_us=now_us + tenant_wait_ms * 1000 if tenant_wait_ms else 0,
            input_tokens=lease.input_tokens,
            kv_tokens=lease.input_tokens + lease.output_tokens,
        )
        self._daemons[daemon_id] = now_us
        return answer(Reason.NONE, queued=True)

    # -- pump.lua -------------------------------------------------------------------

    async def pump(
        self, pool: PoolPolicy, daemon_id: str, waiters: Sequence[Waiter]
    ) -> list[PumpResult]:
        now_us = self._clock()
        self._daemons[daemon_id] = now_us
        if len(self._daemons) > 32:  # every restart brings a new id: forget the silent
            silent = now_us - 10 * self._stale_after_us
            self._daemons = {d: seen for d, seen in self._daemons.items() if seen >= silent}
        record, pool = self._pool(pool, now_us)
        state = record.state
        mine = {waiter.id: waiter for waiter in waiters}
        admitted: dict[str, BucketDecision] = {}
        progress = True
        while progress and len(admitted) < _MAX_ADMITTED_PER_PUMP:
            progress = False
            if pool.gated:
                granted = self._pump_gated(record, pool, mine, now_us)
                if granted is not None:
                    admitted[granted[0]] = granted[1]
                    progress = True
                continue
            shared_open = True
            for head in self._heads(record, pool, now_us):
                cls = head.cls
                how = budget.how_to_take(state, cls, head.record.cost, shared_open)
                waiter = mine.get(head.id)
                if how and waiter is not None:
                    tenant = self._tenant_for(pool, head, waiter, now_us)
                    if tenant is not False:
                        admitted[head.id] = self._admit(
                            record, pool, head, waiter, how, tenant, now_us
                        )
                        progress = True
                        break  # the heads changed: walk again
                elif how:
                    if how == budget.BORROW:
                        shared_open = False  # kept for another daemon's waiter
                elif cls.can_borrow:
                    shared_open = False  # nothing after it may take what it waits for
        results: list[PumpResult] = []
        for waiter in waiters:
            decision = admitted.get(waiter.id)
            if decision is not None:
                results.append(PumpResult(WaiterState.ADMITTED, decision))
            elif waiter.id in record.queues[waiter.qos_class]:
                cls = class_in(pool, waiter.qos_class)
                held = self._held(record, pool, cls, waiter.lease.input_tokens)
                results.append(PumpResult(WaiterState.HELD if held else WaiterState.WAITING, None))
            else:
                results.append(PumpResult(WaiterState.GONE, None))
        return results

    def _pump_gated(
        self, record: _Pool, pool: PoolPolicy, mine: dict[str, Waiter], now_us: int
    ) -> tuple[str, BucketDecision] | None:
        """Admits the best-standing head if it is this daemon's and the pool has room
        for it; a head of another daemon holds the room for that daemon's next pump.
        A head without room holds it too, except the top class's reserve
        (budget.passes_reserve): past it, only top-class heads may go. A head over its
        tenant's ceiling steps aside. Returns what it admitted."""
        state = record.state
        heads = sorted(
            self._heads(record, pool, now_us),
            key=lambda h: (*_standing(state, h.cls, h.record.cost, h.rank), h.record.enqueued_us),
        )
        blocked: ClassPolicy | None = None  # the better-standing head without room
        for head in heads:
            cls, cost = head.cls, head.record.cost
            if blocked is not None and not budget.passes_reserve(cls, blocked, False):
                continue
            if not budget.has_room(state, pool, cls, head.record.kv_tokens, now_us):
                if blocked is None and budget.passes_reserve(pool.classes[0], cls, False):
                    blocked = cls  # the top class may still go past it, into its reserve
                    continue
                return None
            waiter = mine.get(head.id)
            if waiter is None:
                return None
            how = budget.gated_how(state, pool, cls, cost)
            if how == 0:
                continue  # may not go over its share yet: the next may be within its own
            tenant = self._tenant_for(pool, head, waiter, now_us)
            if tenant is not False:
                return head.id, self._admit(record, pool, head, waiter, how, tenant, now_us)
        return None

    def _tenant_for(
        self, pool: PoolPolicy, head: _Head, waiter: Waiter, now_us: int
    ) -> budget.TenantBucket | Literal[False] | None:
        """The head's tenant bucket to charge (None: no ceiling), or False when the
        head is over its tenant's ceiling: then it steps aside until it has refilled."""
        cls, cost = head.cls, head.record.cost
        if cls.tenant_rate <= 0:
            return None
        tenant = self._tenant(pool, cls, waiter.lease.tenant, now_us)
        if budget.tenant_allows(tenant, cost, cls.tenant_burst):
            return tenant
        wait_ms = budget.tenant_wait_ms(tenant, cost, cls.tenant_rate, cls.tenant_burst)
        head.record.blocked_until_us = now_us + wait_ms * 1000
        return False

    def _admit(
        self,
        record: _Pool,
        pool: PoolPolicy,
        head: _Head,
        waiter: Waiter,
        how: int,
        tenant: budget.TenantBucket | None,
        now_us: int,
    ) -> BucketDecision:
        """Admits a waiter at the head of its queue: takes its cost, writes its lease."""
        cls, cost, state = head.cls, head.record.cost, record.state
        budget.take(state, cls, cost, how)
        if tenant is not None:
            tenant.tokens -= cost
        self._add_lease(pool, record, cls.name, cost, waiter.lease, now_us)
        del record.queues[cls.name][head.id]
        return BucketDecision(
            admitted=True,
            reason=Reason.NONE,
            lease_id=waiter.lease.lease_id,
            charged=cost,
            remaining=state.tokens[cls.name],
            retry_after_ms=0,
            lease_ttl_ms=waiter.lease.ttl_ms,
        )

    # -- cancel.lua -----------------------------------------------------------------

    async def cancel(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> None:
        record, _ = self._pool(pool, self._clock())
        for waiter in waiters:
            record.queues[waiter.qos_class].pop(waiter.id, None)

    # -- release.lua ----------------------------------------------------------------

    async def release(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease_id: str,
        usage: UsageReport,
        *,
        exact: bool = False,
    ) -> Settlement:
        now_us = self._clock()
        record = self._leases.get(lease_id)
        # Like a Redis lease hash, a lease is remembered until its TTL and the tombstone
        # time have passed, released or not.
        if record is None or record.expires_us + self._tombstone_us <= now_us:
            raise LeaseNotFound(f"lease {lease_id} is unknown (never issued, or forgotten)")
        pool_record, pool = self._pool(pool, now_us)
        cls = class_in(pool, cls.name)
        state = pool_record.state
        if record.released:
            return Settlement(True, record.final, record.adjustment, state.tokens[cls.name])
        if now_us >= record.expires_us:
            raise LeaseExpired(lease_id, record.charged)
        input_tokens = record.input_tokens if usage.input_tokens is None else usage.input_tokens
        output_tokens = record.output_tokens if usage.output_tokens is None else usage.output_tokens
        actual = (input_tokens + usage.output_weight * output_tokens) * record.weight
        delta = actual - record.charged
        if not exact:
            delta = max(-cls.burst, min(cls.burst, delta))
        budget.settle(state, pool, cls, delta)
        estimate = record.input_tokens + record.output_tokens  # as counted at admission
        budget.lease_ended(state.in_flight, cls.name, estimate, record.expires_us, now_us)
        record.released = True
        record.final = record.charged + delta
        record.adjustment = delta
        return Settlement(False, record.final, delta, state.tokens[cls.name])

    # -- status.lua -----------------------------------------------------------------

    async def status(self, pool: PoolPolicy) -> PoolStatus:
        now_us = self._clock()
        existing = self._pools.get(pool.name)
        if existing is None:
            state = budget.fresh_state(pool, now_us)
            queues: dict[str, dict[str, _Queued]] = {}
        else:
            state = budget.PoolState(
                dict(existing.state.tokens),
                existing.state.shared,
                existing.state.updated_us,
                existing.state.capacity,
                existing.state.admitted,
                existing.state.in_flight.copy(),
                existing.state.long_prefill_tokens,
            )
            queues = existing.queues
        effective = effective_pool(pool, state.capacity)
        budget.refill(state, effective, now_us)
        budget.end_expired(state.in_flight, now_us)
        classes: dict[str, ClassStatus] = {}
        for cls in effective.classes:
            queue = queues.get(cls.name, {})
            oldest = min((w.enqueued_us for w in queue.values()), default=now_us)
            classes[cls.name] = ClassStatus(
                tokens=state.tokens[cls.name],
                waiting=len(queue),
                oldest_wait_ms=(now_us - oldest) // 1000,
                rate=cls.rate,
                burst=cls.burst,
                in_flight=state.in_flight.count.get(cls.name, 0),
                in_flight_tokens=state.in_flight.tokens.get(cls.name, 0.0),
            )
        return PoolStatus(
            shared_tokens=state.shared,
            classes=classes,
            capacity=state.capacity,
            admitted_tokens=state.admitted,
            now_ms=now_us // 1000,
            long_prefill_tokens=state.long_prefill_tokens,
            **_server_status(existing.state if existing else None, pool, now_us),
        )

    # -- control.lua, adjust.lua, lead.lua ------------------------------------------

    async def control(self, pool: PoolPolicy) -> ControlRecord:
        existing = self._pools.get(pool.name)
        epoch = existing.epoch if existing else ""  # control.lua: E, '' before any state
        self._epochs.saw(pool.name, epoch)
        record = self._control.get(pool.name)
        if record is None:
            capacity = existing.state.capacity if existing else pool.capacity
            return ControlRecord(
                capacity, False, 0, "", capacity, "", 0.0, 1, capacity, 0, 0.0, epoch
            )
        return dataclasses.replace(record, epoch=epoch)

    async def adjust(
        self, pool: PoolPolicy, update: ControlRecord, cooldown_ms: int, *, force: bool = False
    ) -> bool:
        now_us = self._clock()
        now_ms = now_us // 1000
        current = self._control.get(pool.name)
        if not force and current is not None:
            if current.pinned:
                return False
            if current.changed_ms and now_ms - current.changed_ms < cooldown_ms:
                return False
        record, _ = self._pool(pool, now_us)  # refilled at the old rate up to now
        old = record.state.capacity
        record.state.capacity = update.capacity
        effective = effective_pool(pool, update.capacity)
        for cls in effective.classes:
            record.state.tokens[cls.name] = min(record.state.tokens[cls.name], cls.burst)
        record.state.shared = min(record.state.shared, effective.shared_burst)
        self._control[pool.name] = dataclasses.replace(
            update, changed_ms=now_ms, changed_from=old, record_epoch=record.epoch
        )
        history = self._history.setdefault(pool.name, deque(maxlen=100))
        history.appendleft(
            Adjustment(now_ms, old, update.capacity, update.reason, update.changed_by)
        )
        return True

    async def set_prefill(
        self, pool: PoolPolicy, tokens: float, model: tuple[float, float, float] | None
    ) -> None:
        record, _ = self._pool(pool, self._clock())
        record.state.long_prefill_tokens = tokens
        record.state.prefill_model = model

    async def report_load(self, pool: PoolPolicy, loads: Sequence[ServerLoad]) -> None:
        now_us = self._clock()
        record, _ = self._pool(pool, now_us)
        reads = self._server_reads.setdefault(pool.name, {})
        for load in loads:
            reads[load.server] = (now_us, load.waiting, load.kv_usage)
        for server in [
            s for s, read in reads.items() if now_us - read[0] > pool.server_load_max_age_us
        ]:
            del reads[server]  # stopped reporting: forgotten, as load.lua does
        waiting, kv_usage = budget.servers_load(reads.values(), now_us, pool.server_load_max_age_us)
        record.state.server_waiting = waiting
        record.state.server_kv_usage = kv_usage
        record.state.server_load_at_us = now_us

    async def history(self, pool: PoolPolicy, limit: int = 20) -> list[Adjustment]:
        return list(self._history.get(pool.name, ()))[:limit]

    async def lead(self, daemon_id: str, lease_ms: int) -> str:
        """One process, one store: this daemon always leads its own pools."""
        return daemon_id if lease_ms > 0 else ""

    # -- report.lua and admin -------------------------------------------------------

    async def report(self, samples: Sequence[Sample], window_size: int) -> None:
        now_ms = self._clock() // 1000
        for sample in samples:
            key = (sample.pool, sample.qos_class)
            window = self._windows.get(key)
            if window is None or window.maxlen != window_size:
                window = deque(window or (), maxlen=window_size)
                self._windows[key] = window
            window.appendleft(f"{now_ms}|{sample.encode()}")

    async def window(self, pool: str, qos_class: str) -> list[StoredSample]:
        return [StoredSample.decode(raw) for raw in self._windows.get((pool, qos_class), ())]

    def _sweep(self, now_us: int) -> None:
        """Forgets leases and request ids past use, so memory stays bounded."""
        self._next_sweep_us = now_us + _SWEEP_INTERVAL_US
        leases, lease_order = self._leases, self._lease_order
        while lease_order and lease_order[0][0] <= now_us:
            leases.pop(lease_order.popleft()[1], None)
        requests, request_order = self._requests, self._request_order
        while request_order and request_order[0][0] <= now_us:
            _, key = request_order.popleft()
            entry = requests.get(key)
            if entry is not None and entry[2] <= now_us:
                del requests[key]
