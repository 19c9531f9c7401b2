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
import re
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from qosd.config import RedisConfig, RedisMode
from qosd.model import (
    Adjustment,
    BucketDecision,
    ClassStatus,
    ControlRecord,
    LeaseExpired,
    LeaseNotFound,
    LeaseSpec,
    Outcome,
    PassRead,
    PoolStatus,
    PrefillLearned,
    PumpResult,
    Reason,
    Sample,
    ServerLoad,
    Settlement,
    StoredSample,
    StoreUnavailable,
    TenantStatus,
    UsageReport,
    Waiter,
    WaiterState,
    lease_field,
    new_daemon_id,
)
from qosd.policy import ClassPolicy, FairShares, PoolPolicy, tenant_digest, tenant_of_lease
from qosd.store import contract
from qosd.store.batching import ScriptBatcher
from qosd.store.contract import Settled, Status
from qosd.store.epochs import EpochWatch, ResetListener
from qosd.store.redis_client import AuthFailed, redis_transport
from qosd.store.redis_clock import RedisClock
from qosd.store.transport import Transport

log = logging.getLogger(__name__)

_WINDOW_EXPIRE_MS = 7 * 24 * 3600 * 1000
#: Servers' pass reads kept per pool: ten minutes of reads every 5 s from 100 servers.
PASS_WINDOW = 12_000
#: A pool whose servers stopped reporting passes forgets them within the hour.
_PASSES_EXPIRE_MS = 3600 * 1000
#: Scripts that start with the shared pool prelude.
POOL_SCRIPTS = frozenset({"acquire", "pump", "cancel", "release", "status", "adjust"})
#: The prelude's files in lua/pool/, by concern, in the order they run.
POOL_PRELUDE = ("args", "allocation", "state", "in_flight", "save", "budget", "deadline",
                "tenants", "waiters", "lease_writes")  # fmt: skip
#: Scripts that apply the shared formulas (lua/formulas.lua, before the prelude).
FORMULA_SCRIPTS = POOL_SCRIPTS | {"prefill"}
#: Every script qosd loads.
SCRIPTS = (
    "acquire", "pump", "cancel", "release", "status", "adjust", "control", "lead", "report",
    "load", "tenants", "prefill",
)  # fmt: skip
_CONSTANT = re.compile(r"local ([A-Z][A-Z0-9_]*) = ")
_NAME = re.compile(r"\b[A-Z][A-Z0-9_]*\b")


def script_source(name: str) -> str:
    """What qosd loads as script ``name``: the constants of _contract.lua it names,
    then the shared formulas for the scripts that apply them, then the pool prelude
    (``POOL_PRELUDE``) for a pool script, then the script.

    Only the constants a script names: a Lua function holds at most 200 locals, and
    the prelude has most of them already (a table of constants instead would cost
    every call microseconds to build).
    """
    folder = resources.files("qosd.store").joinpath("lua")
    source = folder.joinpath(f"{name}.lua").read_text("utf-8")
    if name in POOL_SCRIPTS:
        pool = folder.joinpath("pool")
        prelude = [pool.joinpath(f"{part}.lua").read_text("utf-8") for part in POOL_PRELUDE]
        source = "".join(prelude) + source
    if name in FORMULA_SCRIPTS:
        source = folder.joinpath("formulas.lua").read_text("utf-8") + source
    used = set(_NAME.findall(source))
    constants = [
        line
        for line in folder.joinpath("_contract.lua").read_text("utf-8").splitlines()
        if (match := _CONSTANT.match(line)) and match.group(1) in used
    ]
    return "\n".join(constants) + "\n" + source


def _request_key(prefix: str, lease: LeaseSpec) -> str:
    """Where a request id is recorded: in its pool (the prefix's hash tag) and its
    tenant's scope, by the tenant's digest (fixed length, so no tenant and id pair
    reads as another). Scoped by pool alone, one tenant could take another's ids (the
    test suite's own ``gw-7-000001``) and learn from the 409 which were in use."""
    return f"{prefix}req:{tenant_digest(lease.tenant)}:{lease.request_id}"


def _packed(args: tuple[Any, ...]) -> tuple[str]:
    """A packed layout's record as a call's arguments: one."""
    return (contract.pack(args),)


def _counter_key(prefix: str, cls: ClassPolicy, digest: str) -> str:
    """The key of a tenant's counter in a class that shares by tokens."""
    return f"{prefix}vtc:{cls.name}:{digest}"


