"""Token-bucket arithmetic, the single definition both stores follow.

The embedded store calls these functions; the Redis store's Lua scripts
(`store/lua/*.lua`) restate them line for line, and the conformance suite runs the
same tests against both. Change one, change the other.

Rules:
- A bucket that has never been touched (or has expired from Redis) is full.
- Tokens refill continuously at ``rate`` per second, capped at ``burst``.
- A cost up to ``burst`` is admitted when the bucket holds at least that much.
- A cost above ``burst`` but within ``max_cost`` is admitted only when the bucket is
  full; the bucket then goes negative and pays the debt back from future refill.
  With the default ``max_cost == burst`` this never happens.
- A cost above ``max_cost`` is never admitted (COST_EXCEEDS_BURST).
- Settlement moves tokens by ``actual - charged``, bounded to one burst either way; a
  refund never lifts the bucket above ``burst``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qosd.model import Reason


@dataclass(slots=True)
class BucketState:
    tokens: float
    updated_us: int


def refilled(state: BucketState | None, now_us: int, rate: float, burst: float) -> BucketState:
    if state is None:
        return BucketState(tokens=burst, updated_us=now_us)
    elapsed_us = now_us - state.updated_us
    if elapsed_us <= 0:
        return BucketState(tokens=state.tokens, updated_us=state.updated_us)
    tokens = min(burst, state.tokens + elapsed_us * rate / 1e6)
    return BucketState(tokens=tokens, updated_us=now_us)


@dataclass(frozen=True, slots=True)
class TakeResult:
    admitted: bool
    reason: Reason
    retry_after_ms: int


def take(state: BucketState, cost: float, rate: float, burst: float, max_cost: float) -> TakeResult:
    """Tries to take ``cost`` from an already refilled bucket, in place."""
    if cost > max_cost:
        return TakeResult(False, Reason.COST_EXCEEDS_BURST, 0)
    needed = min(cost, burst)
    if state.tokens < needed:
        wait_ms = math.ceil((needed - state.tokens) * 1000 / rate) if rate > 0 else 0
        return TakeResult(False, Reason.RATE_LIMITED, max(wait_ms, 1))
    state.tokens -= cost
    return TakeResult(True, Reason.NONE, 0)


def settle(state: BucketState, delta: float, burst: float) -> float:
    """Applies ``actual - charged`` to a refilled bucket; returns the bounded delta."""
    bounded = max(-burst, min(burst, delta))
    state.tokens = min(burst, state.tokens - bounded)
    return bounded


def ms_until_full(state: BucketState, rate: float, burst: float) -> int:
    """How long until the bucket is full again: how long Redis must keep it."""
    if rate <= 0:
        return 86_400_000
    return math.ceil(max(0.0, burst - state.tokens) * 1000 / rate)
