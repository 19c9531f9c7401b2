"""Releases the store did not take, retried until they land: no lease is stranded by a
slow or gone store.

A Release that times out or finds the store down leaves its lease in flight in the
store, holding room and tokens until its TTL (300 s by default): a Redis that hangs
for a few seconds under load would otherwise strand every lease that ended meanwhile,
and a GPU-gated pool would stay full for minutes. Release is idempotent by lease id
(a repeat gets the first answer, ``already_released``), so retrying is always safe:
a Release that did land, but whose answer was lost, is simply answered again.

Every pending Release is retried together, with exponential backoff and jitter
(50 ms doubling to 2 s), until it lands, the store says the lease is gone or expired,
or the lease's TTL has passed (it has ended on its own then). Retries of one round go
out at once, so the store batches them into one script call per pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable

from qosd.model import (
    LeaseExpired,
    LeaseNotFound,
    ReleaseRequest,
    Settlement,
    StoreUnavailable,
    lease_issued_s,
)

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.05
MAX_DELAY_S = 2.0
#: Releases kept at most; past it the oldest give way (their leases end by TTL).
MAX_PENDING = 100_000


class SettlementRetry:
    """Keeps Releases the store did not take, and retries them until they land."""

    def __init__(
        self,
        settle: Callable[[ReleaseRequest], Awaitable[Settlement]],
        lease_ttl_s: float,
        *,
        clock: Callable[[], float] = time.time,
        on_retried: Callable[[str], None] | None = None,
    ) -> None:
        """``on_retried(result)``: told how each retry ended ("settled", "gone",
        "expired", "failed"), for the metrics."""
        self._settle = settle
        self._lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._on_retried = on_retried
        self._pending: dict[str, ReleaseRequest] = {}  # by lease id, oldest first
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    @property
    def pending(self) -> int:
        return len(self._pending)

    def add(self, request: ReleaseRequest) -> None:
        """Keeps ``request`` for retrying (a repeat of one kept replaces it: its caller
        may retry too, with the same or better usage)."""
        if self._closing:
            return
        self._pending.pop(request.lease_id, None)
        if len(self._pending) >= MAX_PENDING:
            dropped = next(iter(self._pending))
            del self._pending[dropped]
            log.warning("more than %d releases pending; lease %s ends by its TTL", MAX_PENDING,
                        dropped)  # fmt: skip
        self._pending[request.lease_id] = request
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self, grace_s: float) -> None:
        """Gives pending releases up to ``grace_s`` more to land, then stops."""
        self._closing = True
        task = self._task
        if task is None or task.done():
            return
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(task), grace_s)
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pending:
            log.warning("%d releases not settled at shutdown; their leases end by TTL",
                        len(self._pending))  # fmt: skip

    async def _run(self) -> None:
        delay = FIRST_DELAY_S
        while self._pending:
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            batch = list(self._pending.values())
            results = await asyncio.gather(*(self._retry(r) for r in batch))
            delay = FIRST_DELAY_S if any(results) else min(MAX_DELAY_S, delay * 2)

    async def _retry(self, request: ReleaseRequest) -> bool:
        """One retry; True when the store answered (whatever it said)."""
        issued = lease_issued_s(request.lease_id)
        if issued is not None and self._clock() > issued + self._lease_ttl_s + 1:
            self._done(request, "expired")  # it has ended on its own
            return False
        try:
            await self._settle(request)
        except StoreUnavailable:
            self._count("failed")
            return False
        except (LeaseNotFound, LeaseExpired):
            self._done(request, "gone")
            return True
        except Exception:  # a bug, not the store: never retried forever, never lost silently
            log.exception("retrying the release of lease %s failed", request.lease_id)
            self._done(request, "gone")
            return True
        self._done(request, "settled")
        return True

    def _done(self, request: ReleaseRequest, result: str) -> None:
        if self._pending.get(request.lease_id) is request:
            del self._pending[request.lease_id]
        self._count(result)

    def _count(self, result: str) -> None:
        if self._on_retried is not None:
            self._on_retried(result)
