"""Per-class outcomes of a replay run: attainment, latency percentiles, goodput.

Definitions (stated in ``docs/simulator.md`` too, in a table of every field, because
every QoS benchmark's numbers depend on them):

- a request **attains** its objectives as ``qosd_sim.objectives`` declares them (the
  benchmark's own scoring, never qosd's configuration);
- **attainment of offered** (the brief's SLO attainment) is the share of *all* the
  class's offered requests that attained: a request rejected, timed out in the queue,
  failed or unfinished is a miss, so attainment cannot be bought by refusing the
  class's own traffic. **Over admitted** (``slo_attainment``) is shown beside it;
- the **span** runs from the first arrival (the replay's start) to the completion of
  the last admitted request, or to the end of the run when an admitted request never
  completed, and at least to the end of the arrival window: every token a policy
  served was served inside it;
- **trace goodput** (the headline, ``trace_goodput_of_trace_saturated``) is input
  plus output tokens of the trace's requests that attained, per second of the span,
  against the **FCFS-saturated throughput of the trace**: what the engine serves, first
  come first served, with every one of the trace's requests of the window queued at
  once. That is a reference, not a ceiling: another order can beat it by a little.
  The injected long prompts are on their own line (``injected_goodput_tokens_s``):
  twelve 32K prompts swayed the older figure by 0.04 to 0.23;
- **goodput over the span** (``goodput_span_of_saturated``) counts the injected
  prompts too, against the FCFS-saturated throughput of everything the gateway sent;
  ``trace_goodput_span_of_saturated`` is the trace's requests over that same
  denominator (both kept for the earlier rounds' tables);
- **gave up**: a request whose client stopped waiting (``fifo-deadline``: at its TTFT
  objective) was sent but is neither an error nor a refusal;
- **busy fraction**: the share of the span the simulated GPU spent running
  iterations, as the server itself counts it (``qosd_sim_gpu_busy_seconds``);
- **admitted cost**: what qosd charged at admission, (input + output_weight × the
  gateway's output estimate of 256) × the class weight, by admission time, against
  the pool rate R the SLO loop set.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qosd.config import Config
from qosd.control.windows import percentiles
from qosd_sim.gateway import EXPECTED_OUTPUT_TOKENS, GAVE_UP, RequestRecord
from qosd_sim.objectives import Objectives, Scoring


@dataclass(frozen=True, slots=True)
class ClassFacts:
    """What qosd was configured with for a class in the run: reported beside the
    outcomes (a wait past the class's max wait is a defect), never used to score."""

    max_wait_ms: float
    share: float | None = None
    floor_share: float | None = None
    weight: float = 1.0

    @classmethod
    def from_config(cls, config: Config) -> dict[str, ClassFacts]:
        return {
            name: cls(float(c.max_wait_ms), c.share, c.floor_share, c.weight)
            for name, c in config.classes.items()
        }


def met(record: RequestRecord, objectives: Objectives) -> bool:
    """Whether a request attained its class's objectives (``qosd_sim.objectives``)."""
    return objectives.met(record.request.input_tokens, record)


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
    span_s: float,
    *,
    facts: ClassFacts | None = None,
    served_total_tokens: int | None = None,
) -> dict[str, Any]:
    """One class's outcomes; its goodput over ``span_s`` (the policy's span)."""
    admitted = [r for r in records if r.admitted]
    completed = [r for r in admitted if r.completed]
    attained = [r for r in admitted if met(r, objectives)]
    reasons = Counter(r.decision for r in records if not r.admitted)
    ttft = [r.ttft_ms for r in completed if r.ttft_ms is not None]
    tpot = [t for r in completed if (t := r.tpot_ms) is not None]
    worst_wait = max((r.waited_ms for r in records), default=0.0)
    ttft_p, tpot_p = percentiles(ttft), percentiles(tpot)  # nearest rank, as qosd's windows
    served = sum(served_tokens(r) for r in records)
    long_prompts = [r for r in records if r.request.injected]
    max_wait = facts.max_wait_ms if facts is not None else None
    return {
        "offered": len(records),
        "admitted": len(admitted),
        "completed": len(completed),
        "attained": len(attained),
        "rejected": sum(n for reason, n in reasons.items() if reason not in NOT_REFUSALS),
        "timed_out": reasons.get("QUEUE_TIMEOUT", 0),
        # qosd answered but could not decide (its store failed: fail closed).
        "unavailable": sum(reasons.get(reason, 0) for reason in UNAVAILABLE),
        "still_waiting_at_end": reasons.get("UNANSWERED", 0),
        "unfinished": sum(
            1 for r in admitted if not r.completed and not r.error.startswith(GAVE_UP)
        ),
        # The client stopped waiting for its first token (fifo-deadline).
        "gave_up": sum(1 for r in records if r.error.startswith(GAVE_UP)),
        # Acquire or inference failures: neither a decision nor a served request.
        "errors": sum(
            1
            for r in records
            if r.error and "unfinished" not in r.error and not r.error.startswith(GAVE_UP)
        ),
        "retried": sum(1 for r in records if r.retries),
        "reasons": dict(reasons),
        "attainment_of_offered": _round(len(attained) / len(records), 4) if records else None,
        "slo_attainment": _round(len(attained) / len(admitted), 4)
        if admitted and objectives.has_slo
        else None,
        "completion": _round(len(completed) / len(admitted), 4) if admitted else None,
        "ttft_p50_ms": _round(ttft_p.p50 if ttft_p else None),
        "ttft_p99_ms": _round(ttft_p.p99 if ttft_p else None),
        "tpot_p50_ms": _round(tpot_p.p50 if tpot_p else None),
        "tpot_p99_ms": _round(tpot_p.p99 if tpot_p else None),
        "goodput_tokens_s": round(sum(r.request.tokens() for r in attained) / span_s, 1),
        "served_tokens": served,
        "served_token_share": _share(served, served_total_tokens or 0),
        "configured_share": facts.share if facts else None,
        "floor_share": facts.floor_share if facts else None,
        "long_prompts_offered": len(long_prompts),
        "long_prompts_attained": sum(1 for r in long_prompts if met(r, objectives)),
        "worst_wait_ms": round(worst_wait, 1),
        "max_wait_ms": max_wait,
        "waits_past_max": None
        if max_wait is None
        else sum(1 for r in records if r.waited_ms > max_wait + 50),
    }


