"""Prometheus metrics: what qosd decided, how its store answered, and the state of its
budgets and SLO loop, on ``GET /metrics`` of ``server.http_listen``.

Events (decisions, waits, store calls, rate changes) are counted where they happen, at
a cost of a few microseconds on the Acquire path: label children are cached so a
decision is one dictionary lookup and two increments. State (rates, shares, queues,
compliance, latency percentiles, leases) is read at scrape time through the same code
that answers ``Admin/GetStatus``, so the two can never disagree and idle daemons do no
periodic store reads.

The workers of ``serve --workers N`` (qosd.workers) run prometheus_client's
multiprocess mode: ``$PROMETHEUS_MULTIPROC_DIR``, set by the supervisor, makes every
counter and histogram a memory-mapped file per process, and a scrape, answered by any
worker, merges them all, so events count over the whole group. The state gauges are
not in those files: they are fleet-wide figures from the store, read by the worker
that answers, and summing N copies of a rate would be wrong. The few gauges that are a
process's own take one value over the live workers (``multiprocess_mode``): the
controller leader is the largest (1 if any worker leads), the last reload's success
the smallest (0 if any worker refused it), a restart required the largest, the last
reload's time the latest. With one process none of this applies and the page is as it
always was.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)

from qosd.model import PoolStatus
from qosd.policy import PoolPolicy
from qosd_client.types import ClassState, Status
from qosd_client.v1 import qosd_pb2

#: Tenants shown per pool and class in ``qosd_tenant_admitted_tokens``: the top ones.
TOP_TENANTS = 10
WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STORE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
# Fine between 50 and 500 ms, where a late timer turns a met wait bound into a missed one.
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                      0.5, 1, 2.5)  # fmt: skip


class _LocalGauge(Gauge):
    """A gauge kept in this process's memory even in multiprocess mode, for the state
    read at scrape time: the worker that answers sets and shows its own read, and no
    other worker's (possibly older) copy is merged into it. prometheus_client picks a
    value class for every metric at import (``values.ValueClass``) and has no public
    switch per metric; ``_metric_init`` is where it makes the value (0.26)."""

    def _metric_init(self) -> None:
        self._value = values.MutexValue(  # type: ignore[no-untyped-call]
            self._type, self._name, self._name, self._labelnames, self._labelvalues,
            self._documentation,
        )  # fmt: skip

    def clear(self) -> None:
        """As Gauge.clear, less its multiprocess-mode warning: these values are this
        process's own, and clearing them clears them."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            super().clear()


class TopTenants:
    """The heaviest tenants by tokens admitted, in bounded memory: the space-saving
    algorithm (Metwally et al., 2005) over ``4 x k`` slots. A tenant not tracked takes
    the lightest slot and its count, so a count overstates by at most that count, and
    any tenant with more than a ``1 / (4 k)`` share of the tokens is always tracked.
    Any number of tenants thus costs ``4 x k`` entries per pool and class, and the page
    shows ``k`` series of them."""

    def __init__(self, k: int = TOP_TENANTS) -> None:
        self.k = k
        self._slots = 4 * k
        self._counts: dict[str, float] = {}

    def add(self, tenant: str, tokens: float) -> None:
        counts = self._counts
        if tenant in counts or len(counts) < self._slots:
            counts[tenant] = counts.get(tenant, 0.0) + tokens
            return
        lightest = min(counts, key=counts.__getitem__)
        counts[tenant] = counts.pop(lightest) + tokens

    def top(self) -> list[tuple[str, float]]:
        return sorted(self._counts.items(), key=lambda item: -item[1])[: self.k]

    @property
    def tracked(self) -> int:
        return len(self._counts)


