"""What tests/test_fault_suite.py drives faults with: a proxy stack on a real Redis, a
``qosd sim-vllm`` process that can be stopped and killed, and steady mixed traffic
through the OpenAI proxy and the daemon's JSON API, every answer recorded.

Every client call is bounded (``CALL_TIMEOUT_S``): a call that outlasts it is recorded
as a hang, never waited on for good. Nothing here sleeps to synchronise; the only
sleeps pace the traffic (so many requests a second) or are a gateway holding its
lease while its request runs, as a real one would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from qosd.config import Config
from qosd.doors.proxy.handler import ProxySettings
from qosd.doors.proxy.server import RunningProxy, start_proxy
from qosd.doors.proxy.upstreams import Upstreams
from qosd.model import StoreUnavailable
from qosd.server import Daemon
from qosd_client.types import PoolState
from qosd_harness import (
    PORT_ATTEMPTS,
    PortReservation,
    PortTaken,
    RedisServer,
    redis_server,
    reserve_port,
    start_command,
    stop_process,
)
from tests.conftest import BASE_CONFIG, merge

MODEL = "llama-3-8b"  # the base config's pool serves it
CLASSES = ("P0", "P1", "P2")
#: The most any one client call may take; longer is a hang, recorded as a failure.
CALL_TIMEOUT_S = 30.0
#: Proxy requests a second, and one gateway acquire/release pair per this many.
RATE_PER_S = 20.0
GATEWAY_EVERY = 4


# -- what was answered ------------------------------------------------------------------


@dataclass
class Answer:
    """One call as its client saw it."""

    door: str  # "proxy", "acquire" or "release" (the JSON API), "held" (a held lease's release)
    sent_at: float
    done_at: float = 0.0
    status: int | None = None  # None: no answer (``failure`` says what happened)
    failure: str = ""
    stream: bool = False
    max_tokens: int = 0
    #: proxy: "answer" (a whole answer with usage), "done" (a stream's [DONE]),
    #: "error:CODE" (an OpenAI error body or a stream's error event), "truncated";
    #: JSON API: the decision ("DECISION_ADMITTED", ...), else the error code.
    ending: str = ""
    #: proxy: x-qos-reason; JSON acquire: the decision's reason.
    reason: str = ""
    lease_id: str = ""

    def during(self, began: float, ended: float) -> bool:
        """Sent and answered while the fault lasted."""
        return began <= self.sent_at and self.done_at <= ended


def _parse(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None


def ending_of(raw: bytes, stream: bool) -> str:
    """How an answer's body ended: the whole of it, a stream's [DONE], an error, or cut
    with neither (which a client could not tell from a short answer: never allowed)."""
    if stream:
        events = [line[6:].strip() for line in raw.split(b"\n") if line.startswith(b"data: ")]
        if events and events[-1] == b"[DONE]":
            return "done"
        body = _parse(events[-1]) if events else None
    else:
        body = _parse(raw)
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"error:{body['error'].get('code')}"
    if not stream and isinstance(body, dict) and isinstance(body.get("usage"), dict):
        return "answer"
    return "truncated"


def chat(max_tokens: int, stream: bool, words: int = 8) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


# -- the stack ----------------------------------------------------------------------------


@dataclass
class Stack:
    """A proxy (its daemon serving gRPC and the JSON API too) on one Redis, in front of
    one upstream, with a client session for both doors."""

    running: RunningProxy
    session: aiohttp.ClientSession

    @property
    def daemon(self) -> Daemon:
        return self.running.daemon

    @property
    def proxy_url(self) -> str:
        return f"http://{self.running.address}/v1"

    @property
    def json_url(self) -> str:
        assert self.daemon.http is not None
        return f"http://{self.daemon.http.address}/v1"

    async def pool(self) -> PoolState | None:
        """The pool as the store counts it (leases in flight, waiters, latency windows);
        None while the store does not answer."""
        try:
            status = await self.daemon.status.status(["default"], 0, ())
        except StoreUnavailable:
            return None
        return status.pool("default")

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the daemon's ``name`` samples whose labels include ``labels``."""
        total = 0.0
        for family in self.daemon.metrics.registry.collect():
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    total += sample.value
        return total

    async def ask(self, qos_class: str, max_tokens: int, stream: bool) -> Answer:
        """One chat completion through the proxy, read to its end."""
        answer = Answer("proxy", time.monotonic(), stream=stream, max_tokens=max_tokens)
        raw = b""
        try:
            async with (
                asyncio.timeout(CALL_TIMEOUT_S),
                self.session.post(f"{self.proxy_url}/chat/completions",
                                  json=chat(max_tokens, stream),
                                  headers={"x-qos-class": qos_class}) as response,
            ):  # fmt: skip
                raw = await response.read()
                answer.status = response.status
                answer.reason = response.headers.get("x-qos-reason", "")
        except TimeoutError:
            answer.failure = f"no answer within {CALL_TIMEOUT_S} s"
        except aiohttp.ClientError as exc:  # the proxy broke its connection to the client
            answer.failure = f"{type(exc).__name__}: {exc}"
        answer.done_at = time.monotonic()
        if answer.status is not None:
            answer.ending = ending_of(raw, stream and answer.status == 200)
        return answer

    async def begin_stream(self, max_tokens: int) -> asyncio.Task[Answer]:
        """A stream through the proxy, once its first event has come (mid-answer from
        then on); the task reads the rest and answers what came."""
        answer = Answer("proxy", time.monotonic(), stream=True, max_tokens=max_tokens)
        async with asyncio.timeout(CALL_TIMEOUT_S):
            response = await self.session.post(
                f"{self.proxy_url}/chat/completions", json=chat(max_tokens, stream=True)
            )
            answer.status = response.status
            first = await response.content.readline()

        async def rest() -> Answer:
            raw = first
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    raw += await response.read()
            except TimeoutError:
                answer.failure = f"no end within {CALL_TIMEOUT_S} s"
            except aiohttp.ClientError as exc:
                answer.failure = f"{type(exc).__name__}: {exc}"
            finally:
                response.close()
            answer.done_at = time.monotonic()
            answer.ending = ending_of(raw, answer.status == 200)
            return answer

        return asyncio.get_running_loop().create_task(rest())

    async def call_json(self, door: str, path: str, body: dict[str, Any]) -> Answer:
        """One call to the daemon's JSON API, as a gateway makes it (no retries: what
        the daemon does about a Release that did not land is under test)."""
        answer = Answer(door, time.monotonic())
        try:
            async with (
                asyncio.timeout(CALL_TIMEOUT_S),
                self.session.post(f"{self.json_url}/{path}", json=body) as response,
            ):
                reply = _parse(await response.read())
                answer.status = response.status
        except TimeoutError:
            answer.failure = f"no answer within {CALL_TIMEOUT_S} s"
            reply = None
        except aiohttp.ClientError as exc:
            answer.failure = f"{type(exc).__name__}: {exc}"
            reply = None
        answer.done_at = time.monotonic()
        if isinstance(reply, dict):
            answer.ending = str(reply.get("decision") or reply.get("code") or "")
            answer.reason = str(reply.get("reason", ""))
            answer.lease_id = str(reply.get("lease_id", ""))
        return answer

    async def acquire(self, qos_class: str) -> Answer:
        return await self.call_json("acquire", "acquire", {
            "qos_class": qos_class, "model": MODEL, "input_tokens": 20,
            "expected_output_tokens": 10, "max_wait_ms": 100,
        })  # fmt: skip

    async def release(self, lease_id: str, door: str = "release") -> Answer:
        return await self.call_json(door, "release", {
            "lease_id": lease_id, "actual_input_tokens": 20, "actual_output_tokens": 8,
        })  # fmt: skip


