"""A small pipelined Redis client for the hot path, standalone or cluster.

Why not redis-py's asyncio client: inside a grpc.aio server on our hardware, one
redis-py call costs about 100 us of CPU, more than the RPC itself, and halves the
daemon's throughput (docs/performance.md has the measurement). This client keeps
every command of a connection in one pipeline, matches replies to callers in order,
parses with hiredis (the C parser redis-py itself uses), and packs commands with
``hiredis.pack_command``. It takes URL parsing, slot hashing and exception classes
from redis-py. It does only what the store needs: send a command to the node that
owns a key, or to every primary, with a deadline; follow MOVED and ASK redirects.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import ssl
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis
import redis.exceptions as redis_errors
from redis.asyncio.connection import parse_url
from redis.crc import key_slot

from qosd.model import StoreUnavailable

log = logging.getLogger(__name__)

# Replies that mean "not now" rather than "your command is wrong".
_UNAVAILABLE_CODES = frozenset(
    {"LOADING", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "OOM", "BUSY"}
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


@dataclass(frozen=True, slots=True)
class ConnectionSettings:
    username: str | None = None
    password: str | None = None
    db: int = 0
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = 0.25


class _Protocol(asyncio.Protocol):
    """One connection: replies arrive in the order commands were written."""

    def __init__(self) -> None:
        self._reader = hiredis.Reader(encoding="utf-8")
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._transport: asyncio.Transport | None = None
        self.closed = False

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
        size: int = 2,
    ) -> None:  # fmt: skip
        self.address = (host, port)
        self._unix_path = unix_path
        self._settings = settings
        self._slots: list[_Protocol | None] = [None] * size
        self._connecting: list[asyncio.Task[_Protocol] | None] = [None] * size
        self._next = itertools.cycle(range(size))

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        settings = self._settings
        protocol: _Protocol | None = None
        try:
            async with asyncio.timeout(settings.connect_timeout_s):
                if self._unix_path is not None:
                    _, protocol = await loop.create_unix_connection(_Protocol, self._unix_path)
                else:
                    _, protocol = await loop.create_connection(
                        _Protocol, self.address[0], self.address[1], ssl=settings.ssl_context
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
                        raise StoreUnavailable(f"redis {command[0]} failed: {reply}")
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

    def close(self) -> None:
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


class RespClient:
    """Routes commands to the right node of a standalone server or a cluster."""

    def __init__(
        self, url: str, *, cluster: bool, timeout_s: float, connect_timeout_s: float,
        connections_per_node: int = 2, password: str | None = None,
        tls: TlsFiles | None = None, seeds: Sequence[tuple[str, int]] = (),
    ) -> None:  # fmt: skip
        """``password`` wins over one in ``url``, and ``tls``'s files over its
        ``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile``. ``seeds``: more cluster
        nodes to ask for the topology when the URL's node does not answer."""
        options = parse_url(url)
        context = tls_context(options, tls) if url.startswith("rediss://") else None
        self._settings = ConnectionSettings(
            username=options.get("username"),
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

    def _node(self, host: str, port: int, unix_path: str | None = None) -> NodeClient:
        node = self._nodes.get((host, port))
        if node is None:
            node = NodeClient(host, port, self._settings, unix_path=unix_path, size=self._per_node)
            self._nodes[(host, port)] = node
        return node

    async def refresh_topology(self) -> None:
        """Reads CLUSTER SLOTS from any reachable node (no-op for a standalone server)."""
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

    async def _owner(self, key: str) -> NodeClient:
        if not self._cluster:
            return self._seed
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
        node = await self._owner(route_key)
        asking = False
        for _ in range(_MAX_REDIRECTS + 1):
            try:
                if asking:
                    return await node.execute(pack("ASKING") + packed, self._timeout_s, 2)
                return await node.execute(packed, self._timeout_s)
            except Redirect as redirect:
                node = self._node(*redirect.address)
                asking = redirect.kind == "ASK"
                if not asking:
                    self._slot_owner[redirect.slot] = node
                    self._schedule_refresh()
            except redis_errors.NoScriptError:
                if script_source is None:
                    raise
                await node.execute(pack("SCRIPT", "LOAD", script_source), self._timeout_s)
                script_source = None
            except StoreUnavailable:
                if self._cluster:
                    self._schedule_refresh()  # a primary may have moved
                raise
        raise StoreUnavailable("redis cluster: too many redirects")

    async def execute_on_primaries(self, *args: Any) -> list[Any]:
        """Runs one command on every primary (SCRIPT LOAD), or on the one server."""
        packed = pack(*args)
        if not self._cluster:
            return [await self._seed.execute(packed, self._timeout_s)]
        await self.refresh_topology()
        primaries = {id(node): node for node in self._slot_owner if node is not None}
        return list(
            await asyncio.gather(
                *(node.execute(packed, self._timeout_s) for node in primaries.values())
            )
        )

    def _schedule_refresh(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
            self._refreshing.add_done_callback(_quiet)

    async def close(self) -> None:
        self._closed = True
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(BaseException):
                await self._refreshing
        for node in self._nodes.values():
            node.close()

    def nodes(self) -> Sequence[NodeClient]:
        return list(self._nodes.values())


def _quiet(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("cluster topology refresh failed: %s", task.exception())
