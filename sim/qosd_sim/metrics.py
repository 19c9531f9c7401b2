"""Triton's own Prometheus metrics, as the simulated server exposes them.

Rendered here rather than with ``prometheus_client`` on purpose: that library appends
``_total`` to every counter, and Triton does not (``nv_inference_request_success``, not
``nv_inference_request_success_total``). Scrapers and dashboards written against Triton
must see Triton's names and label sets as Triton writes them.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: Triton's default buckets for ``nv_inference_first_response_histogram_ms``.
FIRST_RESPONSE_BUCKETS_MS: tuple[float, ...] = (100.0, 500.0, 2000.0, 5000.0)

_COUNTERS = (
    ("nv_inference_request_success", "Number of successful inference requests, all batch sizes"),
    ("nv_inference_count", "Number of inferences performed (does not include cached requests)"),
    ("nv_inference_exec_count", "Number of model executions performed"),
    ("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds"),
    ("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds"),
    (
        "nv_inference_compute_infer_duration_us",
        "Cumulative compute inference duration in microseconds",
    ),
)


@dataclass(slots=True)
class _ModelCounters:
    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(dict(_COUNTERS), 0.0))
    failures: dict[str, int] = field(default_factory=dict)  # by reason
    pending: Callable[[], int] = lambda: 0
    busy: Callable[[float], float] | None = None  # busy seconds at a monotonic time
    lost: Callable[[], float] | None = None  # GPU seconds lost to late wake-ups
    late_wakeups: Callable[[], int] | None = None
    first_response_counts: list[int] = field(default_factory=list)
    first_response_sum_ms: float = 0.0
    first_response_count: int = 0


class TritonMetrics:
    """Per-model counters in Triton's names. Thread-safe: the HTTP thread reads them."""

    def __init__(self, buckets_ms: Sequence[float] = FIRST_RESPONSE_BUCKETS_MS) -> None:
        self._buckets = tuple(sorted(buckets_ms))
        self._models: dict[str, _ModelCounters] = {}
        self._lock = threading.Lock()

    def _model(self, model: str) -> _ModelCounters:
        counters = self._models.get(model)
        if counters is None:
            counters = _ModelCounters(first_response_counts=[0] * len(self._buckets))
            self._models[model] = counters
        return counters

    def watch_pending(self, model: str, count: Callable[[], int]) -> None:
        """Where the model's pending count comes from: requests not yet executing.

        Registering a model also makes its metrics appear at once, with zeros, as
        Triton's do when a model loads."""
        with self._lock:
            self._model(model).pending = count

    def watch_busy(self, model: str, seconds: Callable[[float], float]) -> None:
        """Where the simulator's own ``qosd_sim_gpu_busy_seconds`` comes from: the
        seconds its GPU has spent iterating, up to a given ``time.monotonic()``. It is
        rendered with ``qosd_sim_monotonic_seconds``, the server's monotonic clock at
        that reading, so that a reader on the same host knows exactly when it held.
        Neither is a Triton metric (Triton has no exact busy counter); they are named
        apart so that no dashboard mistakes them for one."""
        with self._lock:
            self._model(model).busy = seconds

    def watch_lost(
        self, model: str, seconds: Callable[[], float], late_wakeups: Callable[[], int]
    ) -> None:
        """Where the simulator's ``qosd_sim_gpu_lost_seconds`` (GPU time lost to the
        host's lateness: its event loop woke too late to run iterations back to back)
        and ``qosd_sim_gpu_late_wakeups_total`` (how often) come from. Rendered beside
        ``qosd_sim_gpu_busy_seconds``; not Triton metrics either."""
        with self._lock:
            counters = self._model(model)
            counters.lost, counters.late_wakeups = seconds, late_wakeups

    def first_response(self, model: str, ms: float) -> None:
        with self._lock:
            counters = self._model(model)
            index = bisect.bisect_left(self._buckets, ms)
            if index < len(self._buckets):
                counters.first_response_counts[index] += 1
            counters.first_response_sum_ms += ms
            counters.first_response_count += 1

    def success(self, model: str, *, request_us: float, queue_us: float, compute_us: float) -> None:
        with self._lock:
            values = self._model(model).values
            values["nv_inference_request_success"] += 1
            values["nv_inference_count"] += 1
            values["nv_inference_exec_count"] += 1
            # Triton counts whole microseconds.
            values["nv_inference_request_duration_us"] += round(request_us)
            values["nv_inference_queue_duration_us"] += round(queue_us)
            values["nv_inference_compute_infer_duration_us"] += round(compute_us)

    def failure(self, model: str, reason: str) -> None:
        """``reason`` as Triton labels it: REJECTED, CANCELED, BACKEND or OTHER."""
        with self._lock:
            failures = self._model(model).failures
            failures[reason] = failures.get(reason, 0) + 1

    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4), as Triton writes it."""
        with self._lock:
            models = sorted(self._models.items())
            lines: list[str] = []
            for name, help_text in _COUNTERS:
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                lines += [
                    f'{name}{{model="{m}",version="1"}} {_number(c.values[name])}'
                    for m, c in models
                ]
            name = "nv_inference_request_failure"
            lines += [
                f"# HELP {name} Number of failed inference requests, all batch sizes",
                f"# TYPE {name} counter",
            ]
            for m, c in models:
                for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
                    count = c.failures.get(reason, 0)
                    lines.append(f'{name}{{model="{m}",reason="{reason}",version="1"}} {count}')
            name = "nv_inference_pending_request_count"
            lines += [
                f"# HELP {name} Instantaneous number of pending requests awaiting execution "
                "per-model.",
                f"# TYPE {name} gauge",
            ]
            lines += [f'{name}{{model="{m}",version="1"}} {c.pending()}' for m, c in models]
            name = "nv_inference_first_response_histogram_ms"
            lines += [
                f"# HELP {name} Duration from request to first response in milliseconds",
                f"# TYPE {name} histogram",
            ]
            for m, c in models:
                cumulative = 0
                for bound, count in zip(self._buckets, c.first_response_counts, strict=True):
                    cumulative += count
                    lines.append(
                        f'{name}_bucket{{model="{m}",version="1",le="{_number(bound)}"}} '
                        f"{cumulative}"
                    )
                lines.append(
                    f'{name}_bucket{{model="{m}",version="1",le="+Inf"}} {c.first_response_count}'
                )
                lines.append(
                    f'{name}_sum{{model="{m}",version="1"}} {_number(c.first_response_sum_ms)}'
                )
                lines.append(f'{name}_count{{model="{m}",version="1"}} {c.first_response_count}')
            busy = [(m, c.busy) for m, c in models if c.busy is not None]
            if busy:
                now = time.monotonic()
                name = "qosd_sim_gpu_busy_seconds"
                lines += [
                    f"# HELP {name} Seconds the simulated GPU spent running iterations "
                    "(simulator only, not a Triton metric)",
                    f"# TYPE {name} counter",
                ]
                lines += [f'{name}{{model="{m}"}} {seconds(now):.6f}' for m, seconds in busy]
                lines += _lateness(models)
                name = "qosd_sim_monotonic_seconds"
                lines += [
                    f"# HELP {name} The simulator's monotonic clock when it read "
                    "qosd_sim_gpu_busy_seconds",
                    f"# TYPE {name} gauge",
                    f"{name} {now:.6f}",
                ]
        return "\n".join(lines) + "\n"


def _lateness(models: list[tuple[str, _ModelCounters]]) -> list[str]:
    """``qosd_sim_gpu_lost_seconds`` and ``qosd_sim_gpu_late_wakeups_total``."""
    watched = [(m, c.lost, c.late_wakeups) for m, c in models]
    readings = [(m, lost(), late()) for m, lost, late in watched if lost and late]
    if not readings:
        return []
    name = "qosd_sim_gpu_lost_seconds"
    lines = [
        f"# HELP {name} Seconds of simulated GPU time lost because the host woke the "
        "simulator too late to run iterations back to back (simulator only)",
        f"# TYPE {name} counter",
    ]
    lines += [f'{name}{{model="{m}"}} {lost:.6f}' for m, lost, _ in readings]
    name = "qosd_sim_gpu_late_wakeups_total"
    lines += [
        f"# HELP {name} Wake-ups of the simulated GPU between iterations more than its "
        "50 ms catch-up late (simulator only)",
        f"# TYPE {name} counter",
    ]
    lines += [f'{name}{{model="{m}"}} {late}' for m, _, late in readings]
    return lines


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def serve_metrics(metrics: TritonMetrics, host: str, port: int) -> ThreadingHTTPServer:
    """Serves ``GET /metrics`` on a daemon thread, as Triton does on port 8002."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404)
                return
            body = metrics.render().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="triton-metrics", daemon=True).start()
    return server
