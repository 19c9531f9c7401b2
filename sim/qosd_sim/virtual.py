"""A replay in virtual time: the simulated GPU, qosd's admission and the gateway in
one process, on an event loop whose clock jumps to its next timer (``looptime``).

Why: a replay in real time costs its trace's length in wall time, policy by policy
and seed by seed (one cell of the yardstick's matrix 3.5 hours, the matrix 63 hours
on two CPUs), and a busy host moves its figures (late wake-ups of the gateway, GPU
time lost). In virtual time the same parts run, qosd's own code (the daemon's core
from ``qosd.server.start_core``, its gRPC servicer, the Lua rules on the embedded
store, the SLO loop) and the same engine and gateway, but computing takes no time:
only the GPU's modelled passes and the parts' own waits and timers move the clock.
A run is as fast as the CPU allows, and the same on a busy machine as on an idle one.

What differs from the replay in real time (``qosd_sim.experiment``), and why it is
fair to every policy alike:

- no sockets: the gateway calls the daemon's servicer and the server's ``serve`` in
  process, with the same messages; the network and the daemon's CPU cost nothing
  (in real time, about a millisecond an Acquire on this machine);
- the embedded store, whose scripts are Redis's (ADR 2), with the loop's clock as
  its TIME;
- one daemon; work the daemon puts in a thread (the SLO loop's arithmetic) finishes
  before the clock moves on.

``docs/yardstick.md#virtual-time`` compares the two on the same seeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any, NoReturn, cast

import grpc
import looptime
from tritonclient.grpc import service_pb2

from qosd.config import Config
from qosd.doors.grpc_api import QoSService
from qosd.server import DaemonCore, make_store, start_core
from qosd_client import QosdClient, ServerLoad
from qosd_client.reporter import LatencyReporter
from qosd_sim.errors import QueueFull
from qosd_sim.gateway import Gateway, ServerRefused
from qosd_sim.gpu import GpuModel
from qosd_sim.replay import Request
from qosd_sim.server import EnginePassCounters, RealTimeGpu, SimulatedTriton

#: Where the virtual clock starts: any value works; a large one keeps "0 means unset"
#: bugs from hiding.
START_S = 1_000.0


class _VirtualTimeLoop(looptime.make_event_loop_class(asyncio.SelectorEventLoop)):  # type: ignore[misc]
    """looptime's loop, with work sent to a thread run at once, in the loop's
    thread: it takes no loop time whatever the host's speed (looptime would let the
    clock move on while a thread runs longer than the gap to the next timer, which
    makes a run depend on how busy the machine is)."""

    def run_in_executor(self, executor: Any, func: Callable[..., Any], *args: Any) -> Any:
        future = self.create_future()
        try:
            future.set_result(func(*args))
        except BaseException as error:
            future.set_exception(error)
        return future


@contextlib.contextmanager
def virtual_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A new event loop in virtual time, with ``time.monotonic`` reading its clock
    while it is open (the simulator, the gateway and qosd's waits read that clock)."""
    loop = _VirtualTimeLoop(start=START_S, noop_cycles=0)
    real_monotonic = time.monotonic
    time.monotonic = loop.time
    try:
        yield loop
    finally:
        time.monotonic = real_monotonic
        loop.close()


class InProcessRpcError(grpc.RpcError):  # type: ignore[misc]
    """A status a servicer answered in process, as a gRPC client would see it."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    """What the servicers read of a ``grpc.aio.ServicerContext``, for a call made in
    process: the caller's deadline, no metadata, and ``abort``."""

    def __init__(self, timeout_s: float | None) -> None:
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def invocation_metadata(self) -> tuple[()]:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise InProcessRpcError(code, details)


Handler = Callable[[Any, Any], Any]


async def _call(handler: Handler, request: Any, **call: Any) -> Any:
    """One unary call, as a stub makes it: the handler runs under the caller's
    deadline (``timeout``), and is cancelled when it passes (DEADLINE_EXCEEDED)."""
    deadline_s: float | None = call.get("timeout")
    try:
        async with asyncio.timeout(deadline_s):
            return await handler(request, _Context(deadline_s))
    except TimeoutError:
        raise InProcessRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None


