"""Admission logic between the doors and a bucket store.

It takes requests the doors built and validated (``qosd.doors.request``), lets them
wait in the fleet-wide waiting room (``qosd.waiting``) within the caller's max wait,
turns store outages into the configured fail mode, and sees every lease end: a
Release the store did not take is retried (``qosd.settlements``). It knows nothing of
gRPC or HTTP (the doors do) and nothing of Redis (the store does); the budget rules
themselves, pricing included, are the store's scripts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.trace import Tracer

from qosd.config import Config, FailMode
from qosd.model import (
    FAIL_OPEN_MARK,
    AdmissionRequest,
    BucketDecision,
    LeaseSpec,
    Outcome,
    Reason,
    ReleaseRequest,
    Sample,
    ServerLoad,
    Settlement,
    StoreUnavailable,
    UsageReport,
    Waiter,
    new_lease_token,
)
from qosd.policy import ClassPolicy, PoolPolicy, lease_token, resolve_pools
from qosd.settlements import SettlementRetry
from qosd.store.base import BucketStore
from qosd.waiting import SHUTTING_DOWN_RETRY_MS, WaitingRoom

log = logging.getLogger(__name__)

LONG_PREFILL_MESSAGE = (
    "its prefill would stall the pool's most urgent requests for longer than they can "
    "absorb, and no gap in their traffic (or in the share of time the pool lets long "
    "prompts block them) came within its max wait; retry after retry_after_ms, or use "
    "a pool whose servers chunk prefill or serve the urgent requests first"
)
DEADLINE_MESSAGE = (
    "its TTFT objective cannot be met here: the predicted wait (retry_after_ms) and its "
    "own prefill outlast it; try another pool or replica"
)
# With no max wait of its own, a request with a TTFT objective may wait its slack.
UNCAPPED_WAIT_MS = 3_600_000


class DuplicateRequest(Exception):
    """The request id names another request's lease, or its place in a queue, while
    that lives: a second request under it gets no decision (doors answer 409)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"request_id {request_id[:80]!r} names another request, admitted or waiting "
            "(a released id admits nothing until its lease's TTL has passed); give each "
            "request its own id"
        )
        self.request_id = request_id


# Not frozen, and only here: a frozen dataclass sets each field through
# object.__setattr__, and at 0.6-0.9 us a construction that was 2.5 us of every
# Acquire (docs/performance.md). Treat it as immutable all the same.
@dataclass(slots=True)
class AcquireOutcome:
    decision: BucketDecision
    pool: str
    waited_ms: int
    message: str = ""
    # Where the request stands at servers that schedule by priority (lower first):
    # its class's rank in the pool, 0 for the top class.
    server_priority: int = 0
    # The lease admitted, for a caller that could not use it to undo it (its request
    # id freed: the proxy, when its upstream refused or was never reached).
    lease: LeaseSpec | None = None


class StoreGuard:
    """Fails fast while the store is known to be down, letting one probe through per interval.

    Without it every request during an outage would wait out the full store timeout;
    with it an outage costs one timeout per retry interval, and service resumes on
    the first probe that succeeds.
    """

    def __init__(self, retry_interval_s: float, clock: Callable[[], float] = time.monotonic):
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self.down = False
        self._retry_at = 0.0
        self._probing = False
        self.last_error = ""

    def enter(self) -> bool:
        """Called before a store call while down. Returns True for the probe call."""
        if self._probing or self._clock() < self._retry_at:
            raise StoreUnavailable(f"store down, failing fast ({self.last_error})")
        self._probing = True
        return True

    def probe_done(self) -> None:
        self._probing = False

    def failed(self, error: StoreUnavailable) -> None:
        if not self.down:
            log.warning("store unavailable: %s", error)
        self.down = True
        self.last_error = str(error)
        self._retry_at = self._clock() + self._retry_interval_s

    def recovered(self) -> None:
        if self.down:
            log.info("store reachable again")
        self.down = False