def settled(pool: PoolState | None) -> bool:
    """No lease in flight and nobody waiting, as the store counts them."""
    return (
        pool is not None
        and pool.active_leases == 0
        and all(c.in_flight == 0 and c.waiting == 0 for c in pool.classes)
    )


def window_samples(pool: PoolState | None) -> int:
    """Latency samples in the SLO loop's windows, all classes."""
    return -1 if pool is None else sum(c.latency.samples for c in pool.classes)


# -- traffic ------------------------------------------------------------------------------


@dataclass
class Traffic:
    """~RATE_PER_S proxy requests a second (seeded: streaming or not, class, length),
    and a gateway's acquire/release pair through the JSON API every GATEWAY_EVERY of
    them, each request in a task of its own (an open loop: a slow answer does not slow
    the arrivals), until stopped."""

    stack: Stack
    seed: int
    max_tokens: tuple[int, int] = (4, 30)
    answers: list[Answer] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _runner: asyncio.Task[None] | None = None

    def start(self) -> Traffic:
        self._runner = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> list[Answer]:
        """Stops sending and waits for every call sent (each is bounded)."""
        self._stop.set()
        if self._runner is not None:
            await self._runner
        while self._tasks:
            await asyncio.gather(*self._tasks)
        return self.answers

    def answered_since(self, moment: float) -> int:
        return sum(1 for a in self.answers if a.sent_at >= moment)

    async def _run(self) -> None:
        rng = random.Random(self.seed)
        index = 0
        while not self._stop.is_set():
            call = self._proxy_call(
                rng.choice(CLASSES), rng.randint(*self.max_tokens), rng.random() < 0.5
            )
            self._spawn(call)
            if index % GATEWAY_EVERY == 0:
                self._spawn(self._gateway(rng.choice(CLASSES), rng.uniform(0.0, 0.3)))
            index += 1
            with contextlib.suppress(TimeoutError):  # paces the arrivals; a stop ends it
                await asyncio.wait_for(self._stop.wait(), 1 / RATE_PER_S)

    def _spawn(self, call: Any) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _proxy_call(self, qos_class: str, max_tokens: int, stream: bool) -> None:
        self.answers.append(await self.stack.ask(qos_class, max_tokens, stream))

    async def _gateway(self, qos_class: str, hold_s: float) -> None:
        acquired = await self.stack.acquire(qos_class)
        self.answers.append(acquired)
        if acquired.ending == "DECISION_ADMITTED" and acquired.lease_id:
            await asyncio.sleep(hold_s)  # its request runs upstream meanwhile
            self.answers.append(await self.stack.release(acquired.lease_id))


