"""Daemon assembly: store, admission, gRPC server, health, reflection, drain.

``serve`` runs until SIGTERM or SIGINT, then drains: health turns NOT_SERVING, the
server refuses new calls (clients see UNAVAILABLE), waiters answer at once, and
in-flight calls get ``server.drain_grace_s`` to finish before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import stat
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Tracer

from qosd.admission import Admission
from qosd.config import Config, FailMode, parse_listen_address
from qosd.control.leader import Controller
from qosd.doors.auth import Authorizer
from qosd.doors.decisions import Decisions
from qosd.doors.envoy_rls import MIRROR_SERVICE, EnvoyRateLimitService
from qosd.doors.grpc_api import AdminService, QoSService, RawHandler, add_to_server
from qosd.doors.json_api import JsonApi
from qosd.gc_tuning import tune_for_serving
from qosd.health import DaemonHttp, HealthMonitor
from qosd.loop_lag import LoopLagProbe
from qosd.metrics import Metrics
from qosd.model import StoreUnavailable
from qosd.reload import ConfigReloader, ReloadPlan
from qosd.status import StatusService
from qosd.store.base import BucketStore
from qosd.store.embedded import EmbeddedStore
from qosd.store.instrumented import InstrumentedStore
from qosd.store.redis import RedisStore
from qosd.store.transport import monotonic_us
from qosd.tls import ServerCertificates
from qosd.tracing import Tracing, start_tracing
from qosd_client.v1 import qosd_pb2

log = logging.getLogger(__name__)

QOS_SERVICE = qosd_pb2.DESCRIPTOR.services_by_name["QoS"].full_name
ADMIN_SERVICE = qosd_pb2.DESCRIPTOR.services_by_name["Admin"].full_name


UNIX_SOCKET_MODE = 0o660
#: At most one log line a minute for /metrics pages whose state read failed.
STATE_READ_LOG_INTERVAL_S = 60.0


class StartupError(RuntimeError):
    """The daemon cannot start as configured (for example, a port is taken)."""


def make_store(
    config: Config, daemon_id: str | None = None, clock_us: Callable[[], int] = monotonic_us
) -> BucketStore:
    """The store ``config`` names, for the daemon ``daemon_id`` (None: a new id);
    ``clock_us``: the embedded store's TIME (a replay in virtual time passes its own)."""
    tombstone_ms = int(config.lease.tombstone_s * 1000)
    stale_after_ms = config.waiting.stale_after_ms
    lease_ttl_ms = int(config.lease.ttl_s * 1000)
    if config.redis.url is None:
        return EmbeddedStore(
            tombstone_ms,
            stale_after_ms,
            lease_ttl_ms,
            clock_us,
            key_prefix=config.redis.key_prefix,
            daemon_id=daemon_id,
        )
    return RedisStore(
        config.redis,
        tombstone_ms=tombstone_ms,
        stale_after_ms=stale_after_ms,
        lease_ttl_ms=lease_ttl_ms,
        daemon_id=daemon_id,
    )


