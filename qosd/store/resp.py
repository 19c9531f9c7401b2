"""A small pipelined Redis client for the hot path: standalone, cluster or Sentinel.

Why not redis-py's asyncio client: inside a grpc.aio server on our hardware, one
redis-py call costs about 100 us of CPU, more than the RPC itself, and halves the
daemon's throughput (docs/performance.md has the measurement). This client keeps
every command of a connection in one pipeline, matches replies to callers in order,
parses with hiredis (the C parser redis-py itself uses), and packs commands with
``hiredis.pack_command``. It takes URL parsing, slot hashing and exception classes
from redis-py. It does only what the store needs: send a command to the node that
owns a key, or to every primary, with a deadline; follow MOVED and ASK redirects;
under Sentinel, find the master and follow it through failovers.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis
import redis.exceptions as redis_errors
from redis.asyncio.connection import parse_url
from redis.crc import key_slot

from qosd.model import StoreUnavailable

log = logging.getLogger(__name__)

# Replies that mean "not now" rather than "your command is wrong". NOREPLICAS: a
# master configured with min-replicas-to-write that lost its replicas, as an old
# master does the moment Sentinel promotes its replica.
_UNAVAILABLE_CODES = frozenset(
    {"LOADING", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "OOM", "BUSY", "NOREPLICAS"}
)
_MAX_REDIRECTS = 3


def pack(*args: Any) -> bytes:
    """Encodes one command in RESP (hiredis' stub types it for one-element tuples)."""
    return cast(bytes, hiredis.pack_command(args))


class Redirect(Exception):
    """A MOVED or ASK reply from a cluster node."""

    def __init__(self, kind: str, slot: int, address: tuple[str, int]) -> None:
        super().__init__(f"{kind} {slot} {address[0]}:{address[1]}")
        self.kind = kind
        self.slot = slot
        self.address = address


def error_from_reply(reply: hiredis.ReplyError) -> Exception:
    message = str(reply)
    code = message.split(" ", 1)[0]
    if code == "NOSCRIPT":
        return redis_errors.NoScriptError(message)
    if code in ("MOVED", "ASK"):
        _, slot, target = message.split(" ")
        host, _, port = target.rpartition(":")
        return Redirect(code, int(slot), (host, int(port)))
    if code in _UNAVAILABLE_CODES:
        return StoreUnavailable(f"redis: {message}")
    return redis_errors.ResponseError(message)


class AuthFailed(StoreUnavailable):
    """Redis refused the credentials (AUTH answered WRONGPASS or an error like it).

    Still a StoreUnavailable, so requests fail per ``fail_mode`` (the daemon keeps
    running); apart, so that start-up can say plainly that the credentials are wrong
    rather than that Redis is down. The credentials are read once, when the client is
    made: every reconnect sends the same ones, so a corrected password or user takes
    a restart (``redis.*`` is restart-only, docs/configuration.md)."""


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    username: str | None = None
    password: str | None = None
    db: int = 0
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = 0.25


class _Protocol(asyncio.Protocol):
    """One connection: replies arrive in the order commands were written."""

    def __init__(self, on_lost: Callable[[], None] | None = None) -> None:
        self._reader = hiredis.Reader(encoding="utf-8")
        self._on_lost = on_lost
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None
        self.closed = False
        # Set once AUTH and SELECT passed: only a connection that was in use reports
        # its loss, so a refused AUTH cannot start a reconnect-and-rediscover loop.
        self.ready = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiting = self._waiting
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self.fail(StoreUnavailable(f"redis protocol error: {exc}"))
                return
            if reply is False:
                return
            future = waiting.popleft()
            if not future.done():  # a caller that timed out or went away is skipped
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(StoreUnavailable(f"redis connection lost: {exc or 'closed by server'}"))
        if self._on_lost is not None and self.ready:
            self._on_lost()

    def fail(self, error: Exception) -> None:
        self.closed = True
        while self._waiting:
            future = self._waiting.popleft()
            if not future.done():
                future.set_exception(error)
        if self._transport is not None:
            self._transport.close()

    def send(self, packed: bytes, replies: int = 1) -> list[asyncio.Future[Any]]:
        if self.closed or self._transport is None:
            raise StoreUnavailable("redis connection closed")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(replies)]
        self._waiting.extend(futures)
        self._transport.write(packed)
        return futures


