"""The trace replayer: reading traces, class rules, time scaling, injection; the
reporter; and ``qosd demo`` end to end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from qosd.config import Config
from qosd_client import LatencySample, QosdClient
from qosd_client.reporter import LatencyReporter
from qosd_harness import closed_port, daemon_processes
from qosd_sim.experiment import (
    CapacityChoice,
    Policy,
    configured_capacity,
    daemon_config,
    prefill_probe,
    slo_capacity,
)
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import FIXED_P0, SCALED, Objectives
from qosd_sim.openai_experiment import run_policy_openai
from qosd_sim.replay import (
    BurstProcess,
    BurstTargets,
    ClassRule,
    Request,
    TraceError,
    TraceRow,
    arrival_shape,
    build_workload,
    bursty_workload,
    read_trace,
    seeded_start,
    speedup_for_load,
    trace_from,
    trace_token_rate,
)
from qosd_sim.results import (
    ClassFacts,
    RunSamples,
    busy_at,
    busy_fraction,
    class_summary,
    policy_summary,
    timeline,
)
from qosd_sim.seeds import summed_up
from tests.waiting import until

ROWS = [TraceRow(float(t), 1_000, 100) for t in range(0, 101)]  # one a second for 100 s


@pytest.mark.fast
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


@pytest.mark.fast
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


@pytest.mark.fast
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


@pytest.mark.fast
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


@pytest.mark.fast
def test_slo_attainment_counts_admitted_requests_only() -> None:
    objectives = Objectives(ttft_ms=500, tpot_ms=50)

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
        10.0,
        facts=ClassFacts(max_wait_ms=200),
    )
    assert summary["admitted"] == 3
    assert summary["rejected"] == 1
    assert summary["unfinished"] == 1
    assert summary["slo_attainment"] == pytest.approx(1 / 3, abs=1e-4)
    assert summary["goodput_tokens_s"] == pytest.approx(111 / 10.0)
    assert summary["max_wait_ms"] == 200 and summary["waits_past_max"] == 0


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
                # Under the 5 s flush interval (which would send all 25), with room for
                # a busy machine.
                await until(lambda: reporter.stats.sent >= 20, timeout_s=4)
                assert reporter.stats.sent == 20  # two full batches, without waiting 5 s
                reporter.record(LatencySample("llm", "P9", ttft_ms=1.0))  # unknown class
            assert reporter.stats.sent == 25  # the rest flushed on close
            assert reporter.stats.refused == 1
            assert (await qos.status("llm")).pool("llm").cls("P1").latency.samples == 25
    # qosd gone: recording still returns at once; the failed batch is counted, not raised.
    # A port held closed: no other worker's daemon can be there to answer.
    with closed_port() as port:
        async with QosdClient(f"127.0.0.1:{port}", timeout_s=0.2) as qos:
            reporter = LatencyReporter(qos, batch_size=5, max_buffered=5, call_timeout_s=0.2)
            reporter.start()
            began = time.monotonic()
            for _ in range(12):
                reporter.record(LatencySample("llm", "P1", ttft_ms=1.0))
            # Less than one call's timeout: no record waited on a call. (Not tighter: a
            # busy machine may hold the loop for tens of milliseconds.)
            assert time.monotonic() - began < 0.2
            await reporter.close()
        assert reporter.stats.sent == 0
        assert reporter.stats.dropped >= 7  # 7 pushed out of the full buffer, then a batch
        assert reporter.stats.failed_calls >= 1


async def test_reporter_survives_errors_that_are_not_qosds() -> None:
    with closed_port() as port:  # never connected to: the channel is closed first
        qos = QosdClient(f"127.0.0.1:{port}")
        await qos.close()  # a closed channel raises grpc's UsageError, not a QosdError
    reporter = LatencyReporter(qos, batch_size=1, flush_interval_s=0.01)
    reporter.start()
    for round_ in range(1, 3):
        reporter.record(LatencySample("llm", "P1", ttft_ms=1.0))
        await until(lambda: reporter.stats.failed_calls >= round_, timeout_s=10)  # noqa: B023
        assert reporter.stats.failed_calls == round_  # still sending after a failure
    await reporter.close()  # does not raise
    assert reporter.stats.dropped == 2


def _marked_processes(mark: str) -> set[int]:
    """Live processes whose environment carries ``QOSD_TEST_MARK=mark``: a command
    started with the mark, and everything it started (children inherit it), and no
    process of another test running at the same time."""
    found: set[int] = set()
    needle = f"QOSD_TEST_MARK={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(") ", 1)[1][:1]
        except (OSError, IndexError):
            continue
        if needle in environment and state != "Z":
            found.add(int(entry.name))
    return found


def _marked() -> tuple[str, dict[str, str]]:
    mark = uuid.uuid4().hex
    return mark, {**os.environ, "QOSD_TEST_MARK": mark}


def test_demo_runs_and_leaves_nothing_behind(tmp_path: Path) -> None:
    mark, env = _marked()
    done = subprocess.run(
        [sys.executable, "-m", "qosd.cli", "demo", "--duration", "6", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The same requests with no QoS, then through qosd, and one report of both.
    assert "run 1/2: no QoS" in done.stdout and "run 2/2: qosd" in done.stdout
    report = done.stdout.split("qosd demo report", 1)[1]
    header = report.splitlines()[1]
    assert header.split() == ["no", "QoS", "qosd"]
    for name in ("P0 on time", "P1 on time", "P2 served", "32K prompts admitted"):
        assert name in report
    assert (tmp_path / "qosd_demo_latency.png").stat().st_size > 10_000
    assert (tmp_path / "qosd_demo_rates.png").stat().st_size > 10_000
    assert not _marked_processes(mark)


def test_demo_stops_cleanly_on_ctrl_c(tmp_path: Path) -> None:
    mark, env = _marked()
    process = subprocess.Popen(
        [sys.executable, "-m", "qosd.cli", "demo", "--duration", "60", "--out", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal would have
        env=env,
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
    assert not _marked_processes(mark)


# --- bursty workloads, seeded starts and arrival shapes ----------------------------------


def _steady(rate: float, window: float) -> list[float]:
    return [i / rate for i in range(int(rate * window))]


@pytest.mark.fast
def test_the_burst_process_is_seeded_and_keeps_every_request() -> None:
    process = BurstProcess(bursts_per_s=0.15, size_exponent=1.0, spread_s=0.25)
    times = process.times(1_500, 120.0, seed=3)
    assert times == process.times(1_500, 120.0, seed=3)  # pure, deterministic
    assert times != process.times(1_500, 120.0, seed=4)
    assert len(times) == 1_500 and times == sorted(times)
    assert all(0 <= t < 120.0 for t in times)
    rows = [TraceRow(t, 1_000 + i, 100) for i, t in enumerate(_steady(13.0, 200.0))]
    workload = build_workload(rows, speedup=1.0, duration_s=120.0, inject_every_s=10.0)
    bursty = bursty_workload(workload, 120.0, process, seed=7)
    assert sorted(r.index for r in bursty) == sorted(r.index for r in workload)
    assert sum(r.tokens() for r in bursty) == sum(r.tokens() for r in workload)
    assert [r.at_s for r in bursty] == sorted(r.at_s for r in bursty)
    assert [r for r in bursty if r.injected] == [r for r in workload if r.injected]
    # The trace's own order survives: each request keeps its size, class and tenant.
    trace = [r for r in bursty if not r.injected]
    assert [r.input_tokens for r in trace] == sorted(r.input_tokens for r in trace)


@pytest.mark.fast
def test_the_fit_meets_the_targets_on_seeds_it_was_not_fitted_on() -> None:
    targets = BurstTargets()
    process = BurstProcess.fit(1_600, 120.0, targets)
    shape = process.median_shape(1_600, 120.0, seeds=range(11, 21))
    assert shape["empty_bin_share"] == pytest.approx(targets.empty_bin_share, abs=0.06)
    assert shape["peak_to_mean"] == pytest.approx(targets.peak_to_mean, rel=0.35)
    assert shape["interarrival_cv"] == pytest.approx(targets.interarrival_cv, rel=0.3)
    # The non-empty bins then carry about 1 / (1 - empty) times the mean.
    assert shape["nonempty_to_mean"] == pytest.approx(1 / (1 - shape["empty_bin_share"]), rel=0.05)
    assert BurstTargets.parse("") == targets
    assert BurstTargets.parse("0.5:10:5") == BurstTargets(0.5, 10.0, 5.0)
    for bad in ("0.5:10", "1:10:5", "0.5:0.5:5", "a:b:c"):
        with pytest.raises(ValueError):
            BurstTargets.parse(bad)


@pytest.mark.fast
def test_a_seed_starts_the_trace_elsewhere_and_keeps_its_rows() -> None:
    rows = [TraceRow(float(t), t + 1, 10) for t in range(0, 100, 2)]  # every 2 s
    moved = trace_from(rows, 50.0)
    assert [r.input_tokens for r in moved[:3]] == [51, 53, 55]
    assert moved[0].arrival_s == 0.0
    # The rows before the start follow one mean gap after the last.
    assert [r.input_tokens for r in moved[-2:]] == [47, 49]
    assert moved[25].arrival_s == pytest.approx(48.0 + 2.0)
    assert sorted(r.input_tokens for r in moved) == [r.input_tokens for r in rows]
    assert [r.arrival_s for r in moved] == sorted(r.arrival_s for r in moved)
    starts = {seeded_start(rows, seed) for seed in (11, 12, 13)}
    assert len(starts) == 3 and all(0.0 <= t <= 98.0 for t in starts)
    assert seeded_start(rows, 11) == seeded_start(rows, 11)
    with pytest.raises(ValueError, match="within the trace"):
        trace_from(rows, 200.0)


@pytest.mark.fast
def test_arrival_shape() -> None:
    shape = arrival_shape([0.1, 0.2, 5.5], 10.0)
    assert shape.requests == 3
    assert shape.empty_bin_share == pytest.approx(0.8)
    assert shape.peak_to_mean == pytest.approx(2 / 0.3)
    assert shape.interarrival_cv == pytest.approx(2.6 / 2.7)
    assert shape.nonempty_to_mean == pytest.approx(1.5 / 0.3)
    assert shape.nonempty_cv == pytest.approx(1 / 3)
    assert arrival_shape([1.0], 10.0).interarrival_cv is None
    assert arrival_shape([], 10.0).as_dict()["peak_to_mean_1s"] == 0


# --- outcomes over offered requests, goodput over the span, busy time ---------------------


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


FACTS = ClassFacts.from_config(Config())


@pytest.mark.fast
def test_attainment_of_offered_counts_refusals_as_misses() -> None:
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
    summary = policy_summary(
        records, SCALED, RunSamples(70.0), window_s=10.0, capacity_tokens_s=100.0, facts=FACTS
    )
    p0, p1, p2, total = summary["P0"], summary["P1"], summary["P2"], summary["all"]
    assert (p0["offered"], p0["attained"], p0["rejected"], p0["timed_out"]) == (4, 1, 1, 1)
    assert p0["attainment_of_offered"] == 0.25
    assert p0["slo_attainment"] == 0.5  # over the two admitted
    assert p1["attainment_of_offered"] == pytest.approx(1 / 3, abs=1e-4)
    assert p1["long_prompts_offered"] == 1 and p1["long_prompts_attained"] == 0
    assert p2["attainment_of_offered"] == 0.5 and p2["slo_attainment"] is None
    assert total["attainment_of_offered"] == pytest.approx(3 / 9, abs=1e-4)
    # The span runs to the end of the run: an admitted P1 request never completed.
    assert total["goodput_span_s"] == 70.0
    # Goodput: requests that attained (P0, P1, P2: 111 tokens each) over the span.
    assert total["goodput_span_of_saturated"] == pytest.approx(333 / 70 / 100, abs=1e-4)
    assert total["trace_goodput_span_of_saturated"] == total["goodput_span_of_saturated"]
    # An injected prompt on time counts in goodput, and not in the trace's own.
    on_time = [*records, _record("P1", injected=True)]
    again = policy_summary(on_time, SCALED, RunSamples(70.0), window_s=10.0,
                           capacity_tokens_s=100.0, facts=FACTS)["all"]  # fmt: skip
    assert again["goodput_span_of_saturated"] == pytest.approx(444 / 70 / 100, abs=1e-4)
    assert again["trace_goodput_span_of_saturated"] == total["goodput_span_of_saturated"]
    assert again["long_prompts_attained"] == 1
    # Served shares: completed tokens, the injected prompt's included.
    served = {name: summary[name]["served_tokens"] for name in ("P0", "P1", "P2")}
    assert served == {"P0": 222, "P1": 222, "P2": 111}
    assert p1["served_token_share"] == pytest.approx(222 / 555, abs=1e-4)
    assert p1["floor_share"] == Config().classes["P1"].floor_share
    assert p2["max_wait_ms"] == Config().classes["P2"].max_wait_ms


@pytest.mark.fast
def test_work_done_in_the_drain_never_lifts_goodput_over_the_span() -> None:
    """What finished after the arrival window counts, over the longer span: a policy
    that served 10 s of work in 20 s is not credited with twice the GPU."""
    # A GPU that serves one request every 2 s, saturated: request i arrives at i s
    # and completes at 2 (i + 1) s (its e2e is i + 2 s, its TTFT 400 ms less).
    records = [_record("P2", at_s=float(i), ttft=(i + 2) * 1000.0 - 400.0) for i in range(10)]
    summary = policy_summary(
        records, SCALED, RunSamples(25.0), window_s=10.0, capacity_tokens_s=111.0 / 2
    )["all"]
    assert summary["goodput_span_s"] == pytest.approx(20.0)  # the last completion
    assert summary["goodput_span_of_saturated"] == pytest.approx(1.0)  # not 2.0
    # Nothing admitted finishes after the window: the span is the window.
    quick = policy_summary([_record("P2", at_s=1.0)], SCALED, RunSamples(12.0), window_s=10.0,
                           capacity_tokens_s=100.0)["all"]  # fmt: skip
    assert quick["goodput_span_s"] == 10.0


@pytest.mark.fast
def test_the_scoring_is_the_benchmarks_own() -> None:
    """The objectives are declared in the simulator, not read from qosd's config, and
    the TTFT objective grows with the prompt; the second scoring fixes P0's at 500 ms."""
    long = RequestRecord(Request(0, 0.0, 40_000, 11, "P0", "t"), admitted=True,
                         ttft_ms=5_000.0, e2e_ms=5_400.0, completed=True)  # fmt: skip
    allowed = 500 + 200 * (40_000 - 4_096) / 1000
    assert SCALED["P0"].ttft_for(40_000) == pytest.approx(allowed)
    assert SCALED["P0"].ttft_for(1_000) == 500
    assert SCALED["P0"].met(40_000, long)
    assert not FIXED_P0["P0"].met(40_000, long)
    assert FIXED_P0["P1"] == SCALED["P1"] and SCALED["P1"].ttft_for(1_000) == 2_000
    assert not SCALED["P2"].has_slo
    # A different qosd config leaves the yardstick where it was.
    strict = Config.model_validate(
        {"classes": {"P0": {"priority": 0, "share": 1.0, "slo": {"ttft_ms": 10}}}}
    )
    assert strict.classes["P0"].slo.ttft_ms == 10 and SCALED["P0"].ttft_ms == 500


