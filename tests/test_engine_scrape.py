"""``qosd scrape``: latency samples and load from vLLM's, SGLang's and TensorRT-LLM's
``/metrics`` (qosd_client.engine_metrics), read from the engines' own documented
output (tests/data/engines/README.md says where each comes from), and end to end
from ``qosd sim-vllm`` into a real daemon."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from qosd.scrape_command import ENGINES
from qosd_client import LatencySample, LatencyState, QosdClient
from qosd_client.engine_metrics import (
    PROFILES,
    EngineCounters,
    HistogramCounts,
    Latency,
    parse_engine_metrics,
    samples_between,
)
from qosd_client.histograms import Bucket, FirstTokensWaiting, bucket_deltas, spread
from qosd_client.server_load import ModelLoad, parse_server_load, server_loads
from qosd_harness import daemon_processes, start_command, stop_process
from qosd_sim.experiment import MODEL
from qosd_sim.gpu import GpuModel
from qosd_sim.openai_experiment import vllm_process
from tests.waiting import wait_until

DATA = Path(__file__).parent / "data" / "engines"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def _per_bucket(values: list[float], bounds: list[float]) -> list[int]:
    """How many of ``values`` (ms) fall in each bucket of ``bounds`` (s)."""
    edges = [0.0, *bounds]
    return [sum(1 for v in values if lo * 1000 < v <= hi * 1000)
            for lo, hi in itertools.pairwise(edges)]  # fmt: skip


def test_spread_interpolates_within_buckets_in_proportion() -> None:
    before = {0.1: 2.0, 0.5: 2.0, math.inf: 2.0}
    buckets = bucket_deltas(before, {0.1: 4.0, 0.5: 8.0, math.inf: 8.0})
    assert buckets == [Bucket(0.0, 0.1, 2.0), Bucket(0.1, 0.5, 4.0)]
    # Four values: quantiles 0.75, 2.25, 3.75, 5.25 of six observations.
    assert spread(buckets, 4) == pytest.approx([0.0375, 0.125, 0.275, 0.425])
    assert spread(buckets, 4, within="upper") == [0.1, 0.5, 0.5, 0.5]
    # Past the last finite bound: up to twice it.
    assert spread([Bucket(2.0, math.inf, 1.0)], 1) == [3.0]
    # A restart: the later read is all there is.
    assert bucket_deltas({1.0: 9.0}, {1.0: 3.0}, reset=True) == [Bucket(0.0, 1.0, 3.0)]


def test_vllm_reads_its_documented_output() -> None:
    """vLLM's design doc prints part of a server's /metrics: the TTFT histogram of 140
    requests and the running gauge (no e2e there, so TTFT's count says how many)."""
    text = (DATA / "vllm.txt").read_text()
    (model,) = parse_engine_metrics(text, PROFILES["vllm"])
    assert model == LLAMA
    counters = parse_engine_metrics(text, PROFILES["vllm"])[LLAMA]
    assert set(counters.histograms) == {Latency.TTFT}
    samples = samples_between(EngineCounters(), counters, model=LLAMA, qos_class="P0",
                              profile=PROFILES["vllm"])  # fmt: skip
    assert len(samples) == 140
    ttfts = [s.ttft_ms or 0.0 for s in samples]
    # 13 in (10, 20] ms, 84 in (20, 40], 26 in (40, 60], 15 in (60, 80], 2 in (80, 100].
    assert _per_bucket(ttfts, [0.01, 0.02, 0.04, 0.06, 0.08, 0.1]) == [0, 13, 84, 26, 15, 2]
    assert all(s.tpot_ms is None and s.e2e_ms is None for s in samples)
    assert parse_server_load(text) == {LLAMA: ModelLoad(waiting=None, running=8, kv_usage=None)}
    assert server_loads(text, "vllm-0") == []  # neither gauge the daemon uses


def test_sglang_reads_its_documented_output() -> None:
    """SGLang's production-metrics doc prints a whole /metrics: 11,228 requests'
    histograms, scaled to 200 samples in the same proportions, and its load."""
    text = (DATA / "sglang.txt").read_text()
    counters = parse_engine_metrics(text, PROFILES["sglang"])[LLAMA]
    assert set(counters.histograms) == {Latency.TTFT, Latency.TPOT, Latency.E2E}
    assert counters.histograms[Latency.E2E].count == 11228
    samples = samples_between(EngineCounters(), counters, model=LLAMA, qos_class="P1",
                              profile=PROFILES["sglang"])  # fmt: skip
    assert len(samples) == 200
    for latency, field in ((Latency.TTFT, "ttft_ms"), (Latency.E2E, "e2e_ms")):
        histogram = counters.histograms[latency]
        bounds = sorted(b for b in histogram.buckets if math.isfinite(b))
        values = [getattr(s, field) for s in samples]
        counts = _per_bucket(values, bounds)
        cumulative = [histogram.buckets[b] for b in bounds]
        shares = [c - p for c, p in zip(cumulative, [0.0, *cumulative], strict=False)]
        total = histogram.buckets[math.inf]
        # Each bucket holds its share of the 200 samples, within one sample.
        beyond = 200 - sum(counts)  # past the last finite bound
        assert all(
            abs(n - 200 * share / total) <= 1 for n, share in zip(counts, shares, strict=True)
        )
        assert abs(beyond - 200 * (total - cumulative[-1]) / total) <= 1
    assert all(s.e2e_ms is not None and s.ttft_ms is not None and s.e2e_ms >= s.ttft_ms
               for s in samples)  # fmt: skip
    assert parse_server_load(text) == {LLAMA: ModelLoad(waiting=2826, running=162, kv_usage=0.28)}


def test_the_triton_tensorrt_llm_backend_reports_its_load() -> None:
    """The TensorRT-LLM backend's README prints its gauges: 1 request waiting, 0
    active, 1 KV block used of 6,239."""
    text = (DATA / "triton_trtllm_backend.txt").read_text()
    load = parse_server_load(text)["tensorrt_llm"]
    assert (load.waiting, load.running) == (1, 0)
    assert load.kv_usage == pytest.approx(1 / 6239)  # used over max, as the blocks say
    (reported,) = server_loads(text, "triton-0")
    assert (reported.model, reported.waiting_requests) == ("tensorrt_llm", 1)


def test_trtllm_serve_by_the_names_in_its_source() -> None:
    """No captured trtllm-serve output is published (tests/data/engines/README.md):
    this writes its metrics with prometheus_client by the names, labels and bucket
    bounds of TensorRT-LLM's tensorrt_llm/metrics/collector.py, as trtllm-serve does,
    observes known latencies, and reads them back between two reads."""
    registry = CollectorRegistry()
    labels = {"model_name": "llama", "engine_type": "trtllm"}

    def histogram(name: str, buckets: list[float]) -> Histogram:
        made = Histogram(name, name, list(labels), buckets=buckets, registry=registry)
        return made.labels(**labels)

    latency_buckets = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0]
    ttft_buckets = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
    ttft = histogram("trtllm_time_to_first_token_seconds", ttft_buckets)
    tpot = histogram("trtllm_time_per_output_token_seconds",
                     [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5])  # fmt: skip
    e2e = histogram("trtllm_e2e_request_latency_seconds", latency_buckets)
    for name, value in (("trtllm_num_requests_waiting", 3), ("trtllm_num_requests_running", 5),
                        ("trtllm_kv_cache_utilization", 0.42)):  # fmt: skip
        Gauge(name, name, list(labels), registry=registry).labels(**labels).set(value)
    before = parse_engine_metrics(generate_latest(registry).decode(), PROFILES["trtllm"])
    for first, per_token, total in [(0.03, 0.02, 0.9)] * 3 + [(0.7, 0.12, 12.0)]:
        ttft.observe(first)
        tpot.observe(per_token)
        e2e.observe(total)
    text = generate_latest(registry).decode()
    after = parse_engine_metrics(text, PROFILES["trtllm"])
    samples = samples_between(before["llama"], after["llama"], model="llama", qos_class="P1",
                              profile=PROFILES["trtllm"])  # fmt: skip
    assert len(samples) == 4
    # TTFT and e2e paired by rank: the slow request is the last sample on both.
    assert [20 < (s.ttft_ms or 0) <= 40 for s in samples] == [True, True, True, False]
    assert 500 < (samples[-1].ttft_ms or 0) <= 750 and 10_000 < (samples[-1].e2e_ms or 0) <= 15_000
    # TPOT at random: three within (10, 25] ms and one within (100, 150], in some order.
    tpots = sorted(s.tpot_ms or 0 for s in samples)
    assert all(10 < t <= 25 for t in tpots[:3]) and 100 < tpots[3] <= 150
    assert parse_server_load(text) == {"llama": ModelLoad(waiting=3, running=5, kv_usage=0.42)}