class NodeClient:
    """A few pipelined connections to one Redis node, used round robin."""

    def __init__(
        self, host: str, port: int, settings: ConnectionSettings, *, unix_path: str | None = None,
        size: int = 2, on_lost: Callable[[NodeClient], None] | None = None,
    ) -> None:  # fmt: skip
        """``on_lost`` is called when one of the node's connections closes (a Sentinel
        failover closes the old master's client connections)."""
        self.address = (host, port)
        self._on_lost = on_lost
        self._unix_path = unix_path
        self._settings = settings
        self._slots: list[_Protocol | None] = [None] * size
        self._connecting: list[asyncio.Task[_Protocol] | None] = [None] * size
        self._next = itertools.cycle(range(size))
        # Set once the node is no longer wanted (an old master after a failover, a
        # replica a sentinel named): callers that still hold it get StoreUnavailable
        # instead of a fresh connection that nothing would ever close.
        self.retired = False

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        settings = self._settings
        protocol: _Protocol | None = None
        on_lost = self._on_lost

        def factory() -> _Protocol:
            return _Protocol(None if on_lost is None else lambda: on_lost(self))

        try:
            async with asyncio.timeout(settings.connect_timeout_s):
                if self._unix_path is not None:
                    _, protocol = await loop.create_unix_connection(factory, self._unix_path)
                else:
                    _, protocol = await loop.create_connection(
                        factory, self.address[0], self.address[1], ssl=settings.ssl_context
                    )
                setup: list[tuple[Any, ...]] = []
                if settings.password is not None:
                    setup.append(("AUTH", settings.username or "default", settings.password))
                if settings.db:
                    setup.append(("SELECT", settings.db))
                for command in setup:
                    [future] = protocol.send(pack(*command))
                    reply = await future
                    if isinstance(reply, hiredis.ReplyError):
                        failed = AuthFailed if command[0] == "AUTH" else StoreUnavailable
                        raise failed(f"redis {command[0]} at {self.describe()} failed: {reply}")
                protocol.ready = True
        except (OSError, TimeoutError, StoreUnavailable) as exc:
            if protocol is not None:  # opened, but not usable: do not leak the socket
                protocol.fail(StoreUnavailable("redis connection setup failed"))
            if isinstance(exc, StoreUnavailable):
                raise
            raise StoreUnavailable(
                f"cannot connect to redis at {self.describe()}: {exc or type(exc).__name__}"
            ) from exc
        return protocol

    def describe(self) -> str:
        return self._unix_path or f"{self.address[0]}:{self.address[1]}"

    async def _protocol(self) -> _Protocol:
        index = next(self._next)
        protocol = self._slots[index]
        if protocol is not None and not protocol.closed:
            return protocol
        if self.retired:
            raise StoreUnavailable(f"redis at {self.describe()} is no longer used (retired)")
        task = self._connecting[index]
        if task is None:  # one connect per slot at a time, shared by all callers
            task = asyncio.get_running_loop().create_task(self._connect())
            self._connecting[index] = task
        try:
            protocol = await asyncio.shield(task)
        finally:
            if task.done():
                self._connecting[index] = None
        self._slots[index] = protocol
        return protocol

    async def execute(self, packed: bytes, timeout_s: float, replies: int = 1) -> Any:
        """Sends one packed command (or ``replies`` of them) and returns the last reply.

        A connection whose reply does not arrive in time is closed: its pipeline is
        stuck behind something, and every other caller on it fails fast too.
        """
        protocol = await self._protocol()
        futures = protocol.send(packed, replies)
        last = futures[-1]
        timer = asyncio.get_running_loop().call_later(
            timeout_s, _expire, protocol, last, self, timeout_s
        )
        try:
            reply = await last
        finally:
            timer.cancel()
        for future in futures[:-1]:
            earlier = future.result()
            if isinstance(earlier, hiredis.ReplyError):
                raise error_from_reply(earlier)
        if isinstance(reply, hiredis.ReplyError):
            raise error_from_reply(reply)
        return reply

    @property
    def open_connections(self) -> int:
        """How many of the node's connections are open now."""
        return sum(1 for protocol in self._slots if protocol is not None and not protocol.closed)

    def retire(self) -> None:
        """No new connection from now on; the open ones stay until ``close``, so that
        replies already on their way still reach their callers."""
        self.retired = True

    def close(self) -> None:
        self.retired = True  # a caller still holding it must not reopen a connection
        for protocol in self._slots:
            if protocol is not None:
                protocol.fail(StoreUnavailable("redis client closed"))
        for task in self._connecting:
            if task is not None:
                task.cancel()


