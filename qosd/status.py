"""The daemon's status: one read of the store, the policies and the SLO loop, as the
domain dataclasses of ``qosd_client.types``.

Three readers share it, so the figures they show cannot drift apart:

- ``Admin/GetStatus`` (and PinRate's answer) converts it to protobuf
  (``qosd_client._convert.status_message``, the inverse of what the client reads);
- ``/metrics`` sets its gauges from it (``Metrics.update_from_status``);
- ``qosctl status`` and ``watch`` render what the client reads back, the same types.

The status service is given what it reads (the store, the policies, the waiting room
and the controller) rather than reaching through the admission layer for them.
"""

from __future__ import annotations

from collections.abc import Callable

from qosd.config import Config, SloConfig
from qosd.control import windows as slo_stats
from qosd.control.leader import Controller
from qosd.control.windows import WindowStats, window_stats
from qosd.model import Adjustment
from qosd.policy import PoolPolicy
from qosd.store.base import BucketStore
from qosd.waiting import WaitingRoom
from qosd_client.types import (
    ClassState,
    LatencyState,
    Percentiles,
    PoolState,
    RateChange,
    Status,
)

#: Most past rate changes one status read returns per pool: what the store keeps.
MAX_HISTORY = 100


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
    ) -> None:
        # pools and config are read at each call: a reload replaces them.
        self._store = store
        self._store_kind = store_kind
        self._daemon_id = daemon_id
        self._pools = pools
        self._config = config
        self._waiting_room = waiting_room
        self._controller = controller

    def pool_names(self) -> list[str]:
        return list(self._pools())

    def policy(self, name: str) -> PoolPolicy:
        """The pool's configured policy; KeyError when it is not configured."""
        return self._pools()[name]

    @property
    def leads(self) -> bool:
        """Whether this daemon runs the SLO loop now."""
        return self._controller.running and self._controller.leads

    async def status(self, pools: list[str], history: int = 0) -> Status:
        """The named pools now, each with up to ``history`` past rate changes."""
        controller = self._controller
        return Status(
            pools=tuple([await self.pool(name, history) for name in pools]),
            daemon_id=self._daemon_id,
            store=self._store_kind,
            controller=controller.leader if controller.running else "",
        )

    async def pool(self, name: str, history: int = 0) -> PoolState:
        """One pool as the store sees it now, with the SLO loop's state."""
        config = self._config()
        pool = self.policy(name)
        store = self._store
        status = await store.status(pool)
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
