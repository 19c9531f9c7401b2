"""The interface every budget store implements: embedded (in-process) or Redis.

A store owns all shared state: budgets, waiting rooms, leases, request-id memory and
latency windows. It performs each operation atomically. The admission layer above
it owns validation, fail modes and the waiting callers themselves (``qosd.waiting``),
so both stores stay interchangeable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from qosd.model import (
    Adjustment,
    BucketDecision,
    ControlRecord,
    LeaseSpec,
    PassRead,
    PoolStatus,
    PrefillLearned,
    PumpResult,
    Sample,
    ServerLoad,
    Settlement,
    StoredSample,
    TenantStatus,
    UsageReport,
    Waiter,
)
from qosd.policy import ClassPolicy, PoolPolicy
from qosd.store.epochs import ResetListener


class BucketStore(Protocol):
    @property
    def daemon_id(self) -> str:
        """The daemon this store works for, named when the store is made: its waiters
        in the shared queues, its pumps (which prove it alive) and its leadership."""
        ...

    async def start(self) -> None:
        """Connects and loads what the store needs; a store that is down is not fatal."""

    async def close(self) -> None: ...

    async def acquire(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease: LeaseSpec,
        wait_ms: int,
        *,
        ttft_ms: float = 0.0,
        wait_cap_ms: int | None = None,
    ) -> BucketDecision:
        """Prices the request (its ``lease``'s tokens and weight: formula.cost in
        lua/formulas.lua) and admits it (creating the lease), queues it, or rejects
        it, atomically. One round trip.

        With ``wait_ms`` > 0 a request that cannot be admitted now, and could be within
        ``wait_ms``, is queued among its class's waiters for this daemon to collect
        with ``pump``; the decision's ``retry_after_ms`` then says how long it may
        wait. ``ttft_ms``, the request's TTFT objective (0: none), orders the queue
        (earliest due first) and, once the pool has a prefill model, sets the wait from
        the request's slack, up to ``wait_cap_ms`` (None: ``wait_ms``), or refuses it
        with REASON_DEADLINE (qosd/store/lua/pool/deadline.lua). A ``lease.request_id``
        that names another request's lease or place in a queue gets a ``duplicate``
        answer and changes nothing.
        """
        ...

    async def pump(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> list[PumpResult]:
        """Admits what it can of the pool's waiters in fleet-wide order, and reports on
        ``waiters`` (this daemon's). Also proves the daemon alive."""
        ...

    async def cancel(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> None:
        """Removes waiters from their queues (they hold no tokens)."""
        ...

    async def release(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease_id: str,
        usage: UsageReport,
        frees_request_of: LeaseSpec | None = None,
    ) -> Settlement:
        """Settles a lease, idempotently (a repeat gets the first answer); raises
        LeaseNotFound or LeaseExpired. ``frees_request_of``: the lease's admission,
        whose request id is freed now rather than at the lease's TTL (the request
        failed on its way, and its retry under the same id is a new try)."""
        ...

    async def undo(self, pool: PoolPolicy, cls: ClassPolicy, lease: LeaseSpec) -> Settlement:
        """Undoes an admission whose caller is gone: settles the lease as cancelled with
        nothing used, the whole charge back (not bounded by the burst, as a release
        is), and frees its request id if it still names the lease."""
        ...

    async def status(self, pool: PoolPolicy) -> PoolStatus:
        """The pool's budget, queues and leases in flight now; read-only, and
        O(classes) whatever the number of leases, so scraping it often is safe."""
        ...

    async def tenants(self, pool: PoolPolicy, names: Sequence[str]) -> list[TenantStatus]:
        """The named tenants of each of the pool's classes that share by tokens, in
        class order; read-only, and O(waiters of those classes): an admin query."""
        ...

    async def control(self, pool: PoolPolicy) -> ControlRecord:
        """The SLO loop's record of the pool (defaults when it never changed)."""
        ...

    async def adjust(
        self, pool: PoolPolicy, update: ControlRecord, cooldown_ms: int, *, force: bool = False
    ) -> bool:
        """Sets the pool's admitted rate to ``update.capacity`` and keeps ``update``,
        atomically: the pool is refilled at the old rate up to now first. Refused
        (False) while pinned or within ``cooldown_ms`` of the last change, unless
        ``force`` (pinning and unpinning), so that two controllers can never both
        change a pool within one cooldown. Logged in the pool's history."""
        ...

    async def set_prefill(self, pool: PoolPolicy, learned: PrefillLearned) -> float:
        """Sets what the SLO loop learned of the pool's prefill (``qosd.control.prefill``):
        the prefill model, with which a GPU-gated pool bounds its prefill backlog, and
        from which the store derives the prompt length above which a request waits for
        a gap in the top class's traffic (prefill.lua). Returns that length (0: no
        such rule)."""
        ...

    async def report_load(self, pool: PoolPolicy, loads: Sequence[ServerLoad]) -> None:
        """Keeps each server's latest load and sets the pool's aggregate
        (``budget.servers_load``), which admission reads (``budget.servers_full``)."""
        ...

    async def passes(self, pool: PoolPolicy) -> list[PassRead]:
        """What the pool's servers said their passes carried (``ServerLoad.passes``),
        newest first, stamped when stored: what the leader learns the decode step from
        (``qosd.control.passes``)."""
        ...

    async def history(self, pool: PoolPolicy, limit: int = 20) -> list[Adjustment]:
        """The pool's latest adjustments, newest first."""
        ...

    async def lead(self, lease_ms: int) -> str:
        """Takes or renews the controller lease for this daemon if free or ours;
        returns the leader.
        ``lease_ms`` 0 hands it back if ours (returns the leader after: '' or another)."""
        ...

    async def report(self, samples: Sequence[Sample], window_size: int) -> None:
        """Appends samples to their (pool, class) windows, keeping the newest ones."""
        ...

    async def window(self, pool: str, qos_class: str) -> list[StoredSample]:
        """The stored samples of one window, newest first."""
        ...

    async def ping(self) -> None:
        """Raises StoreUnavailable unless the store answers."""
        ...

    def add_reset_listener(self, listener: ResetListener) -> None:
        """Tells ``listener(pool, old_epoch, new_epoch)`` when a reply shows that the
        pool's state was lost and made anew (the store came back empty;
        ``qosd.store.epochs``). Called on the event loop, from the reply's handling:
        it must not block."""
        ...
