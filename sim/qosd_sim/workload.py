"""The workload one seed of a benchmark cell replays, built from a trace.

A seed decides three things, so that seeds are independent draws of the same cell:
where in the trace the replay starts (``replay.seeded_start``), which class each
request gets (the class hash's seed), and, for bursty workloads, the bursts. The
trace is then compressed or stretched in time to the cell's load on the simulated
GPU, and the seed's 32K-token prompts are injected on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from qosd_sim.experiment import calibrated_workload
from qosd_sim.gpu import GpuModel
from qosd_sim.replay import (
    SEED_LONG_PROMPT_TOKENS,
    BurstProcess,
    BurstTargets,
    ClassRule,
    Request,
    TraceRow,
    bursty_workload,
    seeded_start,
    trace_from,
)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A cell's workload, before a seed picks its draw."""

    load: float
    duration_s: float = 120.0
    mix: str = "P0=0.2,P1=0.5,P2=0.3"
    long_prompt_tokens: int | None = None
    inject_every_s: float | None = 10.0
    inject_tokens: int = SEED_LONG_PROMPT_TOKENS
    inject_output_tokens: int = 128
    inject_class: str = "P1"
    bursts: BurstTargets | None = None


@dataclass(frozen=True, slots=True)
class SeededWorkload:
    """What one seed replays, and how it was drawn."""

    seed: int
    trace_start_s: float
    time_compression: float  # trace time / replay time
    trace_capacity_tokens_s: float  # saturated, on the trace's requests: load's unit
    requests: list[Request]
    burst_process: BurstProcess | None


@cache
def fitted_bursts(requests: int, window_s: float, targets: BurstTargets) -> BurstProcess:
    """``BurstProcess.fit``, remembered: a cell's seeds often ask it the same."""
    return BurstProcess.fit(requests, window_s, targets)


def seeded_workload(
    rows: Sequence[TraceRow], gpu: GpuModel, spec: WorkloadSpec, seed: int
) -> SeededWorkload:
    """The trace from the seed's start, at the load, classes by the seed's hash, the
    injected prompts, and the seed's bursts."""
    start = seeded_start(rows, seed)
    rule = ClassRule.parse(spec.mix, long_prompt_tokens=spec.long_prompt_tokens, seed=seed)
    requests, trace_capacity, speedup = calibrated_workload(
        trace_from(rows, start),
        gpu,
        rule,
        load=spec.load,
        duration_s=spec.duration_s,
        inject_every_s=spec.inject_every_s,
        inject_tokens=spec.inject_tokens,
        inject_output_tokens=spec.inject_output_tokens,
        inject_class=spec.inject_class,
    )
    process = None
    if spec.bursts is not None:
        trace = sum(1 for r in requests if not r.injected)
        process = fitted_bursts(trace, spec.duration_s, spec.bursts)
        requests = bursty_workload(requests, spec.duration_s, process, seed)
    return SeededWorkload(seed, start, speedup, trace_capacity, requests, process)
