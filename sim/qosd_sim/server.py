"""A simulated Triton server: the KServe v2 gRPC protocol in front of the GPU cost model.

It speaks the real protocol (the service definitions that ship inside ``tritonclient``),
so an unmodified ``tritonclient`` calls it, and a gateway under test cannot tell it from
Triton serving a decoupled LLM model. Each request names its token counts as inputs:

- ``input_tokens`` (INT32, shape [1]): the prompt length;
- ``output_tokens`` (INT32, shape [1]): how many tokens the simulated model generates
  (a trace knows this; a real model decides it).

Optional request parameters, as a gateway would forward them: ``qos_class``,
``tenant``, ``lease_id``. Requests that name a class have their TTFT, TPOT and
end-to-end latency reported to qosd with ``Report``, measured here from arrival.

Streaming (``ModelStreamInfer``) answers each request with a response at its first
token, one every ``stream_every`` tokens if set, and a last one flagged
``triton_final_response``; each carries ``token_count``, the tokens since the previous
response. Unary ``ModelInfer`` answers once, at the end.

With ``max_queued`` (``--max-num-queued-reqs``), a request that arrives while that many
are in flight, waiting or running, is refused at once, as vLLM refuses beyond its
``--max-num-queued-reqs``: gRPC UNAVAILABLE, or a stream error, with a message that
starts with ``errors.QUEUE_FULL``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import struct
import sys
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import uvloop
from aiohttp import web
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from qosd.server import write_ready_file
from qosd_client import LatencySample, PassStats, QosdClient
from qosd_client.reporter import LatencyReporter
from qosd_sim.errors import BadRequest, QueueFull
from qosd_sim.gpu import Engine, GpuModel, Sequence, TokenEvent, TokenKind
from qosd_sim.http_api import kserve_http_app
from qosd_sim.metrics import TritonMetrics, serve_metrics

log = logging.getLogger("qosd_sim")
T = TypeVar("T")

INPUT_NAMES = ("input_tokens", "output_tokens")
OUTPUT_NAME = "token_count"


#: How far behind the clock the simulated GPU restarts after a late wake-up of the
#: event loop: it catches up on this much (its tokens come late, but it produced them
#: in time); any more is GPU time lost.
MAX_CATCH_UP_S = 0.05


def pass_tokens(events: list[TokenEvent]) -> tuple[int, int]:
    """What vLLM V1 counts of one pass (engine step): the prompt tokens of the requests
    whose prefill it finished (``vllm:prompt_tokens_total``, a prompt's tokens all at
    once, with its first token) and the tokens it generated
    (``vllm:generation_tokens_total``)."""
    prompt = sum(e.sequence.input_tokens for e in events if e.kind is TokenKind.FIRST)
    return prompt, len(events)


class EnginePassCounters:
    """A server's pass counters, as vLLM V1 keeps them (``vllm:iteration_tokens_total``'s
    count, the prompt and generation token counters of :func:`pass_tokens`, and the
    inter-token latency's sum and count), for ``RealTimeGpu.on_pass``; :meth:`take`
    gives their differences since it last did, as ``qosd scrape`` reports them."""

    def __init__(self) -> None:
        self._counts: list[float] = [0, 0, 0, 0.0, 0]  # passes, prompt, generated, gap s, gaps
        self._taken = list(self._counts)

    def record(self, events: list[TokenEvent], duration_s: float) -> None:
        """One pass: a stream's token after its first comes one pass after the last."""
        prompt, generated = pass_tokens(events)
        later = sum(1 for e in events if e.kind is TokenKind.NEXT)
        for i, value in enumerate((1, prompt, generated, later * duration_s, later)):
            self._counts[i] += value

    def take(self) -> PassStats | None:
        """The passes since the last take; None where none decoded a later token."""
        now, before = list(self._counts), self._taken
        self._taken = now
        passes, prompt, generated, gap_s, gaps = (a - b for a, b in zip(now, before, strict=True))
        if not gaps or not generated:
            return None
        return PassStats(int(passes), int(prompt), int(generated), gap_s / gaps * 1000)


