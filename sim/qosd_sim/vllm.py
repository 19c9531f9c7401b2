"""A simulated vLLM server: vLLM's OpenAI-compatible HTTP API in front of the GPU cost model.

What a client or a proxy sees is what ``vllm serve`` answers: ``/v1/chat/completions``
and ``/v1/completions``, streaming (server-sent events, with ``usage`` in a last chunk
when ``stream_options.include_usage`` asks for it) and not; ``/tokenize`` (a prompt's
or a chat's token count); ``/v1/models``;
``/health``; ``/load`` (vLLM's ``{"server_load": N}``); ``/metrics`` with vLLM's metric
names, labels and types; and the ORCA ``endpoint-load-metrics`` response header when a
request asks for it with ``endpoint-load-metrics-format``. Errors are OpenAI's
``{"error": {...}}`` with vLLM's status codes.

A simulated model has no tokenizer and writes no text, so lengths are made to be
replayed exactly: the prompt's tokens are its whitespace-separated words (every
message's text, summed), and the answer is ``max_tokens`` (or
``max_completion_tokens``) tokens long, ``default_max_tokens`` when neither is set,
as with vLLM's ``ignore_eos``. A request's ``priority`` (lower first) orders the
waiting queue when the engine schedules by priority (``GpuModel.priority_scheduling``,
vLLM's ``--scheduling-policy priority``), and a request that finds no batch slot or KV
room preempts a running one of lower priority, which recomputes when it resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from qosd.server import write_ready_file
from qosd_sim.gpu import GpuModel, Sequence, TokenEvent, TokenKind
from qosd_sim.server import RealTimeGpu, StartupError, pass_tokens, until_signalled

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
#: The word the simulated model writes, once per token.
TOKEN_TEXT = " tok"
LOAD_HEADER = "endpoint-load-metrics"
LOAD_FORMAT_HEADER = "endpoint-load-metrics-format"


@dataclass(frozen=True, slots=True)
class VllmSettings:
    host: str = "127.0.0.1"
    port: int = 8000  # vLLM's
    model_name: str = "llm"
    gpu: GpuModel = field(default_factory=GpuModel)
    #: Tokens in an answer that sets no max_tokens.
    default_max_tokens: int = 16
    #: Requests waiting beyond this are refused with 503, as a server at its queue cap.
    max_waiting: int = 4096
    #: Longest prompt plus answer, tokens (vLLM's --max-model-len).
    max_model_len: int = 131_072
    #: Stream one chunk every N tokens (1: every token, as vLLM does).
    stream_every: int = 1
    #: Fault injection, off by default: break the connection once an answer has N
    #: tokens (a stream after that chunk, a whole answer half-way through its body),
    #: as a server that crashes mid-answer or a link that drops does.
    cut_after_tokens: int | None = None


class VllmMetrics:
    """vLLM's Prometheus metrics, in its names (``vllm:`` prefix), labels
    (``model_name``, ``engine``) and types, on a registry of their own."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine")
        self.labels = (model, "0")
        registry = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            labels,
            registry=registry,
        )
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               (*labels, "finished_reason"), registry=registry)  # fmt: skip
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKEN_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_BUCKETS,
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_BUCKETS,
        )
        # The simulator's own, as sim-triton serves them (not vLLM metrics): what the
        # replay benchmark reads the GPU's busy fraction from.
        self.busy = Gauge(
            "qosd_sim_gpu_busy_seconds",
            "Seconds the simulated GPU spent running iterations (simulator only)",
            ["model"],
            registry=registry,
        )
        self.clock = Gauge(
            "qosd_sim_monotonic_seconds",
            "The simulator's monotonic clock when it read qosd_sim_gpu_busy_seconds",
            registry=registry,
        )
        # The model's series exist from the start, at zero, as vLLM's stat logger makes
        # them when it starts: a scraper's first read sees every histogram.
        for histogram_ in (self.ttft, self.itl, self.request_tpot, self.e2e, self.queue,
                           self.iteration_tokens):  # fmt: skip
            histogram_.labels(*self.labels)
        for counter in (self.prompt_tokens, self.generation_tokens):
            counter.labels(*self.labels)

    def count_pass(self, events: list[TokenEvent], duration_s: float) -> None:
        """One pass's tokens, as vLLM V1 counts them at every engine step
        (``pass_tokens``); its gaps between tokens are observed as they are streamed."""
        prompt, generated = pass_tokens(events)
        self.prompt_tokens.labels(*self.labels).inc(prompt)
        self.generation_tokens.labels(*self.labels).inc(generated)
        self.iteration_tokens.labels(*self.labels).observe(prompt + generated)