@dataclass
class Daemon:
    """A started daemon; ``addresses`` are the bound listen addresses (ports resolved)."""

    config: Config
    server: grpc.aio.Server
    admission: Admission
    decisions: Decisions  # what every door admits and releases through
    controller: Controller
    health: health.aio.HealthServicer
    monitor: HealthMonitor
    metrics: Metrics
    admin: AdminService
    status: StatusService  # what GetStatus, /metrics (and through them qosctl) read
    tracing: Tracing | None = None
    http: DaemonHttp | None = None
    # The admin listener's own server (server.admin_listen), and what it bound.
    admin_server: grpc.aio.Server | None = None
    admin_addresses: list[str] = field(default_factory=list)
    certificates: ServerCertificates | None = None
    addresses: list[str] = field(default_factory=list)
    unix_paths: list[str] = field(default_factory=list)
    reloader: ConfigReloader | None = None
    # Workers only: keeps qosd_controller_leader current (_publish_leadership).
    leadership: asyncio.Task[None] | None = None
    loop_lag: LoopLagProbe | None = None
    _state_read_failed_at: float = -math.inf  # when /metrics last logged a failed read
    _background: set[asyncio.Task[None]] = field(default_factory=set)

    async def stop(self, grace_s: float | None = None) -> None:
        grace = self.config.server.drain_grace_s if grace_s is None else grace_s
        if self.reloader is not None:
            await self.reloader.stop()
        if self._background:  # what a reload started (an SLO loop stopping)
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.leadership is not None:
            self.leadership.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.leadership
        if self.loop_lag is not None:
            await self.loop_lag.stop()
        await self.monitor.stop()
        await self.health.enter_graceful_shutdown()
        await self.controller.stop()
        self.admission.begin_drain()
        stopping = [self.server.stop(grace)]
        if self.admin_server is not None:
            stopping.append(self.admin_server.stop(grace))
        await asyncio.gather(*stopping)
        await self.admission.close(grace)
        if self.http is not None:
            await self.http.stop()
        await self.admission.store.close()
        if self.tracing is not None:
            await self.tracing.shutdown()
        _unlink_all(self.unix_paths)

    def apply(self, plan: ReloadPlan) -> None:
        """Takes a reloaded config (qosd.reload): synchronously, so no call sees half
        of it. Calls, waiters and leases in flight are kept; what needs a restart was
        left at its running value by the plan."""
        config = plan.config
        self.admission.reconfigure(config)
        self.controller.reconfigure(config, self.admission.pools)
        self.monitor.fail_open = config.fail_mode is FailMode.OPEN
        logging.getLogger().setLevel(config.logging.level)
        if (
            self.tracing is not None
            and self.tracing.sampler is not None
            and config.tracing.sample_ratio is not None
        ):
            self.tracing.sampler.set_ratio(config.tracing.sample_ratio)
        if config.control.enabled and not self.controller.running:
            self.controller.start()
        elif not config.control.enabled and self.controller.running:
            self._in_background(self.controller.stop())
        self.config = config

    def reload_result(self, applied: bool, plan: ReloadPlan | None) -> None:
        """Counts a reload for /metrics."""
        metrics = self.metrics
        metrics.config_last_reload_successful.set(1 if applied else 0)
        if not applied:
            metrics.config_reload_failures.inc()
            return
        metrics.config_reloads.inc()
        metrics.config_last_reload_success.set_to_current_time()
        metrics.config_restart_required.set(1 if plan is not None and plan.restart else 0)

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def metrics_page(self) -> bytes:
        """The Prometheus exposition: counters as they stand, state read now. A read
        of the state that fails in any way costs the page its state only: the
        counters are still served, and the failure logged (once a minute at most)."""
        metrics = self.metrics
        try:
            status = await self.status.status(self.status.pool_names())
            policies = {name: self.status.policy(name) for name in self.status.pool_names()}
            metrics.update_from_status(status, self.status.leads, policies)
        except StoreUnavailable:
            metrics.store_up.set(0)
        except Exception:
            metrics.state_read_failures.inc()
            metrics.clear_state()  # no state rather than the last read's, as if current
            now = time.monotonic()
            if now - self._state_read_failed_at >= STATE_READ_LOG_INTERVAL_S:
                self._state_read_failed_at = now
                log.exception("/metrics: the state read failed; serving the counters")
        return metrics.exposition()


