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
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

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
from qosd.store.batching import ScriptBatcher
from qosd.store.resp import RespClient

log = logging.getLogger(__name__)

_WINDOW_EXPIRE_MS = 7 * 24 * 3600 * 1000


# Scripts that start with the shared bucket helpers of _buckets.lua.
_WITH_BUCKETS = frozenset({"acquire", "release", "tokens"})


@dataclass(frozen=True, slots=True)
class _Script:
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> _Script:
        folder = resources.files("qosd.store").joinpath("lua")
        source = folder.joinpath(f"{name}.lua").read_text("utf-8")
        if name in _WITH_BUCKETS:
            source = folder.joinpath("_buckets.lua").read_text("utf-8") + source
        return cls(source=source, sha=hashlib.sha1(source.encode("utf-8")).hexdigest())


class RedisStore:
    def __init__(self, config: RedisConfig, tombstone_ms: int) -> None:
        assert config.url is not None
        self._config = config
        # A lease hash must outlive its newest lease's TTL by the tombstone time, plus
        # its one-second filing width and some clock skew between replicas.
        self._keep_extra_ms = tombstone_ms + 5_000
        self._client = RespClient(
            config.url,
            cluster=config.mode is RedisMode.CLUSTER,
            timeout_s=config.timeout_ms / 1000,
            connect_timeout_s=config.connect_timeout_ms / 1000,
            connections_per_node=config.connections_per_node,
        )
        self._scripts = {
            name: _Script.load(name)
            for name in ("acquire", "release", "report", "leases", "tokens")
        }
        self._pool_prefixes: dict[str, str] = {}
        self._policy_cache: dict[ClassPolicy, tuple[str, str, str, str, str, str]] = {}
        # Redis time minus this process's monotonic clock, in microseconds, learned
        # from every acquire reply; None until the first one.
        self._redis_clock_offset_us: float | None = None
        # A batch must have run this long before its callers' timeout, so that its
        # reply still finds them waiting.
        self._deadline_budget_us = max(config.timeout_ms * 1000 - 10_000, config.timeout_ms * 500)
        self._acquires = ScriptBatcher(
            self._runner(self._scripts["acquire"]),
            fields=8,
            batch_args=self._acquire_deadline,
            header=1,
            on_header=self._learn_redis_clock,
            on_orphan=self._undo_admission,
        )
        self._releases = ScriptBatcher(self._runner(self._scripts["release"]), fields=4)
        self._orphans: set[asyncio.Task[Any]] = set()

    def _prefix(self, pool: str) -> str:
        prefix = self._pool_prefixes.get(pool)
        if prefix is None:
            prefix = f"{self._config.key_prefix}:{{{pool}}}:"
            self._pool_prefixes[pool] = prefix
        return prefix

    async def start(self) -> None:
        """Loads the scripts. A store that is down now is not fatal: calls recover later."""
        try:
            for script in self._scripts.values():
                await self._client.execute_on_primaries("SCRIPT", "LOAD", script.source)
        except StoreUnavailable as exc:
            log.warning("redis not reachable at start (%s); will retry on demand", exc)

    async def close(self) -> None:
        await self._acquires.close()
        await self._releases.close()
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        await self._client.close()

    async def ping(self) -> None:
        await self._client.execute_on_primaries("PING")

    async def _run(self, script: _Script, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self._client.execute(
            keys[0], "EVALSHA", script.sha, len(keys), *keys, *args, script_source=script.source
        )

    def _runner(self, script: _Script) -> Callable[[Sequence[str], Sequence[Any]], Any]:
        async def run(keys: Sequence[str], args: Sequence[Any]) -> Any:
            return await self._run(script, keys, args)

        return run

    def _policy_args(self, policy: ClassPolicy) -> tuple[str, str, str, str, str, str]:
        """Per-(pool, class) strings every Acquire sends, computed once."""
        cached = self._policy_cache.get(policy)
        if cached is None:
            prefix = self._prefix(policy.pool)
            cached = (
                prefix,
                f"{prefix}bucket:{policy.name}",
                repr(policy.rate),
                repr(policy.burst),
                repr(policy.max_cost),
                repr(policy.weight),
            )
            self._policy_cache[policy] = cached
        return cached

    def _lease_location(self, prefix: str, lease_id: str) -> tuple[str, str]:
        """The lease hash (one per pool and epoch second) and field (``class:token``).

        The field names the class, so a lease id edited to name another class finds
        no lease instead of settling against the other class's bucket.
        """
        field = lease_id.partition(":")[2]
        return f"{prefix}leases:{field.rpartition(':')[2][:8]}", field

    def _acquire_deadline(self) -> tuple[str]:
        """The Redis time after which a batch sent now must not charge anything.

        Its callers stop waiting after ``redis.timeout_ms`` and are told the store is
        unavailable (or admitted, failing open). A batch that Redis runs later, say
        after a pause, must therefore change nothing. Replica clocks enter only as a
        duration; 0 (no deadline) until the offset to Redis time is known.
        """
        offset = self._redis_clock_offset_us
        if offset is None:
            return ("0",)
        return (f"{time.monotonic_ns() / 1000 + offset + self._deadline_budget_us:.0f}",)

    def _learn_redis_clock(self, header: list[Any]) -> None:
        self._redis_clock_offset_us = float(header[0]) - time.monotonic_ns() / 1000

    async def acquire(self, policy: ClassPolicy, cost: float, lease: LeaseSpec) -> BucketDecision:
        prefix, bucket_key, rate, burst, max_cost, weight = self._policy_args(policy)
        lease_hash, field = self._lease_location(prefix, lease.lease_id)
        if lease.request_id:
            keys: tuple[str, ...] = (bucket_key, lease_hash, f"{prefix}req:{lease.request_id}")
        else:
            keys = (bucket_key, lease_hash)
        args = (
            repr(cost),
            rate,
            burst,
            max_cost,
            lease.lease_id,
            field,
            lease.ttl_ms,
            lease.ttl_ms + self._keep_extra_ms,
            weight,
            lease.input_tokens,
            lease.output_tokens,
            1 if lease.request_id else 0,
        )
        reply = await self._acquires.submit(prefix, keys, args)
        if reply[1] == Reason.BACKEND_UNAVAILABLE:  # the batch ran past its deadline
            raise StoreUnavailable("redis ran the request after its timeout; nothing charged")
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

    def _undo_admission(self, args: Sequence[Any], reply: list[Any]) -> None:
        """Refunds an admission whose caller left while the batch was in flight.

        Nobody will use or release that lease, so it is settled at once as a
        cancelled request that used nothing, refunding the whole charge. Not so for
        a request with a request id: its caller will retry, and the retry must find
        the admission it was charged for (unused, it expires with its estimate).
        """
        admitted, lease_id, replayed = reply[0], reply[2], reply[7]
        has_request_id = args[11] == 1
        if admitted != 1 or replayed == 1 or has_request_id:
            return
        pool, qos_class, _token = lease_id.split(":")
        rate, burst = float(args[1]), float(args[2])
        task = asyncio.get_running_loop().create_task(
            self._release_raw(pool, qos_class, lease_id, rate, burst, 0, 0, 0.0, 3, exact=True)
        )
        self._orphans.add(task)
        task.add_done_callback(self._undo_done)

    def _undo_done(self, task: asyncio.Task[Any]) -> None:
        self._orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "could not refund an admission whose caller left (its estimate stands "
                "until the lease expires): %s",
                task.exception(),
            )

    async def release(self, policy: ClassPolicy, lease_id: str, usage: UsageReport) -> Settlement:
        status, charged, adjustment, remaining = await self._release_raw(
            policy.pool,
            policy.name,
            lease_id,
            policy.rate,
            policy.burst,
            "" if usage.input_tokens is None else usage.input_tokens,
            "" if usage.output_tokens is None else usage.output_tokens,
            usage.output_weight,
            int(usage.outcome),
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

    async def _release_raw(
        self,
        pool: str,
        qos_class: str,
        lease_id: str,
        rate: float,
        burst: float,
        input_tokens: int | str,
        output_tokens: int | str,
        output_weight: float,
        outcome: int,
        *,
        exact: bool = False,
    ) -> list[Any]:
        prefix = self._prefix(pool)
        lease_hash, field = self._lease_location(prefix, lease_id)
        return await self._releases.submit(
            prefix,
            (lease_hash, f"{prefix}bucket:{qos_class}"),
            (
                field,
                input_tokens,
                output_tokens,
                repr(output_weight),
                repr(rate),
                repr(burst),
                outcome,
                1 if exact else 0,
            ),
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
        raw = await self._client.execute(key, "LRANGE", key, 0, -1)
        return [StoredSample.decode(item) for item in raw]

    async def active_leases(self, pool: str) -> int:
        """Counts live leases by scanning the pool's lease hashes: an admin query."""
        prefix = self._prefix(pool)
        pattern = f"{prefix}leases:*"
        cursor, hashes = "0", []
        while True:
            cursor, found = await self._client.execute(
                pattern, "SCAN", cursor, "MATCH", pattern, "COUNT", 1000
            )
            hashes.extend(found)
            if cursor == "0":
                break
        if not hashes:
            return 0
        return int(await self._run(self._scripts["leases"], hashes, ()))

    async def bucket_tokens(self, policy: ClassPolicy) -> float:
        reply = await self._run(
            self._scripts["tokens"],
            (f"{self._prefix(policy.pool)}bucket:{policy.name}",),
            (repr(policy.rate), repr(policy.burst)),
        )
        return float(reply)