# -- processes ----------------------------------------------------------------------------


@dataclass
class VllmProcess:
    """``qosd sim-vllm`` in a process of its own, on a port it keeps across restarts,
    so that it can be SIGSTOPped, SIGKILLed and started again at the same address.

    That port cannot be port 0 (the proxy in front must find it again after a kill):
    it is reserved (``PortReservation``) from the first start until ``stop``, so no
    other process takes it while the server is down; if it was taken anyway at the
    first start, that start tries again on another."""

    directory: Path
    options: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    port: int = 0
    reservation: PortReservation | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmProcess:
        first = self.reservation is None
        for _ in range(PORT_ATTEMPTS):
            if self.reservation is None:
                self.reservation = reserve_port()
                self.port = self.reservation.port
            try:
                self.process, _ = start_command(
                    ["sim-vllm", "--listen", f"127.0.0.1:{self.port}", "--model", MODEL,
                     *self.options],
                    self.directory,
                    "vllm",
                )  # fmt: skip
                return self
            except PortTaken:
                if not first:
                    raise  # a restart must come back where the proxy looks for it
                self.reservation.close()
                self.reservation = None
        raise RuntimeError(f"sim-vllm found its port taken {PORT_ATTEMPTS} times")

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)  # a stopped process cannot exit
            stop_process(self.process)
            self.process = None
        if self.reservation is not None:
            self.reservation.close()
            self.reservation = None

    async def busy(self, session: aiohttp.ClientSession) -> float:
        """Requests the server is running or has waiting, from its /metrics (vLLM's
        gauges): 0 once every request the proxy sent has ended or been dropped."""
        async with (
            asyncio.timeout(CALL_TIMEOUT_S),
            session.get(f"{self.url}/metrics") as response,
        ):
            text = await response.text()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        )


class Rig:
    """Starts what a case needs and stops it in reverse: the proxy before its upstream
    and its Redis, so that a stopping proxy never waits on a store already gone."""

    def __init__(self, exits: AsyncExitStack, directory: Path) -> None:
        self._exits = exits
        self._directory = directory

    def redis(self, *args: str) -> RedisServer:
        return self._exits.enter_context(redis_server(args))

    async def vllm(self, *options: str) -> VllmProcess:
        upstream = VllmProcess(self._directory, options)
        await asyncio.to_thread(upstream.start)
        self._exits.callback(upstream.stop)
        return upstream

    async def stack(
        self, redis: dict[str, Any], upstream: str, extra: dict[str, Any] | None = None,
        proxy: dict[str, Any] | None = None,
    ) -> Stack:  # fmt: skip
        """A proxy and its daemon (JSON API on an HTTP listener of its own) on
        ``redis``, in front of ``upstream``; ``extra`` merges over the base config,
        ``proxy`` names ProxySettings fields."""
        tree = merge(BASE_CONFIG, {"server": {"http_listen": "127.0.0.1:0"}, "redis": redis})
        settings = ProxySettings(
            upstreams=Upstreams.parse([f"{MODEL}={upstream}"]), default_class="P1",
            **(proxy or {}),
        )  # fmt: skip
        running = await start_proxy(
            Config.model_validate(merge(tree, extra or {})), "127.0.0.1:0", settings
        )
        self._exits.push_async_callback(running.stop)
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._exits.push_async_callback(session.close)
        return Stack(running, session)


@contextlib.asynccontextmanager
async def rig(directory: Path) -> AsyncIterator[Rig]:
    async with AsyncExitStack() as exits:
        yield Rig(exits, directory)
