"""Starts the proxy: a qosd daemon (its store, waiting room, SLO loop, gRPC and HTTP
listeners, as ``qosd serve`` runs them) with the OpenAI-compatible listener in front."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler

from qosd.config import MAX_POOL_SERVERS, Config, parse_listen_address
from qosd.doors import openapi
from qosd.doors.auth import CallerCheck, Group
from qosd.doors.proxy.handler import Proxy, ProxySettings
from qosd.doors.proxy.openai_errors import OpenAIError
from qosd.doors.proxy.telemetry import GenAiTelemetry
from qosd.doors.proxy.upstreams import Upstreams
from qosd.gc_tuning import tune_for_serving
from qosd.server import Daemon, start, write_ready_file

log = logging.getLogger(__name__)

#: How often latency samples gathered from the streams are reported, seconds.
REPORT_INTERVAL_S = 0.2


@dataclass
class RunningProxy:
    daemon: Daemon
    proxy: Proxy
    runner: web.AppRunner
    session: aiohttp.ClientSession
    reporter: asyncio.Task[None]
    address: str  # HOST:PORT bound

    async def stop(self) -> None:
        """Drains: the listener stops, the requests in flight get the daemon's
        ``server.drain_grace_s``, then what still runs is cut and its lease ended."""
        self.daemon.admission.begin_drain()
        for site in list(self.runner.sites):
            await site.stop()
        await self.proxy.drain(self.daemon.config.server.drain_grace_s)
        await self.runner.cleanup()
        self.reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.reporter
        await self.proxy.settled()
        await self.proxy.prompt_counter.close()
        await self.proxy.flush_samples()
        await self.session.close()
        await self.daemon.stop()


@web.middleware
async def openai_not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A path the proxy does not serve, or a method a path does not take, answered in
    OpenAI's format (as OpenAI answers it), not as aiohttp's text page."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return OpenAIError(405, f"{request.method} is not allowed on {request.path} "
                           f"(allowed: {allowed})", code="method_not_allowed",
                           headers={"Allow": allowed}).response()  # fmt: skip
    except web.HTTPNotFound:
        return OpenAIError(404, f"invalid URL ({request.method} {request.path[:200]})",
                           code="unknown_url").response()  # fmt: skip


def proxy_app(proxy: Proxy) -> web.Application:
    app = web.Application(
        client_max_size=proxy.settings.max_body_bytes, middlewares=[openai_not_found]
    )
    app.router.add_post("/v1/chat/completions", proxy.chat_completions,
                        expect_handler=proxy.expect_continue)  # fmt: skip
    app.router.add_post("/v1/completions", proxy.completions,
                        expect_handler=proxy.expect_continue)  # fmt: skip
    app.router.add_get("/v1/models", proxy.models)
    openapi.add_route(app)
    return app


def with_upstream_servers(config: Config, upstreams: Upstreams) -> Config:
    """``config`` with each pool whose server count is not configured counting the
    upstreams of the models it serves (the default pool: those no pool names): the
    proxy spreads each pool's prompts over them, so the stores keep that many prefill
    clocks (``PoolConfig.servers``)."""
    named = {model for pool in config.pools.values() for model in pool.models}
    pools = {}
    for name, pool in config.pools.items():
        models = list(pool.models)
        if name == config.default_pool:
            models += [model for model in upstreams.models() if model not in named]
        servers = min(upstreams.count(models), MAX_POOL_SERVERS)
        counted = pool.servers is None and servers > 1
        pools[name] = pool.model_copy(update={"servers": servers}) if counted else pool
    return config.model_copy(update={"pools": pools})


async def start_proxy(
    config: Config,
    listen: str,
    settings: ProxySettings,
    telemetry: GenAiTelemetry | None = None,
) -> RunningProxy:
    """Starts the daemon, then the proxy's listener on ``listen`` (HOST:PORT).
    ``telemetry``: where the GenAI spans and metrics go; by default, the daemon's
    tracing (spans and metrics exported beside them when tracing is on)."""
    config = with_upstream_servers(config, settings.upstreams)
    # With keys, the daemon opens no door around them (qosd.server.start).
    daemon = await start(config, behind_api_keys=bool(settings.api_keys))
    if config.auth.qos.configured:
        settings = dataclasses.replace(
            settings, caller_check=CallerCheck(config.auth.qos, Group.QOS)
        )
    try:
        # Unbounded: the pool's own limits (max_in_flight, the budget) bound what is
        # sent upstream; aiohttp's default of 100 connections would cap it below them.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            # No total: a stream runs as long as it runs. Connect and each read are
            # bounded, so a hung upstream ends its request and lease.
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=settings.upstream_connect_timeout_s,
                sock_read=settings.upstream_read_timeout_s,
            ),
        )
        if telemetry is None:
            tracing = daemon.tracing
            telemetry = GenAiTelemetry(
                tracing.tracer if tracing else None,
                tracing.meter_provider.get_meter("qosd.proxy")
                if tracing and tracing.meter_provider
                else None,
            )
        proxy = Proxy(daemon.decisions, settings, session, telemetry)
        # A client that disconnects cancels its handler: its waiter leaves the queue,
        # its upstream request is closed and its lease ends.
        runner = web.AppRunner(
            proxy_app(proxy),
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=config.server.http_idle_timeout_s,
            # The drain is RunningProxy.stop's (Proxy.drain); by cleanup, what is
            # left is idle connections to close.
            shutdown_timeout=1.0,
        )
        await runner.setup()
        target = parse_listen_address(listen).target
        host, _, port = target.rpartition(":")
        ssl_context = daemon.certificates.ssl_context() if daemon.certificates else None
        site = web.TCPSite(runner, host.strip("[]"), int(port), ssl_context=ssl_context)
        await site.start()
    except BaseException:
        await daemon.stop(0)
        raise
    bound_host, bound_port = runner.addresses[0][:2]
    reporter = asyncio.get_running_loop().create_task(proxy.report_every(REPORT_INTERVAL_S))
    log.info("qosd proxy serving the OpenAI API on %s:%s for %s", bound_host, bound_port,
             ", ".join(settings.upstreams.models()))  # fmt: skip
    return RunningProxy(daemon, proxy, runner, session, reporter, f"{bound_host}:{bound_port}")


async def serve_proxy(
    config: Config, listen: str, settings: ProxySettings, ready_file: str | None = None
) -> None:
    """Runs until SIGTERM or SIGINT, then stops taking requests and drains."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    running = await start_proxy(config, listen, settings)
    tune_for_serving()
    if ready_file:
        daemon = running.daemon
        write_ready_file(
            ready_file,
            {
                "address": running.address,
                "grpc": daemon.addresses,
                "http": daemon.http.address if daemon.http else None,
            },
        )
    await stop.wait()
    log.info("draining the proxy")
    await running.stop()
