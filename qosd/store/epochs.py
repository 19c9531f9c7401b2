"""Noticing a store that came back empty, from the pool epochs its replies carry.

Each pool's state holds an epoch (``E`` in the state hash; lua/pool/save.lua), written when
the state is first created and never changed. A store that loses its data (a Redis
restarted without persistence, ``FLUSHALL``, a failover to an empty replica) loses
the epoch with it, and the next state written gets a new one. Replies that read the
state anyway carry it (Acquire's reply header, the control record), so noticing costs
no extra command: an uncontended Acquire stays one round trip.

Both stores keep one ``EpochWatch``: the Redis store feeds it every epoch it reads;
the embedded store, whose state cannot be lost, feeds it the epochs its control
records carry, one per pool for good: the path is the same, and it never fires.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Told (pool, old epoch, new epoch) when a pool's state was lost and made anew.
ResetListener = Callable[[str, str, str], None]

_PAST = 8  # epochs remembered per pool, to tell a late reply from a new loss


class EpochWatch:
    """The epoch this daemon last saw per pool, and who to tell when it changes."""

    def __init__(self) -> None:
        self._known: dict[str, str] = {}
        self._past: dict[str, deque[str]] = {}
        self._listeners: list[ResetListener] = []

    def add_listener(self, listener: ResetListener) -> None:
        self._listeners.append(listener)

    def known(self, pool: str) -> str:
        """The pool's epoch as last seen ('' if never): scripts that find no state
        while the caller knew one start the pool empty (``budget.fresh_state``)."""
        return self._known.get(pool, "")

    def saw(self, pool: str, epoch: str) -> None:
        """Notes the epoch a reply carried; a new one, after another was known, is a
        reset. An empty epoch (no state yet) says nothing: a read that ran before the
        state was made anew can be answered after a reply that carried the new epoch.
        So can a reply carrying an older epoch: those already seen are ignored."""
        known = self._known.get(pool)
        if not epoch or epoch == known:
            return
        past = self._past.setdefault(pool, deque(maxlen=_PAST))
        if epoch in past:
            return
        self._known[pool] = epoch
        if known is None:
            return  # the first epoch this daemon sees of the pool
        past.append(known)
        log.warning(
            "pool %s: the store came back empty (epoch %s -> %s): its buckets, leases in "
            "flight, waiters and request ids are gone; its buckets start empty",
            pool, known, epoch,
        )  # fmt: skip
        for listener in self._listeners:
            try:
                listener(pool, known, epoch)
            except Exception:
                log.exception("a store reset listener failed")
