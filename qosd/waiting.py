"""The daemon's half of the waiting room: the callers this daemon holds while they wait.

The queues themselves live in the store (fleet-wide, in Redis), so that every replica
sees every waiter and a P0 request waiting on one replica goes before a P2 request
that arrives later at another. This module keeps the other half: one future per
waiting caller, a pump task per pool that asks the store every ``waiting.poll_ms``
(or at once after a local release) to admit what it can, and a timer per waiter.

Every waiter gets exactly one answer: admitted by a pump, QUEUE_TIMEOUT at its
deadline (measured here, from when it was queued; LONG_PREFILL instead for a long
prompt the store held for a gap in the top class's traffic), DEADLINE as soon as the
store finds it could no longer meet its TTFT objective, SHUTTING_DOWN on drain, or the
fail-mode answer when the store is lost. One failed pump does not lose the store: a pump
that times out on a busy machine (500 waiters' worth of arguments, a CPU-starved replica)
is retried, and the waiters get the fail-mode answer only once pumps have failed for
``store_patience_s`` (``redis.retry_interval_ms``), or at their own deadline if sooner.

Whatever the store does for a waiter after it was answered (a grant racing a timeout
or a cancelled caller) is undone: the lease is refunded in full and the queue entry
removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from qosd.model import (
    BucketDecision,
    LeaseExpired,
    LeaseNotFound,
    PumpResult,
    Reason,
    StoreUnavailable,
    Waiter,
    WaiterState,
)
from qosd.policy import ClassPolicy, PoolPolicy
from qosd.store.base import BucketStore

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Local:
    waiter: Waiter
    future: asyncio.Future[BucketDecision]
    queued_at: float  # loop time
    timer: asyncio.TimerHandle | None = None
    held: bool = False  # the last pump held it for a gap in the top class's traffic


@dataclass(eq=False)
class _PoolRoom:
    policy: PoolPolicy
    waiters: dict[str, _Local] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    failing_since: float | None = None  # loop time of the first of the pumps failing now


class WaitingRoom:
    def __init__(
        self,
        store: BucketStore,
        poll_s: float,
        store_down: Callable[[PoolPolicy, Waiter], BucketDecision],
        store_patience_s: float = 0.0,
        undo_later: Callable[[PoolPolicy, Waiter], None] | None = None,
    ) -> None:
        self._store = store
        # Undoes an admission nobody holds, retried until the store takes it (the
        # daemon's settlements); without one, once, in the background.
        self._undo_later = undo_later
        self._poll_s = poll_s
        self._store_down = store_down
        self._store_patience_s = store_patience_s
        self._pools: dict[str, PoolPolicy] = {}  # the newest policies, once reconfigured
        self._rooms: dict[str, _PoolRoom] = {}
        self._cleanup: set[asyncio.Task[Any]] = set()
        self._draining = False

    def held(self, pool: str) -> dict[str, int]:
        """How many waiters of each class this daemon holds in a pool."""
        counts: dict[str, int] = {}
        room = self._rooms.get(pool)
        for local in room.waiters.values() if room else ():
            counts[local.waiter.qos_class] = counts.get(local.waiter.qos_class, 0) + 1
        return counts

    async def wait(self, pool: PoolPolicy, waiter: Waiter, wait_s: float) -> BucketDecision:
        """Waits until the store admits ``waiter`` (queued already) or its wait is up."""
        if self._draining:  # queued by a call already in flight when the drain began
            self._in_background(self._store.cancel(pool, [waiter]))
            return _rejected(waiter, Reason.SHUTTING_DOWN, SHUTTING_DOWN_RETRY_MS)
        loop = asyncio.get_running_loop()
        room = self._rooms.get(pool.name)
        if room is None:
            # The newest policy: the caller's was read before its store call, and a
            # reload may have come in between.
            room = self._rooms[pool.name] = _PoolRoom(self._pools.get(pool.name, pool))
        local = _Local(waiter, loop.create_future(), loop.time())
        local.timer = loop.call_later(wait_s, self._expire, room, local)
        room.waiters[waiter.id] = local
        if room.task is None or room.task.done():
            # A context of its own: the pump serves every waiter, and must not carry
            # the trace of the request that happened to start it.
            room.task = loop.create_task(self._pump_loop(room), context=contextvars.Context())
        else:
            room.wake.set()
        try:
            return await local.future
        except asyncio.CancelledError:
            # The caller went away (gRPC cancellation or deadline): leave nothing behind.
            if self._forget(room, local):
                self._in_background(self._store.cancel(pool, [waiter]))
            raise

    def reconfigure(self, pools: dict[str, PoolPolicy], poll_s: float) -> None:
        """A reloaded config: each pool's waiters are pumped under its new policy from
        the next pump on (one in flight finishes under the old one)."""
        self._poll_s = poll_s
        self._pools = pools
        for name, room in self._rooms.items():
            if name in pools:
                room.policy = pools[name]

    def nudge(self, pool: str) -> None:
        """Tokens came back in this pool (a release): look for admissions now."""
        room = self._rooms.get(pool)
        if room is not None and room.waiters:
            room.wake.set()

    def drain(self) -> None:
        """Answers every waiter SHUTTING_DOWN at once, and takes them out of the queues."""
        self._draining = True
        for room in self._rooms.values():
            gone = list(room.waiters.values())
            for local in gone:
                refusal = _rejected(local.waiter, Reason.SHUTTING_DOWN, SHUTTING_DOWN_RETRY_MS)
                self._answer(room, local, refusal)
            if gone:
                self._in_background(
                    self._store.cancel(room.policy, [local.waiter for local in gone])
                )

    async def close(self) -> None:
        self.drain()
        for room in self._rooms.values():
            if room.task is not None:
                room.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await room.task
        while self._cleanup:
            await asyncio.gather(*list(self._cleanup), return_exceptions=True)

    # -- internals ------------------------------------------------------------------

    def _forget(self, room: _PoolRoom, local: _Local) -> bool:
        """Drops a waiter from this daemon's books; False when it was not on them."""
        if room.waiters.get(local.waiter.id) is not local:
            return False
        del room.waiters[local.waiter.id]
        if local.timer is not None:
            local.timer.cancel()
        return True

    def _answer(self, room: _PoolRoom, local: _Local, decision: BucketDecision) -> bool:
        """Gives a waiter its one answer; False when it had one already (or its caller
        left: a cancelled future), in which case the caller undoes what it must."""
        self._forget(room, local)
        if local.future.done():
            return False
        local.future.set_result(decision)
        return True

    def _expire(self, room: _PoolRoom, local: _Local) -> None:
        if room.failing_since is not None:  # its wait ended while the store was away
            if self._answer(room, local, self._store_down(room.policy, local.waiter)):
                self._in_background(self._retry_cancel(room.policy, [local.waiter]))
            return
        reason = Reason.LONG_PREFILL if local.held else Reason.QUEUE_TIMEOUT
        if self._answer(room, local, _rejected(local.waiter, reason, _waited_ms(local))):
            self._in_background(self._store.cancel(room.policy, [local.waiter]))

    async def _pump_loop(self, room: _PoolRoom) -> None:
        loop = asyncio.get_running_loop()
        while room.waiters and not self._draining:
            asked = list(room.waiters.values())
            room.wake.clear()  # a nudge during this pump asks for the next one at once
            began = loop.time()
            try:
                results = await self._store.pump(room.policy, [local.waiter for local in asked])
            except StoreUnavailable as error:
                if room.failing_since is None:
                    room.failing_since = began  # the store was away from this pump on
                if loop.time() - room.failing_since >= self._store_patience_s:
                    room.failing_since = None
                    self._store_lost(room, error)
                    return
                log.info("pump failed in pool %s, retrying: %s", room.policy.name, error)
                results = [PumpResult(WaiterState.WAITING, None)] * len(asked)
            except Exception:
                log.exception("pump failed in pool %s", room.policy.name)
                results = [PumpResult(WaiterState.WAITING, None)] * len(asked)
            else:
                room.failing_since = None
            for local, result in _in_grant_order(asked, results):
                try:
                    self._settle(room, local, result)
                except Exception:  # one bad answer must not strand the others
                    log.exception("could not settle a waiter in pool %s", room.policy.name)
            if room.waiters:
                pause = self._poll_s if room.failing_since is None else max(self._poll_s, 0.05)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room.wake.wait(), pause)

    def _settle(self, room: _PoolRoom, local: _Local, result: PumpResult) -> None:
        if result.state in (WaiterState.WAITING, WaiterState.HELD):
            local.held = result.state is WaiterState.HELD
            return
        if result.state is WaiterState.ADMITTED:
            assert result.decision is not None
            if not self._answer(room, local, result.decision):
                # A timeout or a departed caller won the race: give the tokens back.
                self._undo(room.policy, local.waiter)
        elif result.state is WaiterState.LATE:  # it can no longer meet its TTFT objective
            self._answer(room, local, _rejected(local.waiter, Reason.DEADLINE, _waited_ms(local)))
            # The pump took it out of its queue; the cancel frees its request id, for
            # the retry its refusal invites.
            self._in_background(self._store.cancel(room.policy, [local.waiter]))
        else:  # GONE: the store dropped it (taken for a dead daemon's, or expired)
            refusal = _rejected(local.waiter, Reason.QUEUE_TIMEOUT, _waited_ms(local))
            self._answer(room, local, refusal)
            # Or a pump admitted it and its answer was lost with the store: its lease
            # would stand to its TTL. Undone; where there is none, nothing happens.
            self._undo(room.policy, local.waiter)

    def _store_lost(self, room: _PoolRoom, error: StoreUnavailable) -> None:
        """Answers every waiter of the pool by the fail mode (those that joined while
        the failed pump was in flight too); their entries are cancelled later."""
        waiting = list(room.waiters.values())
        log.warning("store lost while %d requests waited in pool %s: %s",
                    len(waiting), room.policy.name, error)  # fmt: skip
        for local in waiting:
            self._answer(room, local, self._store_down(room.policy, local.waiter))
        self._in_background(self._retry_cancel(room.policy, [local.waiter for local in waiting]))

    async def _retry_cancel(self, pool: PoolPolicy, waiters: list[Waiter]) -> None:
        """Takes answered waiters out of the queues once the store is back.

        Until then they may stand at the head of their queue; if the store stays away
        long enough they are dropped as expired by the scripts anyway.
        """
        for attempt in range(20):
            try:
                await self._store.cancel(pool, waiters)
                return
            except StoreUnavailable:
                await asyncio.sleep(min(5.0, 0.1 * 2**attempt))

    def _undo(self, pool: PoolPolicy, waiter: Waiter) -> None:
        """Refunds a grant nobody will use, and frees its request id for a retry, as the
        stores do for Acquires whose caller left: at once, and, where the store is away,
        again until it takes it (``undo_later``)."""
        cls = next(c for c in pool.classes if c.name == waiter.qos_class)
        self._in_background(self._undo_now(pool, cls, waiter))

    async def _undo_now(self, pool: PoolPolicy, cls: ClassPolicy, waiter: Waiter) -> None:
        try:
            await self._store.undo(pool, cls, waiter.lease)
        except (LeaseNotFound, LeaseExpired):
            pass  # nothing was granted, or it has ended on its own
        except StoreUnavailable:
            if self._undo_later is None:
                raise
            self._undo_later(pool, waiter)

    def _in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup_done)

    def _cleanup_done(self, task: asyncio.Task[Any]) -> None:
        self._cleanup.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("waiting-room cleanup failed: %s", task.exception())


