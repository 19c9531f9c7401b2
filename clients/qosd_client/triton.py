"""Report Triton inference latencies to qosd by wrapping ``tritonclient`` calls.

``reporting(client, reporter)`` returns a drop-in wrapper around any tritonclient
``InferenceServerClient`` (``tritonclient.grpc``, ``tritonclient.grpc.aio``,
``tritonclient.http``, ``tritonclient.http.aio``). Calls keep their signatures and
results; each finished request becomes one ``LatencySample``:

- unary calls (``infer``, ``async_infer``): end-to-end latency, which is also the time
  to first token (the whole answer arrives at once); no TPOT;
- streams (``grpc.aio`` ``stream_infer``; ``grpc`` ``start_stream`` +
  ``async_stream_infer``): TTFT at the first response that carries tokens, TPOT over
  the tokens after the first, end to end at the response flagged
  ``triton_final_response`` (decoupled models), or at the only response.

Which class and tenant: the keyword arguments ``qos_class``, ``tenant`` and
``lease_id`` (taken off before tritonclient sees them), else request parameters of
the same names (what a gateway forwards to the server), else the wrapper's defaults.
Calls with no class are not reported (``stats.unclassified``). The objectives a
request stated itself (``slo_ttft_ms``, ``slo_tpot_ms``: milliseconds, as passed to
``QosdClient.acquire``) come the same way, keywords first, then request parameters
(a number, or a string holding one); the sample carries them, and qosd judges it
against them instead of its class's.

Reporting never blocks or fails an inference: samples go to a reporter's bounded
buffer (``LatencyReporter`` on an event loop, ``ThreadedLatencyReporter`` for
blocking code), measurement errors are logged and counted, and the call's own result
or exception is what the caller gets. The current trace context is passed to the
model server in the call's headers and recorded with the sample, so qosd puts the
latencies in the request's trace.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from qosd_client.channel import ClientTls
from qosd_client.client import QosdClient
from qosd_client.reporter import LatencyReporter, ReporterStats
from qosd_client.tracing import current_traceparent, trace_metadata
from qosd_client.types import LatencySample, Outcome, SampleSink

log = logging.getLogger("qosd_client.triton")

QOS_KEYWORDS = ("qos_class", "tenant", "lease_id")
OBJECTIVE_KEYWORDS = ("slo_ttft_ms", "slo_tpot_ms")
# A stream's open requests kept for matching responses: a request whose end never
# comes (a model that flags it only with an empty final response nobody asked for)
# must not grow a long-lived stream's memory without bound.
MAX_OPEN_PER_STREAM = 10_000
FINAL_PARAMETER = "triton_final_response"


@dataclass(slots=True)
class WrapperStats:
    reported: int = 0
    unclassified: int = 0  # finished requests with no class: not reported
    failed: int = 0  # requests that ended in an error (reported with status ERROR)
    unmatched: int = 0  # stream responses or errors no pending request could be found for
    abandoned: int = 0  # requests never seen to end, forgotten past MAX_OPEN_PER_STREAM
    measurement_errors: int = 0


@dataclass(slots=True)
class _Pending:
    """One request in flight, and what has been seen of it."""

    model: str
    qos_class: str
    tenant: str
    lease_id: str
    traceparent: str
    input_tokens: int
    started: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


TokenCounter = Callable[[Any], int]


def one_token_per_response(result: Any) -> int:
    """The default: a response with outputs is one token (the usual LLM stream), an
    empty one (Triton's empty final response) none."""
    try:
        return 1 if result.get_response().outputs else 0
    except AttributeError:  # an HTTP result: no per-response stream there
        return 1


@dataclass
class _Common:
    """What every wrapper shares: defaults, the sink, the token counter, the stats."""

    sink: SampleSink
    qos_class: str | None = None
    tenant: str = ""
    tokens: TokenCounter = one_token_per_response
    input_tokens: Callable[[Any], int] | None = None
    inject_trace: bool = True
    stats: WrapperStats = field(default_factory=WrapperStats)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a stream's requests
    # Callbacks of the blocking clients run on tritonclient's threads.
    stats_lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str) -> None:
        with self.stats_lock:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def begin(self, model: str, kwargs: dict[str, Any], inputs: Any) -> _Pending:
        """Takes the QoS keywords off ``kwargs`` and starts the clock."""
        values = {key: kwargs.pop(key, None) for key in QOS_KEYWORDS}
        stated = {key: _milliseconds(kwargs.pop(key, None)) for key in OBJECTIVE_KEYWORDS}
        parameters = kwargs.get("parameters") or {}
        for key in QOS_KEYWORDS:
            if values[key] is None and isinstance(parameters.get(key), str):
                values[key] = parameters[key]
        for key in OBJECTIVE_KEYWORDS:
            if stated[key] is None:
                stated[key] = _milliseconds(parameters.get(key))
        traceparent = _add_trace_headers(kwargs) if self.inject_trace else ""
        return _Pending(
            model=model,
            qos_class=values["qos_class"] or self.qos_class or "",
            tenant=values["tenant"] or self.tenant,
            lease_id=values["lease_id"] or "",
            traceparent=traceparent,
            input_tokens=self._count_input(inputs),
            started=time.monotonic(),
            slo_ttft_ms=stated["slo_ttft_ms"],
            slo_tpot_ms=stated["slo_tpot_ms"],
        )

    def _count_input(self, inputs: Any) -> int:
        if self.input_tokens is None:
            return 0
        try:
            return max(0, int(self.input_tokens(inputs)))
        except Exception:
            self.count("measurement_errors")
            log.exception("counting input tokens failed")
            return 0

    def saw(self, pending: _Pending, result: Any) -> None:
        """A response arrived for ``pending``."""
        try:
            count = max(0, int(self.tokens(result)))
        except Exception:
            self.count("measurement_errors")
            log.exception("counting tokens failed")
            count = 1
        if count:
            now = time.monotonic()
            if pending.first_token is None:
                pending.first_token = now
            pending.last_token = now
            pending.tokens += count

    def finish(
        self, pending: _Pending, error: BaseException | None, *, unary: bool = False
    ) -> None:
        """Reports ``pending`` as ended now; never raises. ``unary``: the answer came
        whole, so its first token arrived with its last (TTFT = e2e, no TPOT)."""
        try:
            self._finish(pending, error, unary)
        except Exception:
            self.count("measurement_errors")
            log.exception("reporting a Triton request failed")

    def _finish(self, pending: _Pending, error: BaseException | None, unary: bool) -> None:
        ended = time.monotonic()
        if error is not None:
            self.count("failed")
        if not pending.qos_class:
            self.count("unclassified")
            return
        status = Outcome.OK
        if isinstance(error, asyncio.CancelledError):
            status = Outcome.CANCELLED
        elif error is not None:
            status = Outcome.ERROR
        first = pending.first_token if pending.first_token is not None and not unary else ended
        tpot_ms = None
        if not unary and pending.tokens > 1 and pending.last_token is not None:
            tpot_ms = (pending.last_token - first) * 1000 / (pending.tokens - 1)
        self.sink.record(
            LatencySample(
                pending.model,
                pending.qos_class,
                tenant=pending.tenant,
                ttft_ms=(first - pending.started) * 1000 if error is None else None,
                tpot_ms=tpot_ms if error is None else None,
                e2e_ms=(ended - pending.started) * 1000,
                input_tokens=pending.input_tokens,
                output_tokens=pending.tokens,
                status=status,
                lease_id=pending.lease_id,
                traceparent=pending.traceparent,
                slo_ttft_ms=pending.slo_ttft_ms,
                slo_tpot_ms=pending.slo_tpot_ms,
            )
        )
        self.count("reported")


