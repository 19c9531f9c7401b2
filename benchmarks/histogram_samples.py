"""What latency samples made from an engine's histograms cost against per-request ones.

``qosd scrape`` reads an engine's TTFT, TPOT and e2e histograms every few seconds
and turns their bucket deltas into samples (``qosd_client.engine_metrics``). This
runs the simulated GPU (the A100 model, chunked prefill) in virtual time over the
Azure conversation trace, observes every request into histograms with vLLM's own
names and bucket bounds (as ``qosd sim-vllm`` does: TTFT at the first token, one
inter-token latency per token, e2e at the end), writes them as exposition text every
``--interval`` seconds, and feeds each read to the scraper's own code. Beside it, the
truth: each request that finished in the interval, with its TTFT, its TPOT (mean
time per output token after the first) and e2e.

Reported, per load, over all intervals pooled, for the scraper's way (linear within
a bucket; TTFT and e2e paired by rank, TPOT at random) and the alternatives (values
at their bucket's upper bound; TPOT paired by rank too):
- the p50, p90 and p99 of TTFT, TPOT and e2e: samples against truth (relative error);
- compliance, the share of requests within TTFT 500 ms and TPOT 50 ms (the
  benchmarks' P0 objectives), and within the P1 objectives (2 s, 100 ms): samples
  against truth (points);
- TPOT from vLLM's per-token histogram (``inter_token_latency_seconds``) and from a
  per-request one (``request_time_per_output_token_seconds``, newer vLLM).

    python benchmarks/histogram_samples.py --json docs/results/histogram_samples.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from qosd_client.engine_metrics import (
    PROFILES,
    EngineCounters,
    EngineProfile,
    Latency,
    parse_engine_metrics,
    samples_between,
)
from qosd_client.histograms import bucket_deltas, spread
from qosd_harness import source_commit
from qosd_sim.gpu import Engine, GpuModel, Sequence, TokenKind, saturated_throughput
from qosd_sim.replay import read_trace, seeded_start, speedup_for_load, trace_from
from qosd_sim.vllm import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS

MODEL = "llm"
OBJECTIVES = {"P0": (500.0, 50.0), "P1": (2000.0, 100.0)}  # TTFT ms, TPOT ms
PER_REQUEST_TPOT = "vllm:request_time_per_output_token_seconds"
PER_TOKEN = EngineProfile(  # vLLM with the per-token histogram only, as sim-vllm writes
    "vllm-itl",
    "",
    {**PROFILES["vllm"].histograms, Latency.TPOT: ("vllm:inter_token_latency_seconds",)},
)


@dataclass
class Truth:
    ttft_ms: float
    tpot_ms: float | None
    e2e_ms: float


@dataclass
class Interval:
    truth: list[Truth] = field(default_factory=list)
    texts: str = ""


class Histograms:
    """vLLM's histograms, by its names and bounds, on a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine")

        def histogram(name: str, buckets: tuple[float, ...]) -> Any:
            made = Histogram(name, name, labels, buckets=buckets, registry=self.registry)
            return made.labels(MODEL, "0")

        self.ttft = histogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", ITL_BUCKETS)
        self.tpot = histogram(PER_REQUEST_TPOT, ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", REQUEST_BUCKETS)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def run(gpu: GpuModel, arrivals: list[tuple[float, int, int]], interval_s: float) -> list[Interval]:
    """Serves the arrivals in virtual time; the intervals' truth and exposition text."""
    histograms = Histograms()
    engine = Engine(gpu)
    intervals: list[Interval] = []
    current = Interval()
    next_read = interval_s
    last_token: dict[Sequence, float] = {}
    index, now = 0, 0.0
    while index < len(arrivals) or engine.pending:
        while index < len(arrivals) and arrivals[index][0] <= now:
            at, prompt, output = arrivals[index]
            engine.submit(Sequence(f"r{index}", prompt, output, submitted_at=at))
            index += 1
        iteration = engine.plan(now)
        step = iteration.duration_s if iteration else arrivals[index][0] - now
        while now + step >= next_read:  # reads fall between iterations
            current.texts = histograms.text()
            intervals.append(current)
            current = Interval()
            next_read += interval_s
        now += step
        if iteration is None:
            continue
        for event in engine.complete(now):
            seq = event.sequence
            if event.kind is TokenKind.FIRST:
                histograms.ttft.observe(now - seq.submitted_at)
            else:
                histograms.itl.observe(now - last_token[seq])
            last_token[seq] = now
            if event.finished:
                last_token.pop(seq)
                ttft = (seq.first_token_at or now) - seq.submitted_at
                tpot = None
                if seq.output_tokens > 1:
                    tpot = (now - (seq.first_token_at or now)) / (seq.output_tokens - 1)
                    histograms.tpot.observe(tpot)
                histograms.e2e.observe(now - seq.submitted_at)
                current.truth.append(
                    Truth(
                        ttft * 1000,
                        None if tpot is None else tpot * 1000,
                        (now - seq.submitted_at) * 1000,
                    )
                )
    current.texts = histograms.text()
    intervals.append(current)
    return intervals


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def within(ttft: float | None, tpot: float | None, objective: tuple[float, float]) -> bool:
    return (ttft is None or ttft <= objective[0]) and (tpot is None or tpot <= objective[1])


def reconstruct(
    intervals: list[Interval], profile: EngineProfile, *, way: str, rng: random.Random
) -> list[tuple[float | None, float | None, float | None]]:
    """The samples of every read: (ttft, tpot, e2e) ms. ``way``: ``scraper`` (the
    scraper's own code), ``upper`` (each value at its bucket's upper bound, all paired
    by rank) or ``rank`` (the scraper's values, TPOT paired by rank too)."""
    out: list[tuple[float | None, float | None, float | None]] = []
    before = EngineCounters()
    for interval in intervals:
        after = parse_engine_metrics(interval.texts, profile).get(MODEL, EngineCounters())
        samples = samples_between(before, after, model=MODEL, qos_class="P0", profile=profile,
                                  max_samples=10_000, rng=rng)  # fmt: skip
        rows = [(s.ttft_ms, s.tpot_ms, s.e2e_ms) for s in samples]
        if way == "upper" and rows:
            columns = []
            for latency in (Latency.TTFT, Latency.TPOT, Latency.E2E):
                earlier = before.histograms.get(latency)
                now = after.histograms.get(latency)
                values = (spread(bucket_deltas(earlier.buckets if earlier else {}, now.buckets),
                                 len(rows), within="upper") if now else [])  # fmt: skip
                column: list[float | None] = [v * 1000 for v in values]
                columns.append(column or [None] * len(rows))
            rows = list(zip(*columns, strict=True))
        elif way == "rank" and rows:
            ranked: list[float | None] = [*sorted(t for r in rows if (t := r[1]) is not None)]
            tpots = ranked or [None] * len(rows)
            rows = [(r[0], t, r[2]) for r, t in zip(rows, tpots, strict=True)]
        out += rows
        before = after
    return out


def summarize(intervals: list[Interval]) -> dict[str, Any]:
    truth = [t for interval in intervals for t in interval.truth]
    columns = {
        "ttft": [t.ttft_ms for t in truth],
        "tpot": [t.tpot_ms for t in truth if t.tpot_ms is not None],
        "e2e": [t.e2e_ms for t in truth],
    }
    result: dict[str, Any] = {"requests": len(truth), "truth": {}, "ways": {}}
    for name, values in columns.items():
        result["truth"][name] = {f"p{int(q * 100)}": quantile(values, q) for q in (0.5, 0.9, 0.99)}
    for name, objective in OBJECTIVES.items():
        result["truth"][f"compliance_{name}"] = statistics.fmean(
            within(t.ttft_ms, t.tpot_ms, objective) for t in truth
        )
    rng = random.Random(0)
    ways = {
        "scraper": (PROFILES["vllm"], "scraper"),
        "scraper_per_token_tpot": (PER_TOKEN, "scraper"),
        "upper_bound": (PROFILES["vllm"], "upper"),
        "tpot_paired_by_rank": (PROFILES["vllm"], "rank"),
    }
    for label, (profile, way) in ways.items():
        rows = reconstruct(intervals, profile, way=way, rng=rng)
        entry: dict[str, Any] = {"samples": len(rows)}
        for i, name in enumerate(("ttft", "tpot", "e2e")):
            values = [v for r in rows if (v := r[i]) is not None]
            for q in (0.5, 0.9, 0.99):
                key = f"p{int(q * 100)}"
                got = quantile(values, q)
                want = result["truth"][name][key]
                entry[f"{name}_{key}"] = got
                entry[f"{name}_{key}_error"] = (got - want) / want
        for name, objective in OBJECTIVES.items():
            compliance = statistics.fmean(within(r[0], r[1], objective) for r in rows)
            entry[f"compliance_{name}"] = compliance
            entry[f"compliance_{name}_error_points"] = 100 * (
                compliance - result["truth"][f"compliance_{name}"]
            )
        result["ways"][label] = entry
    return result


def summary_of(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per way, over every load and seed: the mean error of each figure and the worst
    (the largest in size, with its sign)."""
    errors: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for by_seed in runs.values():
        for run in by_seed.values():
            for way, entry in run["ways"].items():
                for key, value in entry.items():
                    if key.endswith(("_error", "_error_points")):
                        errors[way][key].append(value)
    return {
        way: {
            **{f"{key} mean": statistics.fmean(values) for key, values in figures.items()},
            **{f"{key} worst": max(values, key=abs) for key, values in figures.items()},
        }
        for way, figures in errors.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", help="a trace CSV (default: the bundled Azure sample)")
    parser.add_argument("--loads", default="0.6,0.9,1.2", help="offered / saturated")
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between reads")
    parser.add_argument("--seeds", default="11,12,13")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = read_trace(args.trace)
    gpu = GpuModel()
    capacity = saturated_throughput(gpu, [(r.input_tokens, r.output_tokens) for r in rows[:2000]])
    report: dict[str, Any] = {
        "command": " ".join(["benchmarks/histogram_samples.py", *(argv or sys.argv[1:])]),
        "commit": source_commit(Path(__file__).resolve().parents[1]),
        "trace": args.trace or "bundled Azure conversation sample",
        "interval_s": args.interval, "seconds": args.seconds, "objectives": OBJECTIVES,
        "runs": defaultdict(dict),
    }  # fmt: skip
    for load in (float(x) for x in args.loads.split(",")):
        for seed in (int(x) for x in args.seeds.split(",")):
            speed = speedup_for_load(rows, capacity, load)
            moved = trace_from(rows, seeded_start(rows, seed))
            arrivals = [(r.arrival_s / speed, r.input_tokens, r.output_tokens) for r in moved
                        if r.arrival_s / speed < args.seconds]  # fmt: skip
            intervals = run(gpu, arrivals, args.interval)
            summary = summarize(intervals)
            report["runs"][str(load)][str(seed)] = summary
            scraper = summary["ways"]["scraper"]
            print(
                f"load {load} seed {seed}: {summary['requests']} requests; scraper p99 error "
                f"TTFT {scraper['ttft_p99_error']:+.1%} TPOT {scraper['tpot_p99_error']:+.1%} "
                f"e2e {scraper['e2e_p99_error']:+.1%}; P0 compliance "
                f"{summary['truth']['compliance_P0']:.3f} truth, "
                f"{scraper['compliance_P0_error_points']:+.1f} points",
                flush=True,
            )
    report["summary"] = summary_of(report["runs"])
    for way, figures in report["summary"].items():
        print(f"{way}: " + ", ".join(f"{k} {v:+.3f}" for k, v in figures.items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
