"""Redis store: thin Python around the Lua scripts in ``lua/``.

Every state change is one script call, so it is atomic on the server and costs one
round trip. The scripts read time from ``redis.call('TIME')``: replica clocks never
enter the arithmetic. All keys of a pool carry the pool's hash tag
(``qosd:{pool}:...``), so each call touches one cluster slot and runs unchanged on
Redis Cluster. Scripts are loaded at start and called by SHA; a server that lost
them (restart, failover, SCRIPT FLUSH) gets them again on the NOSCRIPT reply.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as redis_errors
from redis.asyncio.cluster import RedisCluster

from qosd.config import ClassPolicy, RedisConfig, RedisMode
from qosd.model import (
    BucketDecision,
    LeaseExpired,
    LeaseNotFound,
    LeaseSpec,
    Reason,
    Sample,
    Settlement,
    StoredSample,
    StoreUnavailable,
    UsageReport,
)

log = logging.getLogger(__name__)

# Errors that mean "the store is not usable right now" rather than "a bug".
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis_errors.ConnectionError,
    redis_errors.TimeoutError,
    redis_errors.BusyLoadingError,
    redis_errors.ReadOnlyError,
    redis_errors.ClusterDownError,
    redis_errors.ClusterError,
    redis_errors.TryAgainError,
    redis_errors.MasterDownError,
    redis_errors.OutOfMemoryError,
    TimeoutError,
    OSError,
)

_WINDOW_EXPIRE_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True, slots=True)
class _Script:
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> _Script:
        source = resources.files("qosd.store").joinpath(f"lua/{name}.lua").read_text("utf-8")
        return cls(source=source, sha=hashlib.sha1(source.encode("utf-8")).hexdigest())


class RedisStore:
    def __init__(self, config: RedisConfig, tombstone_ms: int) -> None:
        assert config.url is not None
        self._config = config
        self._timeout_s = config.timeout_ms / 1000
        self._tombstone_ms = str(tombstone_ms)
        self._client: Any = self._make_client(config)
        self._scripts = {
            name: _Script.load(name)
            for name in ("acquire", "release", "report", "leases", "tokens")
        }
        self._acquire = self._scripts["acquire"]
        self._release = self._scripts["release"]
        self._pool_prefixes: dict[str, str] = {}

    @staticmethod
    def _make_client(config: RedisConfig) -> Any:
        assert config.url is not None
        common: dict[str, Any] = {
            "socket_timeout": config.timeout_ms / 1000,
            "socket_connect_timeout": config.connect_timeout_ms / 1000,
            "decode_responses": True,
        }
        if config.mode is RedisMode.CLUSTER:
            return RedisCluster.from_url(
                config.url, max_connections=config.max_connections, **common
            )
        # A blocking pool waits (within the call's timeout) for a free connection
        # instead of failing at once with MaxConnectionsError under a burst.
        pool = aioredis.BlockingConnectionPool.from_url(
            config.url,
            max_connections=config.max_connections,
            timeout=config.timeout_ms / 1000,
            **common,
        )
        return aioredis.Redis(connection_pool=pool)

    def _prefix(self, pool: str) -> str:
        prefix = self._pool_prefixes.get(pool)
        if prefix is None:
            prefix = f"{self._config.key_prefix}:{{{pool}}}:"
            self._pool_prefixes[pool] = prefix
        return prefix

    async def start(self) -> None:
        """Loads the scripts. A store that is down now is not fatal: calls recover later."""
        try:
            await self._load_scripts()
        except StoreUnavailable as exc:
            log.warning("redis not reachable at start (%s); will retry on demand", exc)

    async def _load_scripts(self) -> None:
        try:
            async with asyncio.timeout(self._config.connect_timeout_ms / 1000 + self._timeout_s):
                for script in self._scripts.values():
                    await self._client.script_load(script.source)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis: {exc or type(exc).__name__}") from exc

    async def close(self) -> None:
        await self._client.aclose()

    async def ping(self) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._client.ping()
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis: {exc or type(exc).__name__}") from exc

    async def _run(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            async with asyncio.timeout(self._timeout_s):
                try:
                    return await self._client.evalsha(script.sha, len(keys), *keys, *args)
                except redis_errors.NoScriptError:
                    await self._client.script_load(script.source)
                    return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis: {exc or type(exc).__name__}") from exc

    async def acquire(self, policy: ClassPolicy, cost: float, lease: LeaseSpec) -> BucketDecision:
        prefix = self._prefix(policy.pool)
        keys = [
            f"{prefix}bucket:{policy.name}",
            f"{prefix}lease:{lease.lease_id}",
            f"{prefix}leases",
        ]
        if lease.request_id:
            keys.append(f"{prefix}req:{lease.request_id}")
        reply = await self._run(
            self._acquire,
            keys,
            (
                repr(cost),
                repr(policy.rate),
                repr(policy.burst),
                repr(policy.max_cost),
                lease.lease_id,
                lease.ttl_ms,
                lease.ttl_ms + int(self._tombstone_ms),
                repr(lease.weight),
                lease.input_tokens,
                lease.output_tokens,
                lease.tenant,
            ),
        )
        admitted, reason, lease_id, charged, remaining, retry_ms, ttl_ms, replayed = reply
        return BucketDecision(
            admitted=admitted == 1,
            reason=Reason(reason),
            lease_id=lease_id,
            charged=float(charged),
            remaining=float(remaining),
            retry_after_ms=retry_ms,
            lease_ttl_ms=ttl_ms,
            replayed=replayed == 1,
        )

    async def release(self, policy: ClassPolicy, lease_id: str, usage: UsageReport) -> Settlement:
        prefix = self._prefix(policy.pool)
        status, charged, adjustment, remaining = await self._run(
            self._release,
            (f"{prefix}lease:{lease_id}", f"{prefix}bucket:{policy.name}", f"{prefix}leases"),
            (
                lease_id,
                "" if usage.input_tokens is None else usage.input_tokens,
                "" if usage.output_tokens is None else usage.output_tokens,
                repr(usage.output_weight),
                repr(policy.rate),
                repr(policy.burst),
                int(usage.outcome),
                self._tombstone_ms,
            ),
        )
        if status == "unknown":
            raise LeaseNotFound(f"lease {lease_id} is unknown (never issued, or forgotten)")
        if status == "expired":
            raise LeaseExpired(lease_id, float(charged))
        return Settlement(
            already_released=status == "again",
            charged=float(charged),
            adjustment=float(adjustment),
            remaining=float(remaining),
        )

    async def report(self, samples: Sequence[Sample], window_size: int) -> None:
        by_pool: dict[str, list[Sample]] = defaultdict(list)
        for sample in samples:
            by_pool[sample.pool].append(sample)
        for pool, pool_samples in by_pool.items():
            prefix = self._prefix(pool)
            key_index: dict[str, int] = {}
            args: list[Any] = [window_size, _WINDOW_EXPIRE_MS]
            for sample in pool_samples:
                index = key_index.setdefault(sample.qos_class, len(key_index) + 1)
                args.extend((index, sample.encode()))
            keys = [f"{prefix}window:{name}" for name in key_index]
            await self._run(self._scripts["report"], keys, args)

    async def window(self, pool: str, qos_class: str) -> list[StoredSample]:
        key = f"{self._prefix(pool)}window:{qos_class}"
        try:
            async with asyncio.timeout(self._timeout_s):
                raw = await self._client.lrange(key, 0, -1)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis: {exc or type(exc).__name__}") from exc
        return [StoredSample.decode(item) for item in raw]

    async def active_leases(self, pool: str) -> int:
        active, _forgotten = await self._run(
            self._scripts["leases"], (f"{self._prefix(pool)}leases",), ()
        )
        return int(active)

    async def bucket_tokens(self, policy: ClassPolicy) -> float:
        reply = await self._run(
            self._scripts["tokens"],
            (f"{self._prefix(policy.pool)}bucket:{policy.name}",),
            (repr(policy.rate), repr(policy.burst)),
        )
        return float(reply)
