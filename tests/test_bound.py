"""The P0 bound (sim/qosd_sim/bound.py): exact where it says so, and never below what
a real schedule of the engine model gets on time."""

from __future__ import annotations

import itertools
import random

import pytest

from qosd_sim.bound import Job, jobs_for, on_time_bound, solve
from qosd_sim.gpu import GpuModel, run_virtual
from qosd_sim.objectives import FIXED_P0, SCALED, Objectives

pytestmark = pytest.mark.fast


def _feasible(jobs: tuple[Job, ...], slack_s: float = 1e-12) -> bool:
    """Whether one preemptive machine can finish every job in its window: Horn's
    interval condition, checked directly on every (release, deadline) pair."""
    for job_a, job_b in itertools.product(jobs, repeat=2):
        start, end = job_a.release_s, job_b.deadline_s
        if end <= start:
            continue
        inside = sum(j.work_s for j in jobs if j.release_s >= start and j.deadline_s <= end)
        if inside > end - start + slack_s:
            return False
    return all(j.reachable for j in jobs)


def _most_on_time(jobs: list[Job]) -> int:
    for size in range(len(jobs), 0, -1):
        if any(_feasible(subset) for subset in itertools.combinations(jobs, size)):
            return size
    return 0


def test_the_bound_is_the_optimum_of_the_relaxation() -> None:
    rng = random.Random(5)
    for _ in range(120):
        jobs = []
        for _ in range(rng.randint(1, 7)):
            release = rng.uniform(0.0, 2.0)
            jobs.append(Job(release, rng.uniform(0.05, 0.8), release + rng.uniform(0.1, 1.5)))
        bound = solve(jobs)
        assert bound.exact
        assert bound.on_time == _most_on_time(jobs)
        assert bound.offered == len(jobs)
        # The set it names is that large, and one machine does finish it on time.
        assert len(bound.chosen) == bound.on_time
        assert _feasible(tuple(jobs[i] for i in bound.chosen), slack_s=1e-6)


def test_clusters_apart_and_unreachable_requests() -> None:
    # Two overloaded bursts far apart, and one job longer than its own window.
    burst = [Job(0.0 + 0.01 * i, 0.2, 0.5 + 0.01 * i) for i in range(5)]
    later = [Job(10.0 + 0.01 * i, 0.2, 10.5 + 0.01 * i) for i in range(5)]
    hopeless = Job(20.0, 1.0, 20.5)
    bound = solve([*burst, *later, hopeless])
    assert (bound.on_time, bound.unreachable, bound.clusters) == (4, 1, 2)
    assert bound.share == pytest.approx(4 / 11)
    # A light load: earliest-deadline-first serves it all, and the solver never runs.
    light = solve([Job(i * 1.0, 0.1, i * 1.0 + 0.5) for i in range(20)])
    assert (light.on_time, light.solved_clusters) == (20, 0)
    assert solve([]).share is None


def test_a_solver_stopped_early_still_gives_an_upper_bound() -> None:
    rng = random.Random(8)
    jobs = []
    at = 0.0
    for _ in range(60):
        at += rng.expovariate(20.0)
        jobs.append(Job(at, rng.uniform(0.02, 0.15), at + 0.5))
    exact = solve(jobs)
    early = solve(jobs, time_limit_s=0.0)
    assert exact.exact and not early.exact
    assert early.on_time >= exact.on_time
    # Its set is still one that is on time, only perhaps not the largest.
    assert 0 < len(early.chosen) <= exact.on_time == len(exact.chosen)
    assert _feasible(tuple(jobs[i] for i in early.chosen), slack_s=1e-6)


def _on_time_in_a_run(gpu: GpuModel, requests: list[tuple[float, int, int]], o: Objectives) -> int:
    finished = run_virtual(gpu, requests)
    count = 0
    for s in finished:
        assert s.first_token_at is not None
        ttft = o.ttft_for(s.input_tokens)
        assert ttft is not None
        count += (s.first_token_at - s.submitted_at) * 1000 <= ttft
    return count


@pytest.mark.parametrize("chunk", [2048, None])
def test_no_schedule_of_the_engine_beats_the_bound(chunk: int | None) -> None:
    """Any subset of the requests, served first come first served by the engine, gets
    at most the bound's count on time (a policy that refuses some is such a subset)."""
    gpu = GpuModel(prefill_chunk_tokens=chunk)
    rng = random.Random(3)
    for trial in range(12):
        requests = []
        at = 0.0
        for _ in range(40):
            at += rng.expovariate(12.0)
            prompt = int(2 ** rng.uniform(7, 14.5))
            requests.append((at, prompt, rng.randint(2, 60)))
        objectives = (SCALED, FIXED_P0)[trial % 2]["P0"]
        bound = on_time_bound(gpu, [(a, n) for a, n, _ in requests], objectives)
        for keep in (1.0, 0.7, 0.4):
            subset = [r for r in requests if rng.random() < keep]
            assert _on_time_in_a_run(gpu, subset, objectives) <= bound.on_time


def test_jobs_carry_the_prompts_prefill_work_and_objective() -> None:
    gpu = GpuModel()
    [short, long] = jobs_for(gpu, [(1.0, 1_000), (2.0, 40_000)], SCALED["P0"])
    assert short.work_s == pytest.approx(gpu.prefill_work_s(1_000))
    assert short.deadline_s == pytest.approx(1.5)
    assert long.deadline_s == pytest.approx(2.0 + (500 + 200 * (40_000 - 4_096) / 1000) / 1000)
    [fixed] = jobs_for(gpu, [(2.0, 40_000)], FIXED_P0["P0"])
    assert fixed.deadline_s == pytest.approx(2.5) and not fixed.reachable