@pytest.mark.fast
def test_busy_fraction_and_timeline() -> None:
    samples = [(0.01, 0.0), (1.0, 0.5), (2.0, 1.5), (4.0, 3.0), (9.0, 3.0)]
    assert busy_at(samples, 1.5) == pytest.approx(1.0)
    assert busy_fraction(samples, 4.0) == pytest.approx(0.75)
    assert busy_fraction(samples, 8.0) == pytest.approx(3.0 / 8.0)
    assert busy_fraction(samples, 20.0) is None  # not sampled that far
    # The last sample at the last completion, the span a float's error past it.
    assert busy_fraction(samples, 9.0 + 1e-9) == pytest.approx(3.0 / 9.0)
    assert busy_fraction([(2.0, 1.0), (3.0, 2.0)], 2.0) == pytest.approx(0.5)  # fresh at 0
    records = [
        _record("P0", at_s=0.2),
        _record("P1", at_s=0.5, waited_ms=800.0),  # admitted at 1.3 s
        _record("P1", at_s=0.6, admitted=False, decision="RATE_LIMITED"),
    ]
    series = timeline(
        records,
        FACTS,
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
        SCALED,
        RunSamples(2.0, samples, [(0.5, 1_000.0), (1.5, 900.0)]),
        window_s=2.0,
        capacity_tokens_s=100.0,
        facts=FACTS,
        output_weight=4.0,
    )
    assert summary["all"]["busy_fraction"] == 0.75
    assert summary["all"]["admitted_cost_s"] == pytest.approx(cost)
    assert summary["all"]["admitted_cost_of_pool_rate"] == pytest.approx(cost / 950, abs=1e-4)