def _expire(
    protocol: _Protocol, future: asyncio.Future[Any], node: NodeClient, timeout_s: float
) -> None:
    if not future.done():
        protocol.fail(
            StoreUnavailable(
                f"redis at {node.describe()} did not answer within {timeout_s * 1000:.0f} ms"
            )
        )


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for TLS to Redis (qosd.config.RedisTlsConfig); None: not set."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True


def tls_context(options: Mapping[str, Any], tls: TlsFiles | None) -> ssl.SSLContext:
    """The client's TLS context for a ``rediss://`` URL: the system's CAs unless a CA
    file is given (``tls`` or the URL's ``ssl_ca_certs``), a client certificate when
    one is given, and no checks at all only when asked (``verify`` False or the URL's
    ``ssl_cert_reqs=none``)."""
    tls = tls or TlsFiles()
    ca_file = tls.ca_file or options.get("ssl_ca_certs")
    cert_file = tls.cert_file or options.get("ssl_certfile")
    key_file = tls.key_file or options.get("ssl_keyfile")
    context = ssl.create_default_context(cafile=ca_file)
    if cert_file:
        context.load_cert_chain(cert_file, key_file)
    if not tls.verify or str(options.get("ssl_cert_reqs", "")).lower() == "none":
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


@dataclass(frozen=True, slots=True)
class SentinelOptions:
    """Where to find the master under Redis Sentinel (qosd.config.RedisConfig)."""

    addresses: Sequence[tuple[str, int]]
    master: str
    username: str | None = None
    password: str | None = None
    # How often the sentinels are asked whether the master moved, besides asking at
    # once on a lost connection or a READONLY; 0: only then.
    check_interval_s: float = 1.0
    # TLS to the sentinels: None follows the URL's scheme (rediss://: TLS), as the
    # master's connections do; True or False for sentinels that differ from the
    # master (say TLS on the data port, plain on the sentinels' private network).
    tls: bool | None = None


# Rediscoveries that errors ask for are this far apart at least, so that a master
# that hangs (each ROLE times out, closing the connection) is not asked in a loop.
_DISCOVERY_MIN_GAP_S = 0.1


