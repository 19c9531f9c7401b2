"""A proven upper bound on how many of a class's requests any policy serves on time.

A goal such as "99 % of offered P0 requests on time" is only a fair bar where the GPU
can meet it. This module computes, for one class's requests on the simulated engine
(``qosd_sim.gpu``), a number that no admission policy, server scheduling or ordering
can beat, and proves it (``docs/simulator.md#the-p0-bound`` has the proof in full):

- **the relaxation.** Request j arrives at r_j, and its TTFT objective gives it a
  deadline d_j = r_j + TTFT_j. Its prefill needs p_j = ``GpuModel.prefill_work_s``
  of GPU time: its prompt's tokens at the compute-bound rate plus its attention,
  which is what the cost model charges for those tokens in any iteration, chunked or
  not. Every iteration lasts at least the prefill work it carries, and a request's
  prefill runs only in iterations that start after it arrived and end by its first
  token. So the requests on time in any run form a set S that a single machine can
  process preemptively, each j for p_j within [r_j, d_j]: ``1|r_j,pmtn|ΣU_j``, whose
  optimum is an upper bound on |S|. Everything else (the other classes' work, decode
  steps, TPOT, batch slots and KV cache, the gateway's round trips) only removes
  schedules, so it is left out;
- **the optimum**, as a mixed-integer programme: x_j ∈ {0, 1} says j is on time, and
  its work p_j x_j is spread over the elementary intervals between consecutive release
  times and deadlines inside its window, no interval holding more work than its
  length. A preemptive single-machine schedule exists exactly when such an assignment
  does (process each interval's share in any order). HiGHS (through SciPy) solves its
  linear relaxation, an upper bound already, then the programme itself; when that
  stops at its time limit the bound is the better of the relaxation and the solver's
  dual bound, both upper bounds, and ``exact`` is False.

Requests whose windows do not overlap are independent: the programme runs per
cluster of overlapping windows, and a cluster that preemptive earliest-deadline-first
serves entirely on time needs none.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import Objectives


@dataclass(frozen=True, slots=True)
class Job:
    """One request as the relaxation sees it: seconds."""

    release_s: float
    work_s: float
    deadline_s: float

    @property
    def reachable(self) -> bool:
        return self.release_s + self.work_s <= self.deadline_s


@dataclass(frozen=True, slots=True)
class Bound:
    """At most ``on_time`` of ``offered`` requests can be on time, in any run."""

    offered: int
    on_time: int
    exact: bool  # every cluster's programme was solved to optimality
    unreachable: int  # requests whose prefill alone outlasts their objective
    clusters: int
    solved_clusters: int  # clusters that needed the programme
    #: Positions (in the order given) of a set of ``chosen_count`` requests that a
    #: preemptive single machine does finish on time: the programme's optimal set, the
    #: solver's best set where it ran out of time (then fewer than ``on_time``). What
    #: ``qosd_sim.references`` replays on the engine as the clairvoyant reference.
    chosen: tuple[int, ...] = ()

    @property
    def share(self) -> float | None:
        return self.on_time / self.offered if self.offered else None

    def as_dict(self) -> dict[str, float | int | bool | None]:
        share = self.share
        return {
            "offered": self.offered,
            "on_time": self.on_time,
            "share": None if share is None else round(share, 4),
            "exact": self.exact,
            "unreachable": self.unreachable,
            "clusters": self.clusters,
            "clusters_solved": self.solved_clusters,
        }


def jobs_for(
    gpu: GpuModel, requests: Iterable[tuple[float, int]], objectives: Objectives
) -> list[Job]:
    """The relaxation's jobs for requests given as ``(arrival_s, input_tokens)``."""
    jobs = []
    for at_s, tokens in requests:
        ttft_ms = objectives.ttft_for(tokens)
        deadline = math.inf if ttft_ms is None else at_s + ttft_ms / 1000
        jobs.append(Job(at_s, gpu.prefill_work_s(tokens), deadline))
    return jobs


def on_time_bound(
    gpu: GpuModel,
    requests: Iterable[tuple[float, int]],
    objectives: Objectives,
    *,
    time_limit_s: float = 10.0,
) -> Bound:
    """The bound for requests ``(arrival_s, input_tokens)`` judged by ``objectives``."""
    return solve(jobs_for(gpu, requests, objectives), time_limit_s=time_limit_s)


def solve(jobs: Sequence[Job], *, time_limit_s: float = 10.0) -> Bound:
    """The most of ``jobs`` a preemptive single machine finishes by their deadlines
    (or an upper bound on it, when the solver runs out of time), and a set that does."""
    position = {id(job): i for i, job in enumerate(jobs)}
    reachable = sorted((j for j in jobs if j.reachable), key=lambda j: j.release_s)
    on_time, exact, clusters, solved = 0, True, 0, 0
    chosen: list[int] = []
    for cluster in _clusters(reachable):
        clusters += 1
        if _edf_all_on_time(cluster):
            on_time += len(cluster)
            chosen += (position[id(job)] for job in cluster)
            continue
        solved += 1
        most, optimal, picked = _most_on_time(cluster, time_limit_s)
        on_time += most
        chosen += (position[id(job)] for job in picked)
        exact = exact and optimal
    unreachable = len(jobs) - len(reachable)
    return Bound(len(jobs), on_time, exact, unreachable, clusters, solved, tuple(sorted(chosen)))


