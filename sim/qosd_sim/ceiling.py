"""How much of one class any admission policy could serve on time: two references.

A goal such as "99 % of offered P0 requests within SLO" is only a fair bar where the
GPU can meet it at all. Both references give the class the GPU to itself, with no
other traffic, in virtual time on the same cost model the benchmark's server runs:

- **alone**: every request of the class is served, in arrival order, as a server
  without admission control would. What FIFO would get if the class were the whole
  workload.
- **shed**: an admission controller with perfect knowledge of service times (but
  not of future arrivals) admits a request only if, served from now on with nothing
  else arriving, it and every request already admitted still meet their objectives;
  the rest are refused at arrival, and count as misses, as the brief counts them.
  Shedding a request that would make others late saves them; being greedy, it may
  also refuse one that would have cost less than it saved, so it is not always the
  higher of the two.

The class's **ceiling** is the better of the two.

Neither is a proof of optimality (ordering and shedding to maximise on-time requests
is a scheduling problem with no cheap exact answer), but a policy that also serves
other classes has strictly less GPU for this one, so a goal above both is a goal no
admission policy is expected to reach on that workload and GPU. ``docs/simulator.md``
reports them beside each run.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from qosd_sim.gpu import Engine, GpuModel
from qosd_sim.gpu import Sequence as GpuSequence
from qosd_sim.replay import Request
from qosd_sim.results import Objectives


@dataclass(frozen=True, slots=True)
class Ceiling:
    """One class's references, as the module's docstring defines them."""

    offered: int
    alone_attained: int
    shed_attained: int

    def as_dict(self) -> dict[str, float | int | None]:
        def share(part: int) -> float | None:
            return round(part / self.offered, 4) if self.offered else None

        return {
            "offered": self.offered,
            "alone_attained": self.alone_attained,
            "alone_attainment": share(self.alone_attained),
            "shed_attained": self.shed_attained,
            "shed_attainment": share(self.shed_attained),
            "ceiling": share(max(self.alone_attained, self.shed_attained)),
        }


def on_time(sequence: GpuSequence, objectives: Objectives) -> bool:
    """Whether a finished sequence met its objectives, measured as the gateway measures
    them: TTFT and end to end from arrival, TPOT over the tokens after the first."""
    if sequence.finished_at is None or sequence.first_token_at is None:
        return False
    ttft_ms = (sequence.first_token_at - sequence.submitted_at) * 1000
    e2e_ms = (sequence.finished_at - sequence.submitted_at) * 1000
    tpot_ms = (
        (e2e_ms - ttft_ms) / (sequence.output_tokens - 1) if sequence.output_tokens > 1 else None
    )
    ttft, tpot, e2e = objectives.for_prompt(sequence.input_tokens)
    checks = ((ttft, ttft_ms), (tpot, tpot_ms), (e2e, e2e_ms))
    return all(limit is None or value is None or value <= limit for limit, value in checks)


class _Clock:
    """An engine and the virtual time it has reached; iterations are indivisible."""

    def __init__(self, gpu: GpuModel) -> None:
        self.engine = Engine(gpu)
        self.now = 0.0

    def run_until(self, t_s: float | None) -> None:
        """Runs iterations until the one in progress ends at or after ``t_s`` (None:
        until idle); an idle engine jumps to ``t_s``."""
        while t_s is None or self.now < t_s:
            iteration = self.engine.plan(self.now)
            if iteration is None:
                if t_s is not None:
                    self.now = t_s
                return
            self.now += iteration.duration_s
            self.engine.complete(self.now)


def _sequence(request: Request, at_s: float) -> GpuSequence:
    return GpuSequence(
        f"r{request.index}", request.input_tokens, request.output_tokens, submitted_at=at_s
    )


def class_ceiling(gpu: GpuModel, requests: Sequence[Request], objectives: Objectives) -> Ceiling:
    """Both references for ``requests`` (one class's), judged by ``objectives``."""
    ordered = sorted(requests, key=lambda r: r.at_s)
    alone = _Clock(gpu)
    served: list[GpuSequence] = []
    for request in ordered:
        alone.run_until(request.at_s)
        sequence = _sequence(request, request.at_s)
        alone.engine.submit(sequence)
        served.append(sequence)
    alone.run_until(None)

    shed = _Clock(gpu)
    admitted: list[GpuSequence] = []
    open_: list[GpuSequence] = []  # admitted and not finished: all a trial can change
    for request in ordered:
        shed.run_until(request.at_s)
        open_ = [s for s in open_ if not s.done]
        trial = copy.deepcopy((shed, open_))
        trial_clock, trial_admitted = trial
        candidate = _sequence(request, request.at_s)
        trial_clock.engine.submit(candidate)
        trial_clock.run_until(None)
        if all(on_time(s, objectives) for s in (*trial_admitted, candidate)):
            sequence = _sequence(request, request.at_s)
            shed.engine.submit(sequence)
            admitted.append(sequence)
            open_.append(sequence)
    shed.run_until(None)
    return Ceiling(
        offered=len(ordered),
        alone_attained=sum(1 for s in served if on_time(s, objectives)),
        shed_attained=sum(1 for s in admitted if on_time(s, objectives)),
    )