def test_a_restarted_engine_counts_from_zero() -> None:
    text = (DATA / "sglang.txt").read_text()
    later = parse_engine_metrics(text, PROFILES["sglang"])[LLAMA]
    earlier = EngineCounters()
    for latency, histogram in later.histograms.items():  # the same server, before a restart
        doubled = {bound: count * 2 for bound, count in histogram.buckets.items()}
        earlier.histograms[latency] = HistogramCounts(doubled, histogram.count * 2)
    samples = samples_between(earlier, later, model=LLAMA, qos_class="P1",
                              profile=PROFILES["sglang"], max_samples=20_000)  # fmt: skip
    assert len(samples) == 11228  # what the restarted server counted, not a negative delta


def test_the_command_lists_every_profile_and_refuses_bad_options() -> None:
    assert set(ENGINES) == {"triton", *PROFILES}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qosd.cli", *args], check=False,
                               capture_output=True, text=True, timeout=60)  # fmt: skip

    shown = run("scrape", "--help")
    assert shown.returncode == 0
    for engine in ENGINES:
        assert f"  {engine}:\n    latencies from" in shown.stdout
    for name in ("vllm:time_to_first_token_seconds", "sglang:num_queue_reqs",
                 "trtllm_kv_cache_utilization", "nv_trt_llm_request_metrics"):  # fmt: skip
        assert name in shown.stdout
    unnamed = run("scrape", "--default-class", "P1")
    assert unnamed.returncode == 2 and "--engine" in unnamed.stderr