def _remove_stale_socket(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StartupError(f"listen address unix:{path} exists and is not a socket")
    os.unlink(path)


async def start(
    config: Config,
    store: BucketStore | None = None,
    *,
    reuse_port: bool = False,
    behind_api_keys: bool = False,
) -> Daemon:
    """Starts a daemon. What it has started when a step fails (the store's
    connections, tracing's exporter thread, a bound server, the HTTP listener, unix
    socket files) is undone, in reverse order, before the error propagates.

    ``reuse_port``: a worker of ``serve --workers N`` (qosd.workers), which shares its
    gRPC and HTTP ports with the other workers (SO_REUSEPORT). ``behind_api_keys``:
    the daemon of ``qosd proxy --api-key``, whose callers' identity is their key's;
    its own doors would let them by, so its HTTP listener serves health and metrics
    only (no JSON API), and its gRPC listener the QoS service (Acquire, Release,
    Report) only under ``auth.qos``. (Without keys, anyone who reaches the proxy
    names a class in a header: its daemon's doors give no more.)"""
    async with contextlib.AsyncExitStack() as undo:
        daemon = await _start(config, store, undo, reuse_port, behind_api_keys)
        undo.pop_all()  # the daemon owns all of it now: Daemon.stop undoes it
        return daemon
    raise AssertionError("unreachable")  # for mypy: the stack does not swallow errors


@dataclass
class DaemonCore:
    """What decides, with no listener: the doors' ``Decisions``, the SLO loop and the
    status every reader shares. ``serve`` puts listeners around it; a replay in
    virtual time (the simulator's) calls its services in process."""

    metrics: Metrics
    store: InstrumentedStore
    admission: Admission
    decisions: Decisions
    controller: Controller
    status: StatusService
    admin: AdminService


async def start_core(
    config: Config,
    own_store: BucketStore,
    undo: contextlib.AsyncExitStack,
    tracer: Tracer | None = None,
) -> DaemonCore:
    """Starts the store and builds the rest on it; ``undo`` gets the store's close.
    The SLO loop is built, not started (``Controller.start``)."""
    metrics = Metrics()
    store = InstrumentedStore(
        own_store,
        metrics,
        tracer if config.tracing.store_spans else None,
        "redis" if config.redis.url else "",
    )
    await store.start()
    undo.push_async_callback(store.close)
    admission = Admission(config, store, tracer)
    metrics.pools_known(admission.pool_names())
    decisions = Decisions(admission, metrics, traced=tracer is not None)
    controller = Controller(
        config,
        store,
        admission.pools,
        on_change=lambda pool, kind: metrics.adjustments.labels(pool, kind).inc(),
    )
    status = StatusService(
        store=store,
        store_kind=admission.store_kind,
        daemon_id=admission.daemon_id,
        pools=lambda: admission.pools,
        config=lambda: admission.config,
        waiting_room=admission.waiting_room,
        controller=controller,
        on_pool_read=metrics.pool_read,
    )
    return DaemonCore(
        metrics, store, admission, decisions, controller, status, AdminService(status, controller)
    )


def _serve_grpc(
    server: grpc.aio.Server,
    config: Config,
    core: DaemonCore,
    tracer: Tracer | None,
    authorizer: Authorizer,
    behind_api_keys: bool,
) -> tuple[dict[str, tuple[type[Message], RawHandler]], health.aio.HealthServicer]:
    """Puts the services on the shared gRPC server, with health and reflection; the
    handler chains (for the JSON API) and the health servicer. Behind API keys
    (``start``), QoS only under ``auth.qos``."""
    decisions = core.decisions
    # Behind API keys every door that admits is shut unless auth.qos guards it:
    # Envoy's ShouldRateLimit admits as Acquire does.
    qos_door = not behind_api_keys or config.auth.qos.configured
    envoy_rls = (
        EnvoyRateLimitService(decisions, tracer) if config.envoy_rls.enabled and qos_door else None
    )
    chains = add_to_server(
        QoSService(decisions, tracer) if qos_door else None,
        core.admin, server, envoy_rls, tracer, authorizer,
    )  # fmt: skip
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    served = [ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME]
    if qos_door:
        served.insert(0, QOS_SERVICE)
    if envoy_rls is not None:
        served.append(MIRROR_SERVICE)
    reflection.enable_server_reflection(served, server)
    return chains, health_servicer


async def _start(
    config: Config,
    given_store: BucketStore | None,
    undo: contextlib.AsyncExitStack,
    reuse_port: bool,
    behind_api_keys: bool = False,
) -> Daemon:
    own_store = given_store or make_store(config)
    daemon_id = own_store.daemon_id
    tracing = start_tracing(config.tracing, daemon_id)
    if tracing is not None:
        undo.push_async_callback(tracing.shutdown)
    tracer = tracing.tracer if tracing else None
    core = await start_core(config, own_store, undo, tracer)
    metrics, store, admission, decisions = core.metrics, core.store, core.admission, core.decisions
    controller, status, admin = core.controller, core.status, core.admin
    try:
        certificates = (
            ServerCertificates(
                config.server.tls,
                on_reload=lambda ok: metrics.tls_reloads.labels("loaded" if ok else "failed").inc(),
                on_expiry=metrics.tls_expiry.labels(config.server.tls.cert_file).set,
            )
            if config.server.tls.enabled
            else None
        )
    except (OSError, ValueError) as exc:
        raise StartupError(f"server.tls: the files do not load: {exc}") from exc
    server = grpc.aio.server(options=_server_options(config, reuse_port))
    authorizer = Authorizer(
        config.auth,
        on_refusal=lambda method, code: metrics.auth_refusals.labels(method, code.name).inc(),
    )
    chains, health_servicer = _serve_grpc(server, config, core, tracer, authorizer, behind_api_keys)
    monitor = HealthMonitor(config, store, health_servicer, ("", QOS_SERVICE, ADMIN_SERVICE))
    daemon = Daemon(
        config=config,
        server=server,
        admission=admission,
        decisions=decisions,
        controller=controller,
        health=health_servicer,
        monitor=monitor,
        metrics=metrics,
        admin=admin,
        status=status,
        tracing=tracing,
        certificates=certificates,
    )
    undo.callback(_unlink_all, daemon.unix_paths)  # the list fills as ports are bound
    credentials = certificates.grpc_credentials() if certificates is not None else None
    daemon.addresses = _bind(server, config.server.listen, credentials, daemon.unix_paths)
    undo.push_async_callback(_release, server)
    if config.server.admin_listen:
        # Its own server: a gRPC server cannot tell which of its ports a call came
        # in on, and this one serves control calls with no credentials.
        daemon.admin_server = grpc.aio.server(options=_server_options(config))
        add_to_server(None, admin, daemon.admin_server, tracer=tracer)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, daemon.admin_server)
        daemon.admin_addresses = _bind(
            daemon.admin_server, config.server.admin_listen, None, daemon.unix_paths
        )
        undo.push_async_callback(_release, daemon.admin_server)
    if config.server.http_listen:
        daemon.http = DaemonHttp(
            monitor,
            config.server.http_listen,
            daemon.metrics_page,
            certificates.ssl_context() if certificates is not None else None,
            reuse_port=reuse_port,
            routes=None if behind_api_keys else JsonApi(chains, authorizer).add_routes,
            idle_timeout_s=config.server.http_idle_timeout_s,
        )
        try:
            await daemon.http.start()
        except OSError as exc:
            raise StartupError(f"cannot listen on {config.server.http_listen}: {exc}") from exc
        undo.push_async_callback(daemon.http.stop)
    await server.start()
    if daemon.admin_server is not None:
        await daemon.admin_server.start()
    for path in daemon.unix_paths:
        # Group-writable, so a gateway in another container of the pod (another uid,
        # the pod's fsGroup) can connect; the socket's directory bounds who sees it.
        os.chmod(path, UNIX_SOCKET_MODE)
    if config.control.enabled:
        controller.start()
        undo.push_async_callback(controller.stop)
    await monitor.start()
    daemon.loop_lag = LoopLagProbe(metrics.loop_lag)
    daemon.loop_lag.start()
    undo.push_async_callback(daemon.loop_lag.stop)
    if metrics.multiprocess:
        daemon.leadership = asyncio.get_running_loop().create_task(
            _publish_leadership(metrics, status, config.server.health_check_interval_s)
        )
    tls = ""
    if certificates is not None:
        tls = " (mTLS)" if certificates.requires_client_certificates else " (TLS)"
    log.info(
        "qosd serving on %s%s%s with the %s store, fail mode %s",
        ", ".join(daemon.addresses),
        tls,
        f", admin on {', '.join(daemon.admin_addresses)}" if daemon.admin_addresses else "",
        "redis" if config.redis.url else "embedded",
        config.fail_mode.value,
    )
    return daemon


