"""Model servers' own load, read from their ``/metrics``, for ``report(loads=...)``.

qosd counts what it admitted (leases in flight); the servers know what they hold:
requests waiting in their own queue, and how full their KV cache is. A GPU-gated pool
with ``max_server_waiting`` or ``max_kv_cache_usage`` stops admitting classes below
the top one while its servers are past them (docs/design.md). Each engine's gauges
are in ``LOAD_GAUGES``, by their own names; a read takes whichever the text holds,
so one table serves every engine. Requests running are read too, for ``qosd scrape
--print``, and not reported: qosd's own count of leases in flight is what admission
uses.

A gauge a server does not expose stays unknown (None), never 0.

Where an engine counts its passes (``PASS_COUNTERS``: vLLM V1's
``vllm:iteration_tokens_total``, a histogram of the tokens each pass carried, beside
its prompt and generation token counters and its inter-token latency), a load also
says what the passes carried and took since the previous read (``PassStats``), the
differences of those counters: the leader learns the decode step from them
(``qosd.control.passes`` in the daemon). SGLang and Triton expose no pass count, and
their loads carry none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from prometheus_client.parser import text_string_to_metric_families

from qosd_client.types import PassStats, ServerLoad


class LoadKind(Enum):
    WAITING = "waiting"  # requests queued at the server: summed over its series
    RUNNING = "running"  # requests in its batches: summed
    KV_USAGE = "kv_usage"  # share of the KV cache in use, 0 to 1: the largest
    KV_BLOCKS_USED = "kv_blocks_used"  # KV cache blocks in use: over KV_BLOCKS_MAX
    KV_BLOCKS_MAX = "kv_blocks_max"


@dataclass(frozen=True, slots=True)
class LoadGauge:
    """One engine's gauge: its sample name, the label that names the model, and the
    labels a sample must carry to count (e.g. a request type)."""

    engine: str
    name: str
    kind: LoadKind
    model_label: str = "model_name"
    match: tuple[tuple[str, str], ...] = ()


LOAD_GAUGES: tuple[LoadGauge, ...] = (
    LoadGauge("triton", "nv_inference_pending_request_count", LoadKind.WAITING, "model"),
    # The TensorRT-LLM backend of Triton: its in-flight batcher's requests and KV blocks.
    LoadGauge(
        "triton",
        "nv_trt_llm_request_metrics",
        LoadKind.WAITING,
        "model",
        (("request_type", "waiting"),),
    ),
    LoadGauge(
        "triton",
        "nv_trt_llm_request_metrics",
        LoadKind.RUNNING,
        "model",
        (("request_type", "active"),),
    ),
    LoadGauge(
        "triton",
        "nv_trt_llm_kv_cache_block_metrics",
        LoadKind.KV_BLOCKS_USED,
        "model",
        (("kv_cache_block_type", "used"),),
    ),
    LoadGauge(
        "triton",
        "nv_trt_llm_kv_cache_block_metrics",
        LoadKind.KV_BLOCKS_MAX,
        "model",
        (("kv_cache_block_type", "max"),),
    ),
    LoadGauge("vllm", "vllm:num_requests_waiting", LoadKind.WAITING),
    LoadGauge("vllm", "vllm:num_requests_running", LoadKind.RUNNING),
    LoadGauge("vllm", "vllm:kv_cache_usage_perc", LoadKind.KV_USAGE),
    LoadGauge("vllm", "vllm:gpu_cache_usage_perc", LoadKind.KV_USAGE),  # older servers
    LoadGauge("sglang", "sglang:num_queue_reqs", LoadKind.WAITING),
    LoadGauge("sglang", "sglang:num_running_reqs", LoadKind.RUNNING),
    LoadGauge("sglang", "sglang:token_usage", LoadKind.KV_USAGE),
    LoadGauge("trtllm", "trtllm_num_requests_waiting", LoadKind.WAITING),
    LoadGauge("trtllm", "trtllm_num_requests_running", LoadKind.RUNNING),
    LoadGauge("trtllm", "trtllm_kv_cache_utilization", LoadKind.KV_USAGE),
)

_BY_NAME: dict[str, tuple[LoadGauge, ...]] = {}
for _gauge in LOAD_GAUGES:
    _BY_NAME[_gauge.name] = (*_BY_NAME.get(_gauge.name, ()), _gauge)


def load_gauges(engine: str) -> tuple[LoadGauge, ...]:
    """The gauges of one engine."""
    return tuple(gauge for gauge in LOAD_GAUGES if gauge.engine == engine)


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's gauges at one read; None: the server does not say."""

    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None


