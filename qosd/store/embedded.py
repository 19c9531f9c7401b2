"""The embedded store: qosd with no Redis, running the same scripts in process.

Every budget rule is written once, in the Lua scripts of ``lua/``. The embedded store
is the Redis store (``qosd.store.redis``) over an in-process transport: a keyspace
with Redis's semantics and a Lua 5.1 host (``qosd.store.transport``). So a daemon
alone, with nothing to install, admits exactly as a fleet on Redis does, and a change
to a rule changes both. Nothing is shared between processes and nothing survives a
restart: right for one daemon, wrong for a fleet.
"""

from __future__ import annotations

from collections.abc import Callable

from qosd.config import RedisConfig
from qosd.store.redis import RedisStore
from qosd.store.transport import InProcessTransport, monotonic_us


class EmbeddedStore(RedisStore):
    """The scripts, run in this process. ``clock`` is the store's TIME, in
    microseconds (the monotonic clock by default): tests pass one they move by hand."""

    def __init__(
        self,
        tombstone_ms: int,
        stale_after_ms: int = 500,
        lease_ttl_ms: int = 300_000,
        clock: Callable[[], int] = monotonic_us,
        key_prefix: str = "qosd",
        *,
        daemon_id: str | None = None,
        shared_with: EmbeddedStore | None = None,
    ) -> None:
        """``shared_with``: another embedded store whose keyspace this one shares (two
        daemons of one process, as tests run them; its clock then rules)."""
        self.transport: InProcessTransport = (
            shared_with.transport if shared_with else InProcessTransport(clock)
        )
        super().__init__(
            RedisConfig(key_prefix=key_prefix),
            tombstone_ms=tombstone_ms,
            stale_after_ms=stale_after_ms,
            lease_ttl_ms=lease_ttl_ms,
            transport=self.transport,
            deadlines=False,
            daemon_id=daemon_id,
        )
