"""Achievable references beside the P0 bound: what the engine model itself gets on time
when it serves P0 alone.

The bound (``qosd_sim.bound``) is proven but loose: it forgets decode steps, batch
slots and the iteration floor. These two references are schedules the engine really
runs, so a policy's P0 can be read against something reachable as well as against
something unbeatable. Both run in virtual time on the cell's own engine
(``qosd_sim.gpu.Engine``, the code the simulated servers run), with P0's requests
only: no other class, no gateway, no network. They are therefore neither bounds nor
promises: a policy that shares the GPU with P1 and P2, over real sockets, may fall
short of them, and a better online rule could beat the first.

- ``P0_online``: each request, as it arrives (at the next iteration boundary, as a
  server sees it), is admitted only if a forward run of the engine from its true
  state, with the request added and nothing else arriving, finishes it within its
  objectives; else it is refused at once. Admitted requests are never dropped.
- ``P0_clairvoyant``: the bound's own set (the requests the relaxation's optimum, or
  its solver's best set, puts on time) is submitted as it arrives, the rest refused.

Each is scored as the replays are: a request attains when it completed and its TTFT
(from arrival) and TPOT are within ``qosd_sim.objectives``; the share is of every P0
request offered.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from qosd_sim.gpu import Engine, GpuModel
from qosd_sim.gpu import Sequence as EngineSequence
from qosd_sim.objectives import Objectives
from qosd_sim.replay import Request

#: Decides, at ``now``, whether the engine takes ``candidate`` (not yet submitted).
Admission = Callable[[Engine, EngineSequence, float], bool]


@dataclass(frozen=True, slots=True)
class Served:
    """A sequence's outcome in the terms the objectives judge (``Judged``)."""

    completed: bool
    ttft_ms: float | None
    tpot_ms: float | None

    @classmethod
    def of(cls, sequence: EngineSequence) -> Served:
        first, end = sequence.first_token_at, sequence.finished_at
        ttft = None if first is None else (first - sequence.submitted_at) * 1000
        tpot = None
        if first is not None and end is not None and sequence.output_tokens >= 2:
            tpot = (end - first) * 1000 / (sequence.output_tokens - 1)
        return cls(end is not None, ttft, tpot)


@dataclass(frozen=True, slots=True)
class Reference:
    """How many of ``offered`` requests the reference admitted and got on time."""

    offered: int
    admitted: int
    on_time: int

    @property
    def share(self) -> float | None:
        return self.on_time / self.offered if self.offered else None

    def as_dict(self) -> dict[str, float | int | None]:
        share = self.share
        return {
            "offered": self.offered,
            "admitted": self.admitted,
            "on_time": self.on_time,
            "share": None if share is None else round(share, 4),
        }


def serve_alone(
    gpu: GpuModel, requests: Sequence[Request], admit: Admission
) -> list[EngineSequence | None]:
    """Serves ``requests`` (in arrival order) on one engine in virtual time, each
    submitted only if ``admit`` says so when the engine first sees it; each one's
    sequence, or None where it was refused."""
    engine = Engine(gpu)
    order = sorted(range(len(requests)), key=lambda i: requests[i].at_s)
    served: list[EngineSequence | None] = [None] * len(requests)
    now, next_arrival = 0.0, 0
    while next_arrival < len(order) or engine.pending:
        while next_arrival < len(order) and requests[order[next_arrival]].at_s <= now:
            position = order[next_arrival]
            request = requests[position]
            candidate = EngineSequence(
                f"r{request.index}", request.input_tokens, request.output_tokens,
                submitted_at=request.at_s,
            )  # fmt: skip
            if admit(engine, candidate, now):
                engine.submit(candidate)
                served[position] = candidate
            next_arrival += 1
        iteration = engine.plan(now)
        if iteration is None:
            if next_arrival < len(order):
                now = max(now, requests[order[next_arrival]].at_s)
            continue
        now += iteration.duration_s
        engine.complete(now)
    return served


def forward_run_on_time(objectives: Objectives) -> Admission:
    """Admits a request when a forward run of a copy of the engine, with it added and
    no later arrivals, finishes it within ``objectives``."""

    def admit(engine: Engine, candidate: EngineSequence, now: float) -> bool:
        future = copy.deepcopy(engine)
        trial = copy.copy(candidate)
        future.submit(trial)
        clock = now
        while not trial.done:
            iteration = future.plan(clock)
            if iteration is None:  # cannot happen while the trial is pending
                return False
            clock += iteration.duration_s
            future.complete(clock)
        return objectives.met(trial.input_tokens, Served.of(trial))

    return admit


def chosen_only(indexes: Collection[int]) -> Admission:
    """Admits the requests whose ``Request.index`` is in ``indexes``, and no other."""
    wanted = {f"r{index}" for index in indexes}
    return lambda _engine, candidate, _now: candidate.request_id in wanted


def _scored(
    served: Sequence[EngineSequence | None], requests: Sequence[Request], objectives: Objectives
) -> Reference:
    on_time = sum(
        1
        for request, sequence in zip(requests, served, strict=True)
        if sequence is not None and objectives.met(request.input_tokens, Served.of(sequence))
    )
    admitted = sum(1 for sequence in served if sequence is not None)
    return Reference(len(requests), admitted, on_time)


def p0_online(gpu: GpuModel, requests: Sequence[Request], objectives: Objectives) -> Reference:
    """The online reference for one class's requests (P0's, for the replays)."""
    served = serve_alone(gpu, requests, forward_run_on_time(objectives))
    return _scored(served, requests, objectives)


def p0_clairvoyant(
    gpu: GpuModel, requests: Sequence[Request], objectives: Objectives, chosen: Collection[int]
) -> Reference:
    """The bound's set replayed: ``chosen`` are positions in ``requests`` (the bound's
    ``chosen``, computed over the same list in the same order)."""
    admit = chosen_only({requests[i].index for i in chosen})
    return _scored(serve_alone(gpu, requests, admit), requests, objectives)
