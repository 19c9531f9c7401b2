"""The interface every bucket store implements: embedded (in-process) or Redis.

A store owns all shared state: buckets, leases, request-id memory and latency
windows. It performs each operation atomically; the admission layer above it owns
validation, waiting and fail-mode decisions, so both stores stay small and
interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from qosd.config import ClassPolicy
from qosd.model import BucketDecision, LeaseSpec, Sample, Settlement, StoredSample, UsageReport


class BucketStore(Protocol):
    async def start(self) -> None:
        """Connects and loads what the store needs; raises StoreUnavailable."""

    async def close(self) -> None: ...

    async def acquire(self, policy: ClassPolicy, cost: float, lease: LeaseSpec) -> BucketDecision:
        """Takes ``cost`` from the (pool, class) bucket and creates the lease, atomically.

        One round trip to the shared store. Replays the first admission when
        ``lease.request_id`` was already admitted and its lease still lives.
        """
        ...

    async def release(self, policy: ClassPolicy, lease_id: str, usage: UsageReport) -> Settlement:
        """Settles a lease; raises LeaseNotFound or LeaseExpired."""
        ...

    async def report(self, samples: Sequence[Sample], window_size: int) -> None:
        """Appends samples to their (pool, class) windows, keeping the newest ones."""
        ...

    async def window(self, pool: str, qos_class: str) -> list[StoredSample]:
        """The stored samples of one window, newest first."""
        ...

    async def active_leases(self, pool: str) -> int:
        """Leases neither released nor expired; also forgets expired ones."""
        ...

    async def bucket_tokens(self, policy: ClassPolicy) -> float:
        """Tokens in a bucket now, after refill; read-only."""
        ...

    async def ping(self) -> None:
        """Raises StoreUnavailable unless the store answers."""
        ...
