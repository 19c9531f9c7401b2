"""A transparent store wrapper that measures every call: a Prometheus histogram of its
latency and a counter of failures, and, inside a traced RPC, a child span; and counts
the pools it sees come back empty (``qosd_store_resets_total``).

One wrapper rather than code in each store, so that Redis, the cluster and the
embedded store are measured the same way and no store class carries telemetry.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from qosd.metrics import Metrics
from qosd.model import (
    Adjustment,
    BucketDecision,
    ControlRecord,
    LeaseSpec,
    PassRead,
    PoolStatus,
    PrefillLearned,
    PumpResult,
    Sample,
    ServerLoad,
    Settlement,
    StoredSample,
    StoreUnavailable,
    TenantStatus,
    UsageReport,
    Waiter,
)
from qosd.policy import ClassPolicy, PoolPolicy
from qosd.store.base import BucketStore
from qosd.store.epochs import ResetListener

T = TypeVar("T")


class InstrumentedStore(BucketStore):
    """Wraps ``store``; ``tracer`` None means no spans (and no tracing cost at all).

    Every method of the interface is spelled out, so the wrapper is checked against
    it like any store.

    Spans are made only for calls inside a recording span, that is for calls an RPC
    made: the waiting room's pump and the SLO loop poll the store many times a
    second on their own, and a root span per poll would bury the requests.
    """

    def __init__(
        self,
        store: BucketStore,
        metrics: Metrics,
        tracer: Tracer | None = None,
        system: str = "",
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._tracer = tracer
        self._system = system  # db.system.name: "redis", or "" for the embedded store
        self._seconds = {name: metrics.store_seconds.labels(name) for name in _MEASURED}
        self._errors = {name: metrics.store_errors.labels(name) for name in _MEASURED}
        self._acquire_seconds = self._seconds["acquire"]
        self._acquire_errors = self._errors["acquire"]
        # Counted here, like failures: every daemon counts the resets it sees.
        store.add_reset_listener(lambda pool, old, new: metrics.store_resets.labels(pool).inc())

    # -- not measured: set-up, and what never waits on the store -------------------------

    async def start(self) -> None:
        await self._store.start()

    async def close(self) -> None:
        await self._store.close()

    def add_reset_listener(self, listener: ResetListener) -> None:
        self._store.add_reset_listener(listener)

    # -- measured ---------------------------------------------------------------------

    async def acquire(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease: LeaseSpec,
        wait_ms: int,
        *,
        ttft_ms: float = 0.0,
        wait_cap_ms: int | None = None,
    ) -> BucketDecision:
        call = self._store.acquire(
            pool, cls, lease, wait_ms, ttft_ms=ttft_ms, wait_cap_ms=wait_cap_ms
        )
        if self._tracer is not None and trace.get_current_span().is_recording():
            return await self._measured("acquire", call)
        # The hot path, timed inline: a coroutine frame less than _measured's.
        began = time.perf_counter()
        try:
            return await call
        except StoreUnavailable:
            self._acquire_errors.inc()
            raise
        finally:
            self._acquire_seconds.observe(time.perf_counter() - began)

    async def pump(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> list[PumpResult]:
        return await self._measured("pump", self._store.pump(pool, waiters))

    async def cancel(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> None:
        await self._measured("cancel", self._store.cancel(pool, waiters))

    async def release(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease_id: str,
        usage: UsageReport,
        frees_request_of: LeaseSpec | None = None,
    ) -> Settlement:
        settling = self._store.release(pool, cls, lease_id, usage, frees_request_of)
        return await self._measured("release", settling)

    async def undo(self, pool: PoolPolicy, cls: ClassPolicy, lease: LeaseSpec) -> Settlement:
        return await self._measured("release", self._store.undo(pool, cls, lease))

    async def status(self, pool: PoolPolicy) -> PoolStatus:
        return await self._measured("status", self._store.status(pool))

    async def tenants(self, pool: PoolPolicy, names: Sequence[str]) -> list[TenantStatus]:
        return await self._measured("tenants", self._store.tenants(pool, names))

    async def control(self, pool: PoolPolicy) -> ControlRecord:
        return await self._measured("control", self._store.control(pool))

    async def adjust(
        self, pool: PoolPolicy, update: ControlRecord, cooldown_ms: int, *, force: bool = False
    ) -> bool:
        return await self._measured(
            "adjust", self._store.adjust(pool, update, cooldown_ms, force=force)
        )

    async def set_prefill(self, pool: PoolPolicy, learned: PrefillLearned) -> float:
        return await self._measured("set_prefill", self._store.set_prefill(pool, learned))

    async def report_load(self, pool: PoolPolicy, loads: Sequence[ServerLoad]) -> None:
        await self._measured("report_load", self._store.report_load(pool, loads))

    async def history(self, pool: PoolPolicy, limit: int = 20) -> list[Adjustment]:
        return await self._measured("history", self._store.history(pool, limit))

    async def lead(self, lease_ms: int) -> str:
        return await self._measured("lead", self._store.lead(lease_ms))

    @property
    def daemon_id(self) -> str:
        return self._store.daemon_id

    async def report(self, samples: Sequence[Sample], window_size: int) -> None:
        await self._measured("report", self._store.report(samples, window_size))

    async def passes(self, pool: PoolPolicy) -> list[PassRead]:
        return await self._measured("passes", self._store.passes(pool))

    async def window(self, pool: str, qos_class: str) -> list[StoredSample]:
        return await self._measured("window", self._store.window(pool, qos_class))

    async def ping(self) -> None:
        await self._measured("ping", self._store.ping())

    async def _measured(self, name: str, call: Awaitable[T]) -> T:
        """Times ``call`` (and counts its failure); inside a recording span, in a
        child span of its own."""
        tracer = self._tracer
        if tracer is None or not trace.get_current_span().is_recording():
            return await self._timed(name, call)
        attributes = {"db.operation.name": name, "qosd.store": self._system or "embedded"}
        if self._system:
            attributes["db.system.name"] = self._system
        with tracer.start_as_current_span(
            f"qosd.store/{name}",
            kind=SpanKind.CLIENT,
            attributes=attributes,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                return await self._timed(name, call)
            except StoreUnavailable as exc:
                span.set_status(StatusCode.ERROR, str(exc))
                raise

    async def _timed(self, name: str, call: Awaitable[T]) -> T:
        began = time.perf_counter()
        try:
            return await call
        except StoreUnavailable:
            self._errors[name].inc()
            raise
        finally:
            self._seconds[name].observe(time.perf_counter() - began)


# The calls whose latency and failures are measured, one label each.
_MEASURED = (
    "acquire", "pump", "cancel", "release", "status", "tenants", "control", "adjust", "set_prefill",
    "report_load", "passes", "history", "lead", "report", "window", "ping",
)  # fmt: skip
