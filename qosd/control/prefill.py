"""Long prompts that cannot stall P0: the stall a prefill causes, learned from reports,
against the stall the pool's most urgent class can absorb.

On a server that does not chunk prefill, a prompt is prefilled in one iteration and
every other request waits for it: a 32K-token prompt stalls everyone for about 2 s,
so P0 requests arriving meanwhile miss their TTFT, and those decoding their TPOT.
Every turn, the SLO loop's leader learns from the pool's latency windows:

- **The stall of a prompt of n tokens.** A request's TTFT is at least its own
  prefill; queueing and other prefills only add to it. So the fastest TTFTs per token
  in each band of prompt lengths (their 5th percentile) approximate prefill time.
  Prefill is a fixed cost, linear work per token and attention quadratic in the
  prompt, so those points are fitted as ``stall(n) = c + a·n + b·n²`` ms.
- **The tolerance.** How much later the top class's requests could each have been
  served and still have met their objectives: TTFT slack (objective less TTFT) and,
  over the decode, TPOT slack ((objective less TPOT) × (output tokens − 1)), the
  smaller of the two per sample. The tenth percentile over its recent samples is the
  stall the class can take (TOLERANCE_QUANTILE).

The store derives the threshold from these (``prefill.lua``): the prompt length whose
predicted stall equals the tolerance, but never below the 99th percentile of recent
prompt lengths: the rule is for prompts
unusual in their pool, and must not hold back the pool's ordinary traffic while the
top class runs at its limit (no slack). The top class's own prompts are never held:
that would only trade one of its requests for others. The stores (``budget.held_for_gap``) hold a
longer prompt while the top class has requests in flight or waiting, so it waits for
a gap in that traffic (bursty traffic has them), within its max wait, and is refused
with REASON_LONG_PREFILL otherwise.
On a server that chunks prefill (``pools.<pool>.chunked_prefill``; vLLM V1, SGLang)
running streams keep decoding through a long prompt, but prefill chunks go oldest
request first within each pass's token budget: a prompt that arrives behind a
32K-token one starts after it, about 2 s later. So the rule holds there too, against
TTFT slack alone (a chunked prefill does not stall decodes).

The same prefill model bounds a GPU-gated pool's prefill backlog (``budget.has_room``):
the stores keep, by the model, when the prompts admitted so far will have been
prefilled, and admit while that is within ``max_prefill_backlog_ms``. The deadline rules
(``deadline.lua``) read the same model: a request's own prefill, the backlog ahead of
it, and so the wait its TTFT objective leaves it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qosd.config import SloConfig
from qosd.control.fit import weighted_least_squares
from qosd.control.windows import sample_objectives
from qosd.model import Outcome, PrefillLearned, StoredSample

MIN_SAMPLES = 20  # evidence needed for either estimate
MIN_PROMPT_TOKENS = 256  # shorter prompts' TTFT is mostly fixed overhead
QUANTILE = 0.05  # the fastest: queueing and others' prefills only add
TOLERANCE_QUANTILE = 0.1  # a stall nine in ten of the top class's requests absorb
USUAL_QUANTILE = 0.95  # prompts up to this quantile of the pool's are never held


@dataclass(frozen=True, slots=True)
class PrefillModel:
    """Prefill time of a prompt of n tokens: ``base + a·n + b·n²`` ms. Only learned
    here: the stores apply it (lua/formulas.lua, the one statement of the rule)."""

    base_ms: float
    per_token_ms: float  # a
    per_token2_ms: float  # b

    def coefficients(self) -> tuple[float, float, float]:
        return self.base_ms, self.per_token_ms, self.per_token2_ms


def prefill_ms(model: tuple[float, float, float], tokens: int) -> float:
    """The prefill time the model ``(c, a, b)`` predicts for a prompt, ms: the Python
    reading of ``formula.prefill_ms`` (lua/formulas.lua), for what the loop learns
    from it (qosd.control.decode)."""
    c, a, b = model
    return c + tokens * (a + b * tokens)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def learn_prefill(samples: Iterable[StoredSample]) -> PrefillModel | None:
    """The prefill model from reported TTFTs (see the module's docstring): each
    band's fastest tenth, fitted by least squares (weighted by 1/TTFT², so that
    short and long prompts count alike); None with too little evidence."""
    bands: dict[int, list[tuple[int, float]]] = {}
    for s in samples:
        if s.ttft_ms is None or s.status == Outcome.ERROR or s.input_tokens < MIN_PROMPT_TOKENS:
            continue
        bands.setdefault(int(math.log2(s.input_tokens)), []).append((s.input_tokens, s.ttft_ms))
    if sum(len(points) for points in bands.values()) < MIN_SAMPLES:
        return None
    # Per band: its mean prompt, and the TTFT at its fastest tenth's time per token.
    points: list[tuple[float, float]] = []
    for band in bands.values():
        if len(band) >= 3:
            mean = sum(n for n, _ in band) / len(band)
            points.append((mean, mean * _quantile([t / n for n, t in band], QUANTILE)))
    if not points:
        return None
    if len(points) < 3:  # too few lengths for a curve: a straight line through them
        n_mean = sum(n for n, _ in points) / len(points)
        t_mean = sum(t for _, t in points) / len(points)
        return PrefillModel(0.0, t_mean / n_mean, 0.0)
    # Weighted least squares of t = c + a n + b n^2, each point weighted by 1 / t^2:
    # relative errors count, not the long prompts' milliseconds alone. In thousands
    # of tokens, so that the normal equations stay well scaled.
    solved = weighted_least_squares(
        (1 / (t * t), (1.0, n / 1000, (n / 1000) ** 2), t) for n, t in points
    )
    if solved is None or solved[1] < 0 or solved[2] < 0:
        # A curve bending down is noise: a straight line from the origin instead.
        ratio = sorted(t / n for n, t in points)[len(points) // 2]
        return PrefillModel(0.0, ratio, 0.0)
    return PrefillModel(max(0.0, solved[0]), solved[1] / 1e3, solved[2] / 1e6)


def stall_tolerance_ms(
    samples: Iterable[StoredSample], slo: SloConfig, *, chunked: bool = False
) -> float | None:
    """The stall the class's recent requests could have absorbed (see the module's
    docstring); None without objectives or with too little evidence. ``chunked``: the
    stall delays first tokens only, so TPOT slack does not count."""
    slack: list[float] = []
    for s in samples:
        if s.status not in (Outcome.OK, Outcome.UNSPECIFIED):
            continue
        objectives = sample_objectives(s, slo)
        parts = []
        if objectives.ttft_ms is not None and s.ttft_ms is not None:
            parts.append(objectives.ttft_ms - s.ttft_ms)
        if (
            not chunked
            and objectives.tpot_ms is not None
            and s.tpot_ms is not None
            and s.output_tokens > 1
        ):
            parts.append((objectives.tpot_ms - s.tpot_ms) * (s.output_tokens - 1))
        if parts:
            slack.append(min(parts))
    if len(slack) < MIN_SAMPLES:
        return None
    return max(0.0, _quantile(slack, TOLERANCE_QUANTILE))


def idle_tolerance_ms(
    samples: Sequence[StoredSample],
    slo: SloConfig,
    model: tuple[float, float, float],
    *,
    chunked: bool = False,
) -> float | None:
    """The stall the class's recent requests could have absorbed had nothing been in
    prefill ahead of them: each one's TTFT objective less its own prefill, by the
    model (and, unchunked, its TPOT slack as reported: a prefill stalls the streams
    decoding too), at :data:`TOLERANCE_QUANTILE`, as :func:`stall_tolerance_ms` takes
    the slack they had. None with too little evidence."""
    slack: list[float] = []
    for s in samples:
        if s.status not in (Outcome.OK, Outcome.UNSPECIFIED):
            continue
        objectives = sample_objectives(s, slo)
        if objectives.ttft_ms is None:
            continue
        part = objectives.ttft_ms - prefill_ms(model, s.input_tokens)
        if not chunked and objectives.tpot_ms is not None and s.tpot_ms is not None:
            part = min(part, (objectives.tpot_ms - s.tpot_ms) * max(0, s.output_tokens - 1))
        slack.append(part)
    if len(slack) < MIN_SAMPLES:
        return None
    return max(0.0, _quantile(slack, TOLERANCE_QUANTILE))


def learn(
    windows: dict[str, list[StoredSample]],
    top: str,
    slo: SloConfig,
    *,
    newest: int = 200,
    chunked: bool = False,
    fallback_model: tuple[float, float, float] | None = None,
) -> PrefillLearned:
    """The prefill model of the pool's windows (newest first; ``fallback_model``, the
    operator's, until they teach one), the stall the top class ``top`` absorbs (from
    the newest ``newest`` of its samples) as it was served and had nothing been in
    prefill ahead of it, and the pool's usual prompt length: what the store derives
    the long-prefill thresholds from (prefill.lua). A part is None with too little
    evidence."""
    everything = [s for window in windows.values() for s in window]
    learned = learn_prefill(everything)
    model = fallback_model if learned is None else learned.coefficients()
    tolerance = stall_tolerance_ms(windows.get(top, [])[:newest], slo, chunked=chunked)
    usual = _quantile([s.input_tokens for s in everything], USUAL_QUANTILE) if everything else 0
    return PrefillLearned(
        model=model,
        tolerance_ms=tolerance,
        usual_tokens=float(usual),
        idle_tolerance_ms=None
        if model is None
        else idle_tolerance_ms(windows.get(top, [])[:newest], slo, model, chunked=chunked),
    )
