"""The trace replayer: reading traces, class rules, time scaling, injection; the
reporter; and ``qosd demo`` end to end."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from qosd.sim.gateway import RequestRecord
from qosd.sim.replay import (
    ClassRule,
    Request,
    TraceError,
    TraceRow,
    build_workload,
    read_trace,
    speedup_for_load,
    trace_token_rate,
)
from qosd.sim.results import Objectives, class_summary
from qosd.testing import daemon_processes, free_port
from qosd_client import LatencySample, QosdClient
from qosd_client.reporter import LatencyReporter

ROWS = [TraceRow(float(t), 1_000, 100) for t in range(0, 101)]  # one a second for 100 s


def test_bundled_sample_and_csv_validation(tmp_path: Path) -> None:
    sample = read_trace()
    assert len(sample) == 2_000
    assert sample[0] == TraceRow(0.0, 374, 44)
    bad = tmp_path / "bad.csv"
    bad.write_text("arrival_s,input_tokens\n0,5\n")
    with pytest.raises(TraceError, match="missing column"):
        read_trace(bad)
    bad.write_text("arrival_s,input_tokens,output_tokens\n0,five,5\n")
    with pytest.raises(TraceError, match=":2:"):
        read_trace(bad)
    bad.write_text("arrival_s,input_tokens,output_tokens\n0,0,5\n")
    with pytest.raises(TraceError, match=">= 1"):
        read_trace(bad)
    unsorted = tmp_path / "unsorted.csv"
    unsorted.write_text("arrival_s,input_tokens,output_tokens\n2,5,5\n1,6,6\n")
    assert [r.input_tokens for r in read_trace(unsorted)] == [6, 5]


def test_class_rule_is_deterministic_and_follows_the_mix() -> None:
    rule = ClassRule()
    classes = [rule.classify(i, 1_000) for i in range(20_000)]
    assert classes == [ClassRule().classify(i, 1_000) for i in range(20_000)]
    shares = Counter(classes)
    assert shares["P0"] / 20_000 == pytest.approx(0.2, abs=0.015)
    assert shares["P1"] / 20_000 == pytest.approx(0.5, abs=0.015)
    assert shares["P2"] / 20_000 == pytest.approx(0.3, abs=0.015)
    assert rule.classify(5, 16_384) == "P2"  # long prompts are batch work
    assert ClassRule(long_prompt_tokens=None).classify(5, 100_000) == rule.classify(5, 1)
    other_seed = ClassRule(seed=8)
    assert [other_seed.classify(i, 1) for i in range(20)] != classes[:20]
    parsed = ClassRule.parse("P0=0.5,P1=0.5")
    assert parsed.mix == (("P0", 0.5), ("P1", 0.5))
    with pytest.raises(ValueError, match="add up to 1"):
        ClassRule.parse("P0=0.5,P1=0.6")


def test_time_scaling_reaches_the_target_load() -> None:
    rate = trace_token_rate(ROWS)
    assert rate == pytest.approx(101 * 1_100 / 100)
    speedup = speedup_for_load(ROWS, capacity_tokens_s=555.5, load=2.0)
    assert speedup == pytest.approx(2.0 * 555.5 / rate)
    workload = build_workload(ROWS, speedup=4.0, duration_s=10.0)
    # Trace seconds 0..39 land in the first 10 s of replay, a quarter-second apart.
    assert len(workload) == 40
    assert [r.at_s for r in workload[:3]] == [0.0, 0.25, 0.5]
    offered = sum(r.tokens() for r in workload) / 10.0
    assert offered == pytest.approx(4.0 * 1_100)


def test_injection_and_looping() -> None:
    workload = build_workload(ROWS, speedup=1.0, duration_s=250.0, inject_every_s=50.0)
    injected = [r for r in workload if r.injected]
    assert [r.at_s for r in injected] == [25.0, 75.0, 125.0, 175.0, 225.0]
    assert all(r.input_tokens == 32_768 and r.qos_class == "P2" for r in injected)
    # The 101-row trace (one a second) is looped to fill 250 s, keeping its pace.
    assert [r.at_s for r in workload if not r.injected] == [float(t) for t in range(250)]
    assert [r.at_s for r in workload] == sorted(r.at_s for r in workload)
    assert len({r.index for r in workload}) == len(workload)


def test_slo_attainment_counts_admitted_requests_only() -> None:
    objectives = Objectives(ttft_ms=500, tpot_ms=50, e2e_ms=None, max_wait_ms=200)

    def record(ttft: float | None, admitted: bool = True, decision: str = "NONE") -> RequestRecord:
        request = Request(0, 0.0, 100, 11, "P0", "t")
        return RequestRecord(
            request,
            decision=decision,
            admitted=admitted,
            ttft_ms=ttft,
            e2e_ms=None if ttft is None else ttft + 10 * 40,
            completed=ttft is not None,
        )

    summary = class_summary(
        [record(100), record(600), record(None), record(None, False, "RATE_LIMITED")],
        objectives,
        window_s=10.0,
    )
    assert summary["admitted"] == 3
    assert summary["rejected"] == 1
    assert summary["unfinished"] == 1
    assert summary["slo_attainment"] == pytest.approx(1 / 3, abs=1e-4)
    assert summary["goodput_tokens_s"] == pytest.approx(111 / 10.0)


async def test_reporter_batches_and_never_raises() -> None:
    tree = {
        "pools": {"llm": {"capacity_tokens_s": 100_000, "models": ["llm"]}},
        "default_pool": "llm",
    }
    with daemon_processes(tree) as (daemon,):
        async with QosdClient(daemon.address) as qos:
            async with LatencyReporter(qos, batch_size=10, flush_interval_s=5.0) as reporter:
                for _ in range(25):
                    reporter.record(LatencySample("llm", "P1", ttft_ms=10.0, tpot_ms=5.0))
                for _ in range(50):
                    if reporter.stats.sent >= 20:
                        break
                    await asyncio.sleep(0.02)
                assert reporter.stats.sent == 20  # two full batches, without waiting 5 s
                reporter.record(LatencySample("llm", "P9", ttft_ms=1.0))  # unknown class
            assert reporter.stats.sent == 25  # the rest flushed on close
            assert reporter.stats.refused == 1
            assert (await qos.status("llm")).pool("llm").cls("P1").latency.samples == 25
    # qosd gone: recording still returns at once; the failed batch is counted, not raised.
    async with QosdClient(f"127.0.0.1:{free_port()}", timeout_s=0.2) as qos:
        reporter = LatencyReporter(qos, batch_size=5, max_buffered=5, call_timeout_s=0.2)
        reporter.start()
        began = time.monotonic()
        for _ in range(12):
            reporter.record(LatencySample("llm", "P1", ttft_ms=1.0))
        assert time.monotonic() - began < 0.05
        await reporter.close()
        assert reporter.stats.sent == 0
        assert reporter.stats.dropped >= 7  # 7 pushed out of the full buffer, then a batch
        assert reporter.stats.failed_calls >= 1


async def test_reporter_survives_errors_that_are_not_qosds() -> None:
    qos = QosdClient(f"127.0.0.1:{free_port()}")
    await qos.close()  # a closed channel raises grpc's UsageError, not a QosdError
    reporter = LatencyReporter(qos, batch_size=1, flush_interval_s=0.01)
    reporter.start()
    for round_ in range(1, 3):
        reporter.record(LatencySample("llm", "P1", ttft_ms=1.0))
        for _ in range(100):
            if reporter.stats.failed_calls >= round_:
                break
            await asyncio.sleep(0.01)
        assert reporter.stats.failed_calls == round_  # still sending after a failure
    await reporter.close()  # does not raise
    assert reporter.stats.dropped == 2


def _qosd_processes() -> set[int]:
    """Live processes running ``qosd.cli`` (daemons, simulated servers), from /proc."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().split(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if b"qosd.cli" in command and state != "Z":
            found.add(int(entry.name))
    return found


def test_demo_runs_and_leaves_nothing_behind(tmp_path: Path) -> None:
    before = _qosd_processes()
    done = subprocess.run(
        [sys.executable, "-m", "qosd.cli", "demo", "--duration", "8", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "class   admitted  rejected" in done.stdout  # the live table
    assert "qosd demo report" in done.stdout
    for name in ("P0", "P1", "P2"):
        assert f"  {name}: " in done.stdout
    assert (tmp_path / "qosd_demo_latency.png").stat().st_size > 10_000
    assert (tmp_path / "qosd_demo_rates.png").stat().st_size > 10_000
    assert _qosd_processes() == before


def test_demo_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    before = _qosd_processes()
    process = subprocess.Popen(
        [sys.executable, "-m", "qosd.cli", "demo", "--duration", "60", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal would have
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("t="):
            break
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
    output = process.stdout.read()
    assert process.wait(30) == 130
    assert "interrupted" in output
    assert "qosd demo report" in output
    assert _qosd_processes() == before
