"""The script store's transport to Redis: redis-py's asyncio client, with hiredis.

redis-py speaks the protocol, pools connections, authenticates, does TLS, and routes
a cluster's commands (MOVED, ASK, TRYAGAIN, topology refresh). qosd adds what a store
on the request path needs on top: one deadline for a whole call, redirects and a
script reload included; no retry of a command that may already have run (a batch
applied twice would admit twice); every failure that means "not now" as
``StoreUnavailable``, so that requests fail per ``fail_mode``; and a NOSCRIPT reply
answered by loading the script and running it again. Sentinel is
``qosd.store.sentinel``. Why redis-py and not a client of qosd's own:
docs/adr/0005-redis-py-client.md.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import ConnectionPool, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig

from qosd.config import RedisConfig, RedisMode, parse_host_port
from qosd.model import StoreUnavailable
from qosd.store.transport import Transport

T = TypeVar("T")

# Replies that mean "not now" rather than "your command is wrong". NOREPLICAS: a
# master configured with min-replicas-to-write that lost its replicas, as an old
# master does the moment Sentinel promotes its replica.
_UNAVAILABLE_CODES = frozenset(
    {"LOADING", "READONLY", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "OOM", "BUSY", "NOREPLICAS"}
)


class AuthFailed(StoreUnavailable):
    """Redis refused the credentials (AUTH answered WRONGPASS or an error like it).

    Still a StoreUnavailable, so requests fail per ``fail_mode`` (the daemon keeps
    running); apart, so that start-up can say plainly that the credentials are wrong
    rather than that Redis is down. The credentials are read once, at start: a
    corrected password or user takes a restart (``redis.*`` is restart-only)."""


def store_error(
    exc: redis_errors.RedisError | redis_errors.RedisClusterException, where: str
) -> Exception:
    """What the store sees of a redis-py error: ``StoreUnavailable`` (or
    ``AuthFailed``) for an outage, anything else as redis-py raised it.

    ``RedisClusterException`` is not a ``RedisError``: redis-py raises it when no
    startup node answers and when a slot has no node, both outages here."""
    if isinstance(exc, redis_errors.RedisClusterException):
        return StoreUnavailable(f"redis at {where}: {exc}")
    if isinstance(exc, redis_errors.AuthenticationError | redis_errors.AuthorizationError):
        return AuthFailed(f"redis at {where} refused the credentials: {exc}")
    if isinstance(
        exc,
        redis_errors.ConnectionError
        | redis_errors.TimeoutError
        | redis_errors.ClusterError
        | redis_errors.MaxConnectionsError,
    ):
        return StoreUnavailable(f"redis at {where}: {exc or type(exc).__name__}")
    if isinstance(exc, redis_errors.ResponseError):
        code = str(exc).split(" ", 1)[0]
        if code in _UNAVAILABLE_CODES or isinstance(exc, redis_errors.ReadOnlyError):
            return StoreUnavailable(f"redis at {where}: {exc}")
    return exc


async def within(timeout_s: float, where: str, call: Callable[[], Awaitable[T]]) -> T:
    """``call`` within one deadline, its errors as ``store_error`` says."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call()
    except TimeoutError:
        raise StoreUnavailable(
            f"redis at {where} did not answer within {timeout_s * 1000:.0f} ms"
        ) from None
    except (redis_errors.RedisError, redis_errors.RedisClusterException) as exc:
        raise store_error(exc, where) from None


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for TLS to Redis (qosd.config.RedisTlsConfig); None: not set."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True

    def client_options(self, url_options: dict[str, Any]) -> dict[str, Any]:
        """redis-py's TLS options: the files set here win over the URL's
        ``ssl_ca_certs``, ``ssl_certfile`` and ``ssl_keyfile``; the system's CAs
        when neither names any; no checks at all only when asked."""
        options = {
            "ssl_ca_certs": self.ca_file or url_options.get("ssl_ca_certs"),
            "ssl_certfile": self.cert_file or url_options.get("ssl_certfile"),
            "ssl_keyfile": self.key_file or url_options.get("ssl_keyfile"),
        }
        if not self.verify or str(url_options.get("ssl_cert_reqs", "")).lower() == "none":
            options.update(ssl_cert_reqs="none", ssl_check_hostname=False)
        return options


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How qosd connects: what the URL says, with the config's overrides."""

    timeout_s: float
    connect_timeout_s: float
    max_connections: int
    url_options: dict[str, Any]
    tls: bool
    tls_files: TlsFiles

    @classmethod
    def of(cls, config: RedisConfig) -> ClientOptions:
        """``config.password`` and ``config.username`` win over the URL's."""
        url = config.url or "redis://localhost:6379/0"
        pool = ConnectionPool.from_url(url)  # reads the URL as redis-py documents it
        url_options = dict(pool.connection_kwargs)
        if config.password is not None:
            url_options["password"] = config.password.get_secret_value()
        if config.username is not None:
            url_options["username"] = config.username
        files = TlsFiles() if config.tls is None else TlsFiles(**config.tls.model_dump())
        return cls(
            timeout_s=config.timeout_ms / 1000,
            connect_timeout_s=config.connect_timeout_ms / 1000,
            max_connections=config.connections_per_node,
            url_options=url_options,
            tls=issubclass(pool.connection_class, SSLConnection),
            tls_files=files,
        )

    def client_kwargs(self, *, tls: bool | None = None, credentials: bool = True) -> dict[str, Any]:
        """Keyword arguments for a redis-py client of one node (host and port aside).

        ``tls``: None as the URL says. ``credentials``: the URL's user, password and
        db (False for a sentinel, which has its own)."""
        url = self.url_options
        kwargs: dict[str, Any] = {
            # No socket timeout: every call runs under one deadline of its own
            # (``within``), and a reply it stopped waiting for closes the connection.
            # redis-py writes under asyncio.wait_for when a socket timeout is set, and
            # on Python 3.11 wait_for loses a cancellation that meets a finished
            # write: the SLO loop's stop then never ended (ADR 0005).
            "socket_timeout": None,
            "socket_connect_timeout": self.connect_timeout_s,
            # A command that timed out may have run: never send it again.
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": True,
            # No CLIENT SETINFO at connect: qosd's ACL user need not be allowed it.
            "driver_info": None,
            # Off, not redis-py's "auto": while on, a pool hands out a connection the
            # server has closed (its check for that is skipped), and the call fails
            # where a fresh connection would have served it (after a Redis restart,
            # once per pooled connection).
            "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        }
        if credentials:
            kwargs.update(
                username=url.get("username"), password=url.get("password"), db=url.get("db", 0)
            )
        if self.tls if tls is None else tls:
            kwargs.update(ssl=True, **self.tls_files.client_options(url))
        return kwargs


class Node:
    """One server's client, for a standalone server, a master Sentinel names, or a
    sentinel. Calls run one per connection; ``max_connections`` of them at once,
    more wait (within their deadline)."""

    def __init__(
        self, address: tuple[str, int], options: ClientOptions, *,
        unix_path: str | None = None, **kwargs: Any,
    ) -> None:  # fmt: skip
        """``kwargs``: ``ClientOptions.client_kwargs``'s."""
        self.address = address
        self._unix_path = unix_path
        self._timeout_s = options.timeout_s
        where: dict[str, Any] = (
            {"path": unix_path} if unix_path else {"host": address[0], "port": address[1]}
        )
        connection_class: type[aioredis.Connection] | type[aioredis.UnixDomainSocketConnection]
        if unix_path:
            connection_class = aioredis.UnixDomainSocketConnection
        elif kwargs.pop("ssl", False):
            connection_class = aioredis.SSLConnection
        else:
            connection_class = aioredis.Connection
        # from_pool: the client owns the pool, so that closing it closes the
        # connections (a client given a pool leaves them open).
        self.client = aioredis.Redis.from_pool(
            aioredis.BlockingConnectionPool(
                max_connections=options.max_connections,
                timeout=None,  # the call's deadline bounds the wait
                connection_class=connection_class,
                **where,
                **kwargs,
            )
        )
        # Set once the node is no longer wanted (an old master after a failover, a
        # replica a sentinel named): a caller that still holds it gets
        # StoreUnavailable instead of a fresh connection that nothing would close.
        self.retired = False

    def describe(self) -> str:
        return self._unix_path or f"{self.address[0]}:{self.address[1]}"

    async def execute(
        self, *args: Any, script_source: str | None = None, timeout_s: float | None = None
    ) -> Any:
        """One command within one deadline (the node's timeout unless given); with
        ``script_source``, an EVALSHA that reloads its script on NOSCRIPT."""
        if self.retired:
            raise StoreUnavailable(f"redis at {self.describe()} is no longer used (retired)")
        run: Callable[..., Awaitable[Any]] = self.client.execute_command
        return await within(
            self._timeout_s if timeout_s is None else timeout_s,
            self.describe(),
            lambda: run(*args) if script_source is None else with_reload(run, args, script_source),
        )

    async def close(self) -> None:
        self.retired = True
        await self.client.aclose()


class StandaloneTransport:
    """One Redis server: every command goes to it."""

    def __init__(self, options: ClientOptions) -> None:
        url = options.url_options
        path = url.get("path")
        self.node = Node(
            (str(url.get("host", "localhost")), int(url.get("port", 6379))),
            options,
            unix_path=str(path) if path else None,
            **options.client_kwargs(),
        )

    async def execute(self, route_key: str, *args: Any, script_source: str | None = None) -> Any:
        return await self.node.execute(*args, script_source=script_source)

    async def execute_on_primaries(self, *args: Any) -> list[Any]:
        return [await self.node.execute(*args)]

    async def close(self) -> None:
        await self.node.close()


class ClusterTransport:
    """A Redis Cluster, through redis-py's cluster client: it keeps the slot map,
    follows MOVED and ASK, waits out TRYAGAIN, re-reads the topology after a failure,
    and closes the nodes that leave it."""

    def __init__(self, options: ClientOptions, seeds: list[tuple[str, int]]) -> None:
        url = options.url_options
        first = (str(url.get("host", "localhost")), int(url.get("port", 6379)))
        kwargs = options.client_kwargs()
        kwargs.pop("db", None)  # a cluster has one database
        self._client = RedisCluster(
            # The URL's node first, then the seeds, for when it is down at start.
            startup_nodes=[ClusterNode(*node) for node in dict.fromkeys([first, *seeds])],
            max_connections=options.max_connections,
            **kwargs,
        )
        # At most max_connections calls at once in all, so that no node's pool (which
        # fails rather than waits when it runs out) ever runs out.
        self._calls = asyncio.Semaphore(options.max_connections)
        self._timeout_s = options.timeout_s

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        async def bounded() -> T:
            async with self._calls:
                return await call()

        return await within(self._timeout_s, "redis cluster", bounded)

    async def execute(self, route_key: str, *args: Any, script_source: str | None = None) -> Any:
        run = self._client.execute_command
        if script_source is None:
            return await self._call(lambda: run(*args))
        return await self._call(lambda: with_reload(run, args, script_source))

    async def execute_on_primaries(self, *args: Any) -> list[Any]:
        async def on_every_primary() -> list[Any]:
            await self._client.initialize()
            primaries = self._client.get_primaries()
            return list(
                await asyncio.gather(
                    *(self._client.execute_command(*args, target_nodes=node) for node in primaries)
                )
            )

        return await self._call(on_every_primary)

    async def close(self) -> None:
        await self._client.aclose()


async def with_reload(
    run: Callable[..., Awaitable[Any]], args: tuple[Any, ...], source: str
) -> Any:
    """An EVALSHA; on NOSCRIPT (a restart, a failover, SCRIPT FLUSH, a node that
    joined later), loads the script where the key lives and runs it once more."""
    try:
        return await run(*args)
    except redis_errors.NoScriptError:
        # One word, as redis-py's script_load sends it: a cluster client then sends it
        # to every primary.
        await run("SCRIPT LOAD", source)
        return await run(*args)


def redis_transport(config: RedisConfig) -> Transport:
    """The transport ``config`` names: standalone, Cluster or Sentinel."""
    options = ClientOptions.of(config)
    if config.mode is RedisMode.CLUSTER:
        return ClusterTransport(options, [parse_host_port(seed) for seed in config.cluster_seeds])
    if config.mode is RedisMode.SENTINEL:
        from qosd.store.sentinel import SentinelTransport  # noqa: PLC0415 - avoids a cycle

        return SentinelTransport(options, config)
    return StandaloneTransport(options)
