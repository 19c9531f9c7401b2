"""Whether this daemon can answer as configured, for gRPC health and kubelet probes;
and the daemon's HTTP endpoints.

"Serving" means more than "the process is up": under ``fail_mode: closed`` a daemon
whose store is unreachable can only refuse, so a load balancer or kubelet should take
it out of rotation until the store answers again. Under ``fail_mode: open`` it still
answers (admitting without a budget check), so it stays SERVING. A draining daemon is
NOT_SERVING whatever the store does.

The check is a store PING every ``server.health_check_interval_s``, off the Acquire
path: probes must not cost requests anything, and one slow PING must not be mistaken
for an outage of the hot path's pipelined connections (those have their own guard).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from grpc_health.v1 import health, health_pb2
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from qosd.config import Config, FailMode, parse_listen_address
from qosd.model import StoreUnavailable
from qosd.store.base import BucketStore

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthMonitor:
    """Keeps the gRPC health service, and ``ready``, in step with the store."""

    def __init__(
        self,
        config: Config,
        store: BucketStore,
        servicer: health.aio.HealthServicer,
        services: Sequence[str],
    ) -> None:
        self._interval_s = config.server.health_check_interval_s
        # Public: a reload may change fail_mode (qosd.server.Daemon.apply).
        self.fail_open = config.fail_mode is FailMode.OPEN
        self._store = store
        self._servicer = servicer
        self._services = tuple(services)
        self._task: asyncio.Task[None] | None = None
        self.store_reachable = True
        self.draining = False
        self.reason = "starting"
        self._published: bool | None = None

    @property
    def ready(self) -> bool:
        return not self.draining and (self.store_reachable or self.fail_open)

    async def start(self) -> None:
        await self.check()
        self._task = asyncio.create_task(self._run(), name="qosd-health")

    async def stop(self) -> None:
        """Drain: NOT_SERVING from now on, and no more checks."""
        self.draining = True
        self.reason = "draining"
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._publish()

    async def check(self) -> None:
        try:
            await self._store.ping()
        except StoreUnavailable as error:
            if self.store_reachable:
                log.warning("health: store unreachable (%s)", error)
            self.store_reachable = False
            self.reason = f"store unreachable: {error}"
            if self.fail_open:
                self.reason += "; answering fail-open"
        else:
            if not self.store_reachable:
                log.info("health: store reachable again")
            self.store_reachable = True
            self.reason = "ok"
        if self.draining:
            self.reason = "draining"
        await self._publish()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.check()
            except Exception:  # the monitor must outlive any one check
                log.exception("health check failed")

    async def _publish(self) -> None:
        ready = self.ready
        if ready == self._published:
            return
        self._published = ready
        if not ready and not self.draining:
            log.warning("health: NOT_SERVING (%s; fail mode closed)", self.reason)
        status = SERVING if ready else NOT_SERVING
        for service in self._services:
            await self._servicer.set(service, status)


class DaemonHttp:
    """``GET /healthz`` (the process and its event loop answer), ``GET /readyz`` (it
    can answer as configured) and ``GET /metrics`` (Prometheus), on
    ``server.http_listen``."""

    def __init__(
        self,
        monitor: HealthMonitor,
        address: str,
        metrics_page: Callable[[], Awaitable[bytes]] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        reuse_port: bool = False,
        routes: Callable[[web.Application], None] | None = None,
        idle_timeout_s: float = 75.0,
    ) -> None:
        """``reuse_port``: the workers of ``serve --workers N`` share one HTTP port
        (SO_REUSEPORT); each answers for itself, so ``/readyz`` says whether the
        worker that took the connection can answer, and ``/metrics`` shows the whole
        group (qosd.metrics)."""
        self._monitor = monitor
        self._reuse_port = reuse_port
        self._ssl_context = ssl_context
        self._metrics_page = metrics_page
        self._routes = routes  # more of the daemon on this listener (qosd.doors.json_api)
        self._idle_timeout_s = idle_timeout_s  # server.http_idle_timeout_s
        host, _, port = parse_listen_address(address).target.rpartition(":")
        self._host, self._port = host, int(port)
        self._runner: web.AppRunner | None = None
        self.address = address

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        if self._metrics_page is not None:
            app.router.add_get("/metrics", self._metrics)
        if self._routes is not None:
            self._routes(app)
        # A caller that leaves cancels its handler, as gRPC cancels a call: a waiting
        # Acquire leaves the queue rather than take a lease no one will release.
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            # server.http_idle_timeout_s: aiohttp's keepalive timeout, which since
            # 3.14 also runs from a connection's start (a head never sent).
            keepalive_timeout=self._idle_timeout_s,
        )
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self._host,
            self._port,
            reuse_port=self._reuse_port,
            ssl_context=self._ssl_context,
        )
        await site.start()
        bound = self._runner.addresses  # port 0 resolved
        if bound:
            self.address = f"{self._host}:{bound[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _metrics(self, request: web.Request) -> web.Response:
        assert self._metrics_page is not None
        body = await self._metrics_page()
        # The classic text format, which every Prometheus (and promtool) reads.
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    async def _readyz(self, request: web.Request) -> web.Response:
        monitor = self._monitor
        body = {
            "ready": monitor.ready,
            "reason": monitor.reason,
            "store_reachable": monitor.store_reachable,
        }
        return web.json_response(body, status=200 if monitor.ready else 503)
