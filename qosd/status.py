"""The daemon's status: one read of the store, the policies and the SLO loop, as the
domain dataclasses of ``qosd_client.types``.

Three readers share it, so the figures they show cannot drift apart:

- ``Admin/GetStatus`` (and PinRate's answer) converts it to protobuf
  (``qosd_client._convert.status_message``, the inverse of what the client reads);
- ``/metrics`` sets its gauges from it (``Metrics.update_from_status``);
- ``qosctl status`` and ``watch`` render what the client reads back, the same types.

The status service is given what it reads (the store, the policies, the waiting room
and the controller) rather than reaching through the admission layer for them. The
few figures of the store's read that the client's types do not carry (the prefill
backlog) go to ``on_pool_read``, which sets their gauges: one read feeds both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qosd.config import Config, SloConfig
from qosd.control import windows as slo_stats
from qosd.control.leader import Controller
from qosd.control.windows import WindowStats, window_stats
from qosd.model import Adjustment, PoolStatus, TenantStatus
from qosd.policy import ClassPolicy, PoolPolicy, tenant_digest
from qosd.store.base import BucketStore
from qosd.waiting import WaitingRoom
from qosd_client.types import (
    ClassState,
    LatencyState,
    Percentiles,
    PoolState,
    RateChange,
    Status,
    TenantState,
)

#: Most past rate changes one status read returns per pool: what the store keeps.
MAX_HISTORY = 100
#: Most tenants one status read shows: each costs a key read per class that shares by
#: tokens, and their classes' queues are read once.
MAX_STATUS_TENANTS = 100


class StatusService:
    """Reads the status of the daemon's pools. Raises StoreUnavailable."""

    def __init__(
        self,
        *,
        store: BucketStore,
        store_kind: str,
        daemon_id: str,
        pools: Callable[[], dict[str, PoolPolicy]],
        config: Callable[[], Config],
        waiting_room: WaitingRoom,
        controller: Controller,
        on_pool_read: Callable[[str, PoolStatus], None] | None = None,
    ) -> None:
        # pools and config are read at each call: a reload replaces them.
        self._store = store
        self._store_kind = store_kind
        self._daemon_id = daemon_id
        self._pools = pools
        self._config = config
        self._waiting_room = waiting_room
        self._controller = controller
        self._on_pool_read = on_pool_read

    def pool_names(self) -> list[str]:
        return list(self._pools())

    def policy(self, name: str) -> PoolPolicy:
        """The pool's configured policy; KeyError when it is not configured."""
        return self._pools()[name]

    @property
    def leads(self) -> bool:
        """Whether this daemon runs the SLO loop now."""
        return self._controller.running and self._controller.leads

    async def status(
        self, pools: list[str], history: int = 0, tenants: Sequence[str] = ()
    ) -> Status:
        """The named pools now, each with up to ``history`` past rate changes, and the
        named ``tenants`` of each class that shares by tokens."""
        controller = self._controller
        return Status(
            pools=tuple([await self.pool(name, history, tenants) for name in pools]),
            daemon_id=self._daemon_id,
            store=self._store_kind,
            controller=controller.leader if controller.running else "",
        )

    async def pool(self, name: str, history: int = 0, tenants: Sequence[str] = ()) -> PoolState:
        """One pool as the store sees it now, with the SLO loop's state."""
        config = self._config()
        pool = self.policy(name)
        store = self._store
        status = await store.status(pool)
        if self._on_pool_read is not None:
            self._on_pool_read(name, status)
        policies = {cls.name: cls for cls in pool.classes}
        by_class: dict[str, list[TenantState]] = {}
        for tenant in await store.tenants(pool, tenants) if tenants else ():
            by_class.setdefault(tenant.qos_class, []).append(
                tenant_state(policies[tenant.qos_class], tenant)
            )
        record = await store.control(pool)
        adjustments = await store.history(pool, max(1, history))
        verdict = self._controller.last_verdicts.get(name)
        held = self._waiting_room.held(name)
        max_age = config.report.max_age_s
        classes = []
        for cls in pool.classes:
            now = status.classes[cls.name]
            slo = config.classes[cls.name].slo
            window = window_stats(
                await store.window(name, cls.name),
                slo,
                now_ms=status.now_ms,
                max_age_ms=None if max_age is None else int(max_age * 1000),
            )
            classes.append(
                ClassState(
                    name=cls.name,
                    priority=cls.priority,
                    rate_tokens_s=now.rate,
                    burst_tokens=now.burst,
                    tokens=now.tokens,
                    waiting=now.waiting,
                    oldest_wait_s=now.oldest_wait_ms / 1000,
                    waiting_here=held.get(cls.name, 0),
                    max_wait_s=cls.max_wait_ms / 1000,
                    max_queue=cls.max_queue,
                    can_borrow=cls.can_borrow,
                    configured_rate_tokens_s=cls.rate,
                    latency=latency_state(window, slo),
                    in_flight=now.in_flight,
                    in_flight_tokens=now.in_flight_tokens,
                    fairness="fifo" if cls.fair is None else "vtc",
                    tenants=tuple(by_class.get(cls.name, ())),
                )
            )
        changes = [rate_change(a, status.now_ms) for a in adjustments]
        return PoolState(
            name=name,
            capacity_tokens_s=pool.capacity,
            shared_tokens=status.shared_tokens,
            shared_burst_tokens=pool.burst_s * status.capacity,  # as the scripts allocate
            classes=tuple(classes),
            admitted_rate_tokens_s=status.capacity,
            pinned=record.pinned,
            last_change=changes[0] if changes else None,
            history=tuple(changes[:history]),
            verdict=verdict.reason if verdict and self._controller.leads else "",
            min_rate_tokens_s=pool.min_capacity,
            max_rate_tokens_s=pool.max_capacity,
            active_leases=status.active_leases,
            long_prefill_tokens=status.long_prefill_tokens,
            server_waiting_requests=status.server_waiting,
            server_kv_cache_usage=status.server_kv_usage,
        )


def rate_change(adjustment: Adjustment, now_ms: int) -> RateChange:
    return RateChange(
        at_ms=adjustment.at_ms,
        from_tokens_s=adjustment.changed_from,
        to_tokens_s=adjustment.changed_to,
        reason=adjustment.reason,
        by=adjustment.by,
        age_s=max(0, now_ms - adjustment.at_ms) / 1000,
    )


def _percentiles(measured: slo_stats.Percentiles | None) -> Percentiles | None:
    return None if measured is None else Percentiles(measured.p50, measured.p95, measured.p99)


def tenant_state(cls: ClassPolicy, tenant: TenantStatus) -> TenantState:
    """A tenant as the store holds it, with its weight in its class."""
    fair = cls.fair
    weight = fair.weight(tenant_digest(tenant.tenant)) if fair else 1.0
    return TenantState(
        name=tenant.tenant,
        weight=weight,
        live=tenant.counter is not None,
        counter=tenant.counter or 0.0,
        served_tokens=tenant.served_tokens,
        waiting=tenant.waiting,
    )


def latency_state(stats: WindowStats, slo: SloConfig) -> LatencyState:
    return LatencyState(
        samples=stats.samples,
        compliance=stats.compliance,
        slo_ttft_ms=slo.ttft_ms or None,
        slo_tpot_ms=slo.tpot_ms or None,
        slo_e2e_ms=slo.e2e_ms or None,
        ttft=_percentiles(stats.ttft_ms),
        tpot=_percentiles(stats.tpot_ms),
        e2e=_percentiles(stats.e2e_ms),
        tail_pressure=stats.tail_pressure,
    )
