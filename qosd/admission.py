"""Admission logic between the wire API and a bucket store.

It validates requests, prices them, lets them wait in the fleet-wide waiting room
(``qosd.waiting``) within the caller's max wait, and turns store outages into the
configured fail mode. It knows nothing of gRPC
(the service module maps it onto the wire) and nothing of Redis (the store does).
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
from qosd.control.windows import request_objectives
from qosd.model import (
    BucketDecision,
    LeaseNotFound,
    LeaseSpec,
    Outcome,
    Reason,
    Sample,
    ServerLoad,
    Settlement,
    StoreUnavailable,
    UsageReport,
    Waiter,
    new_daemon_id,
    new_lease_token,
)
from qosd.policy import ClassPolicy, PoolPolicy, lease_token, resolve_pools
from qosd.store.base import BucketStore
from qosd.waiting import WaitingRoom

log = logging.getLogger(__name__)

MAX_ID_LENGTH = 128
MAX_LATENCY_MS = 86_400_000.0  # one day: anything longer is a unit mistake
# A model server's own queue: far above any real one, far below int64 when summed.
MAX_SERVER_WAITING = 10_000_000
FAIL_OPEN_MARK = "open-"
LONG_PREFILL_MESSAGE = (
    "its prefill would stall the pool's most urgent requests in flight for longer than "
    "they can absorb, and no gap in their traffic came within its max wait; retry "
    "later or use a pool whose servers chunk prefill"
)
DEADLINE_MESSAGE = (
    "its TTFT objective cannot be met here: the predicted wait (retry_after_ms) and its "
    "own prefill outlast it; try another pool or replica"
)
# With no max wait of its own, a request with a TTFT objective may wait its slack.
UNCAPPED_WAIT_MS = 3_600_000


class InvalidArgument(ValueError):
    """The request cannot be interpreted; the message names the field and the reason."""


@dataclass(frozen=True, slots=True)
class AcquireOutcome:
    decision: BucketDecision
    pool: str
    waited_ms: int
    message: str = ""
    # Where the request stands at servers that schedule by priority (lower first):
    # its class's rank in the pool, 0 for the top class.
    server_priority: int = 0


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
    def __init__(
        self,
        config: Config,
        store: BucketStore,
        tracer: Tracer | None = None,
        *,
        daemon_id: str | None = None,
    ) -> None:
        self._store = store
        self._tracer = tracer  # None: tracing off, no waiting-room spans
        self._configure(config)
        self._lease_ttl_ms = int(config.lease.ttl_s * 1000)
        self._retry_interval_ms = config.redis.retry_interval_ms
        self.guard = StoreGuard(config.redis.retry_interval_ms / 1000)
        self._draining = False
        # Names this process's waiters in the shared queues, and proves it alive.
        self.daemon_id = daemon_id or new_daemon_id()
        self._waiting = WaitingRoom(
            store,
            self.daemon_id,
            config.waiting.poll_ms / 1000,
            lambda pool, waiter: self._store_down_decision(
                self._policies[(pool.name, waiter.qos_class)], waiter.cost
            ),
            store_patience_s=config.redis.retry_interval_ms / 1000,
        )

    def _configure(self, config: Config) -> None:
        """Derives the rules Acquire and Release read from ``config``. Synchronous, so
        an event loop's calls see all of one config or all of the other; an Acquire
        reads what it needs before its first await."""
        self._config = config
        self._pools = resolve_pools(config)
        self._policies = {
            (pool.name, cls.name): cls for pool in self._pools.values() for cls in pool.classes
        }
        self._class_names = sorted(config.classes, key=lambda n: config.classes[n].priority)
        self._pool_of: dict[str, str] = {name: name for name in config.pools}
        for pool_name, pool in config.pools.items():
            for model in pool.models:
                self._pool_of[model] = pool_name
        self._default_pool = config.default_pool
        self._max_tokens = config.limits.max_request_tokens
        self._output_weight = config.cost.output_weight
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

    # -- validation -------------------------------------------------------------

    def resolve_pool(self, model: str, field: str = "model") -> str:
        pool = self._pool_of.get(model)
        if pool is not None:
            return pool
        if not model and self._default_pool is None:
            raise InvalidArgument(f"{field} is required (no default_pool is configured)")
        if self._default_pool is None:
            raise InvalidArgument(
                f"{field} {model!r} is not served by any configured pool "
                f"(pools: {', '.join(sorted(self._config.pools))})"
            )
        return self._default_pool

    def _class_policy(self, pool: str, qos_class: str, field: str = "qos_class") -> ClassPolicy:
        policy = self._policies.get((pool, qos_class))
        if policy is None:
            if not qos_class:
                raise InvalidArgument(f"{field} is required ({', '.join(self._class_names)})")
            raise InvalidArgument(
                f"{field} {_clip(qos_class)!r} is not configured; "
                f"known classes: {', '.join(self._class_names)}"
            )
        return policy

    def _tokens(self, value: int, field: str, minimum: int) -> int:
        if value < minimum:
            raise InvalidArgument(f"{field} must be at least {minimum} (got {value})")
        if value > self._max_tokens:
            raise InvalidArgument(
                f"{field} {value} exceeds the maximum of {self._max_tokens} tokens "
                "per request (limits.max_request_tokens)"
            )
        return value

    @staticmethod
    def _identifier(value: str, field: str) -> str:
        if len(value) > MAX_ID_LENGTH:
            raise InvalidArgument(
                f"{field} is {len(value)} characters long; the maximum is {MAX_ID_LENGTH}"
            )
        return value

    # -- acquire ----------------------------------------------------------------

    async def acquire(
        self,
        *,
        request_id: str,
        tenant: str,
        model: str,
        qos_class: str,
        input_tokens: int,
        expected_output_tokens: int,
        max_wait_ms: int | None,
        deadline_s: float | None,
        lease_ttl_ms: int | None = None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> AcquireOutcome:
        """``lease_ttl_ms`` overrides ``lease.ttl_s`` for callers that never release
        (Envoy's rate limit protocol has no Release). ``slo_ttft_ms`` and
        ``slo_tpot_ms`` are the request's own objectives: validated here, judged when
        the model server reports them; a TTFT objective also caps the wait."""
        arrived = time.monotonic()
        pool = self._pool_of.get(model) or self.resolve_pool(model)
        policy = self._policies.get((pool, qos_class)) or self._class_policy(pool, qos_class)
        max_tokens = self._max_tokens
        if not (1 <= input_tokens <= max_tokens and 0 <= expected_output_tokens <= max_tokens):
            self._tokens(input_tokens, "input_tokens", 1)
            self._tokens(expected_output_tokens, "expected_output_tokens", 0)
        if len(request_id) > MAX_ID_LENGTH or len(tenant) > MAX_ID_LENGTH:
            self._identifier(request_id, "request_id")
            self._identifier(tenant, "tenant")
        if slo_ttft_ms is not None or slo_tpot_ms is not None:
            _objective(slo_ttft_ms, "slo_ttft_ms")
            _objective(slo_tpot_ms, "slo_tpot_ms")
        ttft_ms = self._ttft_ms(policy.name, input_tokens, slo_ttft_ms)
        wait_ms, wait_cap_ms = self._waits(policy, max_wait_ms, ttft_ms, slo_ttft_ms, deadline_s)
        cost = (input_tokens + self._output_weight * expected_output_tokens) * policy.weight
        lease = LeaseSpec(
            lease_id=f"{pool}:{policy.name}:{lease_token(policy, tenant)}",
            request_id=request_id,
            tenant=tenant,
            input_tokens=input_tokens,
            output_tokens=expected_output_tokens,
            weight=policy.weight,
            ttl_ms=self._lease_ttl_ms if lease_ttl_ms is None else lease_ttl_ms,
        )
        pool_policy = self._pools[pool]
        decision = await self._take(pool_policy, policy, cost, lease, wait_ms, ttft_ms, wait_cap_ms)
        if decision.queued:
            # The wait the store granted, counted from the request's arrival: the store
            # call that queued it is part of the wait (a wait must end by its max wait
            # as the caller sees it, and that call is slow when the store or loop is).
            wait_s = max(0.0, decision.retry_after_ms / 1000 - (time.monotonic() - arrived))
            waiter = Waiter(policy.name, cost, lease)
            if self._tracer is None:
                decision, waited_ms = await self._wait(pool_policy, waiter, wait_s)
            else:
                decision, waited_ms = await self._traced_wait(pool_policy, waiter, wait_s)
            message = ""
            if decision.reason is Reason.QUEUE_TIMEOUT:
                message = "max wait exhausted"
            elif decision.reason is Reason.LONG_PREFILL:
                message = LONG_PREFILL_MESSAGE
            elif decision.reason is Reason.DEADLINE:
                message = DEADLINE_MESSAGE
            elif decision.reason is Reason.SHUTTING_DOWN:
                message = "daemon is draining; retry on another replica"
            return AcquireOutcome(decision, pool, waited_ms, message, policy.rank)
        if self._draining and not decision.admitted and decision.reason is Reason.RATE_LIMITED:
            return AcquireOutcome(
                _with_reason(decision, Reason.SHUTTING_DOWN, retry_after_ms=0),
                pool,
                0,
                "daemon is draining; retry on another replica",
                policy.rank,
            )
        if decision.reason is Reason.LONG_PREFILL:
            return AcquireOutcome(decision, pool, 0, LONG_PREFILL_MESSAGE, policy.rank)
        if decision.reason is Reason.DEADLINE:
            return AcquireOutcome(decision, pool, 0, DEADLINE_MESSAGE, policy.rank)
        return AcquireOutcome(decision, pool, 0, "", policy.rank)

    def _waits(
        self,
        policy: ClassPolicy,
        max_wait_ms: int | None,
        ttft_ms: float,
        slo_ttft_ms: float | None,
        deadline_s: float | None,
    ) -> tuple[int, int]:
        """The request's wait and its cap, ms: the class's max wait (as the caller cut
        it), and the most the store may grant a request with a TTFT objective once it
        can predict prefill (its slack: qosd/store/lua/pool/deadline.lua): the
        caller's own max wait, else the objective."""
        wait_cap_ms = UNCAPPED_WAIT_MS
        if max_wait_ms is None:
            wait_ms = policy.max_wait_ms
        elif max_wait_ms < 0:
            raise InvalidArgument(f"max_wait_ms must not be negative (got {max_wait_ms})")
        else:
            wait_ms = min(max_wait_ms, policy.max_wait_ms)
            wait_cap_ms = max_wait_ms
        if slo_ttft_ms is not None:
            # Admitted after its TTFT objective has passed, it has missed it already.
            wait_ms = min(wait_ms, math.ceil(slo_ttft_ms))
        wait_cap_ms = min(wait_cap_ms, math.ceil(ttft_ms)) if ttft_ms else wait_ms
        if deadline_s is not None:
            # Answer before the caller's deadline: a late admission would leak a lease.
            latest_ms = max(0, int((deadline_s - min(0.05, deadline_s * 0.1)) * 1000))
            wait_ms, wait_cap_ms = min(wait_ms, latest_ms), min(wait_cap_ms, latest_ms)
        if self._draining:
            return 0, 0
        return wait_ms, wait_cap_ms

    def _ttft_ms(self, qos_class: str, input_tokens: int, stated_ms: float | None) -> float:
        """The request's TTFT objective (its own, else its class's for its prompt;
        0: none): what its queue entry is due by."""
        cls = self._config.classes.get(qos_class)
        if cls is None:
            return stated_ms or 0.0
        return request_objectives(cls.slo, input_tokens, ttft_ms=stated_ms).ttft_ms or 0.0

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
        cost: float,
        lease: LeaseSpec,
        wait_ms: int,
        ttft_ms: float,
        wait_cap_ms: int,
    ) -> BucketDecision:
        guard = self.guard
        probe = False
        try:
            if guard.down:
                probe = guard.enter()
            decision = await self._store.acquire(
                pool, policy, cost, lease, wait_ms, self.daemon_id,
                ttft_ms=ttft_ms, wait_cap_ms=wait_cap_ms,
            )  # fmt: skip
        except StoreUnavailable as error:
            if probe or not guard.down:
                guard.failed(error)
            return self._store_down_decision(policy, cost)
        finally:
            if probe:
                guard.probe_done()
        if guard.down:
            guard.recovered()
        return decision

    def _store_down_decision(self, policy: ClassPolicy, cost: float) -> BucketDecision:
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
            charged=cost,
            remaining=0.0,
            retry_after_ms=self._retry_interval_ms,
            lease_ttl_ms=0,
        )

    # -- release ----------------------------------------------------------------

    def parse_lease(self, lease_id: str) -> tuple[ClassPolicy, bool]:
        """Finds a lease's (pool, class) from its id, with no round trip."""
        if not lease_id:
            raise InvalidArgument("lease_id is required")
        parts = lease_id.split(":")
        if len(parts) != 3 or not parts[2] or len(lease_id) > 3 * MAX_ID_LENGTH:
            raise InvalidArgument(
                f"lease_id {_clip(lease_id)!r} is malformed; pass AcquireResponse.lease_id as is"
            )
        policy = self._policies.get((parts[0], parts[1]))
        if policy is None:
            raise LeaseNotFound(
                f"lease {_clip(lease_id)} names pool {parts[0]!r} and class {parts[1]!r}, "
                "which this daemon does not configure"
            )
        return policy, parts[2].startswith(FAIL_OPEN_MARK)

    async def release(
        self,
        lease_id: str,
        actual_input_tokens: int | None,
        actual_output_tokens: int | None,
        outcome: Outcome,
    ) -> Settlement:
        policy, fail_open = self.parse_lease(lease_id)
        if actual_input_tokens is not None:
            self._tokens(actual_input_tokens, "actual_input_tokens", 0)
        if actual_output_tokens is not None:
            self._tokens(actual_output_tokens, "actual_output_tokens", 0)
        if fail_open:
            # Admitted while the store was down: nothing was charged, nothing to settle.
            return Settlement(False, 0.0, 0.0, 0.0)
        usage = UsageReport(
            input_tokens=actual_input_tokens,
            output_tokens=actual_output_tokens,
            outcome=outcome,
            output_weight=self._output_weight,
        )
        pool = self._pools[policy.pool]
        settlement = await self._store.release(pool, policy, lease_id, usage)
        if settlement.adjustment < 0 or (pool.gated and not settlement.already_released):
            self._waiting.nudge(policy.pool)  # tokens or room came back: a waiter may fit
        return settlement

    # -- report -----------------------------------------------------------------

    def check_report_size(self, count: int, loads: int = 0) -> None:
        if count == 0 and loads == 0:
            raise InvalidArgument("samples: at least one sample (or one of loads) is required")
        limit = self._config.limits.max_report_batch
        for name, found in (("samples", count), ("loads", loads)):
            if found > limit:
                raise InvalidArgument(
                    f"{name}: {found} {name} exceed the batch limit of {limit} "
                    "(limits.max_report_batch); split the batch"
                )

    def server_load(
        self, *, model: str, server: str, waiting: int | None, kv_usage: float | None
    ) -> tuple[str, ServerLoad]:
        """Validates one server's load; its pool and the load, or InvalidArgument
        naming the field."""
        pool = self.resolve_pool(model)
        if not server:
            raise InvalidArgument("server is required: the loads of one server replace its last")
        self._identifier(server, "server")
        if waiting is not None and not 0 <= waiting <= MAX_SERVER_WAITING:
            # Bounded so that the pool's sum over its servers fits the int64 of
            # PoolStatus.server_waiting_requests (2**63 from two servers did not).
            raise InvalidArgument(
                f"waiting_requests must be between 0 and {MAX_SERVER_WAITING} (got {waiting})"
            )
        if kv_usage is not None and not (math.isfinite(kv_usage) and 0 <= kv_usage <= 1):
            raise InvalidArgument(f"kv_cache_usage must be between 0 and 1 (got {kv_usage})")
        return pool, ServerLoad(server, waiting, kv_usage)

    async def report_loads(self, loads: list[tuple[str, ServerLoad]]) -> None:
        by_pool: dict[str, list[ServerLoad]] = {}
        for pool, load in loads:
            by_pool.setdefault(pool, []).append(load)
        for pool, pool_loads in by_pool.items():
            await self._store.report_load(self._pools[pool], pool_loads)

    def sample(
        self,
        *,
        model: str,
        qos_class: str,
        tenant: str,
        ttft_ms: float | None,
        tpot_ms: float | None,
        e2e_ms: float | None,
        input_tokens: int,
        output_tokens: int,
        status: Outcome,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> Sample:
        """Validates one latency sample; raises InvalidArgument naming the field."""
        pool = self.resolve_pool(model)
        policy = self._class_policy(pool, qos_class)
        self._identifier(tenant, "tenant")
        self._tokens(input_tokens, "input_tokens", 0)
        self._tokens(output_tokens, "output_tokens", 0)
        for name, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms), ("e2e_ms", e2e_ms)):
            if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_LATENCY_MS):
                raise InvalidArgument(
                    f"{name} must be a finite number of milliseconds between 0 and "
                    f"{MAX_LATENCY_MS:.0f} (got {value})"
                )
        if ttft_ms is None and tpot_ms is None and e2e_ms is None:
            raise InvalidArgument("needs at least one of ttft_ms, tpot_ms, e2e_ms")
        _objective(slo_ttft_ms, "slo_ttft_ms")
        _objective(slo_tpot_ms, "slo_tpot_ms")
        return Sample(
            pool=pool,
            qos_class=policy.name,
            tenant=tenant,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            e2e_ms=e2e_ms,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            status=status,
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
        )

    async def report(self, samples: list[Sample]) -> None:
        if samples:
            await self._store.report(samples, self._config.report.window_size)


def _objective(value: float | None, field: str) -> None:
    """A request's own latency objective: absent, or a sane number of milliseconds."""
    if value is not None and not (math.isfinite(value) and 0 < value <= MAX_LATENCY_MS):
        raise InvalidArgument(
            f"{field} must be a finite number of milliseconds above 0 and at most "
            f"{MAX_LATENCY_MS:.0f} (got {value})"
        )


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


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
