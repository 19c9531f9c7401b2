"""The decode step learned from what the servers' passes carried, as their own
metrics count it: the leading signal, where the reports' TPOTs are a lagging one.

vLLM (V1), TensorRT-LLM and LMDeploy count, per engine pass, the tokens it carried
(``vllm:iteration_tokens_total``, a histogram: its count is the passes), the prompt
tokens whose prefill it finished (``vllm:prompt_tokens_total``), the tokens it
generated (``vllm:generation_tokens_total``), and the time between each stream's
tokens (``vllm:inter_token_latency_seconds``: a stream's next token comes one pass
later, so its mean is the mean pass, weighted by the streams each carried). A scraper
reads them every few seconds and reports the differences (``ServerLoad.passes``).
Over one read's interval, with ``N`` passes, ``D`` tokens generated and ``P`` prompt
tokens prefilled:

    mean step ≈ base + per_sequence · D/N + per_prefill_token · P/N

since a pass reads the weights once, then grows with the sequences it decodes and
the prompt tokens it prefills. Reads at different loads are fitted by least squares,
each weighted by its passes; the decode model is the first two terms (``step(B)``,
as ``qosd.control.decode`` learns it from reports, and as the stores apply it). The
prefill term is there so that passes that carried prompts do not inflate the step;
the stores keep their own prefill model (``qosd.control.prefill``), which has the
attention's quadratic term that one token count per pass cannot show.

Unlike the reports, this needs no prefill model to take the prefill out of each
step, no batch history, and no request to finish: a read says what the passes of
the last few seconds carried and took. Too few reads, or reads at one batch size,
learn nothing, and the leader falls back to the reports (``learn_decode``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from qosd.control.decode import DecodeModel
from qosd.control.fit import weighted_least_squares
from qosd.model import PassRead

MIN_READS = 8  # reads needed to learn the step
MIN_BATCH_SPREAD = 2.0  # sequences between the smallest and largest mean batch read
MAX_AGE_MS = 600_000  # reads older than this say little of the servers now
#: The longest a usual prompt's prefill may take, as a share of a read's interval.
MAX_PREFILL_OF_READ = 0.1


@dataclass(frozen=True, slots=True)
class PassFit:
    """``step = base + per_sequence·B + per_prefill_token·P`` ms, for a pass of ``B``
    streams decoding and ``P`` prompt tokens; ``reads`` it was fitted from."""

    base_ms: float
    per_sequence_ms: float
    per_prefill_token_ms: float
    reads: int

    def decode(self, servers: int = 1) -> DecodeModel:
        """The step by the pool's batch: its leases in flight, spread over its
        ``servers``, so each server's pass carries that share of them."""
        return DecodeModel(self.base_ms, self.per_sequence_ms / servers)


def read_interval_ms(reads: Iterable[PassRead]) -> float | None:
    """The median time between a server's consecutive reads; None with no server read
    twice."""
    by_server: dict[str, list[int]] = {}
    for r in reads:
        by_server.setdefault(r.server, []).append(r.at_ms)
    gaps = sorted(b - a for times in by_server.values()
                  for a, b in itertools.pairwise(sorted(times)) if b > a)  # fmt: skip
    return float(gaps[len(gaps) // 2]) if gaps else None


def _fit(reads: list[PassRead]) -> tuple[float, float, float] | None:
    """(base, per_sequence, per_prefill_token) of the reads, or None where they show
    no step that grows with the batch."""
    points = [
        (float(r.passes), (1.0, r.decode_tokens / r.passes, r.prefill_tokens / r.passes),
         r.step_ms)
        for r in reads
    ]  # fmt: skip
    solved = weighted_least_squares(points)
    if solved is not None and 0 <= solved[2] <= solved[1]:
        base, per_sequence, per_prefill = solved
    elif solved is None or solved[2] > solved[1]:
        # A decoding sequence adds a token to the pass as a prompt token does, and
        # reads its KV cache besides: it costs at least as much. Where load moves the
        # two together the fit cannot tell them apart, so they share one cost.
        shared = weighted_least_squares((w, (1.0, x[1] + x[2]), y) for w, x, y in points)
        if shared is None:
            return None
        (base, per_sequence), per_prefill = shared, shared[1]
    else:  # prompts that shorten a pass are noise: the step by batch alone
        by_batch = weighted_least_squares((w, x[:2], y) for w, x, y in points)
        if by_batch is None:
            return None
        (base, per_sequence), per_prefill = by_batch, 0.0
    if per_sequence < 0 or base < 0:
        return None  # a step that shrinks as the batch grows is noise
    return base, per_sequence, per_prefill


def learn_from_passes(
    reads: Iterable[PassRead], now_ms: int, usual_prefill_ms: float = 0.0
) -> PassFit | None:
    """The step fitted from the reads of the last :data:`MAX_AGE_MS` (see the
    module's docstring); None with too little evidence or no slope to learn, or where
    the pool's usual long prompt (``usual_prefill_ms``, its prefill) takes more than
    :data:`MAX_PREFILL_OF_READ` of a read's interval: a prompt's tokens are counted in
    the read where its prefill ends, while its chunks lengthened the passes of the
    reads before, and where prompts prefill for seconds that misplaces most of the
    prefill (on long-context traffic the step came out 2.4 times the truth)."""
    fresh = [
        r for r in reads
        if now_ms - r.at_ms <= MAX_AGE_MS and r.passes > 0 and r.decode_tokens > 0
    ]  # fmt: skip
    if len(fresh) < MIN_READS:
        return None
    interval_ms = read_interval_ms(fresh)
    if interval_ms is None or usual_prefill_ms > MAX_PREFILL_OF_READ * interval_ms:
        return None
    batches = [r.decode_tokens / r.passes for r in fresh]
    if max(batches) - min(batches) < MIN_BATCH_SPREAD:
        return None  # one batch size: no slope to predict another from
    fitted = _fit(fresh)
    return None if fitted is None else PassFit(*fitted, len(fresh))