def _milliseconds(value: Any) -> float | None:
    """A stated objective as a keyword or request parameter: a number, or a string
    holding one; anything else is no objective. qosd checks the range."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        return float(value)
    except ValueError:
        return None


def _add_trace_headers(kwargs: dict[str, Any]) -> str:
    """Puts the current trace context into the call's ``headers`` (Triton continues
    it when its own tracing is on); returns the ``traceparent``, or "" outside a span."""
    traceparent = current_traceparent()
    if traceparent:
        headers = dict(kwargs.get("headers") or {})
        for key, value in trace_metadata() or ():
            headers.setdefault(key, value)
        kwargs["headers"] = headers
    return traceparent


def _is_final(result: Any) -> bool:
    """Decoupled models flag their last response; anything else has one response."""
    try:
        parameters = result.get_response().parameters
    except AttributeError:
        return True
    if FINAL_PARAMETER in parameters:
        return bool(parameters[FINAL_PARAMETER].bool_param)
    return True


def _response_id(result: Any) -> str:
    try:
        return str(result.get_response().id)
    except AttributeError:
        return ""


class _Proxy:
    """Passes every attribute it does not wrap through to the tritonclient client."""

    def __init__(self, client: Any, common: _Common) -> None:
        self._client = client
        self._common = common

    @property
    def stats(self) -> WrapperStats:
        return self._common.stats

    @property
    def wrapped(self) -> Any:
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class ReportingClient(_Proxy):
    """A blocking tritonclient client (``tritonclient.grpc`` or ``tritonclient.http``).

    Its callbacks run on tritonclient's threads: report through a
    ``ThreadedLatencyReporter``, whose ``record`` is thread-safe.
    """

    def __init__(self, client: Any, common: _Common) -> None:
        super().__init__(client, common)
        self._stream: dict[str, _Pending] = {}  # the open stream's requests, by id

    def __enter__(self) -> ReportingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def infer(self, model_name: str, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        pending = self._common.begin(model_name, kwargs, inputs)
        try:
            result = self._client.infer(model_name, inputs, *args, **kwargs)
        except BaseException as error:
            self._common.finish(pending, error, unary=True)
            raise
        self._common.saw(pending, result)
        self._common.finish(pending, None, unary=True)
        return result

    def async_infer(self, model_name: str, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        common = self._common
        pending = common.begin(model_name, kwargs, inputs)
        callback = kwargs.get("callback")
        if callback is None and args and callable(args[0]):
            # tritonclient.grpc: async_infer(model_name, inputs, callback, ...)
            callback, args = args[0], args[1:]
        if callback is not None:

            def observed(result: Any, error: Any) -> None:
                if error is None:
                    common.saw(pending, result)
                common.finish(pending, error, unary=True)
                callback(result, error)

            kwargs["callback"] = observed
            return self._client.async_infer(model_name, inputs, *args, **kwargs)
        # tritonclient.http: returns an InferAsyncRequest; measure at get_result().
        return _ObservedAsyncRequest(
            self._client.async_infer(model_name, inputs, *args, **kwargs), common, pending
        )

    def start_stream(self, callback: Callable[[Any, Any], None], *args: Any, **kwargs: Any) -> Any:
        common = self._common
        stream = self._stream
        if common.inject_trace:
            _add_trace_headers(kwargs)

        def observed(result: Any, error: Any) -> None:
            _stream_response(common, stream, result, error)
            callback(result, error)

        return self._client.start_stream(observed, *args, **kwargs)

    def async_stream_infer(self, model_name: str, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("request_id"):
            # Responses name their request only by id: give each one an id.
            kwargs["request_id"] = uuid.uuid4().hex
        pending = self._common.begin(model_name, kwargs, inputs)
        _track(self._common, self._stream, kwargs["request_id"], pending)
        return self._client.async_stream_infer(model_name, inputs, *args, **kwargs)

    def stop_stream(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._client.stop_stream(*args, **kwargs)
        finally:
            with self._common.lock:
                unfinished = list(self._stream.values())
                self._stream.clear()
            for pending in unfinished:
                self._common.finish(pending, asyncio.CancelledError())


class _ObservedAsyncRequest:
    """tritonclient.http's InferAsyncRequest, measured when its result is taken."""

    def __init__(self, request: Any, common: _Common, pending: _Pending) -> None:
        self._request = request
        self._common = common
        self._pending: _Pending | None = pending

    def get_result(self, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self._request.get_result(*args, **kwargs)
        except BaseException as error:
            self._settle(None, error)
            raise
        self._settle(result, None)
        return result

    def _settle(self, result: Any, error: BaseException | None) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            if result is not None:
                self._common.saw(pending, result)
            self._common.finish(pending, error, unary=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._request, name)


def _track(common: _Common, stream: dict[str, _Pending], key: str, pending: _Pending) -> None:
    with common.lock:
        if len(stream) >= MAX_OPEN_PER_STREAM:
            del stream[next(iter(stream))]  # the oldest
            common.count("abandoned")
        stream[key] = pending


def _stream_response(common: _Common, stream: dict[str, _Pending], result: Any, error: Any) -> None:
    """One response (or error) of a stream that serves many requests."""
    with common.lock:
        if error is not None:
            # tritonclient drops the failed request's id: blame it only when sure.
            if len(stream) != 1:
                common.count("unmatched")
                return
            pending = stream.pop(next(iter(stream)))
        else:
            key = _response_id(result)
            found = stream.get(key)
            if found is None:
                common.count("unmatched")
                return
            pending = found
            common.saw(pending, result)
            if not _is_final(result):
                return
            del stream[key]
    common.finish(pending, error)


class AsyncReportingClient(_Proxy):
    """An asyncio tritonclient client (``tritonclient.grpc.aio`` or ``tritonclient.http.aio``)."""

    async def __aenter__(self) -> AsyncReportingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.close()

    async def infer(self, model_name: str, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        pending = self._common.begin(model_name, kwargs, inputs)
        try:
            result = await self._client.infer(model_name, inputs, *args, **kwargs)
        except BaseException as error:
            self._common.finish(pending, error, unary=True)
            raise
        self._common.saw(pending, result)
        self._common.finish(pending, None, unary=True)
        return result

    def stream_infer(self, inputs_iterator: Any, *args: Any, **kwargs: Any) -> Any:
        common = self._common
        stream: dict[str, _Pending] = {}
        traceparent = _add_trace_headers(kwargs) if common.inject_trace else ""

        async def requests() -> AsyncIterator[dict[str, Any]]:
            async for item in inputs_iterator:
                if not (isinstance(item, dict) and "model_name" in item):
                    yield item  # tritonclient says what is wrong with it
                    continue
                request = dict(item)
                if not request.get("request_id"):
                    request["request_id"] = uuid.uuid4().hex
                options = {
                    key: request.pop(key)
                    for key in (*QOS_KEYWORDS, *OBJECTIVE_KEYWORDS)
                    if key in request
                }
                options["parameters"] = request.get("parameters")
                pending = common.begin(request["model_name"], options, request.get("inputs"))
                pending.traceparent = pending.traceparent or traceparent
                _track(common, stream, request["request_id"], pending)
                yield request

        responses = self._client.stream_infer(requests(), *args, **kwargs)
        return _ObservedStream(responses, common, stream)


class _ObservedStream:
    """The response iterator of ``grpc.aio`` ``stream_infer``, observed as it is read."""

    def __init__(self, responses: Any, common: _Common, stream: dict[str, _Pending]) -> None:
        self._responses = responses
        self._common = common
        self._stream = stream

    def __aiter__(self) -> _ObservedStream:
        return self

    async def __anext__(self) -> tuple[Any, Any]:
        try:
            result, error = await self._responses.__anext__()
        except StopAsyncIteration:
            self._end(None)
            raise
        except BaseException as failure:
            self._end(failure)
            raise
        _stream_response(self._common, self._stream, result, error)
        return result, error

    def _end(self, failure: BaseException | None) -> None:
        """The stream ended: requests still open never finished."""
        with self._common.lock:
            unfinished = list(self._stream.values())
            self._stream.clear()
        for pending in unfinished:
            self._common.finish(pending, failure or asyncio.CancelledError())

    def cancel(self) -> Any:
        return self._responses.cancel()


def reporting(
    client: Any,
    reporter: SampleSink,
    *,
    qos_class: str | None = None,
    tenant: str = "",
    tokens: TokenCounter = one_token_per_response,
    input_tokens: Callable[[Any], int] | None = None,
    inject_trace: bool = True,
) -> Any:
    """Wraps a tritonclient client so that its requests are reported to qosd.

    ``tokens(result)`` counts the tokens one response carries (default: one per
    response with outputs); ``input_tokens(inputs)`` counts the prompt's, if known.
    Returns an ``AsyncReportingClient`` for the asyncio clients, else a
    ``ReportingClient``.
    """
    common = _Common(
        sink=reporter,
        qos_class=qos_class,
        tenant=tenant,
        tokens=tokens,
        input_tokens=input_tokens,
        inject_trace=inject_trace,
    )
    module = type(client).__module__
    if module.endswith(".aio") or ".aio." in module:
        return AsyncReportingClient(client, common)
    return ReportingClient(client, common)


class ThreadedLatencyReporter:
    """``LatencyReporter`` for blocking code: its own event loop on a daemon thread.

    ``record`` is thread-safe and never blocks: it hands the sample to the loop. Use
    as ``with ThreadedLatencyReporter("qosd:50051") as reporter: ...``.
    """

    def __init__(
        self,
        target: str,
        *,
        tls: ClientTls | None = None,
        token_file: str | None = None,
        **options: Any,
    ) -> None:
        self._target = target
        self._tls, self._token_file = tls, token_file  # for daemons with TLS or auth
        self._options = options
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reporter: LatencyReporter | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._lost = 0

    def __enter__(self) -> ThreadedLatencyReporter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> ReporterStats:
        stats = self._reporter.stats if self._reporter else ReporterStats()
        return ReporterStats(
            recorded=stats.recorded,
            sent=stats.sent,
            refused=stats.refused,
            dropped=stats.dropped + self._lost,
            failed_calls=stats.failed_calls,
        )

    def start(self) -> None:
        """Starts the reporting thread; raises what setting it up raised."""
        if self._thread is not None:
            return
        self._ready.clear()
        self._failure = None
        self._thread = threading.Thread(target=self._run, name="qosd-latency-reporter", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            self._thread = None
            raise self._failure

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def setup() -> tuple[QosdClient, LatencyReporter]:
            client = QosdClient(self._target, tls=self._tls, token_file=self._token_file)
            reporter = LatencyReporter(client, **self._options)
            reporter.start()
            return client, reporter

        try:
            client, self._reporter = loop.run_until_complete(setup())
            self._loop = loop
        except BaseException as failure:  # bad options, a bad target: tell start()
            self._failure = failure
            loop.close()
            return
        finally:
            self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(client.close())
            loop.close()

    def record(self, sample: LatencySample) -> None:
        if not sample.traceparent:
            traceparent = current_traceparent()  # the caller's thread holds the span
            if traceparent:
                sample = dataclasses.replace(sample, traceparent=traceparent)
        loop, reporter = self._loop, self._reporter
        if loop is None or reporter is None or loop.is_closed():
            self._lost += 1
            return
        try:
            loop.call_soon_threadsafe(reporter.record, sample, context=contextvars.Context())
        except RuntimeError:  # the loop closed in between
            self._lost += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Flushes what is buffered (within the reporter's close timeout) and stops."""
        loop, reporter, thread = self._loop, self._reporter, self._thread
        if loop is None or reporter is None or thread is None:
            return
        done = asyncio.run_coroutine_threadsafe(reporter.close(), loop)
        try:
            done.result(timeout_s)
        except Exception:
            log.warning("qosd latency reporter did not close cleanly", exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout_s)
        self._thread = None
        self._loop = None