class SimulatedVllm:
    """One model on one simulated GPU, served the way vLLM serves it."""

    def __init__(self, settings: VllmSettings) -> None:
        self.settings = settings
        self.gpu = RealTimeGpu(settings.gpu)
        self.metrics = VllmMetrics(settings.model_name)
        self.gpu.on_pass = self.metrics.count_pass
        self.created = int(time.time())

    # -- load -----------------------------------------------------------------------

    def kv_usage(self) -> float:
        engine = self.gpu.engine
        return engine.kv_used / engine.model.kv_capacity_tokens

    def waiting(self) -> int:
        return self.gpu.engine.queued

    def running(self) -> int:
        return self.gpu.engine.pending - self.gpu.engine.queued

    def load_header(self, request: web.Request) -> dict[str, str]:
        """vLLM's ORCA header, when the request asks for it (``text`` or ``json``)."""
        wanted = request.headers.get(LOAD_FORMAT_HEADER, "").lower()
        named = {"kv_cache_usage_perc": self.kv_usage(), "num_requests_waiting": self.waiting()}
        if wanted == "text":
            text = ", ".join(f"named_metrics.{k}={v:g}" for k, v in named.items())
            return {LOAD_HEADER: f"TEXT {text}"}
        if wanted == "json":
            return {LOAD_HEADER: "JSON " + json.dumps({"named_metrics": named})}
        return {}

    # -- one request ----------------------------------------------------------------

    async def generate(
        self, input_tokens: int, output_tokens: int, priority: int, request_id: str
    ) -> AsyncGenerator[TokenEvent, None]:
        """Runs the request on the GPU and keeps vLLM's per-request metrics."""
        metrics, labels = self.metrics, self.metrics.labels
        received = time.monotonic()
        sequence = Sequence(request_id, input_tokens, output_tokens, received, priority=priority)
        last = received
        first: float | None = None
        finished = False
        try:
            async with contextlib.aclosing(
                self.gpu.generate(sequence, self.settings.stream_every)
            ) as events:
                async for event in events:
                    now = time.monotonic()
                    if event.kind is TokenKind.FIRST:
                        first = now
                        metrics.ttft.labels(*labels).observe(now - received)
                    elif event.generated > 1:
                        metrics.itl.labels(*labels).observe(
                            (now - last) / max(1, self.settings.stream_every)
                        )
                    last = now
                    finished = event.finished
                    yield event
        finally:
            if not finished:  # its client left: aborted, off the GPU (vLLM's "abort")
                metrics.success.labels(*labels, "abort").inc()
        if finished:
            started = sequence.started_at if sequence.started_at is not None else received
            metrics.queue.labels(*labels).observe(started - received)
            ended = time.monotonic()
            metrics.e2e.labels(*labels).observe(ended - received)
            if first is not None and output_tokens > 1:
                metrics.request_tpot.labels(*labels).observe((ended - first) / (output_tokens - 1))
            metrics.success.labels(*labels, "length").inc()


class ApiError(Exception):
    """An OpenAI-format error answer."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    def response(self) -> web.Response:
        kind = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}
        body = {
            "error": {
                "message": str(self),
                "type": kind.get(self.status, "InternalServerError"),
                "param": self.param,
                "code": self.status,
            }
        }
        return web.json_response(body, status=self.status)


def _words(content: Any) -> int:
    """Words of a message's content: a string, or a list of parts with ``text``."""
    if isinstance(content, str):
        return len(content.split())
    if isinstance(content, list):
        return sum(
            len(str(part.get("text", "")).split()) for part in content if isinstance(part, dict)
        )
    return 0