@pytest.mark.fast
def test_seeds_are_summed_up_as_means_and_the_worst_seed() -> None:
    def seed(p0: float, goodput: float, bound: float | None) -> dict[str, object]:
        classes = {
            "P0": {"attainment_of_offered": p0, "slo_attainment": None, "reasons": {"X": 1}},
            "P1": {"attainment_of_offered": 0.5},
            "P2": {"attainment_of_offered": 1.0, "waits_past_max": int(p0 * 10)},
            "all": {"goodput_span_of_saturated": goodput},
        }
        return {
            "policies": {"qosd": classes},
            "fixed_p0": {"qosd": {"P0": {"attainment_of_offered": p0 / 2}}},
            "bound": {"scaled": {"P0": {"share": bound}}},
            "workload_shape": {"empty_bin_share": 0.7},
        }

    summed = summed_up([seed(0.9, 0.8, 1.0), seed(0.6, 0.5, 0.9), seed(0.3, 0.2, None)])
    p0 = summed["policies"]["qosd"]["P0"]
    assert p0["attainment_of_offered"] == pytest.approx(0.6)
    assert p0["slo_attainment"] is None
    assert p0["reasons"] == {"X": 1.0}
    assert summed["worst"]["qosd"]["P0"]["attainment_of_offered"] == 0.3
    assert summed["worst"]["qosd"]["P2"]["waits_past_max"] == 9
    assert summed["worst"]["qosd"]["all"]["goodput_span_of_saturated"] == 0.2
    assert summed["bound"]["scaled"] == {"P0": 0.95, "P0_worst": 0.9}
    assert summed["fixed_p0"]["policies"]["qosd"]["P0"]["attainment_of_offered"] == 0.3


