"""In-process store: the same semantics as the Redis store, for one daemon alone.

It lets a newcomer run ``qosd serve`` on a bare machine, and it is the reference the
conformance suite holds the Lua scripts to. Every operation runs without an await
in the middle, so on one event loop it is atomic exactly as a Redis script is.
Nothing is shared between processes and nothing survives a restart.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from qosd import bucket
from qosd.config import ClassPolicy
from qosd.model import (
    BucketDecision,
    LeaseExpired,
    LeaseNotFound,
    LeaseSpec,
    Reason,
    Sample,
    Settlement,
    StoredSample,
    UsageReport,
)

_SWEEP_INTERVAL_US = 1_000_000


def monotonic_us() -> int:
    return time.monotonic_ns() // 1000


@dataclass(slots=True)
class _Lease:
    pool: str
    weight: float
    input_tokens: int
    output_tokens: int
    charged: float
    expires_us: int
    released: bool = False
    final: float = 0.0
    adjustment: float = 0.0


class EmbeddedStore:
    def __init__(self, tombstone_ms: int, clock: Callable[[], int] = monotonic_us) -> None:
        self._tombstone_us = tombstone_ms * 1000
        self._clock = clock
        self._buckets: dict[tuple[str, str], bucket.BucketState] = {}
        self._leases: dict[str, _Lease] = {}
        self._requests: dict[tuple[str, str], tuple[str, int]] = {}
        self._windows: dict[tuple[str, str], deque[str]] = {}
        # Every lease has the same TTL, so creation order is expiry order: the sweep
        # only ever looks at the front of these queues.
        self._lease_order: deque[tuple[int, str]] = deque()
        self._request_order: deque[tuple[int, tuple[str, str]]] = deque()
        self._next_sweep_us = 0

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ping(self) -> None:
        return None

    def _bucket(self, policy: ClassPolicy, now_us: int) -> bucket.BucketState:
        key = (policy.pool, policy.name)
        state = bucket.refilled(self._buckets.get(key), now_us, policy.rate, policy.burst)
        self._buckets[key] = state
        return state

    async def acquire(self, policy: ClassPolicy, cost: float, lease: LeaseSpec) -> BucketDecision:
        now_us = self._clock()
        if now_us >= self._next_sweep_us:
            self._sweep(now_us)
        if lease.request_id:
            prior = self._requests.get((policy.pool, lease.request_id))
            if prior is not None and prior[1] > now_us:
                prior_id = prior[0]
                record = self._leases[prior_id]
                state = self._bucket(policy, now_us)
                return BucketDecision(
                    admitted=True,
                    reason=Reason.NONE,
                    lease_id=prior_id,
                    charged=record.charged,
                    remaining=state.tokens,
                    retry_after_ms=0,
                    lease_ttl_ms=(record.expires_us - now_us) // 1000,
                    replayed=True,
                )
        state = self._bucket(policy, now_us)
        result = bucket.take(state, cost, policy.rate, policy.burst, policy.max_cost)
        if not result.admitted:
            return BucketDecision(
                admitted=False,
                reason=result.reason,
                lease_id="",
                charged=cost,
                remaining=state.tokens,
                retry_after_ms=result.retry_after_ms,
                lease_ttl_ms=0,
            )
        expires_us = now_us + lease.ttl_ms * 1000
        self._leases[lease.lease_id] = _Lease(
            pool=policy.pool,
            weight=lease.weight,
            input_tokens=lease.input_tokens,
            output_tokens=lease.output_tokens,
            charged=cost,
            expires_us=expires_us,
        )
        self._lease_order.append((expires_us + self._tombstone_us, lease.lease_id))
        if lease.request_id:
            key = (policy.pool, lease.request_id)
            self._requests[key] = (lease.lease_id, expires_us)
            self._request_order.append((expires_us, key))
        return BucketDecision(
            admitted=True,
            reason=Reason.NONE,
            lease_id=lease.lease_id,
            charged=cost,
            remaining=state.tokens,
            retry_after_ms=0,
            lease_ttl_ms=lease.ttl_ms,
        )

    async def release(self, policy: ClassPolicy, lease_id: str, usage: UsageReport) -> Settlement:
        now_us = self._clock()
        record = self._leases.get(lease_id)
        # Like a Redis lease hash, a lease is remembered until its TTL and the tombstone
        # time have passed, released or not.
        if record is None or record.expires_us + self._tombstone_us <= now_us:
            raise LeaseNotFound(f"lease {lease_id} is unknown (never issued, or forgotten)")
        if record.released:
            state = self._bucket(policy, now_us)
            return Settlement(True, record.final, record.adjustment, state.tokens)
        if now_us >= record.expires_us:
            raise LeaseExpired(lease_id, record.charged)
        input_tokens = record.input_tokens if usage.input_tokens is None else usage.input_tokens
        output_tokens = record.output_tokens if usage.output_tokens is None else usage.output_tokens
        actual = (input_tokens + usage.output_weight * output_tokens) * record.weight
        state = self._bucket(policy, now_us)
        applied = bucket.settle(state, actual - record.charged, policy.burst)
        record.released = True
        record.final = record.charged + applied
        record.adjustment = applied
        return Settlement(False, record.final, applied, state.tokens)

    async def report(self, samples: Sequence[Sample], window_size: int) -> None:
        now_ms = self._clock() // 1000
        for sample in samples:
            key = (sample.pool, sample.qos_class)
            window = self._windows.get(key)
            if window is None or window.maxlen != window_size:
                window = deque(window or (), maxlen=window_size)
                self._windows[key] = window
            window.appendleft(f"{now_ms}|{sample.encode()}")

    async def window(self, pool: str, qos_class: str) -> list[StoredSample]:
        return [StoredSample.decode(raw) for raw in self._windows.get((pool, qos_class), ())]

    async def active_leases(self, pool: str) -> int:
        now_us = self._clock()
        return sum(
            1
            for lease in self._leases.values()
            if lease.pool == pool and not lease.released and lease.expires_us > now_us
        )

    async def bucket_tokens(self, policy: ClassPolicy) -> float:
        state = self._buckets.get((policy.pool, policy.name))
        return bucket.refilled(state, self._clock(), policy.rate, policy.burst).tokens

    def _sweep(self, now_us: int) -> None:
        """Forgets leases and request ids past use, so memory stays bounded."""
        self._next_sweep_us = now_us + _SWEEP_INTERVAL_US
        leases, lease_order = self._leases, self._lease_order
        while lease_order and lease_order[0][0] <= now_us:
            leases.pop(lease_order.popleft()[1], None)
        requests, request_order = self._requests, self._request_order
        while request_order and request_order[0][0] <= now_us:
            _, key = request_order.popleft()
            entry = requests.get(key)
            if entry is not None and entry[1] <= now_us:
                del requests[key]
