"""The decode step by batch size, learned from reports: what admission predicts every
running stream's time per output token from.

A stream's TPOT is the servers' decode step, stretched by the prefill that shares
their passes: about ``step(B) / (1 - ρ)`` for a batch of ``B`` sequences and a share
``ρ`` of the servers' time spent prefilling, on a chunked server (a pass that carries
prefill chunks is longer by them) as on an unchunked one (a prefill pass stops every
stream). So the stores admit a prompt of a class below the top one while the share of
prefill the prompts admitted keep the servers at leaves every stream in flight within
its TPOT objective (``formulas.lua``: ``prefill_share_for``; ``budget.lua``), and no
new stream while the step itself would pass it. The step is the leading signal: it
is known at admission, from the leases in flight, seconds before any TPOT a report
carries; TPOT is what the SLO loop checks.

The step is learned here, every turn, by the leader:

- the leader reads the pool's leases in flight every turn (:class:`BatchHistory`),
  so it knows the mean batch over each reported request's decode, from its first
  token to its report;
- each report's TPOT less the stretch of the prefill that shared its decode, by the
  prefill model (:func:`decode_points`), is its step; what that leaves out only
  lengthens a pass, so the fastest steps in each band of batch sizes (their lower
  quartile) approximate the step at that batch;
- those points are fitted as ``step(B) = base + per_sequence·B`` ms (a pass reads the
  weights once, then grows with the sequences it carries and the KV cache they read,
  which grows with them).

Too little evidence (fewer than :data:`MIN_SAMPLES` decodes the history covers, or
one band only) learns nothing, and the stores keep the configured share
(``pools.<pool>.max_prefill_share``), as before there was a model.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from qosd.model import Outcome, StoredSample

MIN_SAMPLES = 20  # decodes needed to learn the step
QUANTILE = 0.25  # of a band's steps: what prefill the reports do not show only adds
MAX_STRETCH = 0.8  # a decode prefill took more of says little of the step
MIN_BAND_SAMPLES = 3  # a band's quantile needs a few samples
BAND_SEQUENCES = 8  # batch sizes are banded by this many sequences
HISTORY_S = 600  # how far back the leader remembers the batch (a long decode's life)


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """One decode step of a batch of ``B`` sequences: ``base + per_sequence·B`` ms. Only
    learned here: the stores apply it (lua/formulas.lua, the one statement of the rule)."""

    base_ms: float
    per_sequence_ms: float

    def step_ms(self, batch: float) -> float:
        return self.base_ms + self.per_sequence_ms * batch


class BatchHistory:
    """The pool's requests in flight, as the leader read them turn by turn (Redis
    time, ms): the batch a reported request decoded in is their mean over its decode."""

    def __init__(self, horizon_ms: int = HISTORY_S * 1000) -> None:
        self._horizon_ms = horizon_ms
        self._at: deque[int] = deque()
        self._batch: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._at)

    def record(self, at_ms: int, in_flight: int) -> None:
        if self._at and at_ms <= self._at[-1]:
            return  # a clock read twice, or stepped back: keep the order
        self._at.append(at_ms)
        self._batch.append(in_flight)
        while self._at and self._at[0] < at_ms - self._horizon_ms:
            self._at.popleft()
            self._batch.popleft()

    def mean_over(self, start_ms: float, end_ms: float) -> float | None:
        """The mean batch read within [start, end]; the read just before ``start``
        stands for a span shorter than one turn; None where the history does not
        reach back to ``start``."""
        if not self._at or start_ms < self._at[0] or end_ms < start_ms:
            return None
        times = list(self._at)
        first = max(0, bisect.bisect_right(times, start_ms) - 1)
        last = bisect.bisect_right(times, end_ms)
        reads = list(self._batch)[first : max(last, first + 1)]
        return sum(reads) / len(reads)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def decode_points(
    samples: Iterable[StoredSample],
    history: BatchHistory,
    prefill_ms: Callable[[int], float] | None = None,
    *,
    chunked: bool = False,
    servers: int = 1,
) -> list[tuple[float, float]]:
    """(mean batch over its decode, its step) of each reported request that decoded
    (two output tokens or more, not an error) within the history. The step is its
    TPOT less the stretch of the prefill that shared its decode: ``TPOT × (1 - ρ)``,
    where ``ρ`` is the share of its decode the prompts of the requests that started
    meanwhile (their reports say when) added, by the prefill model (all of each
    prefill, or, ``chunked``, the prefill less the step its pass decodes, as the
    stores count it: formulas.lua, ``prefill_stretch_us``). Without a prefill model,
    the TPOT itself. A decode that prefill took most of (ρ above
    :data:`MAX_STRETCH`) says little of the step, and is left out. The pool's
    prompts are spread over its ``servers`` (``PoolConfig.servers``), so each
    decode shared its server with that share of them: counted whole on two
    servers, ρ was twice what slowed the stream, the step learned fast, and the
    stores admitted streams past P0's TPOT objective (ADR 15)."""
    kept = [s for s in samples if s.e2e_ms is not None]
    starts = sorted((s.at_ms - (s.e2e_ms or 0.0), s.input_tokens) for s in kept)
    times = [at for at, _ in starts]
    points = []
    for s in kept:
        if s.status == Outcome.ERROR or s.tpot_ms is None or s.output_tokens < 2:
            continue
        first_token_ms = s.at_ms - (s.e2e_ms or 0.0) + (s.ttft_ms or 0.0)
        batch = history.mean_over(first_token_ms, s.at_ms)
        if batch is None or batch < 1:
            continue
        share = 0.0
        span = s.at_ms - first_token_ms
        if prefill_ms is not None and span > 0:
            begin = bisect.bisect_left(times, first_token_ms)
            end = bisect.bisect_left(times, s.at_ms)
            added = (prefill_ms(n) for _, n in starts[begin:end])
            if chunked:
                added = (max(0.0, ms - s.tpot_ms) for ms in added)
            share = sum(added) / (span * servers)
        if share <= MAX_STRETCH:
            points.append((batch, s.tpot_ms * (1 - share)))
    return points


def learn_decode(points: Iterable[tuple[float, float]]) -> DecodeModel | None:
    """The decode model of (batch, step) points (see the module's docstring): each
    band's :data:`QUANTILE`, fitted by least squares; None with too little evidence."""
    bands: dict[int, list[tuple[float, float]]] = {}
    for batch, tpot in points:
        bands.setdefault(int(batch // BAND_SEQUENCES), []).append((batch, tpot))
    if sum(len(band) for band in bands.values()) < MIN_SAMPLES:
        return None
    fastest = [
        (sum(b for b, _ in band) / len(band), _quantile([t for _, t in band], QUANTILE))
        for band in bands.values()
        if len(band) >= MIN_BAND_SAMPLES
    ]
    if len(fastest) < 2:
        return None  # one batch size: no slope to predict another from
    n = len(fastest)
    mean_b = sum(b for b, _ in fastest) / n
    mean_t = sum(t for _, t in fastest) / n
    spread = sum((b - mean_b) ** 2 for b, _ in fastest)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in fastest) / spread if spread else 0.0
    if slope < 0:
        # A step that shrinks as the batch grows is noise (prefill in the small
        # batches' passes): the fastest band's time for every batch, as a floor.
        return DecodeModel(min(t for _, t in fastest), 0.0)
    return DecodeModel(max(0.0, mean_t - slope * mean_b), slope)
