"""Per-class outcomes of a replay run: SLO attainment, latency percentiles, goodput.

Definitions (stated in ``docs/simulator.md`` too, because every QoS benchmark's numbers
depend on them):

- a request **meets its SLO** when it completed and its gateway-measured TTFT (from
  arrival, admission wait included) and TPOT are within every objective its class
  sets; a class without objectives (P2) meets it by completing;
- **SLO attainment** is the share of *admitted* requests that met their SLO. Requests
  qosd turned away are counted separately (rejected, timed out) rather than as misses,
  because a fast, clear rejection is the outcome admission control is for; a request
  admitted but unfinished at the end of the run is a miss;
- **goodput** is input plus output tokens per second of the trace's requests that met
  their SLO, over the time from the first arrival until the last of them completed
  (at least the arrival window): work a policy defers past the last arrival counts,
  and so does the time it took. The injected long
  prompts are left out of it (they are counted on their own): 32K prompt tokens are
  cheap per token to prefill, and would otherwise swamp the figure that says how much
  useful work got through.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qosd.config import Config
from qosd.sim.gateway import RequestRecord
from qosd.slo import percentiles


@dataclass(frozen=True, slots=True)
class Objectives:
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    max_wait_ms: float

    @classmethod
    def from_config(cls, config: Config) -> dict[str, Objectives]:
        return {
            name: cls(c.slo.ttft_ms, c.slo.tpot_ms, c.slo.e2e_ms, float(c.max_wait_ms))
            for name, c in config.classes.items()
        }

    def met(self, record: RequestRecord) -> bool:
        if not record.completed:
            return False
        checks = (
            (self.ttft_ms, record.ttft_ms),
            (self.tpot_ms, record.tpot_ms),
            (self.e2e_ms, record.e2e_ms),
        )
        return all(limit is None or value is None or value <= limit for limit, value in checks)


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def class_summary(
    records: Sequence[RequestRecord], objectives: Objectives, window_s: float
) -> dict[str, Any]:
    """One class's outcomes; goodput over ``window_s`` (the policy's goodput span)."""
    admitted = [r for r in records if r.admitted]
    completed = [r for r in admitted if r.completed]
    met = [r for r in admitted if objectives.met(r)]
    reasons = Counter(r.decision for r in records if not r.admitted)
    ttft = [r.ttft_ms for r in completed if r.ttft_ms is not None]
    tpot = [t for r in completed if (t := r.tpot_ms) is not None]
    has_slo = any(
        x is not None for x in (objectives.ttft_ms, objectives.tpot_ms, objectives.e2e_ms)
    )
    worst_wait = max((r.waited_ms for r in records), default=0.0)
    ttft_p, tpot_p = percentiles(ttft), percentiles(tpot)  # nearest rank, as qosd's windows
    return {
        "offered": len(records),
        "admitted": len(admitted),
        "completed": len(completed),
        "rejected": sum(
            n
            for reason, n in reasons.items()
            if reason not in ("QUEUE_TIMEOUT", "UNANSWERED", "ERROR")
        ),
        "timed_out": reasons.get("QUEUE_TIMEOUT", 0),
        "still_waiting_at_end": reasons.get("UNANSWERED", 0),
        "unfinished": sum(1 for r in admitted if not r.completed),
        # Acquire or inference failures: neither a decision nor a served request.
        "errors": sum(1 for r in records if r.error and "unfinished" not in r.error),
        "reasons": dict(reasons),
        "slo_attainment": _round(len(met) / len(admitted), 4) if admitted and has_slo else None,
        "completion": _round(len(completed) / len(admitted), 4) if admitted else None,
        "ttft_p50_ms": _round(ttft_p.p50 if ttft_p else None),
        "ttft_p99_ms": _round(ttft_p.p99 if ttft_p else None),
        "tpot_p50_ms": _round(tpot_p.p50 if tpot_p else None),
        "tpot_p99_ms": _round(tpot_p.p99 if tpot_p else None),
        "goodput_tokens_s": round(
            sum(r.request.tokens() for r in met if not r.request.injected) / window_s, 1
        ),
        "worst_wait_ms": round(worst_wait, 1),
        "max_wait_ms": objectives.max_wait_ms,
        "waits_past_max": sum(1 for r in records if r.waited_ms > objectives.max_wait_ms + 50),
    }


def policy_summary(
    records: Sequence[RequestRecord],
    objectives: dict[str, Objectives],
    *,
    window_s: float,
    capacity_tokens_s: float,
) -> dict[str, Any]:
    """Per class, plus ``all``: goodput against the GPU's capacity."""
    trace = [r for r in records if not r.request.injected]
    good = [r for r in trace if objectives[r.request.qos_class].met(r)]
    span = max([window_s] + [r.request.at_s + (r.e2e_ms or 0.0) / 1000 for r in good])
    summary: dict[str, Any] = {}
    for name in sorted(objectives, key=lambda n: n):
        mine = [r for r in records if r.request.qos_class == name]
        summary[name] = class_summary(mine, objectives[name], span)
    goodput = sum(r.request.tokens() for r in good) / span
    offered = sum(r.request.tokens() for r in trace) / window_s
    summary["all"] = {
        "goodput_span_s": round(span, 1),
        "offered_tokens_s": round(offered, 1),
        "goodput_tokens_s": round(goodput, 1),
        "long_prompts_completed": sum(1 for r in records if r.request.injected and r.completed),
        "goodput_of_capacity": round(goodput / capacity_tokens_s, 4),
        "capacity_tokens_s": round(capacity_tokens_s, 1),
        "long_prompts_admitted": sum(1 for r in records if r.request.injected and r.admitted),
        "long_prompts_offered": sum(1 for r in records if r.request.injected),
    }
    return summary