# --- the pool's capacity, and qosd's config as an operator writes it ----------------------


@pytest.mark.fast
def test_the_capacity_comes_from_a_load_test_that_knows_no_trace() -> None:
    gpu = GpuModel()
    found = slo_capacity(gpu, SCALED["P0"])
    assert found.load is not None and 0.3 < found.load < 1.0
    assert found.floor_attainment == 1.0 and found.pool_load == found.load
    assert "1,024-token prompts" in found.rule
    slo = configured_capacity(gpu, 4.0, SCALED["P0"])
    half = configured_capacity(gpu, 4.0, SCALED["P0"], choice=CapacityChoice.HALF)
    saturated = configured_capacity(gpu, 4.0, SCALED["P0"], choice=CapacityChoice.SATURATED)
    assert saturated.cost_s == pytest.approx(saturated.saturated_cost_s)
    assert half.cost_s == pytest.approx(slo.cost_s / 2)
    assert slo.cost_s == pytest.approx(saturated.cost_s * found.load)
    # Objectives no load meets: reported as unreachable, the pool at saturation.
    impossible = slo_capacity(gpu, Objectives(ttft_ms=1.0))
    assert impossible.load is None and impossible.pool_load == 1.0
    assert "no load" in impossible.rule and impossible.as_dict()["slo_load"] is None


