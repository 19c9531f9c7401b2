"""The script store's transport under Redis Sentinel: the master the sentinels name.

redis-py's own Sentinel support asks the sentinels on every new connection and
trusts the first answer. qosd needs two things it does not give (docs/adr/0005):
- **a bounded request path.** With every sentinel down, a request must still be
  answered per ``fail_mode`` within one timeout, not after asking each sentinel in
  turn. The master is found off the request path, by one shared discovery, and kept;
- **a checked answer.** A sentinel may name an old master during a failover, or a
  replica when it is misconfigured. The address it names is used only once ROLE there
  says master; an old master is retired (no new connection) and closed.
Connections, AUTH, TLS and the protocol stay redis-py's (``Node``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import redis.exceptions as redis_errors

from qosd.config import RedisConfig, parse_host_port
from qosd.model import StoreUnavailable
from qosd.store.redis_client import AuthFailed, ClientOptions, Node

log = logging.getLogger(__name__)

# Rediscoveries that errors ask for are this far apart at least, so that a master
# that hangs (each ROLE times out) is not asked in a loop.
_DISCOVERY_MIN_GAP_S = 0.1


class SentinelTransport:
    """Every command goes to the master the sentinels name, followed on failover."""

    def __init__(self, options: ClientOptions, config: RedisConfig) -> None:
        """The master is reached with the URL's credentials, db and TLS; the
        sentinels with their own credentials, and TLS as ``sentinel_tls`` says (None:
        as the URL), with the same CA and client certificate files."""
        assert config.sentinel_master is not None  # checked at load
        self._options = options
        self._name = config.sentinel_master
        self._timeout_s = options.timeout_s
        self._master_kwargs = options.client_kwargs()
        self._check_interval_s = config.sentinel_check_interval_ms / 1000
        sentinel_kwargs = options.client_kwargs(tls=config.sentinel_tls, credentials=False)
        sentinel_kwargs.update(
            username=config.sentinel_username,
            password=(
                config.sentinel_password.get_secret_value() if config.sentinel_password else None
            ),
        )
        self._sentinels = [
            Node(parse_host_port(address), options, **sentinel_kwargs)
            for address in config.sentinels
        ]
        self._master: Node | None = None
        self._discovering: asyncio.Task[Node] | None = None
        # Why the last discovery found no master, for a request that could not wait.
        self._discovery_error = "no answer from the sentinels yet"
        self._watcher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        # Old masters, closed one timeout after they were replaced.
        self._retired: dict[Node, asyncio.Task[None]] = {}
        self._closed = False

    @property
    def master(self) -> tuple[str, int] | None:
        """The master's address, once found."""
        return None if self._master is None else self._master.address

    async def execute(self, route_key: str, *args: Any, script_source: str | None = None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        node = await self._primary(deadline)
        remaining = deadline - loop.time()
        if remaining <= 0:
            raise StoreUnavailable(
                f"redis at {node.describe()}: the {self._timeout_s * 1000:.0f} ms timeout "
                "was spent waiting for the master"
            )
        try:
            return await node.execute(*args, script_source=script_source, timeout_s=remaining)
        except StoreUnavailable:
            if node is self._master:
                self._wake.set()  # lost connection, timeout, READONLY: ask at once
            raise

    async def execute_on_primaries(self, *args: Any) -> list[Any]:
        return [await self.execute("", *args)]

    async def _primary(self, deadline: float) -> Node:
        """The known master, without any I/O. While none is known (at start, or while
        every sentinel is down) the call waits for the discovery in progress, but only
        until ``deadline``; the discovery goes on in the background, and a later call
        finds the master it named."""
        if self._closed:
            raise StoreUnavailable("redis client closed")
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
        master = self._master
        if master is not None:
            return master
        task = self._discovery()
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining > 0:
            # asyncio.wait, unlike wait_for, leaves the shared task running on timeout.
            await asyncio.wait((task,), timeout=remaining)
        if task.cancelled():  # the client is closing
            raise StoreUnavailable("redis client closed")
        if task.done():
            return task.result()
        raise StoreUnavailable(
            f"redis sentinel: no master {self._name!r} known within the "
            f"{self._timeout_s * 1000:.0f} ms timeout; still asking the sentinels "
            f"(last: {self._discovery_error})"
        )

    def _discovery(self) -> asyncio.Task[Node]:
        """The discovery in progress, or a new one: one at a time, shared."""
        if self._discovering is None or self._discovering.done():
            self._discovering = asyncio.get_running_loop().create_task(self._ask_sentinels())
            self._discovering.add_done_callback(_quiet)
        return self._discovering

    async def _ask_sentinels(self) -> Node:
        """The master as the first sentinel that answers names it, once ROLE on that
        address says master: a sentinel may name an old master for a while during a
        failover (and until it is promoted, the new one is still a replica)."""
        errors: list[str] = []
        auth_failed = False
        for sentinel in self._sentinels:
            where = f"sentinel {sentinel.describe()}"
            try:
                reply = await sentinel.execute("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self._name)
            except (StoreUnavailable, redis_errors.RedisError) as exc:
                auth_failed |= isinstance(exc, AuthFailed)
                errors.append(f"{where}: {exc}")
                continue
            if not reply:
                errors.append(f"{where} monitors no master named {self._name!r}")
                continue
            address = (str(reply[0]), int(reply[1]))
            if self._master is not None and self._master.address == address:
                node = self._master
            else:
                node = Node(address, self._options, **self._master_kwargs)
            try:
                role = await node.execute("ROLE")
            except (StoreUnavailable, redis_errors.RedisError) as exc:
                auth_failed |= isinstance(exc, AuthFailed)
                errors.append(f"{node.describe()}, named by {where}: {exc}")
                await self._drop(node)
                continue
            if not role or role[0] != "master":
                what = role[0] if role else "server that gave no ROLE"
                errors.append(f"{node.describe()}, named by {where}, is a {what}")
                await self._drop(node)
                continue
            self._use_master(node)
            return node
        failed = AuthFailed if auth_failed else StoreUnavailable
        error = failed(f"no sentinel named a usable master {self._name!r}: " + "; ".join(errors))
        self._discovery_error = str(error)
        raise error

    async def _drop(self, node: Node) -> None:
        """Closes a node a sentinel named that is not the master (a replica, a server
        that is down), so that its probe connection does not stay open; the master
        in use is kept: its own failures ask the sentinels again."""
        if node is not self._master:
            await node.close()

    def _use_master(self, node: Node) -> None:
        old = self._master
        if old is node:
            return
        self._master = node
        if old is None:
            log.info("redis sentinel: master is %s", node.describe())
            return
        log.warning(
            "redis sentinel: master %r moved from %s to %s",
            self._name,
            old.describe(),
            node.describe(),
        )
        # Retired, it opens no new connection for a caller that still holds it (a
        # NOSCRIPT retry): that call fails as unavailable, as on a lost connection.
        # Replies already on their way reach their callers; after one timeout, none
        # can be left, and its connections close.
        old.retired = True
        self._retired[old] = asyncio.get_running_loop().create_task(self._close_later(old))

    async def _close_later(self, node: Node) -> None:
        await asyncio.sleep(self._timeout_s)
        await node.close()
        del self._retired[node]

    async def _watch(self) -> None:
        """Asks the sentinels every check interval, and at once when a command to the
        master failed, so that a failover is followed without a restart and without
        waiting for a request to fail on it."""
        interval = self._check_interval_s or None
        loop = asyncio.get_running_loop()
        while not self._closed:
            started = loop.time()
            self._wake.clear()
            try:
                await asyncio.shield(self._discovery())
            except StoreUnavailable as exc:
                log.warning("redis sentinel: %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            gap = started + _DISCOVERY_MIN_GAP_S - loop.time()
            if gap > 0:
                await asyncio.sleep(gap)

    async def close(self) -> None:
        self._closed = True
        for task in (self._watcher, self._discovering, *self._retired.values()):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        nodes = [*self._sentinels, *self._retired, *([self._master] if self._master else [])]
        await asyncio.gather(*(node.close() for node in nodes), return_exceptions=True)


def _quiet(task: asyncio.Task[Any]) -> None:
    """Retrieves a background discovery's failure (its awaiters see it raised)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("redis sentinel discovery failed: %s", task.exception())