class Metrics:
    """One daemon's instruments, in a registry of its own (tests run several daemons)."""

    def __init__(self) -> None:
        # Multiprocess mode: prometheus_client chose memory-mapped values at import.
        self.multiprocess_dir = (
            os.environ.get("PROMETHEUS_MULTIPROC_DIR")
            if values.ValueClass is not values.MutexValue
            else None
        )
        self.registry = CollectorRegistry()
        # The state gauges alone, for the multiprocess page (``exposition``).
        self.state_registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "qosd_acquire_decisions",
            "Acquire answers, by pool, class, decision (admitted or rejected) and reason.",
            ["pool", "class", "decision", "reason"],
            registry=r,
        )
        self.wait = Histogram(
            "qosd_acquire_wait_seconds",
            "Time answered Acquires spent in the waiting room.",
            ["pool", "class"],
            buckets=WAIT_BUCKETS_S,
            registry=r,
        )
        self.invalid = Counter(
            "qosd_invalid_requests", "Calls refused with INVALID_ARGUMENT, by RPC.", ["rpc"],
            registry=r,
        )  # fmt: skip
        self.proxy_requests = Counter(
            "qosd_proxy_requests",
            "Requests answered by qosd proxy, by model, class and HTTP status.",
            ["model", "class", "code"],
            registry=r,
        )
        self.proxy_prompt_counts = Counter(
            "qosd_proxy_prompt_counts",
            "Prompts qosd proxy asked an upstream to count (its /tokenize) while the model's "
            "token estimate calibrated, by model and result: learned, refused (a count the "
            "estimate cannot take), unsupported (no such route), failed.",
            ["model", "result"],
            registry=r,
        )
        self.releases = Counter(
            "qosd_releases", "Release calls, by outcome reported and result.",
            ["outcome", "result"], registry=r,
        )  # fmt: skip
        self.report_samples = Counter(
            "qosd_report_samples", "Latency samples received by Report, accepted or not.",
            ["result"], registry=r,
        )  # fmt: skip
        self.slo_samples = Counter(
            "qosd_slo_samples",
            "Stored latency samples judged against their objectives as the windows judge "
            "them (qosd.control.windows.verdict): result met or missed. The SLI of the "
            "burn-rate alerts.",
            ["pool", "class", "result"],
            registry=r,
        )
        self.store_seconds = Histogram(
            "qosd_store_call_seconds", "Store (Redis or embedded) call latency, by call.",
            ["call"], buckets=STORE_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.loop_lag = Histogram(
            "qosd_event_loop_lag_seconds",
            "How late the daemon's event loop ran a timer asking to wake every 50 ms: the "
            "lateness every wait, timeout and deadline of this process shares.",
            buckets=LOOP_LAG_BUCKETS_S,
            registry=r,
        )
        self.store_errors = Counter(
            "qosd_store_errors", "Store calls that failed (unreachable or timed out), by call.",
            ["call"], registry=r,
        )  # fmt: skip
        self.envoy_rls = Counter(
            "qosd_envoy_rls_requests",
            "Envoy ShouldRateLimit answers, by code (OK, OVER_LIMIT) and qosd reason "
            "(other_domain: a domain qosd does not decide for).",
            ["code", "reason"],
            registry=r,
        )
        self.auth_refusals = Counter(
            "qosd_auth_refusals",
            "Calls refused by auth: code UNAUTHENTICATED (no credentials) or "
            "PERMISSION_DENIED (wrong ones, or a control call on a shared listener).",
            ["method", "code"],
            registry=r,
        )
        self.tls_reloads = Counter(
            "qosd_tls_certificate_reloads",
            "Rotations of the server's TLS files seen on disk: result loaded or failed "
            "(the previous certificate kept).",
            ["result"],
            registry=r,
        )
        self.tls_expiry = Gauge(
            "qosd_tls_certificate_expiry_timestamp_seconds",
            "When the served TLS certificate expires (its notAfter), Unix seconds, by its "
            "file; set at start and at each rotation loaded. Absent without server TLS.",
            ["file"],
            registry=r,
            multiprocess_mode="livemin",
        )
        self._add_config_instruments(r)
        self.adjustments = Counter(
            "qosd_rate_adjustments",
            "Changes of a pool's admitted rate made by this daemon: grow, cut, undo, pin, unpin, "
            "restore (written back after the store came back empty).",
            ["pool", "kind"],
            registry=r,
        )
        self.store_resets = Counter(
            "qosd_store_resets",
            "Pools whose state this daemon saw lost and made anew: the store came back "
            "empty (a new epoch; docs/design.md).",
            ["pool"],
            registry=r,
        )
        self.state_read_failures = Counter(
            "qosd_state_read_failures",
            "Scrapes of /metrics whose read of the state failed other than by the store "
            "being unreachable (qosd_store_up): served with the counters, no state series.",
            registry=r,
        )
        self._state_gauges: list[Gauge] = []
        self.pool_rate = self._gauge(
            "qosd_pool_rate_tokens_per_second", "The pool's admitted rate now.", ["pool"]
        )
        self.pool_capacity = self._gauge(
            "qosd_pool_configured_capacity_tokens_per_second",
            "The pool's configured capacity.",
            ["pool"],
        )
        self.pool_pinned = self._gauge(
            "qosd_pool_pinned", "1 while an operator has pinned the pool's rate.", ["pool"]
        )
        self.class_rate = self._gauge(
            "qosd_class_rate_tokens_per_second",
            "A class's refill rate at the pool's admitted rate.",
            ["pool", "class"],
        )
        self.class_share = self._gauge(
            "qosd_class_share_ratio",
            "A class's rate as a fraction of the pool's admitted rate.",
            ["pool", "class"],
        )
        self.queue = self._gauge(
            "qosd_queue_depth", "Acquires waiting, fleet-wide.", ["pool", "class"]
        )
        self.compliance = self._gauge(
            "qosd_slo_compliance_ratio",
            "Share of the class's latency window within its objectives (absent: none).",
            ["pool", "class"],
        )
        self.latency = self._gauge(
            "qosd_latency_seconds",
            "Latency percentiles of the class's window, by metric (ttft, tpot, e2e) and "
            "percentile (p50, p95, p99). A gauge, not a summary: the window is fleet-wide.",
            ["pool", "class", "metric", "percentile"],
        )
        self.window_samples = self._gauge(
            "qosd_latency_window_samples", "Samples in the class's window.", ["pool", "class"]
        )
        self.leases = self._gauge(
            "qosd_active_leases", "Leases neither released nor expired, fleet-wide.", ["pool"]
        )
        self.prefill_backlog = self._gauge(
            "qosd_prefill_backlog_seconds",
            "Predicted prefill admitted and not yet done, by the pool's prefill model on "
            "the real clock of the earliest free of its servers: what the next prompt "
            "waits for (GPU-gated pools; 0 without a model).",
            ["pool"],
        )
        self.in_flight_tokens = self._gauge(
            "qosd_in_flight_tokens",
            "Prompt plus expected output tokens of the pool's leases in flight, fleet-wide.",
            ["pool"],
        )
        self.max_in_flight = self._gauge(
            "qosd_pool_max_in_flight",
            "The pool's bound on leases in flight (max_in_flight); absent without one.",
            ["pool"],
        )
        self.max_in_flight_tokens = self._gauge(
            "qosd_pool_max_in_flight_tokens",
            "The pool's bound on tokens in flight (max_in_flight_tokens); absent without one.",
            ["pool"],
        )
        self.server_waiting = self._gauge(
            "qosd_server_waiting_requests",
            "Requests the pool's servers hold waiting, by their own latest reports "
            "(ReportRequest.loads), summed; absent while none is known.",
            ["pool"],
        )
        self.server_kv = self._gauge(
            "qosd_server_kv_cache_usage",
            "The largest KV cache usage (0 to 1) the pool's servers report; absent while "
            "none is known.",
            ["pool"],
        )
        self.store_up = self._gauge("qosd_store_up", "1 if the last scrape read the store.", [])
        self.leader = Gauge(
            "qosd_controller_leader", "1 while this daemon runs the SLO loop.",
            registry=r, multiprocess_mode="livemax",
        )  # fmt: skip
        self._decision_children: dict[tuple[str, str, bool, int], tuple[Any, Any]] = {}
        self._slo_children: dict[tuple[str, str, bool], Any] = {}
        self.tenant_tokens = self._gauge(
            "qosd_tenant_admitted_tokens",
            f"Prompt plus expected output tokens this daemon admitted, per tenant: the top "
            f"{TOP_TENANTS} tenants of each pool and class only (estimates that may overstate "
            "a tenant by the lightest tracked one's count), so the series stay bounded.",
            ["pool", "class", "tenant"],
        )
        self._top_tenants: dict[tuple[str, str], TopTenants] = {}

    def _add_config_instruments(self, r: CollectorRegistry) -> None:
        """The config's reloads: applied, refused, when, and whether a restart waits."""
        self.config_reloads = Counter(
            "qosd_config_reloads",
            "Config reloads (SIGHUP or the file replaced) that were applied.",
            registry=r,
        )
        self.config_reload_failures = Counter(
            "qosd_config_reload_failures",
            "Config reloads refused (the file did not load or validate; the running config stays).",
            registry=r,
        )
        self.config_last_reload_success = Gauge(
            "qosd_config_last_reload_success_timestamp_seconds",
            "When the running config was last loaded: at start, then each applied reload.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.config_last_reload_successful = Gauge(
            "qosd_config_last_reload_successful",
            "1 if the last reload was applied (or none was asked for), 0 if it was refused.",
            registry=r,
            multiprocess_mode="livemin",
        )
        self.config_restart_required = Gauge(
            "qosd_config_restart_required",
            "1 while the config file holds changes that take effect only at a restart.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.config_last_reload_success.set_to_current_time()
        self.config_last_reload_successful.set(1)

    @property
    def multiprocess(self) -> bool:
        """Whether this is a worker of a group (its counters merge with the others')."""
        return self.multiprocess_dir is not None

    def _gauge(self, name: str, documentation: str, labels: list[str]) -> Gauge:
        gauge = _LocalGauge(name, documentation, labels, registry=self.registry)
        self.state_registry.register(gauge)
        self._state_gauges.append(gauge)
        return gauge

    def clear_state(self) -> None:
        """Drops every state gauge's series: after a failed read, a page shows no
        state rather than the last read's as if it were current."""
        for gauge in self._state_gauges:
            gauge.clear()

    def acquire(
        self, pool: str, qos_class: str, admitted: bool, reason: int, waited_ms: int
    ) -> None:
        key = (pool, qos_class, admitted, reason)
        children = self._decision_children.get(key)
        if children is None:
            # Reason 0 is what an admission answers: "NONE", as the client names it.
            name = qosd_pb2.Reason.Name(reason).removeprefix("REASON_")  # type: ignore[arg-type]
            name = "NONE" if name == "UNSPECIFIED" else name
            decision = "admitted" if admitted else "rejected"
            children = (
                self.decisions.labels(pool, qos_class, decision, name),
                self.wait.labels(pool, qos_class),
            )
            self._decision_children[key] = children
        children[0].inc()
        if waited_ms:
            children[1].observe(waited_ms / 1000)

    def pool_read(self, pool: str, status: PoolStatus) -> None:
        """The store's figures of a pool that GetStatus does not carry, at each read."""
        self.prefill_backlog.labels(pool).set(status.prefill_backlog_ms / 1000)

    def pools_known(self, pools: list[str]) -> None:
        """Shows the pools' reset counters at 0 from the start: a reset is rare, and
        rate() and increase() see no first increment of a series that appears with it."""
        for pool in pools:
            self.store_resets.labels(pool)

    def slo_sample(self, pool: str, qos_class: str, met: bool) -> None:
        """Counts one stored sample judged against its objectives."""
        key = (pool, qos_class, met)
        child = self._slo_children.get(key)
        if child is None:
            # Both results at once: a class that never missed shows missed 0, so the
            # burn rate reads 0, not nothing.
            for result in (True, False):
                labels = (pool, qos_class, "met" if result else "missed")
                self._slo_children[(pool, qos_class, result)] = self.slo_samples.labels(*labels)
            child = self._slo_children[key]
        child.inc()

    def tenant_admitted(self, pool: str, qos_class: str, tenant: str, tokens: int) -> None:
        top = self._top_tenants.get((pool, qos_class))
        if top is None:
            top = self._top_tenants[(pool, qos_class)] = TopTenants()
        top.add(tenant, tokens)

    def update_from_status(
        self, status: Status, leads: bool, policies: Mapping[str, PoolPolicy] | None = None
    ) -> None:
        """Sets the state gauges from the status service's read (qosd/status.py): the
        same figures GetStatus answers and qosctl shows; the in-flight bounds from the
        pools' ``policies`` (configuration, which GetStatus does not carry)."""
        for gauge in (
            self.compliance, self.latency, self.server_waiting, self.server_kv,
            self.max_in_flight, self.max_in_flight_tokens,
        ):  # fmt: skip
            gauge.clear()  # a class whose window emptied must not keep an old value
        for name, policy in (policies or {}).items():
            self._set_bounds(name, policy)
        for pool in status.pools:
            self.pool_rate.labels(pool.name).set(pool.admitted_rate_tokens_s)
            self.pool_capacity.labels(pool.name).set(pool.capacity_tokens_s)
            self.pool_pinned.labels(pool.name).set(1 if pool.pinned else 0)
            self.leases.labels(pool.name).set(pool.active_leases)
            self.in_flight_tokens.labels(pool.name).set(
                sum(cls.in_flight_tokens for cls in pool.classes)
            )
            if pool.server_waiting_requests is not None:
                self.server_waiting.labels(pool.name).set(pool.server_waiting_requests)
            if pool.server_kv_cache_usage is not None:
                self.server_kv.labels(pool.name).set(pool.server_kv_cache_usage)
            for cls in pool.classes:
                self._set_class(pool.name, pool.admitted_rate_tokens_s, cls)
        self.tenant_tokens.clear()  # the top changes: only the current one is shown
        for (pool_name, class_name), top in self._top_tenants.items():
            for tenant, tokens in top.top():
                self.tenant_tokens.labels(pool_name, class_name, tenant).set(tokens)
        self.store_up.set(1)
        self.leader.set(1 if leads else 0)

    def _set_bounds(self, pool: str, policy: PoolPolicy) -> None:
        if policy.max_in_flight > 0:
            self.max_in_flight.labels(pool).set(policy.max_in_flight)
        if policy.max_in_flight_tokens > 0:
            self.max_in_flight_tokens.labels(pool).set(policy.max_in_flight_tokens)

    def _set_class(self, pool: str, pool_rate: float, cls: ClassState) -> None:
        labels = (pool, cls.name)
        self.class_rate.labels(*labels).set(cls.rate_tokens_s)
        self.class_share.labels(*labels).set(cls.rate_tokens_s / pool_rate)
        self.queue.labels(*labels).set(cls.waiting)
        latency = cls.latency
        self.window_samples.labels(*labels).set(latency.samples)
        if latency.compliance is not None:
            self.compliance.labels(*labels).set(latency.compliance)
        for metric, percentiles in (
            ("ttft", latency.ttft),
            ("tpot", latency.tpot),
            ("e2e", latency.e2e),
        ):
            if percentiles is None:
                continue
            for percentile, value in (
                ("p50", percentiles.p50_ms),
                ("p95", percentiles.p95_ms),
                ("p99", percentiles.p99_ms),
            ):
                self.latency.labels(*labels, metric, percentile).set(value / 1000)

    def exposition(self) -> bytes:
        """The page: this daemon's registry; for a worker, every worker's events and
        own gauges merged from the files, then the state this worker just read."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        group = CollectorRegistry()
        multiprocess.MultiProcessCollector(group, path=self.multiprocess_dir)  # type: ignore[no-untyped-call]
        return generate_latest(group) + generate_latest(self.state_registry)