@dataclass(frozen=True, slots=True)
class _Request:
    chat: bool
    model: str
    input_tokens: int
    output_tokens: int
    stream: bool
    include_usage: bool
    priority: int


def parse_request(body: Any, chat: bool, settings: VllmSettings) -> _Request:
    """Validates a completion request the way vLLM does, naming the field."""
    model = _model(body, settings)
    input_tokens = max(1, _prompt_words(body, chat))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None:
        limit = settings.default_max_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ApiError(400, "max_tokens: must be a positive integer", "max_tokens")
    if input_tokens + limit > settings.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {settings.max_model_len} tokens; the "
            f"request asks for {input_tokens + limit}",
            "max_tokens",
        )
    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ApiError(400, "priority: must be an integer", "priority")
    options = body.get("stream_options") or {}
    return _Request(
        chat=chat,
        model=model,
        input_tokens=input_tokens,
        output_tokens=limit,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        priority=priority,
    )


def _model(body: Any, settings: VllmSettings) -> str:
    """The served model a request body names, or vLLM's error naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model: a model name is required", "model")
    if model != settings.model_name:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return model


def _prompt_words(body: dict[str, Any], chat: bool) -> int:
    """The prompt's tokens (its words): every message's text, or the prompt's."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages: a non-empty list is required", "messages")
        return sum(_words(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt: a string or a list of strings is required", "prompt")
    return len(prompt.split())


def tokenized(body: Any, settings: VllmSettings) -> dict[str, Any]:
    """vLLM's ``/tokenize`` answer: a prompt's (``prompt``) or a chat's
    (``messages``) token count, as a completion of it would use it, its tokens (here
    each word's index), and the model's context length."""
    _model(body, settings)
    count = _prompt_words(body, chat="messages" in body)
    return {"count": count, "max_model_len": settings.max_model_len, "tokens": list(range(count))}


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _choice(chat: bool, text: str, finish: str | None, stream: bool) -> dict[str, Any]:
    if not chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if stream:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish}  # fmt: skip
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish}  # fmt: skip


async def _parse(server: SimulatedVllm, request: web.Request, chat: bool) -> _Request:
    settings = server.settings
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    parsed = parse_request(body, chat, settings)
    capacity = server.gpu.engine.model.kv_capacity_tokens
    if parsed.input_tokens + parsed.output_tokens > capacity:
        raise ApiError(
            400,
            f"the request's {parsed.input_tokens + parsed.output_tokens} tokens exceed the KV "
            f"cache ({capacity})",
            "max_tokens",
        )
    if server.waiting() >= settings.max_waiting:
        raise ApiError(503, f"the server has {settings.max_waiting} requests waiting")
    return parsed


