"""The trace replayer: reading traces, class rules, time scaling, injection; the
reporter; and ``qosd demo`` end to end."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from qosd.config import Config
from qosd_client import LatencySample, QosdClient
from qosd_client.reporter import LatencyReporter
from qosd_sim.experiment import (
    CapacityChoice,
    Policy,
    configured_capacity,
    daemon_config,
    largest_cost,
    slo_capacity,
    slo_load,
)
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.harness import daemon_processes, free_port
from qosd_sim.replay import (
    Bursts,
    ClassRule,
    Request,
    TraceError,
    TraceRow,
    arrival_shape,
    build_workload,
    burst_times,
    bursty_workload,
    read_trace,
    speedup_for_load,
    trace_token_rate,
)
from qosd_sim.results import (
    Objectives,
    busy_at,
    busy_fraction,
    class_summary,
    policy_summary,
    timeline,
)

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
    # By default the hash alone decides, whatever the length (the brief's mix).
    assert rule.classify(5, 191_000) == rule.classify(5, 1)
    long_rule = ClassRule(long_prompt_tokens=16_384)  # opt-in: long prompts are batch work
    assert all(long_rule.classify(i, 16_384) == "P2" for i in range(50))
    assert long_rule.classify(5, 16_383) == rule.classify(5, 1)
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
    # The seed's long prompts are an ordinary user's: P1 by default.
    assert all(r.input_tokens == 32_768 and r.qos_class == "P1" for r in injected)
    as_p2 = build_workload(ROWS, speedup=1.0, duration_s=60.0, inject_every_s=50.0,
                           inject_class="P2")  # fmt: skip
    assert [r.qos_class for r in as_p2 if r.injected] == ["P2"]
    by_rule = build_workload(
        ROWS,
        speedup=1.0,
        duration_s=60.0,
        inject_every_s=50.0,
        inject_class=None,
        rule=ClassRule(long_prompt_tokens=16_384),
    )
    assert [r.qos_class for r in by_rule if r.injected] == ["P2"]
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
    assert process.wait(30) == 130, output[-3000:]  # the demo's own words on failure
    assert "interrupted" in output
    assert "qosd demo report" in output
    assert _qosd_processes() == before


# --- bursty workloads and arrival shapes ---------------------------------------------------


def _steady(rate: float, window: float) -> list[float]:
    return [i / rate for i in range(int(rate * window))]


def test_bursts_keep_every_request_in_its_cycle_and_are_seeded() -> None:
    bursts = Bursts(duty=0.25, peak=20.0, period_s=30.0)
    times = _steady(10.0, 120.0)
    moved = burst_times(times, 120.0, bursts, seed=3)
    assert moved == burst_times(times, 120.0, bursts, seed=3)  # pure, deterministic
    assert moved != burst_times(times, 120.0, bursts, seed=4)
    assert len(moved) == len(times) and moved == sorted(moved)
    assert all(0 <= t < 120.0 for t in moved)
    # Each cycle keeps its own requests, so the rate over every cycle is unchanged.
    for k in range(4):
        assert sum(1 for t in moved if 30 * k <= t < 30 * (k + 1)) == 300
        inside = [t for t in moved if 30 * k <= t < 30 * (k + 1)]
        # ... packed into one on-period of duty x period ...
        assert inside[-1] - inside[0] <= 0.25 * 30 + 1e-9
        # ... whose first second holds peak x the mean rate (10/s).
        assert sum(1 for t in inside if t < inside[0] + 1.0) == pytest.approx(200, abs=1)


def test_bursts_edge_cases_and_parsing() -> None:
    times = _steady(10.0, 60.0)
    # A peak no denser than the on-period's even rate (1 / duty) leaves it even.
    even = burst_times(times, 60.0, Bursts(duty=0.5, peak=1.5, period_s=20.0), seed=1)
    first = [t for t in even if t < 20.0]
    gaps = [b - a for a, b in itertools.pairwise(first)]
    assert max(gaps) == pytest.approx(min(gaps))
    assert max(gaps) == pytest.approx(0.05)  # 200 requests over 10 s
    # A front denser than the cycle holds: the whole cycle arrives in its front.
    spike = burst_times(times, 60.0, Bursts(duty=0.5, peak=50.0, period_s=20.0), seed=1)
    first = [t for t in spike if t < 20.0]
    assert first[-1] - first[0] <= 1.0
    # Duty 1 with an even peak changes nothing.
    assert burst_times(times, 60.0, Bursts(duty=1.0, peak=1.0, period_s=20.0), 1) == (
        pytest.approx(times)
    )
    assert burst_times([], 10.0, Bursts(), 1) == []
    with pytest.raises(ValueError, match="sorted"):
        burst_times([2.0, 1.0], 10.0, Bursts(), 1)
    with pytest.raises(ValueError, match=r"\[0, 10"):
        burst_times([1.0, 10.0], 10.0, Bursts(), 1)
    assert Bursts.parse("") == Bursts()
    assert Bursts.parse("0.3:20") == Bursts(duty=0.3, peak=20.0)
    assert Bursts.parse("0.3:20:40") == Bursts(duty=0.3, peak=20.0, period_s=40.0)
    for bad in ("0.3", "0:20", "1.5:20", "0.3:0.5", "0.3:20:0", "a:b"):
        with pytest.raises(ValueError):
            Bursts.parse(bad)


def test_default_bursts_give_the_bursty_shape_and_keep_the_load() -> None:
    rows = [TraceRow(t, 1_000, 100) for t in _steady(17.0, 200.0)]
    workload = build_workload(rows, speedup=1.0, duration_s=120.0, inject_every_s=10.0)
    smooth = arrival_shape([r.at_s for r in workload if not r.injected], 120.0)
    assert smooth.empty_bin_share == 0 and smooth.peak_to_mean < 1.1
    bursty = bursty_workload(workload, 120.0, Bursts(), seed=7)
    assert bursty == bursty_workload(workload, 120.0, Bursts(), seed=7)
    assert sorted(r.index for r in bursty) == sorted(r.index for r in workload)
    assert sum(r.tokens() for r in bursty) == sum(r.tokens() for r in workload)
    assert [r.at_s for r in bursty] == sorted(r.at_s for r in bursty)
    assert [r for r in bursty if r.injected] == [r for r in workload if r.injected]
    shape = arrival_shape([r.at_s for r in bursty if not r.injected], 120.0)
    # Most 1-s bins empty, peaks tens of times the mean rate, gaps very uneven.
    assert 0.65 <= shape.empty_bin_share <= 0.8
    assert 18 <= shape.peak_to_mean <= 27
    assert shape.interarrival_cv is not None and shape.interarrival_cv > 10


def test_arrival_shape() -> None:
    shape = arrival_shape([0.1, 0.2, 5.5], 10.0)
    assert shape.requests == 3
    assert shape.empty_bin_share == pytest.approx(0.8)
    assert shape.peak_to_mean == pytest.approx(2 / 0.3)
    assert shape.interarrival_cv == pytest.approx(2.6 / 2.7)
    assert arrival_shape([1.0], 10.0).interarrival_cv is None
    assert arrival_shape([], 10.0).as_dict()["peak_to_mean_1s"] == 0


# --- outcomes over offered requests, goodput, busy time, admitted cost --------------------


def _record(
    qos_class: str,
    *,
    ttft: float | None = 100.0,
    admitted: bool = True,
    decision: str = "NONE",
    at_s: float = 0.0,
    waited_ms: float = 0.0,
    injected: bool = False,
) -> RequestRecord:
    request = Request(0, at_s, 100, 11, qos_class, "t", injected=injected)
    return RequestRecord(
        request,
        decision=decision,
        admitted=admitted,
        waited_ms=waited_ms,
        ttft_ms=ttft if admitted else None,
        e2e_ms=None if ttft is None or not admitted else ttft + 10 * 40,
        completed=admitted and ttft is not None,
    )


def test_attainment_of_offered_counts_refusals_as_misses() -> None:
    objectives = Objectives.from_config(Config())
    records = [
        _record("P0"),  # attained
        _record("P0", ttft=900.0),  # too slow
        _record("P0", admitted=False, decision="RATE_LIMITED"),
        _record("P0", admitted=False, decision="QUEUE_TIMEOUT", waited_ms=200.0),
        _record("P1"),
        _record("P1", ttft=None),  # unfinished
        _record("P2", ttft=60_000.0),  # no SLO: served is attained
        _record("P2", admitted=False, decision="QUEUE_TIMEOUT", waited_ms=30_000.0),
        _record("P1", ttft=3_000.0, injected=True),
    ]
    summary = policy_summary(records, objectives, window_s=10.0, capacity_tokens_s=100.0)
    p0, p1, p2, total = summary["P0"], summary["P1"], summary["P2"], summary["all"]
    assert (p0["offered"], p0["attained"], p0["rejected"], p0["timed_out"]) == (4, 1, 1, 1)
    assert p0["attainment_of_offered"] == 0.25
    assert p0["slo_attainment"] == 0.5  # over the two admitted
    assert p1["attainment_of_offered"] == pytest.approx(1 / 3, abs=1e-4)
    assert p1["long_prompts_offered"] == 1 and p1["long_prompts_attained"] == 0
    assert p2["attainment_of_offered"] == 0.5 and p2["slo_attainment"] is None
    assert total["attainment_of_offered"] == pytest.approx(3 / 9, abs=1e-4)
    # Goodput: trace requests that attained (P0, P1, P2: 111 tokens each) over the
    # 10 s arrival window, against a capacity of 100 tokens/s.
    assert total["goodput_window_tokens_s"] == pytest.approx(33.3)
    assert total["goodput_of_saturated"] == pytest.approx(0.333)
    # The injected prompt missed, so it adds nothing to its own goodput either ...
    assert total["long_prompt_goodput_of_saturated"] == 0
    # ... and one on time counts there, never in the trace's goodput.
    on_time = [*records, _record("P1", injected=True)]
    again = policy_summary(on_time, objectives, window_s=10.0, capacity_tokens_s=100.0)["all"]
    assert again["long_prompt_goodput_of_saturated"] == pytest.approx(0.111)
    assert again["goodput_of_saturated"] == total["goodput_of_saturated"]
    # The older goodput spans until the last attained request completed (P2 at 60.4 s).
    assert total["goodput_span_s"] == pytest.approx(60.4)
    # Served shares: completed tokens, the injected prompt's included.
    served = {name: summary[name]["served_tokens"] for name in ("P0", "P1", "P2")}
    assert served == {"P0": 222, "P1": 222, "P2": 111}
    assert p1["served_token_share"] == pytest.approx(222 / 555, abs=1e-4)
    assert p1["floor_share"] == Config().classes["P1"].floor_share


def test_objectives_scale_with_the_prompt_as_qosd_judges_them() -> None:
    p0 = Objectives.from_config(Config())["P0"]
    slo = Config().classes["P0"].slo
    long = RequestRecord(Request(0, 0.0, 40_000, 11, "P0", "t"), admitted=True,
                         ttft_ms=5_000.0, e2e_ms=5_400.0, completed=True)  # fmt: skip
    assert slo.ttft_ms is not None
    allowed = slo.ttft_ms + slo.ttft_ms_per_1k_tokens * (40_000 - slo.ttft_free_tokens) / 1000
    assert p0.for_prompt(40_000)[0] == pytest.approx(allowed)
    assert p0.for_prompt(1_000)[0] == slo.ttft_ms
    assert p0.met(long) == (allowed >= 5_000.0)
    fixed = Objectives(ttft_ms=500, tpot_ms=50, e2e_ms=None, max_wait_ms=200)
    assert not fixed.met(long)


def test_busy_fraction_and_timeline() -> None:
    samples = [(0.01, 0.0), (1.0, 0.5), (2.0, 1.5), (4.0, 3.0), (9.0, 3.0)]
    assert busy_at(samples, 1.5) == pytest.approx(1.0)
    assert busy_fraction(samples, 4.0) == pytest.approx(0.75)
    assert busy_fraction(samples, 8.0) == pytest.approx(3.0 / 8.0)
    assert busy_fraction(samples, 20.0) is None  # not sampled that far
    assert busy_fraction([(2.0, 1.0), (3.0, 2.0)], 2.0) == pytest.approx(0.5)  # fresh at 0
    objectives = Objectives.from_config(Config())
    records = [
        _record("P0", at_s=0.2),
        _record("P1", at_s=0.5, waited_ms=800.0),  # admitted at 1.3 s
        _record("P1", at_s=0.6, admitted=False, decision="RATE_LIMITED"),
    ]
    series = timeline(
        records,
        objectives,
        output_weight=4.0,
        rates=[(0.5, 1_000.0), (1.5, 900.0)],
        busy=samples,
        end_s=3.0,
    )
    cost = 100 + 4.0 * 256  # the admission estimate: input + weight x 256
    assert series["t_s"] == [0, 1, 2]
    assert series["admitted_cost_s"]["P0"] == [cost, 0.0, 0.0]
    assert series["admitted_cost_s"]["P1"] == [0.0, cost, 0.0]
    assert series["pool_rate_cost_s"] == [1_000.0, 900.0, 900.0]
    assert series["busy_fraction"] == [0.5, 1.0, 0.75]
    summary = policy_summary(
        records,
        objectives,
        window_s=2.0,
        capacity_tokens_s=100.0,
        busy=samples,
        rates=[(0.5, 1_000.0), (1.5, 900.0)],
        output_weight=4.0,
    )
    assert summary["all"]["busy_fraction"] == 0.75
    assert summary["all"]["admitted_cost_s"] == pytest.approx(cost)
    assert summary["all"]["admitted_cost_of_pool_rate"] == pytest.approx(cost / 950, abs=1e-4)


# --- the SLO capacity is a figure, never a precondition -----------------------------------


def test_slo_capacity_is_reported_not_required() -> None:
    gpu = GpuModel()
    short = [Request(i, i * 0.1, 500, 50, "P1", "t") for i in range(200)]
    found = slo_capacity(gpu, short, ttft_ms=500, tpot_ms=50, window_s=20.0)
    assert found.load is not None and 0.1 < found.load <= 1.0
    assert found.floor_attainment == 1.0 and found.pool_load == found.load
    # A 191K-token prompt prefills for longer than any TTFT objective: unreachable,
    # reported as None, and the pool's slo capacity falls back to saturation.
    huge = [Request(i, i * 2.0, 191_000 if i % 2 else 500, 20, "P1", "t") for i in range(10)]
    unreachable = slo_capacity(gpu, huge, ttft_ms=500, tpot_ms=50)
    assert unreachable.load is None and unreachable.floor_attainment <= 0.5
    assert unreachable.pool_load == 1.0
    assert "unreachable" in unreachable.rule
    assert unreachable.as_dict()["slo_load"] is None
    assert slo_load(gpu, huge, ttft_ms=500, tpot_ms=50) is None
    slo = configured_capacity(gpu, short, 4.0, Config(), window_s=20.0)
    half = configured_capacity(gpu, short, 4.0, Config(), choice=CapacityChoice.HALF,
                               window_s=20.0)  # fmt: skip
    saturated = configured_capacity(gpu, short, 4.0, Config(),
                                    choice=CapacityChoice.SATURATED, window_s=20.0)  # fmt: skip
    assert saturated.cost_s == pytest.approx(saturated.saturated_cost_s)
    assert half.cost_s == pytest.approx(slo.cost_s / 2)
    assert slo.cost_s == pytest.approx(saturated.cost_s * found.load, rel=0.05)
    fallback = configured_capacity(gpu, huge, 4.0, Config())
    assert fallback.cost_s == pytest.approx(fallback.saturated_cost_s)


def test_daemon_config_admits_the_workloads_largest_request() -> None:
    workload = [Request(0, 0.0, 191_000, 10, "P0", "t"), Request(1, 0.1, 500, 10, "P1", "t")]
    largest = largest_cost(workload, 4.0, 256)
    assert largest == 191_000 + 4 * 256
    admit = daemon_config(Policy.QOSD, capacity_cost_s=20_000, output_weight=4.0,
                          redis_url=None, largest_request_cost=largest)  # fmt: skip
    assert {n: c["max_cost_tokens"] for n, c in admit["classes"].items()} == dict.fromkeys(
        ("P0", "P1", "P2"), largest
    )
    small = daemon_config(Policy.STATIC, capacity_cost_s=20_000, output_weight=4.0,
                          redis_url=None, largest_request_cost=5_000)  # fmt: skip
    assert [c["max_cost_tokens"] for c in small["classes"].values()] == [20_000, 20_000, 40_000]
    assert not small["control"]["enabled"]
    refuse = daemon_config(Policy.QOSD, capacity_cost_s=20_000, output_weight=4.0,
                           redis_url=None, admit_long_prompts=False,
                           largest_request_cost=largest)  # fmt: skip
    assert [c["max_cost_tokens"] for c in refuse["classes"].values()] == [20_000] * 3