#: A draining daemon's refusals: come back in a second, to another replica (the
#: balancer takes this one out meanwhile).
SHUTTING_DOWN_RETRY_MS = 1_000


def _in_grant_order(
    asked: list[_Local], results: list[PumpResult]
) -> list[tuple[_Local, PumpResult]]:
    """The pump's answers, those it granted first and in the order it granted them.

    The store predicted each grant's prefill behind the grants before it; on servers
    that prefill oldest first, a short prompt answered after a long one granted in the
    same pump reaches them second and waits out the long one's prefill (Mooncake 1.5x
    chunked, development seeds 1 to 10: P1's late first tokens among its admitted
    requests went from 8 to 2).
    """
    pairs = list(zip(asked, results, strict=True))
    pairs.sort(key=lambda pair: pair[1].granted or len(pairs) + 1)
    return pairs


def _waited_ms(local: _Local) -> int:
    """How long a waiter waited, as the retry-after of its refusal: the queue ahead of
    it did not clear in that time, and a retry sooner would most likely wait it out
    again (these refusals carried none, and the proxy's 429s no Retry-After)."""
    return max(1, round((asyncio.get_running_loop().time() - local.queued_at) * 1000))


def _rejected(waiter: Waiter, reason: Reason, retry_after_ms: int) -> BucketDecision:
    return BucketDecision(
        admitted=False,
        reason=reason,
        lease_id="",
        charged=waiter.cost,
        remaining=0.0,
        retry_after_ms=retry_after_ms,
        lease_ttl_ms=0,
    )
