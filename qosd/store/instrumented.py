"""A transparent store wrapper that measures every call: a Prometheus histogram of its
latency and a counter of failures, and, inside a traced RPC, a child span; and counts
the pools it sees come back empty (``qosd_store_resets_total``).

One wrapper rather than code in each store, so that Redis, the cluster and the
embedded store are measured the same way and no store class carries telemetry.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from qosd.metrics import Metrics
from qosd.model import StoreUnavailable
from qosd.store.base import BucketStore


class InstrumentedStore:
    """Wraps ``store``; ``tracer`` None means no spans (and no tracing cost at all).

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
        # Counted here, like failures: every daemon counts the resets it sees.
        store.add_reset_listener(lambda pool, old, new: metrics.store_resets.labels(pool).inc())

    def __getattr__(self, name: str) -> Any:
        # Called only on the first lookup of a name: the wrapper is then set on the
        # instance, so later calls cost an ordinary attribute lookup.
        attribute = getattr(self._store, name)
        if (
            name.startswith("_")
            or name in ("start", "close")
            or not inspect.iscoroutinefunction(attribute)
        ):
            return attribute
        wrapped = self._wrap(name, attribute)
        setattr(self, name, wrapped)
        return wrapped

    def _wrap(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        seconds = self._metrics.store_seconds.labels(name)
        errors = self._metrics.store_errors.labels(name)

        async def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return await call(*args, **kwargs)
            except StoreUnavailable:
                errors.inc()
                raise
            finally:
                seconds.observe(time.perf_counter() - began)

        tracer = self._tracer
        if tracer is None:
            return timed
        span_name = f"qosd.store/{name}"
        attributes = {"db.operation.name": name, "qosd.store": self._system or "embedded"}
        if self._system:
            attributes["db.system.name"] = self._system
        current_span = trace.get_current_span

        async def traced(*args: Any, **kwargs: Any) -> Any:
            if not current_span().is_recording():
                return await timed(*args, **kwargs)
            with tracer.start_as_current_span(
                span_name,
                kind=SpanKind.CLIENT,
                attributes=attributes,
                record_exception=False,
                set_status_on_exception=False,
            ) as span:
                try:
                    return await timed(*args, **kwargs)
                except StoreUnavailable as exc:
                    span.set_status(StatusCode.ERROR, str(exc))
                    raise

        return traced
