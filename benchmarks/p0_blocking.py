"""Which P0 misses an admission policy could not have avoided once it had admitted
what it did: P0 requests that arrived behind prefill already admitted to a server
that prefills oldest first.

    python -m benchmarks.p0_blocking docs/results/deadline_mooncake_1.5x_chunked.json \
        --markdown docs/results/p0_blocking.md

Reads a ``benchmarks/qos_replay.py`` cell and its per-request records. For each
policy and seed:

- **P0 behind admitted prefill**: P0 requests at whose arrival an earlier-admitted
  request of a lower class was still to be prefilled so long that the P0 request,
  admitted at once and prefilled right after it, would have started past its TTFT
  objective (the earlier request's first token came later than the P0 request's due
  time less its own prefill, ``GpuModel.prefill_work_s``). Both engines serve prompts
  oldest first, so no later decision saves such a request: these misses were decided
  when the earlier prompt was admitted.
- **time behind long prefill**: the share of the span during which a P0 request with a
  short prompt, arriving then, was lost that way: the union over lower-class
  admissions of [admitted, first token - P0's base objective].
- **on-time tokens from long prompts**: of the tokens that count as goodput, the share
  from prompts whose prefill alone takes longer than P0's base objective. Every such
  prompt blocks any P0 arrival in its first stretch. This is the work that a policy
  must give up to keep P0 clear of it.

The first two figures say how much of P0's gap to ``bound.P0`` (which lets P0 preempt)
comes from the order the engine prefills in. The third says what closing it by
admission alone would cost. Definitions of the rest: ``docs/simulator.md``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.qos_replay import SeedRun
from qosd_sim.experiment import PolicyRun
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import SCALED
from qosd_sim.results import met, span_end

TOP = "P0"


@dataclass(frozen=True, slots=True)
class Blocking:
    """One policy's run of one seed."""

    policy: str
    seed: int
    p0_offered: int
    p0_on_time: int
    p0_behind_prefill: int  # arrived behind lower-class prefill it could not pass
    p0_behind_and_missed: int
    time_behind_long_prefill: float  # share of the span
    long_prompt_goodput_share: float  # of on-time tokens


def _admitted_at(record: RequestRecord) -> float:
    return record.request.at_s + record.waited_ms / 1000


def _first_token_at(record: RequestRecord) -> float | None:
    if record.ttft_ms is None:
        return None
    return record.request.at_s + record.ttft_ms / 1000


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def blocking(run: PolicyRun, seed: int, gpu: GpuModel, window_s: float) -> Blocking:
    records = run.records
    objective = SCALED[TOP]
    base_s = (objective.ttft_ms or 0.0) / 1000
    lower = [
        (_admitted_at(r), first)
        for r in records
        if r.admitted and r.request.qos_class != TOP and (first := _first_token_at(r)) is not None
    ]
    behind = behind_missed = on_time = 0
    tops = [r for r in records if r.request.qos_class == TOP]
    for p in tops:
        good = met(p, objective)
        on_time += good
        limit_ms = objective.ttft_for(p.request.input_tokens) or 0.0
        latest_start = p.request.at_s + limit_ms / 1000 - gpu.prefill_work_s(p.request.input_tokens)
        if any(admitted <= p.request.at_s and first > latest_start for admitted, first in lower):
            behind += 1
            behind_missed += not good
    span = span_end(records, window_s, run.duration_s)
    blocked = [(a, f - base_s) for a, f in lower if f - base_s > a]
    good_tokens = long_tokens = 0
    for r in records:
        if r.completed and met(r, SCALED[r.request.qos_class]):
            tokens = r.request.tokens()
            good_tokens += tokens
            if gpu.prefill_work_s(r.request.input_tokens) > base_s:
                long_tokens += tokens
    return Blocking(
        run.policy.value, seed, len(tops), on_time, behind, behind_missed,
        _union_length(blocked) / span, long_tokens / good_tokens if good_tokens else 0.0,
    )  # fmt: skip


def cell(path: Path) -> tuple[dict[str, Any], list[Blocking]]:
    results = json.loads(path.read_text())
    gpu = GpuModel.from_options(results["gpu"])
    records_path = path.with_suffix(".records.json.gz")
    seeds = [SeedRun.from_record(s) for s in json.loads(gzip.decompress(records_path.read_bytes()))]
    out = [
        blocking(run, s.workload.seed, gpu, results["duration_s"]) for s in seeds for run in s.runs
    ]
    return results, out


def _workload(results: dict[str, Any]) -> str:
    name = Path(results["trace"]).stem.split("_")[0]
    return f"{name}, bursty" if results.get("bursty") else name


HEADER = (
    "| workload | load | engine | policy | P0 on time | P0 behind lower-class prefill "
    "(of them missed) | share of the span behind long prefill | on-time tokens from long "
    "prompts |\n|---|---|---|---|---:|---:|---:|---:|"
)


def rows(results: dict[str, Any], runs: list[Blocking]) -> list[str]:
    lines = []
    for policy in dict.fromkeys(b.policy for b in runs):
        mine = [b for b in runs if b.policy == policy]
        offered = sum(b.p0_offered for b in mine)
        on_time = sum(b.p0_on_time for b in mine)
        behind = sum(b.p0_behind_prefill for b in mine)
        missed = sum(b.p0_behind_and_missed for b in mine)
        span_share = sum(b.time_behind_long_prefill for b in mine) / len(mine)
        long_share = sum(b.long_prompt_goodput_share for b in mine) / len(mine)
        lines.append(
            f"| {_workload(results)} | {results['load']:g}x | {results['engine']} | {policy} "
            f"| {on_time}/{offered} ({on_time / offered:.1%}) "
            f"| {behind} ({missed}) = {behind / offered:.1%} of offered "
            f"| {span_share:.1%} | {long_share:.1%} |"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="qos_replay.py JSON files")
    parser.add_argument("--markdown", type=Path, help="write the table here too")
    args = parser.parse_args()
    lines = [HEADER]
    for path in args.results:
        lines += rows(*cell(path))
    table = "\n".join(lines) + "\n"
    print(table, end="")
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