@pytest.mark.fast
def test_daemon_config_holds_only_what_an_operator_knows() -> None:
    gpu = GpuModel()
    admit = daemon_config(Policy.QOSD, capacity_cost_s=20_000, output_weight=4.0,
                          redis_url=None, gpu=gpu)  # fmt: skip
    pool = admit["pools"]["llm"]
    assert pool == {
        "capacity_tokens_s": 20_000,
        "models": ["llm"],
        "max_in_flight": 256,
        "max_in_flight_tokens": 400_000.0,
        "chunked_prefill": True,
        "servers_schedule_by_priority": False,
        "prefill_model_ms": list(prefill_probe(gpu)),
    }
    # The prefill model, from lone requests on the idle server: it predicts a length
    # the probe did not send as the server prefills it.
    c, a, b = pool["prefill_model_ms"]
    assert c + 4_096 * (a + b * 4_096) == pytest.approx(gpu.prefill_work_s(4_096) * 1000, rel=0.01)
    # Debt for one request of up to the server's largest context (its KV cache here),
    # nothing learned from a workload; and no long-prefill threshold: qosd learns it.
    largest = gpu.kv_capacity_tokens + 4 * 256
    assert [c["max_cost_tokens"] for c in admit["classes"].values()] == [largest] * 3
    unchunked = daemon_config(Policy.QOSD, capacity_cost_s=20_000, output_weight=4.0,
                              redis_url=None, gpu=GpuModel(prefill_chunk_tokens=None))  # fmt: skip
    assert unchunked["pools"]["llm"]["chunked_prefill"] is False
    by_priority = daemon_config(Policy.QOSD, capacity_cost_s=20_000, output_weight=4.0,
                                redis_url=None, gpu=GpuModel(priority_scheduling=True))  # fmt: skip
    assert by_priority["pools"]["llm"]["servers_schedule_by_priority"] is True
    assert "long_prefill_tokens" not in unchunked["pools"]["llm"]
    static = daemon_config(Policy.STATIC, capacity_cost_s=20_000, output_weight=4.0,
                           redis_url=None, gpu=gpu)  # fmt: skip
    # Static has the same servers' gate (issue 37), and no SLO loop.
    assert static["pools"]["llm"] == pool
    assert not static["control"]["enabled"] and admit["control"]["enabled"]
    refuse = daemon_config(Policy.QOSD, capacity_cost_s=20_000, output_weight=4.0,
                           redis_url=None, gpu=gpu, admit_long_prompts=False)  # fmt: skip
    assert [c["max_cost_tokens"] for c in refuse["classes"].values()] == [20_000] * 3


def test_the_replay_runs_through_the_openai_api_with_no_gateway_code() -> None:
    """``qos_replay.py --server vllm``: the same requests straight to a simulated vLLM
    (fifo) and through qosd proxy (qosd), with the official openai client; each is
    served with its trace's output length, and the GPU's busy time is read."""
    gpu = GpuModel(speed=20.0)
    requests = [Request(n, 0.05 * n, 40 + n, 6, ("P0", "P1", "P2")[n % 3], "t") for n in range(9)]
    for policy in (Policy.FIFO, Policy.QOSD):
        run = run_policy_openai(
            policy, requests, gpu=gpu, capacity_cost_s=1_000_000.0, output_weight=4.0,
            redis_url=None, drain_s=20.0, window_s=0.5,
        )  # fmt: skip
        assert [r.completed for r in run.records] == [True] * 9, policy
        assert {r.tokens_seen for r in run.records} == {6}
        assert run.busy and run.busy[-1][1] > 0
        for record in run.records:
            assert record.ttft_ms is not None and record.e2e_ms is not None
            assert record.ttft_ms <= record.e2e_ms
