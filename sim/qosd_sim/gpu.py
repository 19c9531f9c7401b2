"""A cost model of one GPU serving an LLM with continuous batching.

The engine is pure and runs in virtual time: it plans one iteration, the caller lets
the iteration's duration pass (really, with ``asyncio.sleep``, or virtually, in a
calibration loop), and the engine then says which tokens came out. Keeping time out of
the engine is what lets the same code serve the real-time simulated Triton server, the
capacity calibration and fast unit tests.

The model follows what iteration-level schedulers (Orca, vLLM) do, with the seed
article's figures as defaults:

- **prefill** of a prompt of n tokens costs ``prefill_us_per_token × n +
  prefill_us_per_token2 × n²`` (the matrix multiplies, then attention over the prompt),
  plus ``prefill_base_ms`` per iteration: about 30 ms for a typical 1K-token chat
  prompt, and about 2 s for a 32K-token one, as in the seed;
- **decode**: every running sequence emits one token per step, and a step costs
  ``decode_base_ms + decode_ms_per_seq × batch``: about 25 ms at a batch of 128;
- **unchunked** (the default, and the seed's case): an iteration that admits new
  sequences runs only their prefill, so every running sequence waits for it. One 32K
  prompt therefore stalls every other stream for about 2 s;
- **chunked** (``prefill_chunk_tokens`` set, as Sarathi-Serve and vLLM's chunked prefill
  do): each iteration decodes every running sequence and spends what is left of a token
  budget on prefill chunks, so a long prompt slows decoding a little for longer instead
  of stopping it;
- **capacity**: at most ``max_batch`` sequences run at once, and their prompts plus
  outputs must fit in ``kv_capacity_tokens`` of KV cache; the rest wait, first come
  first served, as in a server without QoS.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass(frozen=True, slots=True)
class GpuModel:
    """The cost model's constants; ``docs/simulator.md`` states and justifies them."""

    prefill_base_ms: float = 5.0
    prefill_us_per_token: float = 25.0
    prefill_us_per_token2: float = 0.0011
    decode_base_ms: float = 12.0
    decode_ms_per_seq: float = 0.1
    max_batch: int = 128
    kv_capacity_tokens: int = 400_000
    #: Most prompt tokens one unchunked prefill iteration takes, beyond its first prompt.
    max_prefill_tokens: int = 8192
    #: None: unchunked prefill. Otherwise the token budget of every iteration.
    prefill_chunk_tokens: int | None = None
    #: Multiplies the GPU's speed: 2.0 halves every duration.
    speed: float = 1.0

    def __post_init__(self) -> None:
        positive = {
            "prefill_us_per_token": self.prefill_us_per_token,
            "decode_base_ms": self.decode_base_ms,
            "speed": self.speed,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if min(self.prefill_base_ms, self.decode_ms_per_seq, self.prefill_us_per_token2) < 0:
            raise ValueError(
                "prefill_base_ms, prefill_us_per_token2, decode_ms_per_seq must be >= 0"
            )
        if self.max_batch < 1 or self.kv_capacity_tokens < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_batch, kv_capacity_tokens, max_prefill_tokens must be >= 1")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= self.max_batch:
            raise ValueError("prefill_chunk_tokens must exceed max_batch (decodes share it)")

    def chunk_us(self, start: int, tokens: int) -> float:
        """Prefill work of prompt tokens [start, start + tokens): linear plus attention."""
        end = start + tokens
        return self.prefill_us_per_token * tokens + self.prefill_us_per_token2 * (
            end * end - start * start
        )

    def prefill_s(self, prompts: Iterable[int]) -> float:
        """One unchunked prefill iteration over whole prompts of these lengths."""
        work_us = sum(self.chunk_us(0, n) for n in prompts)
        return (self.prefill_base_ms + work_us / 1000) / 1000 / self.speed

    def decode_s(self, batch: int) -> float:
        return (self.decode_base_ms + self.decode_ms_per_seq * batch) / 1000 / self.speed

    def mixed_s(self, batch: int, chunks: Iterable[tuple[int, int]]) -> float:
        """One chunked iteration: the decode step plus its ``(start, tokens)`` chunks."""
        work_us = sum(self.chunk_us(start, tokens) for start, tokens in chunks)
        return self.decode_s(batch) + work_us / 1_000_000 / self.speed

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> GpuModel:
        known = set(cls.__dataclass_fields__)
        unknown = set(options) - known
        if unknown:
            raise ValueError(f"unknown GPU model options: {sorted(unknown)}")
        return cls(**options)


class TokenKind(Enum):
    FIRST = "first"  # the first output token: prefill is done
    NEXT = "next"  # one more output token


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine. Times are in the caller's clock, in seconds."""

    request_id: str
    input_tokens: int
    output_tokens: int
    submitted_at: float
    context: Any = None
    prefilled: int = 0
    generated: int = 0
    started_at: float | None = None  # its first prefill work began: the end of its queueing
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def kv_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def done(self) -> bool:
        return self.finished_at is not None


@dataclass(frozen=True, slots=True)
class TokenEvent:
    sequence: Sequence
    kind: TokenKind
    finished: bool
    generated: int  # the sequence's tokens so far, this one included


@dataclass(slots=True)
class Iteration:
    """What the engine runs next: its duration, and what it works on."""

    duration_s: float
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens)
    decode: list[Sequence] = field(default_factory=list)


