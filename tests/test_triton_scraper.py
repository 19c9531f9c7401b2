"""Scraper mode: samples from Triton's /metrics, read from real Triton output and from
the simulated server, and sent on to a real daemon."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import tritonclient.grpc.aio as triton

from qosd_client import LatencySample, Outcome, QosdClient
from qosd_client.reporter import LatencyReporter
from qosd_client.triton_metrics import (
    ModelCounters,
    TritonMetricsScraper,
    parse_triton_metrics,
    samples_between,
)
from qosd_harness import daemon_processes
from qosd_sim.experiment import simulator_process
from qosd_sim.gateway import token_inputs
from qosd_sim.gpu import GpuModel
from tests.waiting import wait_until

DATA = Path(__file__).parent / "data" / "triton"


class Collected:
    def __init__(self) -> None:
        self.samples: list[LatencySample] = []

    def record(self, sample: LatencySample) -> None:
        self.samples.append(sample)


def test_reads_real_triton_output() -> None:
    first = parse_triton_metrics((DATA / "passthrough_23.12_a.txt").read_text())
    assert set(first) == {"vastpipe_passthrough", "custom_metrics"}  # labels, not names
    model = first["vastpipe_passthrough"]
    assert (model.success, model.failure, model.duration_us) == (2, 0, 45735)
    assert model.first_response == {}  # not a decoupled model

    idle = parse_triton_metrics((DATA / "failure_reasons_idle.txt").read_text())
    assert set(idle) == {"densenet_onnx", "cc_fraud_detect_model"}
    assert idle["densenet_onnx"].failure == 0  # summed over the four reasons

    docs = parse_triton_metrics((DATA / "first_response_docs.txt").read_text())
    assert docs["my_model"].first_response == {100: 8, 500: 30, 2000: 36, 5000: 37, math.inf: 37}


def test_a_restart_is_not_a_negative_delta() -> None:
    """The second real read is from a later run of the server: counters went down."""
    before = parse_triton_metrics((DATA / "passthrough_23.12_a.txt").read_text())
    after = parse_triton_metrics((DATA / "passthrough_23.12_b.txt").read_text())
    samples = samples_between(
        before["vastpipe_passthrough"], after["vastpipe_passthrough"],
        model="vastpipe_passthrough", qos_class="P1",
    )  # fmt: skip
    # Since the restart: 2 requests, 43,717 µs in all.
    assert len(samples) == 2
    assert all(s.e2e_ms == pytest.approx(43717 / 2 / 1000) for s in samples)
    assert all(s.ttft_ms is None and s.status is Outcome.OK for s in samples)


def _in_buckets(values: list[float], bounds: list[float]) -> list[int]:
    edges = [0.0, *bounds]
    return [sum(1 for v in values if lo < v <= hi) for lo, hi in itertools.pairwise(edges)]


def test_ttft_follows_the_histogram() -> None:
    docs = parse_triton_metrics((DATA / "first_response_docs.txt").read_text())["my_model"]
    after = ModelCounters(success=37, duration_us=37 * 900_000, first_response=docs.first_response)
    samples = samples_between(ModelCounters(), after, model="my_model", qos_class="P0")
    ttfts = [s.ttft_ms or 0.0 for s in samples]
    # 8 in (0, 100] ms, 22 in (100, 500], 6 in (500, 2000], 1 in (2000, 5000]: spread
    # within each bucket (qosd_client.histograms).
    assert _in_buckets(ttfts, [100, 500, 2000, 5000]) == [8, 22, 6, 1]
    assert len(set(ttfts)) == 37
    # e2e is the interval's mean (900 ms), but never below the sample's own TTFT.
    assert all(s.e2e_ms == max(900, s.ttft_ms or 0) for s in samples)
    # Scaled down: the same proportions in fewer samples.
    few = samples_between(ModelCounters(), after, model="my_model", qos_class="P0", max_samples=10)
    assert len(few) == 10
    # 8/37 of 10 rounds to 2, 22/37 to 6, 6/37 to 2; the 1-in-37 tail rounds away.
    assert _in_buckets([s.ttft_ms or 0.0 for s in few], [100, 500, 2000, 5000]) == [2, 6, 2, 0]
    # Requests above the last bound count as up to twice it; failures are ERROR samples.
    tail = ModelCounters(success=2, failure=3, cancelled=1, duration_us=2_000,
                         first_response={1000: 1, math.inf: 2})  # fmt: skip
    mixed = samples_between(ModelCounters(), tail, model="m", qos_class="P2")
    assert sorted(s.ttft_ms or 0 for s in mixed if s.status is Outcome.OK) == [500, 1500]
    assert [s.status for s in mixed].count(Outcome.ERROR) == 3
    assert [s.status for s in mixed].count(Outcome.CANCELLED) == 1


def test_first_responses_wait_for_the_reads_where_their_requests_succeed() -> None:
    """A decoupled model's first response is counted before its request's success,
    often a read earlier: the scraper keeps it for the success (without, the request
    reached the daemon with no TTFT)."""
    sink = Collected()
    scraper = TritonMetricsScraper("http://unused", sink, {"m": "P0"})
    assert scraper.samples_since_last({"m": ModelCounters()}) == []  # the baseline
    first = ModelCounters(first_response={100: 1, 500: 2, math.inf: 2})
    assert scraper.samples_since_last({"m": first}) == []  # two first responses, none done
    one = ModelCounters(success=1, duration_us=900_000, first_response=first.first_response)
    (done,) = scraper.samples_since_last({"m": one})
    both = ModelCounters(success=2, duration_us=1_800_000, first_response=first.first_response)
    (other,) = scraper.samples_since_last({"m": both})
    # Which request had which first response is not known: each took half of each
    # bucket, the waiting responses' median (the bound between the two buckets).
    assert done.ttft_ms == other.ttft_ms == pytest.approx(100)
    # The stateless difference of the last two reads has no first response to give.
    assert samples_between(one, both, model="m", qos_class="P0")[0].ttft_ms is None


def test_the_first_read_is_the_baseline_and_unnamed_models_are_skipped() -> None:
    sink = Collected()
    scraper = TritonMetricsScraper("http://unused", sink, {"densenet_onnx": "P1"})
    idle = parse_triton_metrics((DATA / "failure_reasons_idle.txt").read_text())
    assert scraper.samples_since_last(idle) == []
    busy = dict(idle)
    busy["densenet_onnx"] = ModelCounters(success=4, duration_us=4_000)
    busy["cc_fraud_detect_model"] = ModelCounters(success=9, duration_us=9_000)
    samples = scraper.samples_since_last(busy)
    assert [(s.model, s.qos_class) for s in samples] == [("densenet_onnx", "P1")] * 4
    assert scraper.stats.unmapped_models == 1


async def test_scrapes_the_simulated_server_into_qosd() -> None:
    """Requests to the simulated Triton server, its /metrics read twice, the samples
    in the daemon's window for the model's class."""
    tree = {"pools": {"llm": {"capacity_tokens_s": 100_000}}, "default_pool": "llm"}
    with (
        daemon_processes(tree) as (daemon,),
        simulator_process(GpuModel(speed=4.0)) as simulated,
    ):
        async with QosdClient(daemon.address) as qos, aiohttp.ClientSession() as session:
            async with LatencyReporter(qos, flush_interval_s=0.05) as reporter:
                scraper = TritonMetricsScraper(simulated.metrics_url, reporter, {"llm": "P1"})
                assert await scraper.scrape_once(session) == []  # baseline
                async with triton.InferenceServerClient(simulated.grpc) as client:
                    await asyncio.gather(*(client.infer("llm", _inputs(200, 8)) for _ in range(6)))
                samples = await scraper.scrape_once(session)
            assert len(samples) == 6
            assert all(s.qos_class == "P1" and s.ttft_ms is not None for s in samples)
            assert all(s.e2e_ms is not None and s.e2e_ms > 8 * 2.5 for s in samples)
            window = (await qos.status("llm")).pool("llm").cls("P1").latency
            assert window.samples == 6
            # An unreachable server is a failed read, not an exception.
            dead = TritonMetricsScraper("http://127.0.0.1:9/metrics", reporter, {"llm": "P1"})
            assert await dead.scrape_once(session) == []
            assert dead.stats.failed_reads == 1


def test_the_cli_refuses_bad_options() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "qosd.cli", "triton-scrape", *args],
                              check=False, capture_output=True, text=True, timeout=30)  # fmt: skip

    missing = run()
    assert missing.returncode == 2 and "--class" in missing.stderr
    bad = run("--class", "llm")
    assert bad.returncode == 2 and "MODEL=CLASS" in bad.stderr


def test_the_cli_reports_until_stopped(tmp_path: Path) -> None:
    tree = {"pools": {"llm": {"capacity_tokens_s": 100_000}}, "default_pool": "llm"}
    ready = tmp_path / "ready.json"
    with (
        daemon_processes(tree) as (daemon,),
        simulator_process(GpuModel(speed=4.0)) as simulated,
    ):
        process = subprocess.Popen(
            [sys.executable, "-m", "qosd.cli", "triton-scrape", "--metrics-url",
             simulated.metrics_url, "--qosd", daemon.address, "--class", "llm=P0",
             "--interval", "0.2", "--ready-file", str(ready)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            # The baseline read: requests that finish after it are the ones reported.
            wait_until(lambda: ready.exists() or process.poll() is not None, timeout_s=30)
            assert ready.exists(), f"no baseline read (exit code {process.poll()})"
            written = json.loads(ready.read_text())
            assert written == {"pid": process.pid, "metrics_url": simulated.metrics_url,
                               "qosd": daemon.address}  # fmt: skip
            # Every read reports the server's own load too, the baseline included: an
            # idle server holds no request waiting.
            assert asyncio.run(_server_waiting(daemon.address)) == 0
            asyncio.run(_traffic(simulated.grpc, 4))
            deadline = time.monotonic() + 10
            samples = 0
            while samples < 4 and time.monotonic() < deadline:
                samples = asyncio.run(_p0_samples(daemon.address))
                time.sleep(0.1)
            assert samples == 4
        finally:
            process.terminate()
            _, logged = process.communicate(timeout=10)
            assert process.returncode == 0, logged
    assert f"baseline read from {simulated.metrics_url}" in logged  # said as well as written


def _inputs(prompt: int, output: int) -> list[triton.InferInput]:
    return token_inputs(prompt, output, triton)


async def _traffic(address: str, count: int) -> None:
    async with triton.InferenceServerClient(address) as client:
        await asyncio.gather(*(client.infer("llm", _inputs(100, 4)) for _ in range(count)))


async def _server_waiting(address: str) -> int | None:
    async with QosdClient(address) as qos:
        return (await qos.status("llm")).pool("llm").server_waiting_requests


async def _p0_samples(address: str) -> int:
    async with QosdClient(address) as qos:
        return (await qos.status("llm")).pool("llm").cls("P0").latency.samples
