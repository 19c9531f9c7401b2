"""Per-class outcomes of a replay run: SLO attainment, latency percentiles, goodput.

Definitions (stated in ``docs/simulator.md`` too, in a table of every field, because
every QoS benchmark's numbers depend on them):

- a request **attains its SLO** when it completed and its gateway-measured TTFT (from
  arrival, admission wait included) and TPOT are within every objective its class
  sets for it, as ``qosd.slo.request_objectives`` states them (the one definition qosd
  judges by: the TTFT objective grows with the prompt beyond ``ttft_free_tokens``); a
  class without objectives (P2) attains it by completing (being served);
- **attainment of offered** (the brief's SLO attainment) is the share of *all* the
  class's offered requests that attained it: a request rejected, timed out in the
  queue, failed or unfinished is a miss, so attainment cannot be bought by refusing
  the class's own traffic;
- **SLO attainment over admitted** (``slo_attainment``) is the share of *admitted*
  requests that attained it, with the refusals counted apart (rejected, timed out):
  what admission control does for the requests it lets through;
- **goodput of saturated** is input plus output tokens of the trace's requests that
  attained their SLO (whenever they completed, drain included), per second of the
  arrival window, over the GPU's saturated capacity on the replayed mix. The older
  ``goodput_tokens_s`` divides by the time from the first arrival until the last of
  them completed instead (at least the arrival window). The injected long prompts
  are left out of both (they are counted on their own): 32K prompt tokens are cheap
  per token to prefill, and would otherwise swamp the figure that says how much
  useful work got through;
- **busy fraction**: the share of the arrival window the simulated GPU spent running
  iterations, as the server itself counts it (``qosd_sim_gpu_busy_seconds``);
- **admitted cost**: what qosd charged at admission, (input + output_weight × the
  gateway's output estimate of 256) × the class weight, by admission time, against
  the pool rate R the SLO loop set.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qosd.config import Config, SloConfig
from qosd.slo import percentiles, request_objectives
from qosd_sim.gateway import EXPECTED_OUTPUT_TOKENS, RequestRecord


@dataclass(frozen=True, slots=True)
class Objectives:
    """A class's objectives, as the benchmark judges its requests by them.

    ``ttft_ms``, ``tpot_ms`` and ``e2e_ms`` are the base objectives (a prompt's TTFT
    objective grows beyond them when ``slo`` scales it with the prompt)."""

    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    max_wait_ms: float
    # The class's share of the pool, the floor the SLO loop never cuts it below (a
    # fraction of the configured capacity) and its cost weight.
    share: float | None = None
    floor_share: float | None = None
    weight: float = 1.0
    # The class's SLO config: each request's objectives come from it, by its prompt
    # (``qosd.slo.request_objectives``). None: the fixed objectives above.
    slo: SloConfig | None = None

    @classmethod
    def from_config(cls, config: Config) -> dict[str, Objectives]:
        return {
            name: cls(
                c.slo.ttft_ms,
                c.slo.tpot_ms,
                c.slo.e2e_ms,
                float(c.max_wait_ms),
                c.share,
                c.floor_share,
                c.weight,
                c.slo,
            )
            for name, c in config.classes.items()
        }

    @property
    def has_slo(self) -> bool:
        return any(x is not None for x in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def for_prompt(self, input_tokens: int) -> tuple[float | None, float | None, float | None]:
        """(TTFT, TPOT, e2e) objectives, ms, of a request with this prompt."""
        if self.slo is None:
            return self.ttft_ms, self.tpot_ms, self.e2e_ms
        found = request_objectives(self.slo, input_tokens)
        return found.ttft_ms, found.tpot_ms, found.e2e_ms

    def met(self, record: RequestRecord) -> bool:
        if not record.completed:
            return False
        ttft, tpot, e2e = self.for_prompt(record.request.input_tokens)
        checks = ((ttft, record.ttft_ms), (tpot, record.tpot_ms), (e2e, record.e2e_ms))
        return all(limit is None or value is None or value <= limit for limit, value in checks)


#: Reasons that are no refusal by the policy: its store failed (qosd fails closed),
#: it was stopping, the run ended while the request waited, or Acquire itself failed.
UNAVAILABLE = ("BACKEND_UNAVAILABLE", "SHUTTING_DOWN")
NOT_REFUSALS = ("QUEUE_TIMEOUT", "UNANSWERED", "ERROR", *UNAVAILABLE)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _share(part: float, whole: float, digits: int = 4) -> float | None:
    return round(part / whole, digits) if whole > 0 else None


def served_tokens(record: RequestRecord) -> int:
    """Input plus output tokens of a completed request; 0 otherwise."""
    return record.request.tokens() if record.completed else 0


def admission_cost(record: RequestRecord, output_weight: float, weight: float = 1.0) -> float:
    """What qosd charged the request at admission (its estimate, not the release)."""
    request = record.request
    return (request.input_tokens + output_weight * EXPECTED_OUTPUT_TOKENS) * weight


def class_summary(
    records: Sequence[RequestRecord],
    objectives: Objectives,
    window_s: float,
    *,
    arrival_window_s: float | None = None,
    served_total_tokens: int | None = None,
) -> dict[str, Any]:
    """One class's outcomes; goodput over ``window_s`` (the policy's goodput span),
    and over ``arrival_window_s`` (default: ``window_s``)."""
    arrival_window = arrival_window_s or window_s
    admitted = [r for r in records if r.admitted]
    completed = [r for r in admitted if r.completed]
    met = [r for r in admitted if objectives.met(r)]
    reasons = Counter(r.decision for r in records if not r.admitted)
    ttft = [r.ttft_ms for r in completed if r.ttft_ms is not None]
    tpot = [t for r in completed if (t := r.tpot_ms) is not None]
    worst_wait = max((r.waited_ms for r in records), default=0.0)
    ttft_p, tpot_p = percentiles(ttft), percentiles(tpot)  # nearest rank, as qosd's windows
    served = sum(served_tokens(r) for r in records)
    long_prompts = [r for r in records if r.request.injected]
    met_trace_tokens = sum(r.request.tokens() for r in met if not r.request.injected)
    return {
        "offered": len(records),
        "admitted": len(admitted),
        "completed": len(completed),
        "attained": len(met),
        "rejected": sum(n for reason, n in reasons.items() if reason not in NOT_REFUSALS),
        "timed_out": reasons.get("QUEUE_TIMEOUT", 0),
        # qosd answered but could not decide (its store failed: fail closed).
        "unavailable": sum(reasons.get(reason, 0) for reason in UNAVAILABLE),
        "still_waiting_at_end": reasons.get("UNANSWERED", 0),
        "unfinished": sum(1 for r in admitted if not r.completed),
        # Acquire or inference failures: neither a decision nor a served request.
        "errors": sum(1 for r in records if r.error and "unfinished" not in r.error),
        "reasons": dict(reasons),
        "attainment_of_offered": _round(len(met) / len(records), 4) if records else None,
        "slo_attainment": _round(len(met) / len(admitted), 4)
        if admitted and objectives.has_slo
        else None,
        "completion": _round(len(completed) / len(admitted), 4) if admitted else None,
        "ttft_p50_ms": _round(ttft_p.p50 if ttft_p else None),
        "ttft_p99_ms": _round(ttft_p.p99 if ttft_p else None),
        "tpot_p50_ms": _round(tpot_p.p50 if tpot_p else None),
        "tpot_p99_ms": _round(tpot_p.p99 if tpot_p else None),
        "goodput_tokens_s": round(met_trace_tokens / window_s, 1),
        "goodput_window_tokens_s": round(met_trace_tokens / arrival_window, 1),
        "served_tokens": served,
        "served_token_share": _share(served, served_total_tokens or 0),
        "configured_share": objectives.share,
        "floor_share": objectives.floor_share,
        "long_prompts_offered": len(long_prompts),
        "long_prompts_attained": sum(1 for r in long_prompts if objectives.met(r)),
        "worst_wait_ms": round(worst_wait, 1),
        "max_wait_ms": objectives.max_wait_ms,
        "waits_past_max": sum(1 for r in records if r.waited_ms > objectives.max_wait_ms + 50),
    }


def busy_at(samples: Sequence[tuple[float, float]], t_s: float) -> float | None:
    """Cumulative busy seconds at ``t_s``, interpolated between the samples around
    it; None when ``t_s`` lies outside them."""
    ordered = sorted(samples)
    for (t0, b0), (t1, b1) in itertools.pairwise(ordered):
        if t0 <= t_s <= t1:
            return b0 if t1 == t0 else b0 + (b1 - b0) * (t_s - t0) / (t1 - t0)
    return None


def busy_fraction(samples: Sequence[tuple[float, float]], window_s: float) -> float | None:
    """The share of [0, ``window_s``) the GPU was busy, from cumulative samples (the
    GPU is fresh at 0, so a missing first sample reads 0 busy seconds)."""
    points = list(samples)
    if points and min(t for t, _ in points) > 0:
        points.append((0.0, 0.0))
    end = busy_at(points, window_s)
    start = busy_at(points, 0.0)
    if end is None or start is None or window_s <= 0:
        return None
    return max(0.0, min(1.0, (end - start) / window_s))


def admitted_cost_series(
    records: Iterable[RequestRecord],
    objectives: dict[str, Objectives],
    output_weight: float,
    *,
    bin_s: float = 1.0,
    end_s: float | None = None,
) -> dict[str, list[float]]:
    """Admitted cost per second, by class, in bins of ``bin_s`` by admission time
    (arrival plus the wait in qosd's queue)."""
    admitted = [r for r in records if r.admitted]
    last = max((r.request.at_s + r.waited_ms / 1000 for r in admitted), default=0.0)
    bins = int(max(last, (end_s or 0.0) - 1e-9) // bin_s) + 1
    series = {name: [0.0] * bins for name in objectives}
    for r in admitted:
        name = r.request.qos_class
        weight = objectives[name].weight if name in objectives else 1.0
        at = r.request.at_s + r.waited_ms / 1000
        series.setdefault(name, [0.0] * bins)[min(bins - 1, int(at // bin_s))] += (
            admission_cost(r, output_weight, weight) / bin_s
        )
    return series


def timeline(
    records: Sequence[RequestRecord],
    objectives: dict[str, Objectives],
    *,
    output_weight: float,
    rates: Sequence[tuple[float, float]],
    busy: Sequence[tuple[float, float]],
    end_s: float,
) -> dict[str, Any]:
    """Per second from the start of the replay: admitted cost by class (qosd's cost
    units per second, by admission time), the pool rate R qosd reported during that
    second (its latest sample; None for FIFO or before the first sample), and the
    GPU's busy fraction in that second."""
    cost = admitted_cost_series(records, objectives, output_weight, end_s=end_s)
    seconds = len(next(iter(cost.values()))) if cost else math.ceil(end_s)
    ordered_rates = sorted(rates)
    pool_rate: list[float | None] = []
    for second in range(seconds):
        seen = [rate for t, rate in ordered_rates if t < second + 1]
        pool_rate.append(round(seen[-1], 1) if seen else None)
    busy_per_s: list[float | None] = []
    for second in range(seconds):
        a, b = busy_at(busy, float(second)), busy_at(busy, float(second + 1))
        if second == 0 and a is None and busy:
            a = 0.0
        busy_per_s.append(None if a is None or b is None else round(max(0.0, b - a), 3))
    return {
        "bin_s": 1.0,
        "t_s": list(range(seconds)),
        "admitted_cost_s": {k: [round(v, 1) for v in values] for k, values in cost.items()},
        "pool_rate_cost_s": pool_rate,
        "busy_fraction": busy_per_s,
    }


def policy_summary(
    records: Sequence[RequestRecord],
    objectives: dict[str, Objectives],
    *,
    window_s: float,
    capacity_tokens_s: float,
    busy: Sequence[tuple[float, float]] = (),
    rates: Sequence[tuple[float, float]] = (),
    output_weight: float | None = None,
) -> dict[str, Any]:
    """Per class, plus ``all``: goodput against the GPU's saturated capacity, the
    GPU's busy fraction (from ``busy`` samples) and, with ``output_weight``, the cost
    qosd admitted over the arrival window against its pool rate (``rates``)."""
    trace = [r for r in records if not r.request.injected]
    good = [r for r in trace if objectives[r.request.qos_class].met(r)]
    span = max([window_s] + [r.request.at_s + (r.e2e_ms or 0.0) / 1000 for r in good])
    served_total = sum(served_tokens(r) for r in records)
    summary: dict[str, Any] = {}
    for name in sorted(objectives, key=lambda n: n):
        mine = [r for r in records if r.request.qos_class == name]
        summary[name] = class_summary(
            mine,
            objectives[name],
            span,
            arrival_window_s=window_s,
            served_total_tokens=served_total,
        )
    good_tokens = sum(r.request.tokens() for r in good)
    goodput = good_tokens / span
    offered = sum(r.request.tokens() for r in trace) / window_s
    attained = sum(1 for r in records if objectives[r.request.qos_class].met(r))
    fraction = busy_fraction(busy, window_s) if busy else None
    summary["all"] = {
        "offered": len(records),
        "attained": attained,
        "attainment_of_offered": _share(attained, len(records)),
        "goodput_window_tokens_s": round(good_tokens / window_s, 1),
        "goodput_of_saturated": round(good_tokens / window_s / capacity_tokens_s, 4),
        "busy_fraction": None if fraction is None else round(fraction, 4),
        "goodput_span_s": round(span, 1),
        "offered_tokens_s": round(offered, 1),
        "goodput_tokens_s": round(goodput, 1),
        "long_prompts_completed": sum(1 for r in records if r.request.injected and r.completed),
        "goodput_of_capacity": round(goodput / capacity_tokens_s, 4),
        "capacity_tokens_s": round(capacity_tokens_s, 1),
        "served_tokens": served_total,
        "long_prompts_admitted": sum(1 for r in records if r.request.injected and r.admitted),
        "long_prompts_attained": sum(
            1 for r in records if r.request.injected and objectives[r.request.qos_class].met(r)
        ),
        "long_prompts_offered": sum(1 for r in records if r.request.injected),
        # The injected long prompts are not the trace's, so goodput leaves them out; this
        # is the share of the GPU they got on time, to show where the GPU's time went.
        "long_prompt_goodput_of_saturated": round(
            sum(
                r.request.tokens()
                for r in records
                if r.request.injected and objectives[r.request.qos_class].met(r)
            )
            / window_s
            / capacity_tokens_s,
            4,
        ),
    }
    if output_weight is not None:
        admitted_cost = sum(
            admission_cost(r, output_weight, objectives[r.request.qos_class].weight)
            for r in records
            if r.admitted and r.request.at_s + r.waited_ms / 1000 < window_s
        )
        in_window = sorted((t, rate) for t, rate in rates if t <= window_s)
        mean_rate = sum(rate for _, rate in in_window) / len(in_window) if in_window else None
        summary["all"]["admitted_cost_s"] = round(admitted_cost / window_s, 1)
        summary["all"]["mean_pool_rate_cost_s"] = _round(mean_rate)
        summary["all"]["admitted_cost_of_pool_rate"] = (
            _share(admitted_cost / window_s, mean_rate) if mean_rate else None
        )
    return summary