def _clusters(jobs: Sequence[Job]) -> Iterable[list[Job]]:
    """Runs of jobs (sorted by release) whose windows overlap, directly or in a chain."""
    current: list[Job] = []
    end = -math.inf  # the latest deadline in the current run
    for job in jobs:
        if current and job.release_s >= end:
            yield current
            current, end = [], -math.inf
        current.append(job)
        end = max(end, job.deadline_s)
    if current:
        yield current


def _edf_all_on_time(jobs: Sequence[Job], slack_s: float = 1e-12) -> bool:
    """Whether preemptive earliest-deadline-first finishes every job by its deadline
    (it does whenever any preemptive schedule can: Jackson's rule), within
    ``slack_s``."""
    ordered = sorted(jobs, key=lambda j: j.release_s)
    ready: list[tuple[float, float]] = []  # (deadline, work left)
    now, index = 0.0, 0
    while index < len(ordered) or ready:
        if not ready:
            now = max(now, ordered[index].release_s)
        while index < len(ordered) and ordered[index].release_s <= now:
            heapq.heappush(ready, (ordered[index].deadline_s, ordered[index].work_s))
            index += 1
        deadline, left = heapq.heappop(ready)
        horizon = ordered[index].release_s if index < len(ordered) else math.inf
        run = min(left, horizon - now)
        now += run
        if run < left:
            heapq.heappush(ready, (deadline, left - run))
        elif now > deadline + slack_s:
            return False
    return True


def _most_on_time(jobs: Sequence[Job], time_limit_s: float) -> tuple[int, bool, list[Job]]:
    """The programme of the module's docstring for one cluster: (at most this many on
    time, solved to optimality, a set that is on time: the optimum, or the solver's
    best feasible set, or the greedy one where it found none)."""
    points = sorted({j.release_s for j in jobs} | {j.deadline_s for j in jobs})
    lengths_ms = np.diff(np.array(points)) * 1000
    index = {t: i for i, t in enumerate(points)}
    n = len(jobs)
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    # Rows 0..n-1: sum_k y_jk - p_j x_j = 0. Rows n..: sum_j y_jk <= length_k.
    column = n
    for j, job in enumerate(jobs):
        rows.append(j)
        cols.append(j)
        values.append(-job.work_s * 1000)
        for k in range(index[job.release_s], index[job.deadline_s]):
            rows += [j, n + k]
            cols += [column, column]
            values += [1.0, 1.0]
            column += 1
    matrix = coo_array((values, (rows, cols)), shape=(n + len(lengths_ms), column)).tocsr()
    lower = np.concatenate([np.zeros(n), np.full(len(lengths_ms), -np.inf)])
    # A hair of slack: a set that fits exactly must never be cut off by rounding.
    upper = np.concatenate([np.zeros(n), lengths_ms + 1e-6])
    cost = np.concatenate([-np.ones(n), np.zeros(column - n)])
    constraints = LinearConstraint(matrix, lower, upper)
    bounds = Bounds(np.zeros(column), np.concatenate([np.ones(n), np.full(column - n, np.inf)]))
    # The linear relaxation first: fast, and already an upper bound (often within a
    # request or two of the optimum); then the integer programme, for as long as allowed.
    relaxed = milp(cost, integrality=np.zeros(column, dtype=np.int64), bounds=bounds,
                   constraints=constraints)  # fmt: skip
    best = n if relaxed.fun is None else min(n, math.floor(-relaxed.fun + 1e-6))
    integral = np.concatenate([np.ones(n, dtype=np.int64), np.zeros(column - n, dtype=np.int64)])
    result = milp(cost, integrality=integral, bounds=bounds, constraints=constraints,
                  options={"time_limit": time_limit_s, "disp": False})  # fmt: skip
    picked = _greedy_on_time(jobs)
    if result.x is not None:
        solved_set = [job for job, x in zip(jobs, result.x[:n], strict=True) if x > 0.5]
        # The programme's slack is 1e-9 s: its set is checked within a microsecond.
        if len(solved_set) >= len(picked) and _edf_all_on_time(solved_set, 1e-6):
            picked = solved_set
    if result.status == 0 and result.fun is not None:
        return round(-result.fun), True, picked
    dual = getattr(result, "mip_dual_bound", None)
    if dual is not None and math.isfinite(dual):
        best = min(best, math.floor(-dual + 1e-6))
    return best, False, picked


def _greedy_on_time(jobs: Sequence[Job]) -> list[Job]:
    """A set that preemptive EDF finishes on time, built by deadline: each job joins
    if the set stays on time. Feasible, seldom optimal: the fallback set."""
    picked: list[Job] = []
    for job in sorted(jobs, key=lambda j: j.deadline_s):
        if _edf_all_on_time([*picked, job]):
            picked.append(job)
    return picked
