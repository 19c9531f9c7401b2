"""Answers the store never sent. A script that ran while its reply was lost (Redis
killed, or the network cut, right after it ran) must leave no lease that nobody
holds: the daemon answered its caller by the fail mode, so the lease the store made
would stand in flight to its TTL, holding budget and room.

A relay between the daemon and a real Redis loses replies on purpose: while it is
losing, a connection forwards what the daemon sends, and when the store's reply
comes, it cuts both sides instead of passing it on. The store ran the call; the
daemon saw its connection cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from qosd.config import Config
from qosd.server import Daemon, start
from qosd_client import QosdClient, Reason
from qosd_harness import RedisServer, redis_server
from tests.conftest import BASE_CONFIG, merge
from tests.waiting import eventually


class LosingRelay:
    """A TCP relay to ``upstream``; while ``losing``, a reply from the store cuts its
    connection instead of reaching the client (``lost`` counts them)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.losing = False
        self.lost = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> LosingRelay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pipes both ways until either side ends, or a reply is to be lost; then cuts
        both connections."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            pipes = [
                asyncio.create_task(self._pipe(reader, up_writer, replies=False)),
                asyncio.create_task(self._pipe(up_reader, writer, replies=True)),
            ]
            try:
                await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pipe in pipes:
                    pipe.cancel()
                await asyncio.gather(*pipes, return_exceptions=True)
                up_writer.close()
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pipe(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, replies: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                if replies and self.losing:
                    self.lost += 1  # the store ran the call: its answer goes nowhere
                    return
                sink.write(data)
                await sink.drain()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    with redis_server() as server:
        yield server


@pytest.fixture
async def relay(own_redis: RedisServer) -> AsyncIterator[LosingRelay]:
    async with LosingRelay(own_redis.port) as running:
        yield running


@pytest.fixture(params=["closed", "open"])
async def daemon(request: pytest.FixtureRequest, relay: LosingRelay) -> AsyncIterator[Daemon]:
    config = merge(
        BASE_CONFIG,
        {
            "fail_mode": request.param,
            # One slot: a lease left in flight refuses the next request at once.
            "pools": {"default": {"max_in_flight": 1, "top_reserve": 0}},
            "classes": {"P1": {"max_wait_ms": 0}},
            "redis": {
                "url": f"redis://127.0.0.1:{relay.port}/0",
                "key_prefix": f"t{uuid.uuid4().hex[:12]}",
                "timeout_ms": 2_000,
                "connect_timeout_ms": 2_000,
                "retry_interval_ms": 200,
            },
        },
    )
    running = await start(Config.model_validate(config))
    yield running
    await running.stop(0)


async def test_an_admission_whose_answer_was_lost_is_undone(
    daemon: Daemon, relay: LosingRelay
) -> None:
    """The store admits and its answer is lost: the caller gets the fail mode's answer,
    and once the store answers again the daemon undoes the lease it never handed out,
    so the pool's one slot is free and the request id can be used again."""
    fail_mode = daemon.config.fail_mode.value
    async with QosdClient(daemon.addresses[0]) as qos:
        first = await qos.acquire("P1", 10, request_id="lost-1", timeout_s=10)
        assert first.admitted
        await qos.release(first.lease_id)

        relay.losing = True
        lost = await qos.acquire("P1", 10, request_id="lost-2", timeout_s=10)
        relay.losing = False
        assert relay.lost >= 1
        expected = Reason.FAIL_OPEN if fail_mode == "open" else Reason.BACKEND_UNAVAILABLE
        assert lost.reason is expected, lost

        status = await eventually(
            qos.status,
            lambda s: (
                s.pool("default").active_leases == 0 and daemon.admission.settlements.pending == 0
            ),
            timeout_s=20,
        )
        assert status.pool("default").active_leases == 0, status.pool("default")
        # Until a probe finds the store back, the daemon answers by its fail mode at once.
        again = await eventually(
            lambda: qos.acquire("P1", 10, request_id="lost-2", timeout_s=10),
            lambda r: r.reason not in (Reason.FAIL_OPEN, Reason.BACKEND_UNAVAILABLE),
            timeout_s=20,
            interval_s=0.1,
        )
        assert again.admitted and again.reason is Reason.NONE, again
        await qos.release(again.lease_id)
