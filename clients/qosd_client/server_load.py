"""Model servers' own load, read from their ``/metrics``, for ``report(loads=...)``.

qosd counts what it admitted (leases in flight); the servers know what they hold:
requests waiting in their own queue, and how full their KV cache is. A GPU-gated pool
with ``max_server_waiting`` or ``max_kv_cache_usage`` stops admitting classes below
the top one while its servers are past them (docs/design.md). Understood, per model:

- Triton: ``nv_inference_pending_request_count`` (requests received, not yet
  executing), summed over the model's versions;
- vLLM: ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (0 to 1; its
  older name ``vllm:gpu_cache_usage_perc``), by the ``model_name`` label.

A gauge a server does not expose stays unknown (None), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from qosd_client.types import ServerLoad

TRITON_PENDING = "nv_inference_pending_request_count"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass
class _Gauges:
    waiting: float | None = None
    kv_usage: float | None = None


def parse_server_load(text: str) -> dict[str, tuple[int | None, float | None]]:
    """Per model, ``(waiting requests, KV cache usage)`` from exposition text; other
    metrics are ignored. Raises ValueError on text that does not parse."""
    found: dict[str, _Gauges] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == TRITON_PENDING:
                gauges = found.setdefault(sample.labels.get("model", ""), _Gauges())
                gauges.waiting = (gauges.waiting or 0.0) + sample.value
            elif sample.name == VLLM_WAITING:
                gauges = found.setdefault(sample.labels.get("model_name", ""), _Gauges())
                gauges.waiting = (gauges.waiting or 0.0) + sample.value
            elif sample.name in VLLM_KV_USAGE:
                gauges = found.setdefault(sample.labels.get("model_name", ""), _Gauges())
                gauges.kv_usage = max(gauges.kv_usage or 0.0, sample.value)
    return {
        model: (
            None if g.waiting is None else max(0, round(g.waiting)),
            None if g.kv_usage is None else min(1.0, max(0.0, g.kv_usage)),
        )
        for model, g in found.items()
        if model
    }


def server_loads(text: str, server: str) -> list[ServerLoad]:
    """The loads to report for one server (``server`` names it) from its metrics."""
    return [
        ServerLoad(model, server, waiting_requests=waiting, kv_cache_usage=kv_usage)
        for model, (waiting, kv_usage) in sorted(parse_server_load(text).items())
    ]