class Admission:
    def __init__(self, config: Config, store: BucketStore, tracer: Tracer | None = None) -> None:
        self._store = store
        self._tracer = tracer  # None: tracing off, no waiting-room spans
        self._configure(config)
        self._retry_interval_ms = config.redis.retry_interval_ms
        self.guard = StoreGuard(config.redis.retry_interval_ms / 1000)
        self._draining = False
        # Names this process's waiters in the shared queues, and proves it alive: the
        # store's, named when it was made.
        self.daemon_id = store.daemon_id
        self._waiting = WaitingRoom(
            store,
            config.waiting.poll_ms / 1000,
            lambda pool, waiter: self._store_down_decision(
                self._policies[(pool.name, waiter.qos_class)]
            ),
            store_patience_s=config.redis.retry_interval_ms / 1000,
            undo_later=lambda pool, waiter: self.undo_later(
                self._policies[(pool.name, waiter.qos_class)], waiter.lease
            ),
        )
        # Releases the store did not take, retried until they land or their lease
        # has expired: a slow or gone store strands no lease.
        self.settlements = SettlementRetry(self._settle, config.lease.ttl_s)

    def _configure(self, config: Config) -> None:
        """Derives the rules Acquire and Release read from ``config``. Synchronous, so
        an event loop's calls see all of one config or all of the other; an Acquire
        reads what it needs before its first await."""
        self._config = config
        self._pools = resolve_pools(config)
        self._policies = {
            (pool.name, cls.name): cls for pool in self._pools.values() for cls in pool.classes
        }
        self._lease_ttl_ms = int(config.lease.ttl_s * 1000)
        self._fail_open = config.fail_mode is FailMode.OPEN

    def reconfigure(self, config: Config) -> None:
        """Takes a reloaded config (qosd.reload: every pool and class of the running
        one is still in it, and the store, leases and listeners are unchanged). New
        calls use it at once; waiters are pumped under their pool's new policy."""
        self._configure(config)
        self._waiting.reconfigure(self._pools, config.waiting.poll_ms / 1000)

    @property
    def store(self) -> BucketStore:
        return self._store

    @property
    def config(self) -> Config:
        return self._config

    @property
    def pools(self) -> dict[str, PoolPolicy]:
        return dict(self._pools)

    def policy(self, pool: str, qos_class: str) -> ClassPolicy:
        return self._policies[(pool, qos_class)]

    @property
    def waiting_room(self) -> WaitingRoom:
        return self._waiting

    def pool(self, name: str) -> PoolPolicy:
        return self._pools[name]

    def pool_names(self) -> list[str]:
        return list(self._pools)

    @property
    def store_kind(self) -> str:
        return "redis" if self._config.redis.url else "embedded"

    def begin_drain(self) -> None:
        """Answers every waiter now (SHUTTING_DOWN); new requests no longer wait."""
        self._draining = True
        self._waiting.drain()

    async def close(self, grace_s: float) -> None:
        """Closes the waiting room, and gives releases still being retried up to
        ``grace_s`` to land."""
        await self._waiting.close()
        await self.settlements.close(grace_s)

    # -- acquire ----------------------------------------------------------------

    async def acquire(self, request: AdmissionRequest) -> AcquireOutcome:
        """Admits, queues until admitted or out of time, or refuses ``request``. Raises
        DuplicateRequest when its request id names another request."""
        arrived = time.monotonic()
        policy = self._policies[(request.pool, request.qos_class)]
        ttft_ms = request.ttft_ms
        wait_ms, wait_cap_ms = self._waits(policy, request)
        lease = LeaseSpec(
            lease_id=f"{request.pool}:{policy.name}:{lease_token(policy, request.tenant)}",
            request_id=request.request_id,
            tenant=request.tenant,
            input_tokens=request.input_tokens,
            output_tokens=request.expected_output_tokens,
            weight=policy.weight,
            ttl_ms=self._lease_ttl_ms if request.lease_ttl_ms is None else request.lease_ttl_ms,
            estimated=request.estimated,
        )
        pool_policy = self._pools[request.pool]
        decision = await self._take(pool_policy, policy, lease, wait_ms, ttft_ms, wait_cap_ms)
        if decision.duplicate:
            raise DuplicateRequest(request.request_id)
        if decision.queued:
            # The wait the store granted, counted from the request's arrival: the store
            # call that queued it is part of the wait (a wait must end by its max wait
            # as the caller sees it, and that call is slow when the store or loop is).
            wait_s = max(0.0, decision.retry_after_ms / 1000 - (time.monotonic() - arrived))
            waiter = Waiter(policy.name, decision.charged, lease)
            if self._tracer is None:
                decision, waited_ms = await self._wait(pool_policy, waiter, wait_s)
            else:
                decision, waited_ms = await self._traced_wait(pool_policy, waiter, wait_s)
            return AcquireOutcome(
                decision, request.pool, waited_ms, _MESSAGES.get(decision.reason, ""),
                policy.rank, lease if decision.admitted else None,
            )  # fmt: skip
        if self._draining and not decision.admitted and decision.reason is Reason.RATE_LIMITED:
            decision = _with_reason(decision, Reason.SHUTTING_DOWN, SHUTTING_DOWN_RETRY_MS)
        return AcquireOutcome(
            decision, request.pool, 0, _MESSAGES.get(decision.reason, ""), policy.rank,
            lease if decision.admitted else None,
        )  # fmt: skip

    def _waits(self, policy: ClassPolicy, request: AdmissionRequest) -> tuple[int, int]:
        """The request's wait and its cap, ms: the class's max wait (as the caller cut
        it), and the most the store may grant a request with a TTFT objective once it
        can predict prefill (its slack: qosd/store/lua/pool/deadline.lua): the
        caller's own max wait, else the objective."""
        if self._draining:
            return 0, 0
        wait_cap_ms = UNCAPPED_WAIT_MS
        max_wait_ms = request.max_wait_ms
        if max_wait_ms is None:
            wait_ms = policy.max_wait_ms
        else:
            wait_ms = min(max_wait_ms, policy.max_wait_ms)
            wait_cap_ms = max_wait_ms
        if request.slo_ttft_ms is not None:
            # Admitted after its TTFT objective has passed, it has missed it already.
            wait_ms = min(wait_ms, math.ceil(request.slo_ttft_ms))
        ttft_ms = request.ttft_ms
        wait_cap_ms = min(wait_cap_ms, math.ceil(ttft_ms)) if ttft_ms else wait_ms
        deadline_s = request.deadline_s
        if deadline_s is not None:
            # Answer before the caller's deadline: a late admission would leak a lease.
            latest_ms = max(0, int((deadline_s - min(0.05, deadline_s * 0.1)) * 1000))
            wait_ms, wait_cap_ms = min(wait_ms, latest_ms), min(wait_cap_ms, latest_ms)
        return wait_ms, wait_cap_ms

    async def _wait(
        self, pool: PoolPolicy, waiter: Waiter, wait_s: float
    ) -> tuple[BucketDecision, int]:
        loop = asyncio.get_running_loop()
        queued_at = loop.time()
        decision = await self._waiting.wait(pool, waiter, wait_s)
        return decision, _ms(loop.time() - queued_at)

    async def _traced_wait(
        self, pool: PoolPolicy, waiter: Waiter, wait_s: float
    ) -> tuple[BucketDecision, int]:
        """``_wait`` in a span of its own: a trace shows queueing apart from the store."""
        assert self._tracer is not None
        with self._tracer.start_as_current_span(
            "qosd.waiting_room",
            attributes={
                "qosd.pool": pool.name,
                "qosd.class": waiter.qos_class,
                "qosd.cost_tokens": waiter.cost,
                "qosd.max_wait_ms": _ms(wait_s),
            },
        ) as span:
            decision, waited_ms = await self._wait(pool, waiter, wait_s)
            span.set_attributes(
                {
                    "qosd.decision": "admitted" if decision.admitted else "rejected",
                    "qosd.reason": decision.reason.name,
                    "qosd.wait_ms": waited_ms,
                }
            )
            return decision, waited_ms

    async def _take(
        self,
        pool: PoolPolicy,
        policy: ClassPolicy,
        lease: LeaseSpec,
        wait_ms: int,
        ttft_ms: float,
        wait_cap_ms: int,
    ) -> BucketDecision:
        guard = self.guard
        probe = sent = False
        try:
            if guard.down:
                probe = guard.enter()
            sent = True
            decision = await self._store.acquire(
                pool, policy, lease, wait_ms, ttft_ms=ttft_ms, wait_cap_ms=wait_cap_ms
            )
        except StoreUnavailable as error:
            if probe or not guard.down:
                guard.failed(error)
            if sent:
                # The script may have run with its answer lost (a store killed or cut
                # off after it), leaving a lease or a queue entry nobody holds.
                self.undo_later(policy, lease)
            return self._store_down_decision(policy)
        finally:
            if probe:
                guard.probe_done()
        if guard.down:
            guard.recovered()
        return decision

    def _store_down_decision(self, policy: ClassPolicy) -> BucketDecision:
        if self._fail_open:
            return BucketDecision(
                admitted=True,
                reason=Reason.FAIL_OPEN,
                lease_id=f"{policy.pool}:{policy.name}:{FAIL_OPEN_MARK}{new_lease_token()}",
                charged=0.0,
                remaining=0.0,
                retry_after_ms=0,
                lease_ttl_ms=self._lease_ttl_ms,
            )
        return BucketDecision(
            admitted=False,
            reason=Reason.BACKEND_UNAVAILABLE,
            lease_id="",
            charged=0.0,
            remaining=0.0,
            retry_after_ms=self._retry_interval_ms,
            lease_ttl_ms=0,
        )

    # -- release ----------------------------------------------------------------

    async def release(self, request: ReleaseRequest) -> Settlement:
        """Settles a lease. A Release the store does not take (StoreUnavailable) is
        raised to the caller and also kept, and retried until it lands or the lease
        has expired: Release is idempotent by lease id, so the caller may retry too."""
        if request.fail_open:
            # Admitted while the store was down: nothing was charged, nothing to settle.
            return Settlement(False, 0.0, 0.0, 0.0)
        try:
            return await self._settle(request)
        except StoreUnavailable:
            self.settlements.add(request)
            raise

    def undo_later(self, policy: ClassPolicy, lease: LeaseSpec) -> None:
        """Undoes an admission nobody holds, whenever the store takes it: its queue
        entry withdrawn, its whole charge back and its request id freed, as for a
        caller that left. Retried with the Releases (``settlements``); where the store
        made nothing, the retry finds nothing and ends."""
        self.settlements.add(
            ReleaseRequest(lease.lease_id, policy, False, 0, 0, Outcome.CANCELLED, undo=lease)
        )

    async def _settle(self, request: ReleaseRequest) -> Settlement:
        policy = request.policy
        if request.undo is not None:
            pool = self._pools[policy.pool]
            await self._store.cancel(pool, [Waiter(policy.name, 0.0, request.undo)])
            settlement = await self._store.undo(pool, policy, request.undo)
            self._waiting.nudge(policy.pool)
            return settlement
        usage = UsageReport(request.input_tokens, request.output_tokens, request.outcome)
        pool = self._pools[policy.pool]
        settlement = await self._store.release(
            pool, policy, request.lease_id, usage, request.frees_request_of
        )
        if settlement.adjustment < 0 or (pool.gated and not settlement.already_released):
            self._waiting.nudge(policy.pool)  # tokens or room came back: a waiter may fit
        return settlement

    # -- report -----------------------------------------------------------------

    async def report_loads(self, loads: list[tuple[str, ServerLoad]]) -> None:
        by_pool: dict[str, list[ServerLoad]] = {}
        for pool, load in loads:
            by_pool.setdefault(pool, []).append(load)
        for pool, pool_loads in by_pool.items():
            await self._store.report_load(self._pools[pool], pool_loads)

    async def report(self, samples: list[Sample]) -> None:
        if samples:
            await self._store.report(samples, self._config.report.window_size)


#: What a refusal says, beyond its reason.
_MESSAGES = {
    Reason.QUEUE_TIMEOUT: "max wait exhausted",
    Reason.LONG_PREFILL: LONG_PREFILL_MESSAGE,
    Reason.DEADLINE: DEADLINE_MESSAGE,
    Reason.SHUTTING_DOWN: "daemon is draining; retry on another replica",
}


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


def _with_reason(
    decision: BucketDecision, reason: Reason, retry_after_ms: int | None = None
) -> BucketDecision:
    return BucketDecision(
        admitted=False,
        reason=reason,
        lease_id="",
        charged=decision.charged,
        remaining=decision.remaining,
        retry_after_ms=decision.retry_after_ms if retry_after_ms is None else retry_after_ms,
        lease_ttl_ms=0,
    )