class Engine:
    """Continuous batching on one GPU, in virtual time. Not thread-safe; one owner."""

    def __init__(self, model: GpuModel) -> None:
        self.model = model
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted: holding KV, prefilled or not
        self.kv_used = 0
        self._current: Iteration | None = None

    @property
    def pending(self) -> int:
        """Requests not finished: waiting or running."""
        return len(self.waiting) + len(self.running)

    @property
    def queued(self) -> int:
        """Requests waiting for their first iteration (Triton's pending request count)."""
        return len(self.waiting) + sum(1 for s in self.running if s.started_at is None)

    def submit(self, sequence: Sequence) -> None:
        if sequence.input_tokens < 1 or sequence.output_tokens < 1:
            raise ValueError("a sequence needs at least one input and one output token")
        if sequence.kv_tokens > self.model.kv_capacity_tokens:
            raise ValueError(
                f"{sequence.kv_tokens} tokens exceed the KV cache ({self.model.kv_capacity_tokens})"
            )
        self.waiting.append(sequence)

    def _admit_head(self, now: float) -> Sequence | None:
        if not self.waiting or len(self.running) >= self.model.max_batch:
            return None
        head = self.waiting[0]
        if self.kv_used + head.kv_tokens > self.model.kv_capacity_tokens:
            return None
        self.waiting.popleft()
        self.running.append(head)
        self.kv_used += head.kv_tokens
        return head

    def plan(self, now: float) -> Iteration | None:
        """The next iteration, or None when idle. Call ``complete`` when it has run."""
        if self._current is not None:
            raise RuntimeError("the previous iteration has not completed")
        if self.model.prefill_chunk_tokens is None:
            iteration = self._plan_unchunked(now)
        else:
            iteration = self._plan_chunked(now, self.model.prefill_chunk_tokens)
        self._current = iteration
        return iteration

    def _plan_unchunked(self, now: float) -> Iteration | None:
        # Prefill first, as vLLM's default scheduler does: new prompts join the batch
        # as soon as they fit, and running sequences wait for that iteration.
        prefill: list[tuple[Sequence, int]] = []
        tokens = 0
        while self.waiting and (
            not prefill or tokens + self.waiting[0].input_tokens <= self.model.max_prefill_tokens
        ):
            admitted = self._admit_head(now)
            if admitted is None:
                break
            admitted.started_at = now
            prefill.append((admitted, admitted.input_tokens))
            tokens += admitted.input_tokens
        if prefill:
            duration = self.model.prefill_s(n for _, n in prefill)
            return Iteration(duration, prefill=prefill)
        if self.running:
            return Iteration(self.model.decode_s(len(self.running)), decode=list(self.running))
        return None

    def _plan_chunked(self, now: float, budget: int) -> Iteration | None:
        while self._admit_head(now) is not None:
            pass
        decode = [s for s in self.running if s.prefilled == s.input_tokens]
        left = budget - len(decode)
        prefill: list[tuple[Sequence, int]] = []
        for sequence in self.running:
            if left <= 0:
                break
            remaining = sequence.input_tokens - sequence.prefilled
            if remaining > 0:
                if sequence.started_at is None:
                    sequence.started_at = now
                chunk = min(remaining, left)
                prefill.append((sequence, chunk))
                left -= chunk
        if not decode and not prefill:
            return None
        duration = self.model.mixed_s(len(decode), ((s.prefilled, n) for s, n in prefill))
        return Iteration(duration, prefill=prefill, decode=decode)

    def complete(self, now: float) -> list[TokenEvent]:
        """Ends the planned iteration at ``now``: the tokens it produced, in order."""
        iteration = self._current
        if iteration is None:
            raise RuntimeError("no iteration is running")
        self._current = None
        events: list[TokenEvent] = []
        for sequence in iteration.decode:
            sequence.generated += 1
            events.append(self._emit(sequence, TokenKind.NEXT, now))
        for sequence, chunk in iteration.prefill:
            sequence.prefilled += chunk
            if sequence.prefilled == sequence.input_tokens:
                sequence.generated = 1
                sequence.first_token_at = now
                events.append(self._emit(sequence, TokenKind.FIRST, now))
        return events

    def _emit(self, sequence: Sequence, kind: TokenKind, now: float) -> TokenEvent:
        finished = sequence.generated >= sequence.output_tokens
        if finished:
            sequence.finished_at = now
            self.running.remove(sequence)
            self.kv_used -= sequence.kv_tokens
        return TokenEvent(sequence, kind, finished, sequence.generated)

    def cancel(self, sequence: Sequence) -> None:
        """Drops a sequence the caller gave up on; its KV is freed at once."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        elif sequence in self.running and not sequence.done:
            self.running.remove(sequence)
            self.kv_used -= sequence.kv_tokens
            if self._current is not None:
                self._current.decode = [s for s in self._current.decode if s is not sequence]
                self._current.prefill = [p for p in self._current.prefill if p[0] is not sequence]


def run_virtual(model: GpuModel, arrivals: Iterable[tuple[float, int, int]]) -> list[Sequence]:
    """Serves ``(arrival_s, input_tokens, output_tokens)`` requests in virtual time.

    Used to calibrate capacity and to test the model; returns the finished sequences.
    """
    engine = Engine(model)
    pending = sorted(arrivals)
    sequences: list[Sequence] = []
    now = 0.0
    index = 0
    while index < len(pending) or engine.pending:
        while index < len(pending) and pending[index][0] <= now:
            arrival, input_tokens, output_tokens = pending[index]
            sequence = Sequence(f"r{index}", input_tokens, output_tokens, submitted_at=arrival)
            engine.submit(sequence)
            sequences.append(sequence)
            index += 1
        iteration = engine.plan(now)
        if iteration is None:
            now = pending[index][0]
            continue
        now += iteration.duration_s
        engine.complete(now)
    return sequences


def saturated_throughput(
    model: GpuModel, requests: Iterable[tuple[int, int]], *, cost_output_weight: float = 1.0
) -> float:
    """Tokens per second the GPU serves when every request is queued at once.

    The capacity the benchmarks scale load against: a workload's own mix of prompt and
    output lengths, served with an always-full queue. Tokens count input plus
    ``cost_output_weight`` × output, the same units as qosd's cost.
    """
    batch = [(0.0, i, o) for i, o in requests]
    if not batch:
        raise ValueError("no requests to calibrate with")
    finished = run_virtual(model, batch)
    elapsed = max(s.finished_at or 0.0 for s in finished)
    tokens = sum(s.input_tokens + cost_output_weight * s.output_tokens for s in finished)
    return tokens / elapsed