class RealTimeGpu:
    """Runs the engine's iterations against the wall clock, one at a time."""

    def __init__(self, model: GpuModel) -> None:
        self.engine = Engine(model)
        self._wake = asyncio.Event()
        self._queues: dict[Sequence, asyncio.Queue[TokenEvent]] = {}
        self._stream_every: dict[Sequence, int] = {}
        self._task: asyncio.Task[None] | None = None
        self.iterations = 0
        # (busy seconds of completed iterations, the running one's start and duration),
        # replaced whole, so that the metrics thread reads a consistent state.
        self._busy: tuple[float, float, float] = (0.0, 0.0, 0.0)
        #: GPU seconds lost to the host's lateness: how much later than it could have
        #: the simulated GPU started iterations after wake-ups more than
        #: ``MAX_CATCH_UP_S`` late (a slow host makes a slower GPU than the model).
        self.lost_seconds = 0.0
        #: Wake-ups, between back-to-back iterations, more than ``MAX_CATCH_UP_S`` late.
        self.late_wakeups = 0
        #: Told of every pass's tokens and duration as it ends (a server's per-pass
        #: metrics).
        self.on_pass: Callable[[list[TokenEvent], float], None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="simulated-gpu")

    def busy_seconds(self, now: float | None = None) -> float:
        """Seconds the simulated GPU has spent iterating since it started, to ``now``
        (the monotonic clock): completed iterations, and the elapsed part of the
        running one. The busy fraction over an interval is the difference of two
        readings over its length."""
        done, start, duration = self._busy
        elapsed = (time.monotonic() if now is None else now) - start
        return done + min(duration, max(0.0, elapsed))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        # Iterations run back to back against absolute deadlines: a late wake-up of the
        # event loop delays when tokens are delivered, not when the GPU would have
        # produced them, so lag does not add up into a slower GPU than the model. Up to
        # MAX_CATCH_UP_S of it: beyond, the GPU restarts that far back, and the rest is
        # lost (lost_seconds), lest an event loop blocked for long replay a burst.
        busy_until: float | None = None
        while True:
            now = time.monotonic()
            start = now
            if busy_until is not None:
                start = max(busy_until, now - MAX_CATCH_UP_S)
                if start > busy_until:
                    self.late_wakeups += 1
                    self.lost_seconds += start - self._ready_since(busy_until, start)
            iteration = self.engine.plan(start)
            if iteration is None:
                busy_until = None
                if self.engine.waiting:
                    # What waits arrived after this iteration's start (the server was
                    # catching up): plan again once it has arrived. Waiting for a wake
                    # instead would wait for good, as its submit's wake is spent.
                    head = self.engine.waiting[0].submitted_at
                    await asyncio.sleep(max(0.0, head - time.monotonic()))
                    continue
                self._wake.clear()
                await self._wake.wait()
                continue
            busy_until = start + iteration.duration_s
            self._busy = (self._busy[0], start, iteration.duration_s)
            await asyncio.sleep(max(0.0, busy_until - time.monotonic()))
            self._busy = (self._busy[0] + iteration.duration_s, 0.0, 0.0)
            self.iterations += 1
            events = self.engine.complete(busy_until)
            if self.on_pass is not None:
                self.on_pass(events, iteration.duration_s)
            for event in events:
                self._deliver(event)

    def _ready_since(self, busy_until: float, start: float) -> float:
        """When, between the last iteration's end and ``start``, the GPU had work again:
        at once if some request was left running, else when the first of those waiting
        arrived (at ``start`` if none had by then: then nothing was lost)."""
        if self.engine.running:
            return busy_until
        arrivals = (s.submitted_at for s in self.engine.waiting if s.submitted_at <= start)
        return max(busy_until, min(arrivals, default=start))

    def _deliver(self, event: TokenEvent) -> None:
        queue = self._queues.get(event.sequence)
        if queue is None:
            return
        every = self._stream_every.get(event.sequence, 0)
        wanted = (
            event.finished
            or event.kind is TokenKind.FIRST
            or (every > 0 and event.generated % every == 0)
        )
        if wanted:
            queue.put_nowait(event)
        if event.finished:
            del self._queues[event.sequence]
            self._stream_every.pop(event.sequence, None)

    async def generate(
        self, sequence: Sequence, stream_every: int = 0
    ) -> AsyncGenerator[TokenEvent, None]:
        """Yields the first token, every ``stream_every``-th token, and the last."""
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._queues[sequence] = queue
        self._stream_every[sequence] = stream_every
        self.engine.submit(sequence)
        self._wake.set()
        try:
            while True:
                event = await queue.get()
                yield event
                if event.finished:
                    return
        finally:
            if not sequence.done:
                self.engine.cancel(sequence)
                self._queues.pop(sequence, None)
                self._stream_every.pop(sequence, None)