async def _completions(url: str, count: int) -> None:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as client:
        calls = [client.completions.create(model=MODEL, prompt="a b c d", max_tokens=6)
                 for _ in range(count)]  # fmt: skip
        await asyncio.gather(*calls)


async def _status(address: str) -> tuple[int, int | None]:
    async with QosdClient(address) as qos:
        pool = (await qos.status("llm")).pool("llm")
        return pool.cls("P1").latency.samples, pool.server_waiting_requests


async def _latencies(address: str) -> LatencyState:
    async with QosdClient(address) as qos:
        return (await qos.status("llm")).pool("llm").cls("P1").latency


def test_scrape_reports_sim_vllm_to_the_daemon(tmp_path: Path) -> None:
    """``qosd scrape --engine vllm`` between ``qosd sim-vllm`` and a daemon: after its
    baseline read, 5 completions become 5 P1 samples in the daemon's window, with
    TTFT, TPOT and e2e, and the server's load is reported; ``--print`` shows a read,
    running requests included, without a daemon."""
    tree = {"pools": {"llm": {"capacity_tokens_s": 100_000}}, "default_pool": "llm"}
    with (
        daemon_processes(tree) as (daemon,),
        vllm_process(GpuModel(speed=20.0), tmp_path) as url,
    ):
        scraper, _ = start_command(
            ["scrape", "--engine", "vllm", "--metrics-url", f"{url}/metrics", "--qosd",
             daemon.address, "--class", f"{MODEL}=P1", "--interval", "0.1"],
            tmp_path, "scrape",
        )  # fmt: skip
        try:
            assert asyncio.run(_status(daemon.address)) == (0, 0)  # the baseline's load
            asyncio.run(_completions(url, 5))
            wait_until(lambda: asyncio.run(_status(daemon.address))[0] >= 5, timeout_s=30)
            window = asyncio.run(_latencies(daemon.address))
            assert window.samples == 5
            # TTFT, TPOT (vLLM's per-request histogram) and e2e, each from its histogram.
            assert window.ttft and window.tpot and window.e2e
            assert 0 < window.ttft.p50_ms <= window.e2e.p50_ms
        finally:
            stop_process(scraper)
        printed = subprocess.run(
            [sys.executable, "-m", "qosd.cli", "scrape", "--engine", "vllm", "--metrics-url",
             f"{url}/metrics", "--default-class", "P2", "--print", "--reads", "1",
             "--log-level", "WARNING"],
            check=True, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    (line,) = printed.stdout.splitlines()
    read = json.loads(line)
    assert read["read"] == 1 and read["samples"] == []  # the baseline reports nothing
    assert read["loads"] == {MODEL: {"waiting": 0, "running": 0, "kv_usage": 0.0}}


def test_each_request_is_reported_once_when_the_e2e_series_appears_late() -> None:
    """An engine may write a model's series on its first observation: a read can show
    first tokens and no e2e series yet (counted by TTFT, as for a server that writes
    no e2e), and the read after it the e2e series whole. Each finished request is
    reported once (five requests on a busy machine once came back as six samples)."""
    registry = CollectorRegistry()
    labels = {"model_name": "llama"}

    def histogram(name: str) -> Histogram:
        made = Histogram(name, name, list(labels), buckets=[0.1, 1.0, 10.0], registry=registry)
        return made.labels(**labels)

    def read() -> EngineCounters:
        text = generate_latest(registry).decode()
        return parse_engine_metrics(text, PROFILES["vllm"]).get("llama", EngineCounters())

    def between(before: EngineCounters, after: EngineCounters) -> list[LatencySample]:
        return samples_between(before, after, model="llama", qos_class="P1",
                               profile=PROFILES["vllm"])  # fmt: skip

    baseline = read()
    ttft = histogram("vllm:time_to_first_token_seconds")
    ttft.observe(0.05)  # the first request's first token, and no e2e series yet
    early = read()
    e2e = histogram("vllm:e2e_request_latency_seconds")
    for _ in range(4):
        ttft.observe(0.05)
    for _ in range(5):
        e2e.observe(0.5)
    later = read()
    assert len(between(baseline, early)) + len(between(early, later)) == 5
    e2e.observe(0.5)  # and from then on by e2e alone
    assert len(between(later, read())) == 1


def test_first_tokens_wait_for_the_reads_where_their_requests_finish() -> None:
    """A first token and its request's finish can fall in different reads: always, for
    a class of one request at a time. The first tokens wait for the finishes, which
    take their share of them, so no finished request goes without its TTFT (five
    requests once reached the daemon with none) and none is given a TTFT twice."""
    registry = CollectorRegistry()

    def histogram(name: str, buckets: list[float]) -> Histogram:
        made = Histogram(name, name, ["model_name"], buckets=buckets, registry=registry)
        return made.labels(model_name="llama")

    def read() -> EngineCounters:
        text = generate_latest(registry).decode()
        return parse_engine_metrics(text, PROFILES["vllm"]).get("llama", EngineCounters())

    ttft = histogram("vllm:time_to_first_token_seconds", [0.1, 1.0, 10.0])
    e2e = histogram("vllm:e2e_request_latency_seconds", [1.0, 10.0])
    waiting = FirstTokensWaiting()

    def between(before: EngineCounters, after: EngineCounters) -> list[LatencySample]:
        return samples_between(before, after, model="llama", qos_class="P1",
                               profile=PROFILES["vllm"], first_tokens=waiting)  # fmt: skip

    baseline = read()
    for seconds in (0.05, 0.05, 0.5, 0.5):  # four first tokens, and no request done
        ttft.observe(seconds)
    first_tokens = read()
    assert between(baseline, first_tokens) == [] and waiting.count == 4
    e2e.observe(0.8)
    e2e.observe(0.9)  # two finish
    two = read()
    assert [0.1 < (s.ttft_ms or 0) <= 1000 for s in between(first_tokens, two)] == [True] * 2
    assert waiting.count == pytest.approx(2)
    e2e.observe(5.0)
    e2e.observe(6.0)  # and the other two
    last = read()
    rest = between(two, last)
    assert len(rest) == 2 and all(s.ttft_ms and s.ttft_ms <= 1000 for s in rest)
    assert waiting.count == 0
    # Without the waiting first tokens, the same reads give the finishes no TTFT.
    assert [s.ttft_ms for s in samples_between(first_tokens, last, model="llama",
            qos_class="P1", profile=PROFILES["vllm"])] == [None] * 4  # fmt: skip
    # A restart takes the requests in flight with it: their first tokens wait no more.
    ttft.observe(0.05)
    assert between(last, read()) == [] and waiting.count == 1
    restarted = EngineCounters()  # the server back, counting from zero, one request done
    restarted.histograms[Latency.E2E] = HistogramCounts({1.0: 1.0, 10.0: 1.0, math.inf: 1.0}, 1)
    (after_restart,) = between(last, restarted)
    assert after_restart.ttft_ms is None and waiting.count == 0  # cleared by the restart
    # First tokens no finish ever claims (aborted requests) stay within a bound.
    for _ in range(100):
        waiting.add([Bucket(0.0, 0.1, 100.0)])
    assert waiting.count == pytest.approx(FirstTokensWaiting.LIMIT)