async def _release(server: grpc.aio.Server) -> None:
    """Gives a server's ports back. grpcio keeps the ports of a server that was never
    started bound until the process exits, stop() or not (measured with grpcio
    1.78): so a failed start, retried in the same process, found its own port taken.
    Started, then stopped at once, it lets them go."""
    await server.start()
    await server.stop(0)


def _unlink_all(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def _publish_leadership(metrics: Metrics, status: StatusService, interval_s: float) -> None:
    """Workers (multiprocess metrics): ``qosd_controller_leader`` is the largest of the
    workers' own values, and a scrape is answered by one worker, which reads only its
    own; so each sets its own as it goes. Leadership changes at most once an SLO turn,
    and this reads a flag in memory, no store."""
    while True:
        metrics.leader.set(1 if status.leads else 0)
        await asyncio.sleep(interval_s)


def _server_options(config: Config, reuse_port: bool = False) -> list[tuple[str, Any]]:
    max_bytes = config.limits.max_message_bytes
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", max_bytes),
        # Two daemons on one port would silently split traffic; fail instead. Workers
        # of one supervisor share theirs on purpose (it checked that no one else holds
        # it: qosd.workers).
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


def _bind(
    server: grpc.aio.Server,
    addresses: list[str],
    credentials: grpc.ServerCredentials | None,
    unix_paths: list[str],
) -> list[str]:
    """Adds a port per address (TCP ones with ``credentials``, when set; unix sockets
    always plain: the file system guards them); returns the bound addresses."""
    bound = []
    for address in addresses:
        parsed = parse_listen_address(address)
        if parsed.unix_path is not None:
            Path(parsed.unix_path).parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_socket(parsed.unix_path)
        try:
            if credentials is not None and parsed.unix_path is None:
                port = server.add_secure_port(parsed.target, credentials)
            else:
                port = server.add_insecure_port(parsed.target)
        except RuntimeError as exc:
            raise StartupError(f"cannot listen on {address}: {exc}") from exc
        if parsed.unix_path is not None:
            unix_paths.append(parsed.unix_path)
            bound.append(parsed.target)
        else:
            host = parsed.target.rpartition(":")[0]
            bound.append(f"{host}:{port}")
    return bound


async def serve(
    config: Config,
    ready_file: str | None = None,
    *,
    reload: Callable[[], Config] | None = None,
    config_path: str | None = None,
    reuse_port: bool = False,
) -> None:
    """Runs the daemon until SIGTERM/SIGINT, then drains within the configured grace.

    With ``reload`` (how the config was loaded: the file, the environment and the
    command line's overrides), SIGHUP and a replaced ``config_path`` reload it.
    ``reuse_port``: as a worker of ``serve --workers N`` (``start``)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Before start: its "serving on" line may prompt a supervisor's (or a test's)
    # SIGTERM at once, which must drain, not kill (exit -15). SIGHUP, until the
    # reloader takes it, changes nothing (its default would kill the daemon).
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: None)
    daemon = await start(config, reuse_port=reuse_port)
    tune_for_serving()
    if reload is not None:
        reloader = daemon.reloader = ConfigReloader(
            reload,
            lambda: daemon.config,
            daemon.apply,
            path=config_path,
            sample_ratio_live=daemon.tracing is not None and daemon.tracing.sampler is not None,
            on_result=daemon.reload_result,
        )
        loop.add_signal_handler(signal.SIGHUP, reloader.request, "SIGHUP")
        reloader.start()
    if ready_file:
        http = daemon.http.address if daemon.http else None
        write_ready_file(
            ready_file,
            {"addresses": daemon.addresses, "admin": daemon.admin_addresses, "http": http},
        )
    await stop.wait()
    log.info("draining: refusing new calls, %.1fs grace", config.server.drain_grace_s)
    await daemon.stop()
    log.info("stopped")


def write_ready_file(path: str, content: dict[str, Any]) -> None:
    """Tells a supervisor (or a test) where a server listens, atomically: through
    ``PATH.tmp`` and a rename, so a reader never sees half a file."""
    temporary = f"{path}.tmp"
    Path(temporary).write_text(json.dumps({"pid": os.getpid(), **content}))
    os.replace(temporary, path)