class _Stub:
    """A gRPC stub whose unary ``methods`` call ``servicer``'s in process."""

    def __init__(self, servicer: object, *methods: str) -> None:
        for name in methods:
            setattr(self, name, functools.partial(_call, getattr(servicer, name)))


class _NoChannel:
    """A channel the client's stubs are built on and never call (``_Stub`` replaces
    them)."""

    def unary_unary(self, *_: Any, **__: Any) -> None:
        return None

    async def close(self) -> None:
        return None


class InProcessQosd(QosdClient):
    """The gateway's and the reporter's qosd client, calling a daemon's servicers in
    this process: the client's own conversions and errors, no socket."""

    def __init__(self, core: DaemonCore, *, timeout_s: float = 5.0) -> None:
        super().__init__(channel=cast(grpc.aio.Channel, _NoChannel()), timeout_s=timeout_s)
        qos = QoSService(core.decisions)
        self._stub = cast(Any, _Stub(qos, "Acquire", "Release", "Report"))
        self._admin = cast(Any, _Stub(core.admin, "GetStatus"))


@contextlib.asynccontextmanager
async def in_process_daemon(config: Config) -> AsyncGenerator[DaemonCore, None]:
    """qosd's core on the embedded store, with the loop's clock as the store's TIME,
    and its SLO loop running where ``config`` enables it."""
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as undo:
        store = make_store(config, clock_us=lambda: int(loop.time() * 1e6))
        core = await start_core(config, store, undo)
        if config.control.enabled:
            core.controller.start()
            undo.push_async_callback(core.controller.stop)
        undo.push_async_callback(core.admission.close, 0.0)
        yield core


class InProcessGateway(Gateway):
    """The replay's gateway, sending each request to a simulated Triton in process."""

    def __init__(self, server: SimulatedTriton, *, model: str, **options: Any) -> None:
        super().__init__(cast(Any, None), model=model, **options)
        self._server = server

    async def _stream(
        self, request: Request, lease_id: str, priority: int
    ) -> AsyncGenerator[tuple[int, bool], None]:
        message = service_pb2.ModelInferRequest(model_name=self._model, id=str(request.index))
        for name, value in (
            ("input_tokens", request.input_tokens),
            ("output_tokens", request.output_tokens),
        ):
            tensor = message.inputs.add(name=name, datatype="INT32", shape=[1])
            tensor.contents.int_contents.append(value)
        message.parameters["priority"].uint64_param = priority
        message.parameters["qos_class"].string_param = request.qos_class
        message.parameters["tenant"].string_param = request.tenant
        message.parameters["lease_id"].string_param = lease_id
        try:
            async for tokens, final in self._server.serve(message, self._server.stream_every):
                yield tokens, final
        except QueueFull as refused:
            raise ServerRefused(str(refused)) from None


@contextlib.asynccontextmanager
async def in_process_server(
    gpu: GpuModel,
    qos: QosdClient | None,
    *,
    model: str,
    max_queued: int | None = None,
    passes_every_s: float | None = None,
) -> AsyncGenerator[SimulatedTriton, None]:
    """A simulated Triton in this process, reporting to ``qos`` when given: its
    requests' latencies, and with ``passes_every_s``, what its passes carried, as
    ``qosd scrape --engine vllm`` reads a vLLM server's counters that often."""
    reporter = LatencyReporter(qos) if qos is not None else None
    server = SimulatedTriton(
        RealTimeGpu(gpu), model_name=model, reporter=reporter, max_queued=max_queued
    )
    server.gpu.start()
    if reporter is not None:
        reporter.start()
    scraping = None
    if qos is not None and passes_every_s is not None:
        counter = EnginePassCounters()
        server.gpu.on_pass = counter.record
        scraping = asyncio.create_task(_report_passes(qos, counter, model, passes_every_s))
    try:
        yield server
    finally:
        if scraping is not None:
            scraping.cancel()
            await asyncio.gather(scraping, return_exceptions=True)
        await server.gpu.stop()
        if reporter is not None:
            await reporter.close()


async def _report_passes(
    qos: QosdClient, counter: EnginePassCounters, model: str, every_s: float
) -> None:
    while True:
        await asyncio.sleep(every_s)
        stats = counter.take()
        if stats is not None:
            await qos.report([], loads=[ServerLoad(model, "sim-0", passes=stats)])