async def _completions(
    server: SimulatedVllm, request: web.Request, chat: bool
) -> web.StreamResponse:
    try:
        parsed = await _parse(server, request, chat)
    except ApiError as error:
        return error.response()
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    events = server.generate(parsed.input_tokens, parsed.output_tokens, parsed.priority, request_id)
    kind = "chat.completion" if chat else "text_completion"
    base = {
        "id": request_id,
        "object": kind + (".chunk" if chat and parsed.stream else ""),
        "created": int(time.time()),
        "model": parsed.model,
    }
    headers = server.load_header(request)
    if not parsed.stream:
        produced = 0
        async with contextlib.aclosing(events):
            async for event in events:
                produced = event.generated
        body = {
            **base,
            "choices": [_choice(chat, TOKEN_TEXT * produced, "length", False)],
            "usage": _usage(parsed.input_tokens, produced),
        }
        if _cuts(server.settings, produced):
            raw = json.dumps(body).encode()
            whole = web.StreamResponse(headers=headers)
            whole.content_type, whole.content_length = "application/json", len(raw)
            await whole.prepare(request)
            await whole.write(raw[: len(raw) // 2])
            return _cut_off(request, whole)
        return web.json_response(body, headers=headers)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
    )
    await response.prepare(request)

    async def send(payload: dict[str, Any]) -> None:
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    # A client that leaves ends the request: writing fails, and closing the events
    # takes the sequence off the GPU.
    async with contextlib.aclosing(events):
        if chat:
            role = {"role": "assistant", "content": ""}
            first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
            await send({**base, "choices": [first]})
        sent = 0
        async for event in events:
            text = TOKEN_TEXT * (event.generated - sent)
            sent = event.generated
            finish = "length" if event.finished else None
            await send({**base, "choices": [_choice(chat, text, finish, True)]})
            if _cuts(server.settings, sent):
                return _cut_off(request, response)
        if parsed.include_usage:
            await send({**base, "choices": [], "usage": _usage(parsed.input_tokens, sent)})
        await response.write(b"data: [DONE]\n\n")
    return response


def _cuts(settings: VllmSettings, tokens: int) -> bool:
    return settings.cut_after_tokens is not None and tokens >= settings.cut_after_tokens


def _cut_off(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Closes the connection with the answer incomplete (``cut_after_tokens``): what was
    written goes out, the rest never does (no last chunk, a body short of its length)."""
    if request.transport is not None:
        request.transport.close()
    return response


def vllm_app(server: SimulatedVllm) -> web.Application:
    settings = server.settings

    async def chat_completions(request: web.Request) -> web.StreamResponse:
        return await _completions(server, request, chat=True)

    async def text_completions(request: web.Request) -> web.StreamResponse:
        return await _completions(server, request, chat=False)

    async def models(_: web.Request) -> web.Response:
        model = {"id": settings.model_name, "object": "model", "created": server.created,
                 "owned_by": "vllm", "root": settings.model_name, "parent": None,
                 "max_model_len": settings.max_model_len}  # fmt: skip
        return web.json_response({"object": "list", "data": [model]})

    async def tokenize(request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
            return web.json_response(tokenized(body, settings))
        except ApiError as error:
            return error.response()

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def load(_: web.Request) -> web.Response:
        return web.json_response({"server_load": server.gpu.engine.pending})

    async def metrics(_: web.Request) -> web.Response:
        m, labels = server.metrics, server.metrics.labels
        m.running.labels(*labels).set(server.running())
        m.waiting.labels(*labels).set(server.waiting())
        m.kv_usage.labels(*labels).set(server.kv_usage())
        now = time.monotonic()
        m.busy.labels(server.settings.model_name).set(server.gpu.busy_seconds(now))
        m.clock.set(now)
        return web.Response(
            body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", text_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics)
    return app


def vllm_runner(server: SimulatedVllm) -> web.AppRunner:
    """The app's runner. A client that disconnects cancels its handler, which takes
    its sequence off the GPU (closing its events), as vLLM aborts a request whose
    client left: the GPU does not go on generating for nobody."""
    return web.AppRunner(vllm_app(server), access_log=None, handler_cancellation=True)


async def run_vllm(
    settings: VllmSettings, *, stop: asyncio.Event, ready: asyncio.Future[int] | None = None
) -> None:
    """Serves until ``stop`` is set; ``ready`` gets the bound port. Raises StartupError
    when it cannot bind, with nothing left running."""
    server = SimulatedVllm(settings)
    runner = vllm_runner(server)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, reuse_port=False)
        try:
            await site.start()
        except OSError as exc:
            raise StartupError(f"cannot listen on {settings.host}:{settings.port}: {exc}") from exc
        server.gpu.start()
        if ready is not None:
            ready.set_result(runner.addresses[0][1])
        await stop.wait()
    finally:
        await runner.cleanup()
        await server.gpu.stop()


def serve_vllm_until_signalled(settings: VllmSettings, ready_file: str | None = None) -> int:
    """``qosd sim-vllm``: runs until SIGINT or SIGTERM; writes the port once serving."""

    def serving(port: int) -> None:
        print(f"simulated vLLM serving {settings.model_name} on http://{settings.host}:{port}",
              flush=True)  # fmt: skip
        if ready_file:
            write_ready_file(ready_file, {"port": port})

    return until_signalled(
        "sim-vllm", lambda stop, ready: run_vllm(settings, stop=stop, ready=ready), serving
    )