@dataclass(frozen=True, slots=True)
class _Parsed:
    input_tokens: int
    output_tokens: int
    qos_class: str
    tenant: str
    lease_id: str
    traceparent: str
    priority: int  # the engine's: lower first


#: Triton's request priority: 1 is the highest, and 0 (or none) the model's default
#: level, here after every level a request names.
DEFAULT_PRIORITY_LEVEL = 2**63


def _priority(request: service_pb2.ModelInferRequest) -> int:
    parameter = request.parameters.get("priority")
    level = 0 if parameter is None else parameter.uint64_param or parameter.int64_param
    if level < 0:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "priority must be >= 0")
    return level or DEFAULT_PRIORITY_LEVEL


def _traceparent(context: grpc.aio.ServicerContext) -> str:
    """The caller's W3C trace context, as Triton takes it from request headers."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent" and isinstance(value, str):
            return value
    return ""


def _int_input(request: service_pb2.ModelInferRequest, name: str) -> int:
    for index, tensor in enumerate(request.inputs):
        if tensor.name != name:
            continue
        if tensor.datatype != "INT32":
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be INT32")
        if index < len(request.raw_input_contents):
            raw = request.raw_input_contents[index]
            if len(raw) != 4:
                raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must hold one value")
            return int(struct.unpack("<i", raw)[0])
        if len(tensor.contents.int_contents) == 1:
            return int(tensor.contents.int_contents[0])
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must hold one value")
    raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"missing input {name}")


def _string_parameter(request: service_pb2.ModelInferRequest, name: str) -> str:
    parameter = request.parameters.get(name)
    return parameter.string_param if parameter is not None else ""


def _bool_parameter(request: service_pb2.ModelInferRequest, name: str) -> bool:
    parameter = request.parameters.get(name)
    return bool(parameter.bool_param) if parameter is not None else False


class SimulatedTriton(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        gpu: RealTimeGpu,
        *,
        model_name: str = "llm",
        metrics: TritonMetrics | None = None,
        reporter: LatencyReporter | None = None,
        stream_every: int = 0,
        max_queued: int | None = None,
    ) -> None:
        """``max_queued``: refuse a request that arrives while the engine has this many
        in flight, waiting or running (``QueueFull``), as vLLM's
        ``--max-num-queued-reqs`` does; None: no cap, vLLM's default."""
        self.gpu = gpu
        self.model_name = model_name
        self.metrics = metrics or TritonMetrics()
        self.metrics.watch_pending(model_name, lambda: gpu.engine.queued)
        self.metrics.watch_busy(model_name, gpu.busy_seconds)
        self.metrics.watch_lost(model_name, lambda: gpu.lost_seconds, lambda: gpu.late_wakeups)
        self.reporter = reporter
        self.stream_every = stream_every
        self.max_queued = max_queued

    # Health and metadata -------------------------------------------------------------

    async def ServerLive(self, request: object, context: object) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(
        self, request: object, context: object
    ) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=True)

    async def ModelReady(
        self, request: service_pb2.ModelReadyRequest, context: object
    ) -> service_pb2.ModelReadyResponse:
        return service_pb2.ModelReadyResponse(ready=request.name == self.model_name)

    async def ServerMetadata(
        self, request: object, context: object
    ) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(
            name="qosd-simulated-triton", version="2.41.0", extensions=["parameters"]
        )

    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelMetadataResponse:
        if request.name != self.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        tensor = service_pb2.ModelMetadataResponse.TensorMetadata
        return service_pb2.ModelMetadataResponse(
            name=self.model_name,
            versions=["1"],
            platform="qosd_simulated_llm",
            inputs=[tensor(name=name, datatype="INT32", shape=[1]) for name in INPUT_NAMES],
            outputs=[tensor(name=OUTPUT_NAME, datatype="INT32", shape=[1])],
        )

    async def ModelConfig(
        self, request: service_pb2.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelConfigResponse:
        if request.name != self.model_name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
        config = model_config_pb2.ModelConfig(
            name=self.model_name, platform="qosd_simulated_llm", max_batch_size=0
        )
        for name in INPUT_NAMES:
            config.input.add(name=name, data_type=model_config_pb2.TYPE_INT32, dims=[1])
        config.output.add(name=OUTPUT_NAME, data_type=model_config_pb2.TYPE_INT32, dims=[1])
        config.model_transaction_policy.decoupled = True
        return service_pb2.ModelConfigResponse(config=config)

    # Inference ---------------------------------------------------------------------------

    def _parse(self, request: service_pb2.ModelInferRequest, traceparent: str) -> _Parsed:
        if request.model_name != self.model_name:
            raise BadRequest(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_name!r}")
        parsed = _Parsed(
            input_tokens=_int_input(request, "input_tokens"),
            output_tokens=_int_input(request, "output_tokens"),
            qos_class=_string_parameter(request, "qos_class"),
            tenant=_string_parameter(request, "tenant"),
            lease_id=_string_parameter(request, "lease_id"),
            # Per request (a parameter), or for the whole call (gRPC metadata).
            traceparent=_string_parameter(request, "traceparent") or traceparent,
            priority=_priority(request),
        )
        if parsed.input_tokens < 1 or parsed.output_tokens < 1:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT, "input_tokens and output_tokens must be >= 1"
            )
        limit = self.gpu.engine.model.kv_capacity_tokens
        if parsed.input_tokens + parsed.output_tokens > limit:
            raise BadRequest(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"input_tokens + output_tokens exceed the KV cache ({limit} tokens)",
            )
        return parsed

    def _response(
        self, request: service_pb2.ModelInferRequest, tokens: int, *, final: bool | None
    ) -> service_pb2.ModelInferResponse:
        response = service_pb2.ModelInferResponse(
            model_name=self.model_name, model_version="1", id=request.id
        )
        response.outputs.add(name=OUTPUT_NAME, datatype="INT32", shape=[1])
        response.raw_output_contents.append(struct.pack("<i", tokens))
        if final is not None:
            response.parameters["triton_final_response"].bool_param = final
        return response

    async def serve(
        self, request: service_pb2.ModelInferRequest, stream_every: int, traceparent: str = ""
    ) -> AsyncIterator[tuple[int, bool]]:
        """Runs one request on the GPU; yields (tokens since last, final)."""
        parsed = self._parse(request, traceparent)
        # In flight as vLLM's --max-num-queued-reqs counts it: waiting and running
        # (AsyncLLM.check_admission). Checked and submitted with no await between
        # them, so concurrent arrivals cannot all pass the check.
        if self.max_queued is not None and self.gpu.engine.pending >= self.max_queued:
            raise QueueFull(self.max_queued)
        received = time.monotonic()
        sequence = Sequence(
            request.id or uuid.uuid4().hex,
            parsed.input_tokens,
            parsed.output_tokens,
            submitted_at=received,
            priority=parsed.priority,
        )
        reported = 0
        finished = False
        try:
            async for event in self.gpu.generate(sequence, stream_every):
                if event.kind is TokenKind.FIRST:
                    self.metrics.first_response(
                        self.model_name, (time.monotonic() - received) * 1e3
                    )
                tokens, reported = event.generated - reported, event.generated
                finished = event.finished
                yield tokens, finished
        finally:
            if finished:
                self._account(parsed, sequence, received)
            else:
                self.metrics.failure(self.model_name, "CANCELED")

    def _account(self, parsed: _Parsed, sequence: Sequence, received: float) -> None:
        assert sequence.finished_at is not None and sequence.first_token_at is not None
        started = sequence.started_at if sequence.started_at is not None else received
        e2e_s = sequence.finished_at - received
        self.metrics.success(
            self.model_name,
            request_us=e2e_s * 1e6,
            queue_us=(started - received) * 1e6,
            compute_us=(sequence.finished_at - started) * 1e6,
        )
        if self.reporter is None or not parsed.qos_class:
            return
        ttft_ms = (sequence.first_token_at - received) * 1000
        tpot_ms = None
        if sequence.output_tokens > 1:
            decode_s = sequence.finished_at - sequence.first_token_at
            tpot_ms = decode_s * 1000 / (sequence.output_tokens - 1)
        self.reporter.record(
            LatencySample(
                self.model_name,
                parsed.qos_class,
                tenant=parsed.tenant,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
                e2e_ms=e2e_s * 1000,
                input_tokens=parsed.input_tokens,
                output_tokens=parsed.output_tokens,
                lease_id=parsed.lease_id,
                traceparent=parsed.traceparent,
            )
        )

    async def ModelInfer(
        self, request: service_pb2.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> service_pb2.ModelInferResponse:
        total = 0
        try:
            async for tokens, _ in self.serve(request, 0, _traceparent(context)):
                total += tokens
        except BadRequest as error:
            self.metrics.failure(self.model_name, "REJECTED")
            await context.abort(error.code, str(error))
        return self._response(request, total, final=None)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[service_pb2.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Decoupled: requests on one stream run concurrently, responses interleave."""
        outbox: asyncio.Queue[service_pb2.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()
        traceparent = _traceparent(context)

        def failed(request: service_pb2.ModelInferRequest, message: str) -> None:
            # As Triton does, name the request, so the client knows which one failed.
            outbox.put_nowait(
                service_pb2.ModelStreamInferResponse(
                    error_message=message,
                    infer_response=service_pb2.ModelInferResponse(
                        model_name=request.model_name, id=request.id
                    ),
                )
            )

        async def one(request: service_pb2.ModelInferRequest) -> None:
            empty_final = _bool_parameter(request, "triton_enable_empty_final_response")
            try:
                async for tokens, final in self.serve(request, self.stream_every, traceparent):
                    response = self._response(request, tokens, final=final and not empty_final)
                    outbox.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=response))
                if empty_final:
                    last = service_pb2.ModelInferResponse(
                        model_name=self.model_name, model_version="1", id=request.id
                    )
                    last.parameters["triton_final_response"].bool_param = True
                    outbox.put_nowait(service_pb2.ModelStreamInferResponse(infer_response=last))
            except BadRequest as error:
                self.metrics.failure(self.model_name, "REJECTED")
                failed(request, str(error))
            except Exception as error:  # a bug must still answer the request
                log.exception("request %r failed", request.id)
                self.metrics.failure(self.model_name, "OTHER")
                failed(request, f"internal error: {error}")

        async def read_requests() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:
                await asyncio.gather(*running, return_exceptions=True)
            outbox.put_nowait(None)

        reader = asyncio.create_task(read_requests())
        try:
            while (item := await outbox.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)


@dataclass(frozen=True, slots=True)
class SimulatorSettings:
    host: str = "127.0.0.1"
    port: int = 8001  # Triton's gRPC port
    metrics_port: int = 8002  # Triton's metrics port; 0 picks a free one
    http_port: int | None = 8000  # KServe v2 HTTP/REST, Triton's port; None: no HTTP
    model_name: str = "llm"
    gpu: GpuModel = field(default_factory=GpuModel)
    qosd_target: str = ""  # where to Report latencies; empty: do not report
    stream_every: int = 0
    #: Refuse a request (gRPC UNAVAILABLE, "queue full") that arrives while this many
    #: are in flight, waiting or running (vLLM's --max-num-queued-reqs); None: no cap.
    max_queued: int | None = None

    def __post_init__(self) -> None:
        if self.max_queued is not None and self.max_queued < 1:
            raise ValueError(f"max_queued must be at least 1, got {self.max_queued}")


class StartupError(Exception):
    """The simulator could not start serving (a port in use, most often)."""


async def run_simulator(
    settings: SimulatorSettings,
    *,
    stop: asyncio.Event,
    ready: asyncio.Future[tuple[int, int, int | None]] | None = None,
) -> None:
    """Serves until ``stop`` is set; ``ready`` gets the (grpc, metrics, HTTP) ports.

    Raises StartupError, with everything it started stopped again, when it cannot bind.
    """
    gpu = RealTimeGpu(settings.gpu)
    metrics = TritonMetrics()
    qos = QosdClient(settings.qosd_target) if settings.qosd_target else None
    reporter = LatencyReporter(qos) if qos is not None else None
    servicer = SimulatedTriton(
        gpu,
        model_name=settings.model_name,
        metrics=metrics,
        reporter=reporter,
        stream_every=settings.stream_every,
        max_queued=settings.max_queued,
    )
    # No SO_REUSEPORT: a second server on a busy port must fail, not share it.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    http = None
    rest: web.AppRunner | None = None
    rest_port: int | None = None
    try:
        try:
            port = server.add_insecure_port(f"{settings.host}:{settings.port}")
            http = serve_metrics(metrics, settings.host, settings.metrics_port)
            if settings.http_port is not None:
                rest = web.AppRunner(kserve_http_app(servicer), access_log=None)
                await rest.setup()
                site = web.TCPSite(rest, settings.host, settings.http_port, reuse_port=False)
                await site.start()
                rest_port = rest.addresses[0][1]
        except (OSError, RuntimeError) as exc:
            raise StartupError(f"cannot listen on {settings.host}: {exc}") from exc
        gpu.start()
        if reporter is not None:
            reporter.start()
        await server.start()
        if ready is not None:
            ready.set_result((port, http.server_address[1], rest_port))
        await stop.wait()
    finally:
        await server.stop(grace=1.0)
        if rest is not None:
            await rest.cleanup()
        await gpu.stop()
        if http is not None:
            await asyncio.to_thread(http.shutdown)
            http.server_close()
        if reporter is not None:
            await reporter.close()
        if qos is not None:
            await qos.close()


def until_signalled(
    command: str,
    serve: Callable[[asyncio.Event, asyncio.Future[T]], Coroutine[Any, Any, None]],
    on_ready: Callable[[T], None],
) -> int:
    """A simulated server command's life: ``serve`` until SIGINT or SIGTERM, with
    ``on_ready`` once it serves. Returns the exit status: 0 after a signal, 1 when it
    could not start (``serve`` raised StartupError, said on stderr)."""

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        ready: asyncio.Future[T] = loop.create_future()
        runner = asyncio.create_task(serve(stop, ready))
        either: set[asyncio.Future[Any]] = {runner, ready}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            try:
                await runner
            except StartupError as exc:
                print(f"qosd {command}: {exc}", file=sys.stderr, flush=True)
                return 1
            return 0
        on_ready(ready.result())
        await runner
        return 0

    return uvloop.run(main())


def serve_until_signalled(settings: SimulatorSettings, ready_file: str | None = None) -> int:
    """``qosd sim-triton``: runs until SIGINT or SIGTERM; writes the ports once serving."""

    def serving(ports: tuple[int, int, int | None]) -> None:
        port, metrics_port, http_port = ports
        rest = f", HTTP {settings.host}:{http_port}" if http_port is not None else ""
        print(
            f"simulated Triton: gRPC {settings.host}:{port}{rest}, "
            f"metrics http://{settings.host}:{metrics_port}/metrics",
            flush=True,
        )
        if ready_file:
            write_ready_file(
                ready_file, {"port": port, "metrics_port": metrics_port, "http_port": http_port}
            )

    return until_signalled(
        "sim-triton", lambda stop, ready: run_simulator(settings, stop=stop, ready=ready), serving
    )