@dataclass(frozen=True, slots=True)
class _Script:
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> _Script:
        source = script_source(name)
        return cls(source=source, sha=hashlib.sha1(source.encode("utf-8")).hexdigest())


@dataclass(frozen=True, slots=True)
class _PoolArgs:
    """What every pool script call of one pool carries: its keys and its policy."""

    prefix: str
    keys: tuple[str, ...]
    policy: tuple[Any, ...]


class RedisStore:
    def __init__(
        self,
        config: RedisConfig,
        tombstone_ms: int,
        stale_after_ms: int = 500,
        lease_ttl_ms: int = 300_000,
        transport: Transport | None = None,
        deadlines: bool = True,
        daemon_id: str | None = None,
    ) -> None:
        """``lease_ttl_ms`` is the usual lease TTL: its expiry second is read with the
        pool's state, so counting a lease in flight costs no extra command.
        ``daemon_id`` names this daemon's waiters in the shared queues, and pumps
        prove it alive (default: a new one).
        ``transport``: where the scripts run; by default the Redis ``config`` names.
        ``deadlines``: batches carry the Redis time after which they must change
        nothing (``_acquire_deadline``); a transport in process runs a call when it is
        made, so it needs none."""
        self._config = config
        self._deadlines = deadlines
        self._stale_after_ms = stale_after_ms
        self._lease_ttl_ms = lease_ttl_ms
        # A lease hash must outlive its newest lease's TTL by the tombstone time, plus
        # its one-second filing width and some clock skew between replicas.
        self._keep_extra_ms = tombstone_ms + 5_000
        self._client: Transport = transport or redis_transport(config)
        self._scripts = {name: _Script.load(name) for name in SCRIPTS}
        self._pool_args: dict[str, _PoolArgs] = {}
        self._pools: dict[str, PoolPolicy] = {}
        self.daemon_id = daemon_id or new_daemon_id()
        # Each pool's epoch as last seen (qosd/store/epochs.py), and what this store
        # adds to a new one: distinct even for two states made in the same microsecond.
        self._epochs = EpochWatch()
        self._epoch_nonce = uuid.uuid4().hex[:12]
        # Redis time against this process's clock, learned from every acquire reply.
        self._redis_clock = RedisClock()
        # A batch must have run this long before its callers' timeout, so that its
        # reply still finds them waiting.
        self._deadline_budget_us = max(config.timeout_ms * 1000 - 10_000, config.timeout_ms * 500)
        self._acquires = ScriptBatcher(
            self._runner(self._scripts["acquire"]),
            fields=contract.size(contract.Decision),
            batch_keys=self._group_keys,
            batch_args=self._acquire_batch_args,
            header=contract.size(contract.AcquireHeader),
            on_header=self._acquire_header,
            on_orphan=self._undo_admission,
        )
        self._releases = ScriptBatcher(
            self._runner(self._scripts["release"]),
            fields=contract.size(contract.Settlement),
            batch_keys=self._group_keys,
            batch_args=self._policy,
        )
        self._cancels = ScriptBatcher(
            self._runner(self._scripts["cancel"]),
            fields=contract.size(contract.Cancelled),
            batch_keys=self._group_keys,
            batch_args=self._policy,
        )
        self._orphans: set[asyncio.Task[Any]] = set()

    # -- plumbing -------------------------------------------------------------------

    def _args_for(self, pool: PoolPolicy) -> _PoolArgs:
        """Keys and policy of a pool's script calls, computed once per pool policy (a
        reload brings new PoolPolicy objects, and with them new arguments)."""
        cached = self._pool_args.get(pool.name)
        if cached is None or self._pools.get(pool.name) is not pool:
            prefix = f"{self._config.key_prefix}:{{{pool.name}}}:"
            keys = (
                f"{prefix}state",
                *(f"{prefix}queue:{cls.name}" for cls in pool.classes),
                f"{prefix}waiters",
                f"{prefix}daemons",
            )
            policy: list[str] = [
                contract.pack(
                    contract.PoolArgs(
                        capacity=repr(pool.capacity),
                        burst_s=repr(pool.burst_s),
                        stale_after_ms=self._stale_after_ms,
                        class_count=len(pool.classes),
                        lease_ttl_ms=self._lease_ttl_ms,
                        max_in_flight=repr(pool.max_in_flight),
                        max_in_flight_tokens=repr(pool.max_in_flight_tokens),
                        top_reserve=repr(pool.top_reserve),
                        top_peak_half_life_us=pool.top_peak_half_life_us,
                        prefill_backlog_us=repr(pool.prefill_backlog_us),
                        prefill_share=repr(pool.prefill_share),
                        max_server_waiting=pool.max_server_waiting,
                        max_kv_cache_usage=repr(pool.max_kv_cache_usage),
                        server_load_max_age_us=pool.server_load_max_age_us,
                        servers_by_priority=1 if pool.servers_by_priority else 0,
                        shared_pass_stretch=repr(pool.shared_pass_stretch),
                        output_weight=repr(pool.output_weight),
                        top_blocked_share=repr(pool.top_blocked_share),
                        top_blocked_burst_us=pool.top_blocked_burst_us,
                        servers=pool.servers,
                    )
                )
            ]
            for cls in pool.classes:
                policy.append(
                    contract.pack(
                        contract.ClassArgs(
                            name=cls.name,
                            rate=repr(cls.rate),
                            burst=repr(cls.burst),
                            max_cost=repr(cls.max_cost),
                            can_borrow=1 if cls.can_borrow else 0,
                            max_queue=cls.max_queue,
                            aging_ms=cls.aging_ms,
                            tenant_rate=repr(cls.tenant_rate),
                            tenant_burst=repr(cls.tenant_burst),
                            floor_rate=repr(cls.floor_rate),
                            burst_s=repr(cls.burst_s),
                            tenant_share=repr(cls.tenant_share),
                            fair_idle_ms=cls.fair.idle_ms if cls.fair else 0,
                        )
                    )
                )
            # As bytes once: what the client would encode on every call otherwise.
            cached = _PoolArgs(prefix, keys, tuple(value.encode() for value in policy))
            self._pool_args[pool.name] = cached
            self._pools[pool.name] = pool
        return cached

    def _group_keys(self, pool_name: str) -> Sequence[str]:
        return self._pool_args[pool_name].keys

    def _policy(self, pool_name: str) -> tuple[Any, ...]:
        """The arguments the pool prelude reads: the pool's policy, then the epoch this store
        last saw (a state found missing while one was known was lost: it starts
        empty) and the nonce a new epoch takes."""
        epoch = contract.EpochArgs(known=self._epochs.known(pool_name), nonce=self._epoch_nonce)
        return (*self._pool_args[pool_name].policy, *epoch)

    def _acquire_batch_args(self, pool_name: str) -> Sequence[Any]:
        own = contract.AcquireArgs(deadline_us=self._acquire_deadline(), daemon=self.daemon_id)
        return (*self._policy(pool_name), *own)

    def _acquire_deadline(self) -> str:
        """The Redis time after which a batch (or pump) sent now must not charge anything.

        Its callers stop waiting after ``redis.timeout_ms`` and are told the store is
        unavailable (or admitted, failing open). A batch that Redis runs later, say
        after a pause, must therefore change nothing. Replica clocks enter only as a
        duration; 0 (no deadline) until the offset to Redis time is known.
        """
        deadline = self._redis_clock.redis_time_in(self._deadline_budget_us)
        return "0" if deadline is None or not self._deadlines else f"{deadline:.0f}"

    def _acquire_header(self, pool_name: str, values: list[Any]) -> None:
        """An acquire batch's reply header: Redis time, then the pool's epoch."""
        header = contract.AcquireHeader._make(values)
        self._redis_clock.saw(float(header.now_us))
        self._epochs.saw(pool_name, header.epoch)

    def add_reset_listener(self, listener: ResetListener) -> None:
        self._epochs.add_listener(listener)

    @staticmethod
    def _lease_hash(prefix: str, lease_id: str) -> str:
        """The lease hash of a lease: one per pool and epoch second of its token."""
        return f"{prefix}leases:{lease_id.rpartition(':')[2][:8]}"

    async def start(self) -> None:
        """Loads the scripts. A store that is down now is not fatal: calls recover later."""
        try:
            for script in self._scripts.values():
                await self._client.execute_on_primaries("SCRIPT", "LOAD", script.source)
        except AuthFailed as exc:
            # Not an outage that passes: say so plainly (requests still fail per
            # fail_mode; the credentials were read at start, so fixing them takes a
            # restart).
            log.error(
                "redis refused qosd's credentials (%s); check redis.username and "
                "redis.password ($QOSD_REDIS_USERNAME, $QOSD_REDIS_PASSWORD)%s, then "
                "restart qosd (credentials are read at start)",
                exc,
                ", redis.sentinel_username and redis.sentinel_password"
                if self._config.mode is RedisMode.SENTINEL
                else "",
            )
        except StoreUnavailable as exc:
            log.warning("redis not reachable at start (%s); will retry on demand", exc)

    async def close(self) -> None:
        await self._acquires.close()
        await self._releases.close()
        await self._cancels.close()
        if self._orphans:
            await asyncio.gather(*self._orphans, return_exceptions=True)
        try:
            await self._client.close()
        except Exception as exc:  # redis-py's own TimeoutError among them
            # Closing sockets is best effort: a slow close (redis-py bounds it by the
            # connect timeout) must not fail a daemon's stop.
            log.warning("redis connections not closed cleanly: %s", exc)

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

    # -- acquire --------------------------------------------------------------------

    @staticmethod
    def _tenant_counter(
        prefix: str, cls: ClassPolicy, lease_id: str
    ) -> tuple[str, FairShares, str] | None:
        """The counter key of a lease's tenant, with the class's charges and the tenant's
        digest; None where the class does not share by tokens."""
        digest = tenant_of_lease(lease_id) if cls.fair else None
        if cls.fair is None or digest is None:
            return None
        return _counter_key(prefix, cls, digest), cls.fair, digest

    @classmethod
    def _fair_counter(cls, prefix: str, policy: ClassPolicy, lease: LeaseSpec) -> tuple[str, str]:
        """The tenant counter's key and the request's charge, where the class shares by
        tokens ((no key, '0') otherwise): queueing or admitting charges it, and a
        waiter that leaves unserved gets it back."""
        counter = cls._tenant_counter(prefix, policy, lease.lease_id)
        if counter is None:
            return "", "0"
        key, fair, digest = counter
        return key, repr(fair.charge(digest, lease.input_tokens, lease.output_tokens))

    def _request_keys(
        self, prefix: str, cls: ClassPolicy, lease: LeaseSpec
    ) -> tuple[list[str], int, int]:
        keys = [self._lease_hash(prefix, lease.lease_id)]
        has_request = 0
        if lease.request_id:
            keys.append(_request_key(prefix, lease))
            has_request = 1
        has_tenant = 0
        if cls.tenant_rate > 0:
            keys.append(f"{prefix}tenant:{cls.name}:{lease.tenant}")
            has_tenant = 1
        return keys, has_request, has_tenant

    async def acquire(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease: LeaseSpec,
        wait_ms: int,
        *,
        ttft_ms: float = 0.0,
        wait_cap_ms: int | None = None,
    ) -> BucketDecision:
        args_for = self._args_for(pool)
        keys, has_request, has_tenant = self._request_keys(args_for.prefix, cls, lease)
        fair_key, fair_charge = self._fair_counter(args_for.prefix, cls, lease)
        if fair_key:
            keys.append(fair_key)
        args = contract.RequestArgs(
            qos_class=cls.name,
            lease_id=lease.lease_id,
            field=lease_field(lease.lease_id),
            ttl_ms=lease.ttl_ms,
            keep_ms=lease.ttl_ms + self._keep_extra_ms,
            weight=repr(lease.weight),
            input_tokens=lease.input_tokens,
            output_tokens=lease.output_tokens,
            wait_ms=wait_ms,
            ttft_ms=repr(float(ttft_ms)),
            wait_cap_ms=wait_ms if wait_cap_ms is None else wait_cap_ms,
            has_request=has_request,
            has_tenant=has_tenant,
            fair_charge=fair_charge,
            estimated=1 if lease.estimated else 0,
        )
        reply = contract.Decision._make(await self._acquires.submit(pool.name, keys, _packed(args)))
        if reply.reason == Reason.BACKEND_UNAVAILABLE:  # the batch ran past its deadline
            raise StoreUnavailable("redis ran the request after its timeout; nothing charged")
        return BucketDecision(
            admitted=reply.status == Status.ADMITTED,
            reason=Reason(reply.reason),
            lease_id=reply.lease_id,
            charged=float(reply.charged),
            remaining=float(reply.remaining),
            retry_after_ms=reply.retry_after_ms,
            lease_ttl_ms=reply.lease_ttl_ms,
            queued=reply.status == Status.QUEUED,
            duplicate=reply.status == Status.DUPLICATE,
            burst=float(reply.burst),
            rate=float(reply.rate),
            requests_left=int(reply.requests.partition("|")[0] or -1),
            requests_bound=int(reply.requests.partition("|")[2] or -1),
        )

    def _undo_admission(self, keys: Sequence[str], args: Sequence[Any], reply: list[Any]) -> None:
        """Undoes what an Acquire did for a caller that left while it was in flight.

        An admission is settled at once as a cancelled request that used nothing,
        refunding the whole charge, and its request id (if any) is freed, so that the
        caller's retry is a new request; a queued request is taken out of its queue.
        """
        decision = contract.Decision._make(reply)
        request = contract.unpack(contract.RequestArgs, args[0])
        lease_id = decision.lease_id
        pool_name = lease_id.partition(":")[0] if lease_id else ""
        pool = self._pools.get(pool_name)
        if pool is None:
            return
        cls = next(c for c in pool.classes if c.name == request.qos_class)
        if decision.status == Status.ADMITTED:
            usage = UsageReport(0, 0, Outcome.CANCELLED)
            # unpacked: every field as its text
            request_key = keys[1] if str(request.has_request) == "1" else None
            coroutine: Any = self._settle(pool, cls, lease_id, usage, True, request_key)
        elif decision.status == Status.QUEUED:
            waiter = Waiter(request.qos_class, float(decision.charged), _lease_stub(lease_id))
            coroutine = self.cancel(pool, [waiter])
        else:
            return
        task = asyncio.get_running_loop().create_task(coroutine)
        self._orphans.add(task)
        task.add_done_callback(self._undo_done)

    def _undo_done(self, task: asyncio.Task[Any]) -> None:
        self._orphans.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "could not undo an Acquire whose caller left (an admission's estimate "
                "stands until the lease expires; a queue entry goes stale): %s",
                task.exception(),
            )

    # -- waiting --------------------------------------------------------------------

    async def pump(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> list[PumpResult]:
        args_for = self._args_for(pool)
        classes = {cls.name: cls for cls in pool.classes}
        keys: list[str] = list(args_for.keys)
        own = contract.PumpArgs(daemon=self.daemon_id, deadline_us=self._acquire_deadline())
        args: list[Any] = [len(waiters), *self._policy(pool.name), *own]
        for waiter in waiters:
            lease = waiter.lease
            cls = classes[waiter.qos_class]
            waiter_keys, has_request, has_tenant = self._request_keys(args_for.prefix, cls, lease)
            fair_key, fair_refund = self._fair_counter(args_for.prefix, cls, lease)
            keys += [*waiter_keys, fair_key] if fair_key else waiter_keys
            args += contract.WaiterArgs(
                field=waiter.id,
                qos_class=waiter.qos_class,
                lease_id=lease.lease_id,
                ttl_ms=lease.ttl_ms,
                keep_ms=lease.ttl_ms + self._keep_extra_ms,
                weight=repr(lease.weight),
                input_tokens=lease.input_tokens,
                output_tokens=lease.output_tokens,
                has_request=has_request,
                has_tenant=has_tenant,
                fair_refund=fair_refund,
            )
        reply = await self._run(self._scripts["pump"], keys, args)
        results: list[PumpResult] = []
        for answer in contract.records(contract.Decision, reply, len(waiters)):
            if answer.status == Status.ADMITTED:
                decision = BucketDecision(
                    admitted=True,
                    reason=Reason.NONE,
                    lease_id=answer.lease_id,
                    charged=float(answer.charged),
                    remaining=float(answer.remaining),
                    retry_after_ms=0,
                    lease_ttl_ms=answer.lease_ttl_ms,
                    burst=float(answer.burst),
                    rate=float(answer.rate),
                )
                results.append(PumpResult(WaiterState.ADMITTED, decision, int(answer.granted)))
            else:
                results.append(PumpResult(WaiterState(answer.status), None))
        return results

    async def cancel(self, pool: PoolPolicy, waiters: Sequence[Waiter]) -> None:
        args_for = self._args_for(pool)
        classes = {cls.name: cls for cls in pool.classes}
        calls = []
        for waiter in waiters:
            fair_key, refund = self._fair_counter(
                args_for.prefix, classes[waiter.qos_class], waiter.lease
            )
            keys = [_request_key(args_for.prefix, waiter.lease)] if waiter.lease.request_id else []
            keys += [fair_key] if fair_key else []
            args = contract.CancelArgs(waiter.id, waiter.qos_class, fair_refund=refund,
                                       has_request=1 if waiter.lease.request_id else 0)  # fmt: skip
            calls.append(self._cancels.submit(pool.name, tuple(keys), args))
        await asyncio.gather(*calls)

    # -- release --------------------------------------------------------------------

    async def release(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease_id: str,
        usage: UsageReport,
        frees_request_of: LeaseSpec | None = None,
    ) -> Settlement:
        request_key = None
        if frees_request_of is not None and frees_request_of.request_id:
            request_key = _request_key(self._args_for(pool).prefix, frees_request_of)
        return await self._settle(pool, cls, lease_id, usage, False, request_key)

    async def undo(self, pool: PoolPolicy, cls: ClassPolicy, lease: LeaseSpec) -> Settlement:
        prefix = self._args_for(pool).prefix
        request_key = _request_key(prefix, lease) if lease.request_id else None
        usage = UsageReport(0, 0, Outcome.CANCELLED)
        return await self._settle(pool, cls, lease.lease_id, usage, True, request_key)

    async def _settle(
        self,
        pool: PoolPolicy,
        cls: ClassPolicy,
        lease_id: str,
        usage: UsageReport,
        exact: bool,
        request_key: str | None,
    ) -> Settlement:
        """A release; ``exact``: the undo of an admission whose caller left (the whole
        charge back, not bounded by the burst). ``request_key`` is freed if it still
        names the lease."""
        args_for = self._args_for(pool)
        keys = [self._lease_hash(args_for.prefix, lease_id)]
        if request_key is not None:
            keys.append(request_key)
        counter = self._tenant_counter(args_for.prefix, cls, lease_id)
        fair_charges = ""
        if counter is not None:
            key, fair, digest = counter
            keys.append(key)
            fair_charges = "|".join(repr(c) for c in fair.per_token(digest))
        reply = await self._releases.submit(
            pool.name,
            keys,
            _packed(
                contract.ReleaseArgs(
                    qos_class=cls.name,
                    field=lease_field(lease_id),
                    input_tokens="" if usage.input_tokens is None else usage.input_tokens,
                    output_tokens="" if usage.output_tokens is None else usage.output_tokens,
                    outcome=int(usage.outcome),
                    exact=1 if exact else 0,
                    has_request=0 if request_key is None else 1,
                    fair_charges=fair_charges,
                )
            ),
        )
        settled = contract.Settlement._make(reply)
        if settled.status == Settled.UNKNOWN:
            raise LeaseNotFound(f"lease {lease_id} is unknown (never issued, or forgotten)")
        if settled.status == Settled.EXPIRED:
            raise LeaseExpired(lease_id, float(settled.charged))
        return Settlement(
            already_released=settled.status == Settled.AGAIN,
            charged=float(settled.charged),
            adjustment=float(settled.adjustment),
            remaining=float(settled.remaining),
        )

    # -- status, report, admin ------------------------------------------------------

    async def status(self, pool: PoolPolicy) -> PoolStatus:
        args_for = self._args_for(pool)
        reply = await self._run(
            self._scripts["status"],
            args_for.keys,
            (0, *self._policy(pool.name)),  # 0: no calls
        )
        head = contract.record(contract.StatusHead, reply)
        now_us = int(head.now_us)
        count = len(pool.classes)
        start = contract.size(contract.StatusHead)
        classes: dict[str, ClassStatus] = {}
        rows = contract.records(contract.StatusClass, reply, count, start)
        for cls, row in zip(pool.classes, rows, strict=True):
            classes[cls.name] = ClassStatus(
                tokens=float(row.tokens),
                waiting=int(row.waiting),
                oldest_wait_ms=(now_us - int(float(row.oldest_us))) // 1000 if row.oldest_us else 0,
                rate=float(row.rate),
                burst=float(row.burst),
                in_flight=int(row.in_flight),
                in_flight_tokens=float(row.in_flight_tokens),
            )
        servers = contract.record(
            contract.StatusServers, reply, start + count * contract.size(contract.StatusClass)
        )
        return PoolStatus(
            shared_tokens=float(head.shared),
            classes=classes,
            capacity=float(head.capacity),
            admitted_tokens=float(head.admitted),
            now_ms=now_us // 1000,
            long_prefill_tokens=float(head.long_prefill),
            prefill_backlog_ms=float(head.prefill_backlog_us) / 1000,
            shared_burst=float(head.shared_burst),
            server_waiting=int(servers.waiting) if servers.waiting else None,
            server_kv_usage=float(servers.kv_usage) if servers.kv_usage else None,
        )

    async def tenants(self, pool: PoolPolicy, names: Sequence[str]) -> list[TenantStatus]:
        args_for = self._args_for(pool)
        asked: list[tuple[ClassPolicy, str]] = []
        keys: list[str] = []
        args: list[str] = []
        for index, cls in enumerate(pool.classes):
            if cls.fair is None:
                continue
            for name in names:
                digest = tenant_digest(name)
                asked.append((cls, name))
                keys += [args_for.keys[1 + index], _counter_key(args_for.prefix, cls, digest)]
                args.append(digest)
        if not asked:
            return []
        reply = await self._run(self._scripts["tenants"], keys, args)
        rows = contract.records(contract.TenantStatus, reply, len(asked))
        return [
            TenantStatus(
                qos_class=cls.name,
                tenant=name,
                counter=float(row.counter) if row.counter else None,
                served_tokens=float(row.served),
                waiting=int(row.waiting),
            )
            for (cls, name), row in zip(asked, rows, strict=True)
        ]

    # -- the SLO loop's state -------------------------------------------------------

    def _control_keys(self, pool: PoolPolicy) -> tuple[str, str]:
        prefix = self._args_for(pool).prefix
        return f"{prefix}control", f"{prefix}history"

    async def control(self, pool: PoolPolicy) -> ControlRecord:
        args_for = self._args_for(pool)
        control_key, _ = self._control_keys(pool)
        reply = contract.ControlReply._make(
            await self._run(self._scripts["control"], (args_for.keys[0], control_key), ())
        )
        self._epochs.saw(pool.name, reply.epoch)
        # Rates are kept relative to the configured capacity they were written under:
        # R under the state's K (rewritten by every budget call), the record's own
        # rates under its k (written by adjust.lua).
        scale = pool.capacity / float(reply.written_under) if reply.written_under else 1.0
        rate = float(reply.rate) * scale if reply.rate else pool.capacity
        scale = pool.capacity / float(reply.recorded_under) if reply.recorded_under else scale
        return ControlRecord(
            capacity=rate,
            pinned=reply.pinned == "1",
            changed_ms=int(float(reply.changed_ms)) if reply.changed_ms else 0,
            reason=reply.reason,
            changed_from=float(reply.changed_from) * scale if reply.changed_from else rate,
            changed_by=reply.changed_by,
            probe_step=float(reply.probe_step) if reply.probe_step else 0.0,
            probe_wait=int(reply.probe_wait) if reply.probe_wait else 1,
            last_good=float(reply.last_good) * scale if reply.last_good else rate,
            direction=int(reply.direction) if reply.direction else 0,
            ceiling=float(reply.ceiling) * scale if reply.ceiling else 0.0,
            epoch=reply.epoch,
            record_epoch=reply.record_epoch,
        )

    async def adjust(
        self, pool: PoolPolicy, update: ControlRecord, cooldown_ms: int, *, force: bool = False
    ) -> bool:
        args_for = self._args_for(pool)
        control_key, history_key = self._control_keys(pool)
        own = contract.AdjustArgs(
            cooldown_ms=cooldown_ms,
            force=1 if force else 0,
            capacity=repr(update.capacity),
            reason=update.reason,
            changed_by=update.changed_by,
            probe_step=repr(update.probe_step),
            probe_wait=update.probe_wait,
            last_good=repr(update.last_good),
            direction=int(update.direction),
            pinned=1 if update.pinned else 0,
            ceiling=repr(update.ceiling),
        )
        reply = await self._run(
            self._scripts["adjust"],
            (*args_for.keys, control_key, history_key),
            (0, *self._policy(pool.name), *own),  # 0: no calls, as status
        )
        return bool(contract.Adjusted._make(reply).applied == 1)

    async def set_prefill(self, pool: PoolPolicy, learned: PrefillLearned) -> float:
        state_key = self._args_for(pool).keys[0]
        model = learned.model
        args = contract.PrefillArgs(
            usual_tokens=repr(float(learned.usual_tokens)),
            tolerance_ms="" if learned.tolerance_ms is None else repr(float(learned.tolerance_ms)),
            fallback_tokens=repr(float(learned.fallback_tokens)),
            model="" if model is None else "|".join(repr(float(x)) for x in model),
            decode=""
            if learned.decode is None
            else "|".join(
                repr(float(x))
                for x in (*learned.decode, int(learned.chunked), *learned.tpot_targets_ms)
            ),
            idle_tolerance_ms=""
            if learned.idle_tolerance_ms is None
            else repr(float(learned.idle_tolerance_ms)),
        )
        return float(await self._run(self._scripts["prefill"], (state_key,), args))

    async def report_load(self, pool: PoolPolicy, loads: Sequence[ServerLoad]) -> None:
        args_for = self._args_for(pool)
        args: list[Any] = list(
            contract.LoadArgs(
                max_age_us=pool.server_load_max_age_us,
                expire_ms=10 * pool.server_load_max_age_us // 1000,
            )
        )
        for load in loads:
            args += contract.ServerLoadArgs(
                server=load.server,
                waiting="" if load.waiting is None else load.waiting,
                kv_usage="" if load.kv_usage is None else repr(float(load.kv_usage)),
            )
        keys = (args_for.keys[0], f"{args_for.prefix}servers")
        await self._run(self._scripts["load"], keys, args)
        passes = [PassRead.encode(load.passes, load.server) for load in loads if load.passes]
        if passes:  # appended, stamped, as the latency windows are (report.lua)
            args = list(contract.ReportArgs(window_size=PASS_WINDOW, expire_ms=_PASSES_EXPIRE_MS))
            for encoded in passes:
                args += contract.SampleArgs(key_index=1, sample=encoded)
            await self._run(self._scripts["report"], (f"{args_for.prefix}passes",), args)

    async def passes(self, pool: PoolPolicy) -> list[PassRead]:
        key = f"{self._args_for(pool).prefix}passes"
        raw = await self._client.execute(key, "LRANGE", key, 0, -1)
        return [PassRead.decode(item) for item in raw]

    async def history(self, pool: PoolPolicy, limit: int = 20) -> list[Adjustment]:
        if limit <= 0:
            return []
        _, history_key = self._control_keys(pool)
        raw = await self._client.execute(history_key, "LRANGE", history_key, 0, limit - 1)
        entries = []
        for item in raw:
            at_ms, old, new, by, reason = item.split("|", 4)
            entries.append(Adjustment(int(float(at_ms)), float(old), float(new), reason, by))
        return entries

    async def lead(self, lease_ms: int) -> str:
        key = f"{self._config.key_prefix}:{{control}}:leader"
        args = contract.LeadArgs(daemon=self.daemon_id, lease_ms=lease_ms)
        return str(await self._run(self._scripts["lead"], (key,), args))

    async def report(self, samples: Sequence[Sample], window_size: int) -> None:
        by_pool: dict[str, list[Sample]] = defaultdict(list)
        for sample in samples:
            by_pool[sample.pool].append(sample)
        for pool, pool_samples in by_pool.items():
            prefix = f"{self._config.key_prefix}:{{{pool}}}:"
            key_index: dict[str, int] = {}
            args: list[Any] = list(
                contract.ReportArgs(window_size=window_size, expire_ms=_WINDOW_EXPIRE_MS)
            )
            for sample in pool_samples:
                index = key_index.setdefault(sample.qos_class, len(key_index) + 1)
                args += contract.SampleArgs(key_index=index, sample=sample.encode())
            keys = [f"{prefix}window:{name}" for name in key_index]
            await self._run(self._scripts["report"], keys, args)

    async def window(self, pool: str, qos_class: str) -> list[StoredSample]:
        key = f"{self._config.key_prefix}:{{{pool}}}:window:{qos_class}"
        raw = await self._client.execute(key, "LRANGE", key, 0, -1)
        return [StoredSample.decode(item) for item in raw]


def _lease_stub(lease_id: str) -> LeaseSpec:
    """Enough of a lease to name a waiter by (cancel needs only its id)."""
    return LeaseSpec(lease_id, "", "", 0, 0, 1.0, 0)