class RespClient:
    """Routes commands to the right node of a standalone server, a cluster, or the
    master that Redis Sentinel names."""

    def __init__(
        self, url: str, *, cluster: bool, timeout_s: float, connect_timeout_s: float,
        connections_per_node: int = 2, password: str | None = None,
        username: str | None = None, tls: TlsFiles | None = None,
        seeds: Sequence[tuple[str, int]] = (), sentinel: SentinelOptions | None = None,
    ) -> None:  # fmt: skip
        """``password`` and ``username`` win over those in ``url``, and ``tls``'s files
        over its ``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile``. ``seeds``: more
        cluster nodes to ask for the topology when the URL's node does not answer.
        ``sentinel``: the URL's host is not used; the master is the one the sentinels
        name (reached with the URL's credentials, db and TLS). The sentinels use TLS
        as ``sentinel.tls`` says (None: as the master), with the same CA and client
        certificate files."""
        options = parse_url(url)
        master_tls = url.startswith("rediss://")
        context = tls_context(options, tls) if master_tls else None
        self._settings = ConnectionSettings(
            username=username if username is not None else options.get("username"),
            password=password if password is not None else options.get("password"),
            db=int(options.get("db", 0) or 0),
            ssl_context=context,
            connect_timeout_s=connect_timeout_s,
        )
        self._timeout_s = timeout_s
        self._per_node = connections_per_node
        self._cluster = cluster
        self._nodes: dict[tuple[str, int], NodeClient] = {}
        self._seed = self._node(
            str(options.get("host", "localhost")),
            int(options.get("port", 6379)),
            unix_path=options.get("path"),
        )
        self._seeds = [self._seed, *(self._node(host, port) for host, port in seeds)]
        self._slot_owner: list[NodeClient | None] = [None] * 16384
        self._refreshing: asyncio.Task[None] | None = None
        self._closed = False
        # Sentinel mode: the sentinels (one connection each, their own credentials and
        # TLS), the master they last named, and the task that keeps asking.
        self._sentinel = sentinel
        self._sentinels: list[NodeClient] = []
        if sentinel is not None:
            sentinel_tls = master_tls if sentinel.tls is None else sentinel.tls
            sentinel_context: ssl.SSLContext | None = None
            if sentinel_tls:
                sentinel_context = context or tls_context(options, tls)
            sentinel_settings = ConnectionSettings(
                username=sentinel.username,
                password=sentinel.password,
                ssl_context=sentinel_context,
                connect_timeout_s=connect_timeout_s,
            )
            self._sentinels = [
                NodeClient(host, port, sentinel_settings, size=1)
                for host, port in sentinel.addresses
            ]
        self._master: NodeClient | None = None
        self._discovering: asyncio.Task[NodeClient] | None = None
        # Why the last discovery found no master, for a request that could not wait.
        self._discovery_error = "no answer from the sentinels yet"
        self._watcher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def _node(self, host: str, port: int, unix_path: str | None = None) -> NodeClient:
        node = self._nodes.get((host, port))
        if node is None:
            node = NodeClient(
                host, port, self._settings, unix_path=unix_path, size=self._per_node,
                on_lost=self._lost,
            )  # fmt: skip
            self._nodes[(host, port)] = node
        return node

    # -- Sentinel -------------------------------------------------------------------

    @property
    def master(self) -> tuple[str, int] | None:
        """The master's address under Sentinel, once found (None before, or not Sentinel)."""
        return None if self._master is None else self._master.address

    def _lost(self, node: NodeClient) -> None:
        """A connection closed: under Sentinel, if it was the master's, ask the
        sentinels at once (a failover closes the old master's client connections)."""
        if node is self._master:
            self._wake.set()

    async def _primary(self, deadline: float) -> NodeClient:
        """The node that takes every command outside a cluster. Under Sentinel, the
        known master without any I/O. While none is known (at start, or while every
        sentinel is down) the call waits for the discovery in progress, but only
        until ``deadline`` (its own timeout): the sentinels are asked one after the
        other, each up to a connect timeout plus a timeout, and a call must still be
        answered per ``fail_mode`` in about one timeout. The discovery goes on in the
        background, and a later call finds the master it named."""
        if self._sentinel is None:
            return self._seed
        if self._watcher is None and not self._closed:
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
        name = self._sentinel.master
        raise StoreUnavailable(
            f"redis sentinel: no master {name!r} known within the "
            f"{self._timeout_s * 1000:.0f} ms timeout; still asking the sentinels "
            f"(last: {self._discovery_error})"
        )

    def _discovery(self) -> asyncio.Task[NodeClient]:
        """The discovery in progress, or a new one: one at a time, shared."""
        if self._discovering is None or self._discovering.done():
            self._discovering = asyncio.get_running_loop().create_task(self._ask_sentinels())
            self._discovering.add_done_callback(_quiet)
        return self._discovering

    async def _discover(self) -> NodeClient:
        """Waits for a discovery with no time limit: the watcher's, off the request path."""
        return await asyncio.shield(self._discovery())

    async def _ask_sentinels(self) -> NodeClient:
        """The master as the first sentinel that answers names it, once ROLE on that
        address says master: a sentinel may name an old master for a while during a
        failover (and until it is promoted, the new one is still a replica)."""
        assert self._sentinel is not None
        name = self._sentinel.master
        errors: list[str] = []
        auth_failed = False
        for sentinel in self._sentinels:
            where = f"sentinel {sentinel.describe()}"
            try:
                reply = await sentinel.execute(
                    pack("SENTINEL", "get-master-addr-by-name", name), self._timeout_s
                )
            except (StoreUnavailable, redis_errors.ResponseError) as exc:
                auth_failed |= isinstance(exc, AuthFailed)
                errors.append(f"{where}: {exc}")
                continue
            if not reply:
                errors.append(f"{where} monitors no master named {name!r}")
                continue
            node = self._node(str(reply[0]), int(reply[1]))
            try:
                role = await node.execute(pack("ROLE"), self._timeout_s)
            except (StoreUnavailable, redis_errors.ResponseError) as exc:
                auth_failed |= isinstance(exc, AuthFailed)
                errors.append(f"{node.describe()}, named by {where}: {exc}")
                self._drop(node)
                continue
            if not role or role[0] != "master":
                what = role[0] if role else "server that gave no ROLE"
                errors.append(f"{node.describe()}, named by {where}, is a {what}")
                self._drop(node)
                continue
            self._use_master(node)
            return node
        failed = AuthFailed if auth_failed else StoreUnavailable
        error = failed(f"no sentinel named a usable master {name!r}: " + "; ".join(errors))
        self._discovery_error = str(error)
        raise error

    def _drop(self, node: NodeClient) -> None:
        """Closes and forgets a node a sentinel named that is not the master (a
        replica, a server that is down), so that its probe connection does not stay
        open; the master in use is kept: its own failure path asks the sentinels."""
        if node is self._master:
            return
        if self._nodes.get(node.address) is node:
            del self._nodes[node.address]
        node.close()

    def _use_master(self, node: NodeClient) -> None:
        old = self._master
        if old is node:
            return
        self._master = node
        if old is not None:
            log.warning(
                "redis sentinel: master %r moved from %s to %s",
                self._sentinel.master if self._sentinel else "",
                old.describe(),
                node.describe(),
            )
            # Replies already on their way from the old master still reach their
            # callers; after that its connections go. Retired, it opens no new one
            # for a caller that still holds it (a NOSCRIPT retry): that call fails
            # as unavailable, as it would on a lost connection.
            if self._nodes.get(old.address) is old:
                del self._nodes[old.address]
            old.retire()
            asyncio.get_running_loop().call_later(self._timeout_s, old.close)
        else:
            log.info("redis sentinel: master is %s", node.describe())

    async def _watch(self) -> None:
        """Asks the sentinels every check interval, and at once when a command to the
        master failed or its connection closed, so that a failover is followed
        without a restart and without waiting for a request to fail on it."""
        assert self._sentinel is not None
        interval = self._sentinel.check_interval_s or None
        loop = asyncio.get_running_loop()
        while not self._closed:
            started = loop.time()
            self._wake.clear()
            try:
                await self._discover()
            except StoreUnavailable as exc:
                log.warning("redis sentinel: %s", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            gap = started + _DISCOVERY_MIN_GAP_S - loop.time()
            if gap > 0:
                await asyncio.sleep(gap)

    def _failed_on(self, node: NodeClient) -> None:
        """A command failed as unavailable (lost connection, timeout, READONLY,
        NOREPLICAS...): the topology may have changed."""
        if self._cluster:
            self._schedule_refresh()  # a primary may have moved
        elif node is self._master:
            self._wake.set()

    # -- cluster --------------------------------------------------------------------

    async def refresh_topology(self) -> None:
        """Reads CLUSTER SLOTS from any reachable node (no-op outside a cluster)."""
        if not self._cluster:
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
        await asyncio.shield(self._refreshing)

    async def _refresh(self) -> None:
        errors: list[str] = []
        # The seeds first (a node met in a redirect may be gone), each node once.
        for node in dict.fromkeys([*self._seeds, *self._nodes.values()]):
            try:
                slots = await node.execute(pack("CLUSTER", "SLOTS"), self._timeout_s)
            except StoreUnavailable as exc:
                errors.append(str(exc))
                continue
            owner: list[NodeClient | None] = [None] * 16384
            for start, end, primary, *_replicas in slots:
                host = primary[0] or node.address[0]
                target = self._node(host, int(primary[1]))
                for slot in range(int(start), int(end) + 1):
                    owner[slot] = target
            self._slot_owner = owner
            return
        raise StoreUnavailable("no cluster node answered CLUSTER SLOTS: " + "; ".join(errors))

    async def _owner(self, key: str, deadline: float) -> NodeClient:
        if not self._cluster:
            return await self._primary(deadline)
        slot = key_slot(key.encode())
        node = self._slot_owner[slot]
        if node is None:
            await self.refresh_topology()
            node = self._slot_owner[slot]
            if node is None:
                raise StoreUnavailable(f"redis cluster: no node serves slot {slot}")
        return node

    async def execute(self, route_key: str, *args: Any, script_source: str | None = None) -> Any:
        """Runs one command on the node that owns ``route_key``.

        With ``script_source``, the command is an EVALSHA: a NOSCRIPT reply (restart,
        failover, SCRIPT FLUSH, a node that joined later) loads the script on the
        node that gave it, and the call is retried once.
        """
        if self._closed:
            raise StoreUnavailable("redis client closed")
        packed = pack(*args)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        node = await self._owner(route_key, deadline)
        # Outside a cluster the first command gets what the wait for a master left of
        # the timeout (all of it when a master was known); a cluster's topology read,
        # redirects and a NOSCRIPT reload get a timeout each, as before.
        timeout_s = self._timeout_s if self._cluster else self._remaining(deadline, node)
        asking = False
        for _ in range(_MAX_REDIRECTS + 1):
            try:
                if asking:
                    return await node.execute(pack("ASKING") + packed, timeout_s, 2)
                return await node.execute(packed, timeout_s)
            except Redirect as redirect:
                node = self._node(*redirect.address)
                timeout_s = self._timeout_s
                asking = redirect.kind == "ASK"
                if not asking:
                    self._slot_owner[redirect.slot] = node
                    self._schedule_refresh()
            except redis_errors.NoScriptError:
                if script_source is None:
                    raise
                await node.execute(pack("SCRIPT", "LOAD", script_source), self._timeout_s)
                timeout_s = self._timeout_s
                script_source = None
            except StoreUnavailable:
                self._failed_on(node)
                raise
        raise StoreUnavailable("redis cluster: too many redirects")

    async def execute_on_primaries(self, *args: Any) -> list[Any]:
        """Runs one command on every primary (SCRIPT LOAD), or on the one server."""
        packed = pack(*args)
        if not self._cluster:
            deadline = asyncio.get_running_loop().time() + self._timeout_s
            node = await self._primary(deadline)
            try:
                return [await node.execute(packed, self._remaining(deadline, node))]
            except StoreUnavailable:
                self._failed_on(node)
                raise
        await self.refresh_topology()
        primaries = {id(node): node for node in self._slot_owner if node is not None}
        return list(
            await asyncio.gather(
                *(node.execute(packed, self._timeout_s) for node in primaries.values())
            )
        )

    def _remaining(self, deadline: float, node: NodeClient) -> float:
        """What is left of a call's timeout once its node is known; a call that
        spent it all waiting for a master fails here rather than send a command that
        its caller will not wait for."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise StoreUnavailable(
                f"redis at {node.describe()}: the {self._timeout_s * 1000:.0f} ms timeout "
                "was spent waiting for the master"
            )
        return remaining

    def _schedule_refresh(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
            self._refreshing.add_done_callback(_quiet)

    async def close(self) -> None:
        self._closed = True
        for task in (self._refreshing, self._watcher, self._discovering):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        for node in [*self._nodes.values(), *self._sentinels]:
            node.close()
        if self._master is not None:
            self._master.close()

    def nodes(self) -> Sequence[NodeClient]:
        return list(self._nodes.values())


def _quiet(task: asyncio.Task[Any]) -> None:
    """Retrieves a background task's failure (its awaiters, if any, see it raised)."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("redis topology refresh failed: %s", task.exception())