def span_end(records: Iterable[RequestRecord], window_s: float, run_end_s: float) -> float:
    """Where the span ends: the last admitted request's completion, or ``run_end_s``
    when an admitted request never completed, and at least ``window_s``."""
    end = window_s
    for r in records:
        if not r.admitted:
            continue
        if r.completed and r.e2e_ms is not None:
            end = max(end, r.request.at_s + r.e2e_ms / 1000)
        else:
            end = max(end, run_end_s)
    return end


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
    last = max((t for t, _ in points), default=0.0)
    # A run in virtual time takes its last sample as its last request completes, the
    # same instant up to float error in the records' offsets.
    end = busy_at(points, last if 0 < window_s - last < 1e-6 else window_s)
    start = busy_at(points, 0.0)
    if end is None or start is None or window_s <= 0:
        return None
    return max(0.0, min(1.0, (end - start) / window_s))


def admitted_cost_series(
    records: Iterable[RequestRecord],
    facts: Mapping[str, ClassFacts],
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
    series = {name: [0.0] * bins for name in facts}
    for r in admitted:
        name = r.request.qos_class
        weight = facts[name].weight if name in facts else 1.0
        at = r.request.at_s + r.waited_ms / 1000
        series.setdefault(name, [0.0] * bins)[min(bins - 1, int(at // bin_s))] += (
            admission_cost(r, output_weight, weight) / bin_s
        )
    return series


def timeline(
    records: Sequence[RequestRecord],
    facts: Mapping[str, ClassFacts],
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
    cost = admitted_cost_series(records, facts, output_weight, end_s=end_s)
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


#: A run whose gateway sent 1 % of its requests later than this behind their
#: schedule is marked: the machine, not the policy, shaped its latencies.
LATE_P99_MARK_MS = 50.0


def lateness(late_ms: Sequence[float]) -> dict[str, Any]:
    """How far behind the schedule the gateway sent (from each request's scheduled
    arrival to the moment its task ran), and whether the run is marked late."""
    p = percentiles(list(late_ms))
    p99 = p.p99 if p else 0.0
    return {
        "gateway_late_p50_ms": round(p.p50 if p else 0.0, 1),
        "gateway_late_p99_ms": round(p99, 1),
        "gateway_late_max_ms": round(max(late_ms, default=0.0), 1),
        "late_run": p99 > LATE_P99_MARK_MS,
    }


@dataclass(frozen=True, slots=True)
class RunSamples:
    """What a run measured besides its records: when it ended (seconds from the
    replay's start), the GPU's cumulative busy seconds and qosd's pool rate R, each
    as ``(seconds from the start, value)``."""

    end_s: float
    busy: Sequence[tuple[float, float]] = ()
    rates: Sequence[tuple[float, float]] = ()


def policy_summary(
    records: Sequence[RequestRecord],
    scoring: Scoring,
    samples: RunSamples,
    *,
    window_s: float,
    capacity_tokens_s: float,
    trace_capacity_tokens_s: float | None = None,
    facts: Mapping[str, ClassFacts] | None = None,
    output_weight: float | None = None,
) -> dict[str, Any]:
    """Per class, plus ``all``: the trace's goodput over the span against its
    FCFS-saturated throughput (``trace_capacity_tokens_s``; the headline), goodput
    against the saturated throughput on everything sent (``capacity_tokens_s``), the
    GPU's busy fraction over the span, how late the gateway sent, and, with
    ``output_weight``, the cost qosd admitted over the arrival window against its pool
    rate R."""
    facts = facts or {}
    busy, rates = samples.busy, samples.rates
    span = span_end(records, window_s, samples.end_s)
    attained = [r for r in records if met(r, scoring[r.request.qos_class])]
    served_total = sum(served_tokens(r) for r in records)
    summary: dict[str, Any] = {}
    for name in sorted(scoring):
        summary[name] = class_summary(
            [r for r in records if r.request.qos_class == name],
            scoring[name],
            span,
            facts=facts.get(name),
            served_total_tokens=served_total,
        )
    good_tokens = sum(r.request.tokens() for r in attained)
    trace_tokens = sum(r.request.tokens() for r in attained if not r.request.injected)
    fraction = busy_fraction(busy, span) if busy else None
    injected = [r for r in records if r.request.injected]
    summary["all"] = {
        "offered": len(records),
        "attained": len(attained),
        "attainment_of_offered": _share(len(attained), len(records)),
        "goodput_span_s": round(span, 1),
        "goodput_tokens_s": round(good_tokens / span, 1),
        "goodput_span_of_saturated": round(good_tokens / span / capacity_tokens_s, 4),
        "trace_goodput_tokens_s": round(trace_tokens / span, 1),
        "trace_goodput_of_trace_saturated": None
        if not trace_capacity_tokens_s
        else round(trace_tokens / span / trace_capacity_tokens_s, 4),
        "injected_goodput_tokens_s": round((good_tokens - trace_tokens) / span, 1),
        "injected_goodput_span_of_saturated": round(
            (good_tokens - trace_tokens) / span / capacity_tokens_s, 4
        ),
        "trace_goodput_span_of_saturated": round(trace_tokens / span / capacity_tokens_s, 4),
        "served_tokens": served_total,
        "served_span_of_saturated": round(served_total / span / capacity_tokens_s, 4),
        "busy_fraction": None if fraction is None else round(fraction, 4),
        "capacity_tokens_s": round(capacity_tokens_s, 1),
        "long_prompts_offered": len(injected),
        "long_prompts_admitted": sum(1 for r in injected if r.admitted),
        "long_prompts_completed": sum(1 for r in injected if r.completed),
        "long_prompts_attained": sum(1 for r in injected if met(r, scoring[r.request.qos_class])),
        **lateness([r.late_ms for r in records]),
    }
    if output_weight is not None:
        admitted_cost = sum(
            admission_cost(r, output_weight, facts[r.request.qos_class].weight)
            for r in records
            if r.admitted
            and r.request.qos_class in facts
            and r.request.at_s + r.waited_ms / 1000 < window_s
        )
        in_window = sorted((t, rate) for t, rate in rates if t <= window_s)
        mean_rate = sum(rate for _, rate in in_window) / len(in_window) if in_window else None
        summary["all"]["admitted_cost_s"] = round(admitted_cost / window_s, 1)
        summary["all"]["mean_pool_rate_cost_s"] = _round(mean_rate)
        summary["all"]["admitted_cost_of_pool_rate"] = (
            _share(admitted_cost / window_s, mean_rate) if mean_rate else None
        )
    return summary
