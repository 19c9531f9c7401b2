"""A cost model of one GPU serving an LLM with continuous batching.

The engine is pure and runs in virtual time: it plans one iteration, the caller lets
the iteration's duration pass (really, with ``asyncio.sleep``, or virtually, in a
calibration loop), and the engine then says which tokens came out. Keeping time out of
the engine is what lets the same code serve the real-time simulated servers, the
capacity calibration, the P0 bound and fast unit tests.

**One forward pass** (an iteration) over T tokens costs a roofline:
``max(iteration_floor_ms, us_per_token × T)`` (reading the weights bounds a small
batch; the GEMMs bound a large one), plus attention: ``attention_us_per_token2`` per
pair of prompt tokens a prefill chunk attends over, and ``decode_us_per_context_token``
per token of context a decoding sequence reads from its KV cache, plus
``us_per_sequence`` per sequence in the pass. The constants are fitted to a published
table of measurements (``benchmarks/engine_calibration.py``, ``docs/simulator.md``).

**Two engines**, as servers run them:

- **chunked** (``prefill_chunk_tokens`` set, the default: vLLM V1, SGLang,
  Sarathi-Serve): every iteration is one fused pass under a token budget (vLLM's
  ``max_num_batched_tokens``): one token for each decoding sequence, and what is left
  spent on prefill chunks, oldest request first. A long prompt slows many steps a
  little instead of stopping them all;
- **unchunked** (``None``: vLLM V0, the seed's case): an iteration that takes new
  prompts runs only their prefill, so every running sequence waits for it. One 32K
  prompt therefore stalls every other stream for seconds.

Either can also run as vLLM does with ``--scheduling-policy priority``
(``priority_scheduling``: waiting requests by the priority each carries, then
arrival) and, chunked, with ``--long-prefill-token-threshold``
(``long_prefill_token_threshold``: one prompt takes at most that many tokens of an
iteration, so a short prompt behind a long one starts within an iteration or two).

**Capacity**: at most ``max_batch`` sequences run at once, in ``kv_capacity_tokens``
of KV cache, held as passes write it: a request is admitted when its prompt (what its
first pass will compute) fits, and a running request that finds the cache full
preempts one (``reserve_output_kv``, opt-in, reserves the whole output at admission
instead). The rest wait, first come first served (or by priority), as in a server
without QoS.

**As vLLM V1 schedules** (``docs/yardstick.md#the-engine-beside-vllms-scheduler``
cites its code for each): a chunked iteration serves the running sequences first (a
decode token each, then the chunk of a prompt already started), and only then admits
waiting ones, each only if the iteration's budget has a token left for it, so a
request that has not started stays in the (priority-ordered) waiting queue, where a
later request of a better priority overtakes it. A request is admitted when its
prompt fits in the free KV cache, and holds KV as its passes write it; when a running
request's next tokens do not fit, the latest admitted (by priority: the lowest
priority, then the latest arrival) is preempted, its KV freed, to be recomputed, and
no waiting request is admitted in that pass. A running request is never preempted to
admit a waiting one. The engine's earlier behaviours are opt-in and off by default:
``preempt_for_waiting`` (V0's priority preemption, and what open vLLM pull requests
propose), ``admit_beyond_budget`` (every waiting request that fits joins the running
set at once) and ``reserve_output_kv`` (KV for the whole output reserved at
admission).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

#: vLLM V1's token budget per iteration on an A100 (``max_num_batched_tokens``).
VLLM_A100_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class GpuModel:
    """The cost model's constants; ``docs/simulator.md`` states where each comes from.

    The defaults are a 7B-class model with grouped-query attention (Llama-3-8B's
    shape) in FP16 on one A100-80GB, served with vLLM V1's defaults for that GPU."""

    iteration_floor_ms: float = 16.0
    us_per_token: float = 61.2
    attention_us_per_token2: float = 0.0012
    decode_us_per_context_token: float = 0.047
    us_per_sequence: float = 21.0
    max_batch: int = 256
    kv_capacity_tokens: int = 400_000
    #: Unchunked only: most prompt tokens one prefill iteration takes beyond its first.
    max_prefill_tokens: int = 8192
    #: The token budget of every iteration (chunked prefill); None: unchunked.
    prefill_chunk_tokens: int | None = VLLM_A100_BATCHED_TOKENS
    #: Multiplies the GPU's speed: 2.0 halves every duration.
    speed: float = 1.0
    #: Chunked only: most tokens of one prompt an iteration prefills (vLLM's
    #: ``--long-prefill-token-threshold``), so prompts behind a long one share the
    #: budget with it rather than wait for it; None: no cap.
    long_prefill_token_threshold: int | None = None
    #: Waiting requests go by their priority (lower first), then arrival (vLLM's
    #: ``--scheduling-policy priority``); False: by arrival alone.
    priority_scheduling: bool = False
    #: Opt-in, not vLLM V1: with priority scheduling, a waiting request that finds no
    #: batch slot or KV room preempts a running request of lower priority (vLLM V0,
    #: and open pull requests for vLLM issue #40004).
    preempt_for_waiting: bool = False
    #: Opt-in, not vLLM V1: a chunked iteration admits every waiting request that
    #: fits, whether or not its budget has room to start it (the engine before issue
    #: 37); False: admitted only with a token of the budget, as V1 does.
    admit_beyond_budget: bool = False
    #: Opt-in, not vLLM: a request reserves KV for its whole prompt and output at
    #: admission, and is never preempted for KV (the engine before issue 37); False:
    #: admitted when its prompt fits, its KV held as its passes write it, and a running
    #: request preempted when the next pass's tokens do not fit, as vLLM does.
    reserve_output_kv: bool = False

    def __post_init__(self) -> None:
        positive = {
            "iteration_floor_ms": self.iteration_floor_ms,
            "us_per_token": self.us_per_token,
            "speed": self.speed,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        rates = (
            self.attention_us_per_token2,
            self.decode_us_per_context_token,
            self.us_per_sequence,
        )
        if min(rates) < 0:
            raise ValueError(
                "attention_us_per_token2, decode_us_per_context_token, us_per_sequence must be >= 0"
            )
        if self.max_batch < 1 or self.kv_capacity_tokens < 1 or self.max_prefill_tokens < 1:
            raise ValueError("max_batch, kv_capacity_tokens, max_prefill_tokens must be >= 1")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens <= self.max_batch:
            raise ValueError("prefill_chunk_tokens must exceed max_batch (decodes share it)")
        if self.long_prefill_token_threshold is not None and (
            self.prefill_chunk_tokens is None or self.long_prefill_token_threshold < 1
        ):
            raise ValueError("long_prefill_token_threshold needs chunked prefill, and >= 1")

    @property
    def chunked(self) -> bool:
        return self.prefill_chunk_tokens is not None

    @property
    def engine(self) -> str:
        """The engine's name in results: its prefill, and ``-priority`` where waiting
        requests go by priority and (chunked) long prompts share each iteration."""
        name = "chunked" if self.chunked else "unchunked"
        if self.chunked and self.prefill_chunk_tokens != VLLM_A100_BATCHED_TOKENS:
            name += f"-{self.prefill_chunk_tokens}"
        return f"{name}-priority" if self.priority_scheduling else name

    def attention_us(self, start: int, tokens: int) -> float:
        """Prefill attention of prompt tokens [start, start + tokens) over the prompt so far."""
        end = start + tokens
        return self.attention_us_per_token2 * (end * end - start * start)

    def prefill_work_s(self, tokens: int) -> float:
        """The GPU time a whole prompt's prefill needs beyond any iteration's floor, in
        any schedule: its tokens at the compute-bound rate, plus its attention (the
        chunks of a prompt add up to the whole). The P0 bound's processing time."""
        return (self.us_per_token * tokens + self.attention_us(0, tokens)) / 1e6 / self.speed

    def iteration_s(
        self,
        tokens: int,
        chunks: Iterable[tuple[int, int]] = (),
        decode_context_tokens: int = 0,
        sequences: int = 0,
    ) -> float:
        """One forward pass over ``tokens`` tokens: prefill ``chunks`` as ``(start,
        tokens)``, decoding sequences reading ``decode_context_tokens`` of KV cache, and
        ``sequences`` sequences in all."""
        attention = sum(self.attention_us(start, n) for start, n in chunks)
        us = (
            max(self.iteration_floor_ms * 1000, self.us_per_token * tokens)
            + attention
            + self.decode_us_per_context_token * decode_context_tokens
            + self.us_per_sequence * sequences
        )
        return us / 1e6 / self.speed

    def prefill_s(self, prompts: Iterable[int]) -> float:
        """One unchunked prefill iteration over whole prompts of these lengths."""
        lengths = list(prompts)
        return self.iteration_s(sum(lengths), ((0, n) for n in lengths), 0, len(lengths))

    def decode_s(self, batch: int, context_tokens: int = 0) -> float:
        """One decode step of ``batch`` sequences holding ``context_tokens`` in all."""
        return self.iteration_s(batch, (), context_tokens, batch)

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
    priority: int = 0  # lower first, where the model schedules by priority
    #: Output tokens to prefill again with the prompt: those it had when it was last
    #: preempted (vLLM recomputes a preempted request's KV rather than swap it).
    recomputed: int = 0
    #: Tokens of KV cache it holds now: what its passes so far have written (vLLM's
    #: blocks, allocated as tokens come), or its whole prompt and output from
    #: admission with ``reserve_output_kv``.
    kv_held: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def prefill_target(self) -> int:
        """Tokens its prefill covers: the prompt, and any output to recompute."""
        return self.input_tokens + self.recomputed

    @property
    def context_tokens(self) -> int:
        """Tokens a decode step of this sequence attends over: its prompt and output so far."""
        return self.input_tokens + self.generated

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


#: Takes a preempted sequence out of the pass being planned.
Unschedule = Callable[[Sequence], None]


def _drop_from(planned: list[Sequence]) -> Unschedule:
    def drop(victim: Sequence) -> None:
        if victim in planned:
            planned.remove(victim)

    return drop


class _PassPlan:
    """The tokens of each sequence in the pass being planned, against its budget."""

    def __init__(self, engine: Engine, now: float, budget: int) -> None:
        self.engine, self.now = engine, now
        self.left = budget
        self.tokens: dict[Sequence, int] = {}

    def add(self, sequence: Sequence, tokens: int) -> None:
        self.tokens[sequence] = tokens
        self.left -= tokens

    def unschedule(self, victim: Sequence) -> None:
        self.left += self.tokens.pop(victim, 0)

    def chunk(self, sequence: Sequence) -> None:
        """Its next prefill chunk: what is left of its prompt, the budget and the
        long-prefill threshold allow, if its KV fits (else it was preempted)."""
        remaining = sequence.prefill_target - sequence.prefilled
        cap = self.engine.model.long_prefill_token_threshold
        tokens = min(remaining, self.left, cap or remaining)
        if self.engine._room_for(sequence, tokens, self.unschedule):
            if sequence.started_at is None:
                sequence.started_at = self.now
            self.add(sequence, tokens)


class Engine:
    """Continuous batching on one GPU, in virtual time. Not thread-safe; one owner."""

    def __init__(self, model: GpuModel) -> None:
        self.model = model
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted: holding KV, prefilled or not
        self.kv_used = 0
        #: The most KV ever held, how often a request that had a batch slot waited for
        #: KV room, and how often a running request was preempted for it: where KV,
        #: not the batch or the budget, bound the schedule.
        self.kv_peak = 0
        self.kv_refusals = 0
        self.preemptions = 0
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
        if not self.model.priority_scheduling:
            self.waiting.append(sequence)
            return
        # Behind every waiting request of its priority or a better one: arrivals come
        # in time order, so the queue stays ordered by (priority, arrival).
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].priority > sequence.priority:
            index -= 1
        self.waiting.insert(index, sequence)

    def _admit_head(self, now: float) -> Sequence | None:
        if not self.waiting:
            return None
        head = self.waiting[0]
        # A server catching up on a late wake-up plans an iteration that began before
        # now: what arrived after its start is not in it.
        if head.submitted_at > now:
            return None
        # vLLM admits a request whose prompt (and any output to recompute) fits in the
        # free blocks; with reserve_output_kv, its whole output must fit too.
        reserve = self.model.reserve_output_kv
        need = head.kv_tokens if reserve else head.prefill_target
        while (
            len(self.running) >= self.model.max_batch
            or self.kv_used + need > self.model.kv_capacity_tokens
        ):
            victim = self._victim_for(head)
            if victim is None:
                if len(self.running) < self.model.max_batch:
                    self.kv_refusals += 1
                return None
            self._preempt(victim)
        self.waiting.popleft()
        self.running.append(head)
        if reserve:
            self._hold(head, head.kv_tokens)
        return head

    def _hold(self, sequence: Sequence, tokens: int) -> None:
        sequence.kv_held += tokens
        self.kv_used += tokens
        self.kv_peak = max(self.kv_peak, self.kv_used)

    def _hold_decodes(self, decoding: list[Sequence], plan: _PassPlan) -> None:
        """A decode token each for ``decoding``, whose KV is known to fit."""
        if not self.model.reserve_output_kv:
            for sequence in decoding:
                sequence.kv_held += 1
            self.kv_used += len(decoding)
            self.kv_peak = max(self.kv_peak, self.kv_used)
        plan.tokens.update(dict.fromkeys(decoding, 1))
        plan.left -= len(decoding)

    def _free(self, sequence: Sequence) -> None:
        self.kv_used -= sequence.kv_held
        sequence.kv_held = 0

    def _room_for(self, sequence: Sequence, tokens: int, unschedule: Unschedule) -> bool:
        """Holds KV for ``tokens`` more of a running sequence's tokens in the pass being
        planned, preempting as vLLM does when they do not fit: by priority, the
        lowest priority and latest arrival; else the latest admitted; the sequence
        itself, if it is that one (then False). A victim already planned into this
        pass is taken out of it (``unschedule``)."""
        if self.model.reserve_output_kv:
            return True
        while self.kv_used + tokens > self.model.kv_capacity_tokens:
            if self.model.priority_scheduling:
                victim = max(self.running, key=lambda s: (s.priority, s.submitted_at))
            else:
                victim = self.running[-1]
            unschedule(victim)
            self._preempt(victim)
            if victim is sequence:
                return False
        self._hold(sequence, tokens)
        return True

    def _victim_for(self, head: Sequence) -> Sequence | None:
        """With ``preempt_for_waiting`` (and priority scheduling), a running request of
        lower priority than ``head`` makes room for it: the lowest priority, and the
        latest arrival among those (vLLM V0's choice). vLLM V1 never does this."""
        if not (self.model.priority_scheduling and self.model.preempt_for_waiting):
            return None
        lower = [s for s in self.running if s.priority > head.priority]
        return max(lower, key=lambda s: (s.priority, s.submitted_at), default=None)

    def _preempt(self, victim: Sequence) -> None:
        """Back to the waiting queue, its KV freed: it prefills its prompt and the
        output it had again when it runs next. By priority, in (priority, arrival)
        order; first come first served, at the front (vLLM's ``prepend_request``)."""
        self.running.remove(victim)
        self._free(victim)
        victim.recomputed, victim.prefilled = victim.generated, 0
        self.preemptions += 1
        if not self.model.priority_scheduling:
            self.waiting.appendleft(victim)
            return
        index = len(self.waiting)
        rank = (victim.priority, victim.submitted_at)
        while index > 0 and (self.waiting[index - 1].priority,
                             self.waiting[index - 1].submitted_at) > rank:  # fmt: skip
            index -= 1
        self.waiting.insert(index, victim)

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
        # Prefill first, as vLLM's V0 scheduler does: new prompts join the batch as
        # soon as they fit, and running sequences wait for that iteration.
        prefill: list[tuple[Sequence, int]] = []
        tokens = 0
        while self.waiting and (
            not prefill or tokens + self.waiting[0].prefill_target <= self.model.max_prefill_tokens
        ):
            admitted = self._admit_head(now)
            if admitted is None:
                break
            if admitted.started_at is None:
                admitted.started_at = now
            if not self.model.reserve_output_kv:
                self._hold(admitted, admitted.prefill_target)  # V0: the prompt's blocks
            prefill.append((admitted, admitted.prefill_target))
            tokens += admitted.prefill_target
        if prefill:
            return Iteration(self.model.prefill_s(n for _, n in prefill), prefill=prefill)
        decode: list[Sequence] = []
        for sequence in list(self.running):
            if sequence in self.running and self._room_for(sequence, 1, _drop_from(decode)):
                decode.append(sequence)
        if decode:
            context = sum(s.context_tokens for s in decode)
            return Iteration(self.model.decode_s(len(decode), context), decode=decode)
        return None

    def _plan_chunked(self, now: float, budget: int) -> Iteration | None:
        # One fused pass, as vLLM V1 schedules it: a token for every decoding
        # sequence, then the chunks of prompts already running, oldest first, then
        # waiting requests, in the queue's order, while the budget lasts; each chunk
        # at most the long-prefill threshold where there is one. KV is held for the
        # pass's tokens as they are planned; a preemption for it takes the victim out
        # of the pass, and stops admissions for this pass.
        if self.model.admit_beyond_budget:
            while self._admit_head(now) is not None:
                pass
        plan = _PassPlan(self, now, budget)
        preemptions = self.preemptions
        decoding = [s for s in self.running if s.prefilled == s.prefill_target]
        if self.kv_used + len(decoding) <= self.model.kv_capacity_tokens:
            # Room for every decode token: none preempts, so hold them in one step
            # (the same schedule as one at a time, at a fraction of the cost).
            self._hold_decodes(decoding, plan)
        else:
            for sequence in decoding:
                if sequence in self.running and self._room_for(sequence, 1, plan.unschedule):
                    plan.add(sequence, 1)
        for sequence in list(self.running):
            if plan.left <= 0:
                break
            # Membership matters only once a preemption has taken one out.
            gone = self.preemptions != preemptions and sequence not in self.running
            if not gone and sequence.prefilled < sequence.prefill_target:
                plan.chunk(sequence)
        while self.preemptions == preemptions and plan.left > 0:
            admitted = self._admit_head(now)
            if admitted is None:
                break
            plan.chunk(admitted)
        decode = [s for s in plan.tokens if s.prefilled == s.prefill_target]
        prefill = [(s, n) for s, n in plan.tokens.items() if s.prefilled < s.prefill_target]
        left = plan.left
        if not decode and not prefill:
            return None
        duration = self.model.iteration_s(
            budget - left,
            ((s.prefilled, n) for s, n in prefill),
            sum(s.context_tokens for s in decode),
            len(decode) + len(prefill),
        )
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
            if sequence.prefilled != sequence.prefill_target:
                continue
            if sequence.first_token_at is None:
                sequence.generated = 1
                sequence.first_token_at = now
                events.append(self._emit(sequence, TokenKind.FIRST, now))
            else:  # resumed after a preemption: recomputed, and the next token
                sequence.generated += 1
                events.append(self._emit(sequence, TokenKind.NEXT, now))
        return events

    def _emit(self, sequence: Sequence, kind: TokenKind, now: float) -> TokenEvent:
        finished = sequence.generated >= sequence.output_tokens
        if finished:
            sequence.finished_at = now
            self.running.remove(sequence)
            self._free(sequence)
        return TokenEvent(sequence, kind, finished, sequence.generated)

    def cancel(self, sequence: Sequence) -> None:
        """Drops a sequence the caller gave up on; its KV is freed at once."""
        if sequence in self.waiting:
            self.waiting.remove(sequence)
        elif sequence in self.running and not sequence.done:
            self.running.remove(sequence)
            self._free(sequence)
            if self._current is not None:
                self._current.decode = [s for s in self._current.decode if s is not sequence]
                self._current.prefill = [p for p in self._current.prefill if p[0] is not sequence]


def run_virtual(
    model: GpuModel, arrivals: Iterable[tuple[float, int, int]], engine: Engine | None = None
) -> list[Sequence]:
    """Serves ``(arrival_s, input_tokens, output_tokens)`` requests in virtual time, on
    ``engine`` if given (to read its counters after), else a fresh one of ``model``.

    Used to calibrate capacity and to test the model; returns the finished sequences.
    """
    engine = engine or Engine(model)
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