def _model_load(sums: dict[LoadKind, float]) -> ModelLoad:
    """The gauges from the sums of one model's samples: counts rounded, usage within
    0 and 1 (from blocks used over blocks in all where no share is given)."""
    usage = sums.get(LoadKind.KV_USAGE)
    if usage is None and sums.get(LoadKind.KV_BLOCKS_MAX, 0.0) > 0:
        usage = sums.get(LoadKind.KV_BLOCKS_USED, 0.0) / sums[LoadKind.KV_BLOCKS_MAX]

    def count(kind: LoadKind) -> int | None:
        return max(0, round(sums[kind])) if kind in sums else None

    return ModelLoad(
        waiting=count(LoadKind.WAITING),
        running=count(LoadKind.RUNNING),
        kv_usage=None if usage is None else min(1.0, max(0.0, usage)),
    )


def parse_server_load(text: str) -> dict[str, ModelLoad]:
    """Per model, the gauges of ``LOAD_GAUGES`` found in exposition text (counts summed
    over a model's series, KV usage the largest); other metrics are ignored. Raises
    ValueError on text that does not parse."""
    found: dict[str, dict[LoadKind, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for gauge in _BY_NAME.get(sample.name, ()):
                model = sample.labels.get(gauge.model_label, "")
                if not model or any(sample.labels.get(k) != v for k, v in gauge.match):
                    continue
                sums = found.setdefault(model, {})
                value = sample.value
                if gauge.kind is LoadKind.KV_USAGE:
                    sums[gauge.kind] = max(sums.get(gauge.kind, 0.0), value)
                else:
                    sums[gauge.kind] = sums.get(gauge.kind, 0.0) + value
    return {model: _model_load(sums) for model, sums in found.items()}


class PassCounter(Enum):
    PASSES = "passes"  # passes run: the count of the tokens-per-pass histogram
    PROMPT = "prompt"  # prompt tokens whose prefill finished
    GENERATED = "generated"  # tokens generated
    GAP_SUM = "gap_sum"  # the inter-token latency histogram's sum, seconds
    GAPS = "gaps"  # and its count


#: Each engine's pass counters, by their sample names (summed over a model's series:
#: a data-parallel server's engines), and the label that names the model.
PASS_COUNTERS: dict[str, PassCounter] = {
    "vllm:iteration_tokens_total_count": PassCounter.PASSES,
    "vllm:prompt_tokens_total": PassCounter.PROMPT,
    "vllm:generation_tokens_total": PassCounter.GENERATED,
    "vllm:inter_token_latency_seconds_sum": PassCounter.GAP_SUM,
    "vllm:inter_token_latency_seconds_count": PassCounter.GAPS,
}
PASS_MODEL_LABEL = "model_name"

#: One model's pass counters at one read.
PassCounts = dict[PassCounter, float]


def parse_pass_counts(text: str) -> dict[str, PassCounts]:
    """Per model, the pass counters of ``PASS_COUNTERS`` found in exposition text, each
    summed over the model's series; a model is left out unless all are there. Raises
    ValueError on text that does not parse."""
    found: dict[str, PassCounts] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            counter = PASS_COUNTERS.get(sample.name)
            model = sample.labels.get(PASS_MODEL_LABEL, "")
            if counter is None or not model:
                continue
            counts = found.setdefault(model, {})
            counts[counter] = counts.get(counter, 0.0) + sample.value
    return {model: counts for model, counts in found.items() if len(counts) == len(PassCounter)}


def passes_between(before: PassCounts, after: PassCounts) -> PassStats | None:
    """What the passes carried between two reads of one model's counters; None where
    no pass decoded, or a counter went down (the server restarted: the next read
    starts afresh)."""
    delta = {counter: after[counter] - before[counter] for counter in PassCounter}
    if any(change < 0 for change in delta.values()):
        return None
    passes, generated = round(delta[PassCounter.PASSES]), round(delta[PassCounter.GENERATED])
    if passes < 1 or generated < 1 or delta[PassCounter.GAPS] < 1:
        return None
    step_ms = delta[PassCounter.GAP_SUM] / delta[PassCounter.GAPS] * 1000
    if not 0 < step_ms <= 60_000:
        return None
    return PassStats(passes, round(delta[PassCounter.PROMPT]), generated, step_ms)


def to_report(
    loads: Mapping[str, ModelLoad],
    server: str,
    passes: Mapping[str, PassStats] | None = None,
) -> list[ServerLoad]:
    """The loads to report for one server (``server`` names it), with what each
    model's passes carried where known: models with neither a waiting count, a KV
    usage nor passes are left out (running requests are not reported)."""
    passes = passes or {}
    return [
        ServerLoad(
            model,
            server,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_usage,
            passes=passes.get(model),
        )
        for model, load in sorted({**{m: ModelLoad() for m in passes}, **loads}.items())
        if load.waiting is not None or load.kv_usage is not None or model in passes
    ]


def server_loads(text: str, server: str) -> list[ServerLoad]:
    """The loads to report for one server from its metrics' text."""
    return to_report(parse_server_load(text), server)
