"""One OpenAI-compatible request through the proxy: admit, forward, settle, report.

Every admitted request ends its lease exactly once, from ``_admit_and_forward``'s
``finally``, whatever happens after admission: with the usage the server reported,
with what was streamed when the stream broke, with nothing used when the upstream
refused or was unreachable, or with the estimate when the answer was cut or the
proxy itself failed. A settlement the store does not take is retried
(``qosd.settlements``).

Identity (docs/security.md): with API keys configured, a request's key decides its
class and tenant; a request with no key, an unknown key or a scheme other than
Bearer (matched without regard to case) is refused, and ``x-qos-class`` may only
lower the key's class. The caller's credentials are never forwarded upstream: an
upstream key is its own setting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler  # aiohttp's own: no public name
from opentelemetry.trace import Span

from qosd.admission import AcquireOutcome, DuplicateRequest
from qosd.doors.auth import CallerCheck, TokenFile, bearer_of
from qosd.doors.bodies import (
    PARSE_OFF_LOOP_BYTES,
    BadJson,
    BodyTimedOut,
    BodyTooLarge,
    parse_json,
    read_body,
)
from qosd.doors.decisions import Decisions
from qosd.doors.dialects import (
    DYNAMO_PRIORITY_FIELD,
    DYNAMO_PRIORITY_HEADER,
    REQUEST_HEADERS,
    given_once,
    rate_limit_headers,
    without_ranking_hints,
)
from qosd.doors.grpc_api import judge_samples
from qosd.doors.proxy.answers import (
    AnswerCut,
    AnswerTooLarge,
    Lines,
    broke_off,
    event_data,
    has_content,
    is_done,
    is_event,
    is_usage_chunk,
    note_finishes,
    read_capped,
    read_load,
    retry_after_of,
    what_broke,
)
from qosd.doors.proxy.estimate import Estimator, PromptSize, Usage, prompt_size
from qosd.doors.proxy.forwarded import REQUEST_ID_HEADER, forwarded
from qosd.doors.proxy.openai_errors import NEVER_RETRIED, OpenAIError, refusal
from qosd.doors.proxy.telemetry import Finished, GenAiTelemetry
from qosd.doors.proxy.tokenize import TOKENIZE_PATH, PromptCounter
from qosd.doors.proxy.upstreams import Sent, Upstream, Upstreams
from qosd.doors.request import MAX_LATENCY_MS, InvalidArgument
from qosd.model import (
    AdmissionRequest,
    LeaseExpired,
    LeaseNotFound,
    LeaseSpec,
    Outcome,
    Sample,
    StoreUnavailable,
)

log = logging.getLogger(__name__)

CLASS_HEADER = "x-qos-class"
TENANT_HEADER = "x-qos-tenant"
#: Per-request objectives: qosd's own headers, then llm-d's.
TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
#: An objective header's value: milliseconds, in ASCII decimal digits.
DECIMAL_MS = re.compile(r"[0-9]+(?:\.[0-9]+)?", re.ASCII)
TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
#: The headers that name the request, its class, tenant and objectives: each given
#: once (``given_once``).
NAMING_HEADERS = (CLASS_HEADER, TENANT_HEADER, REQUEST_ID_HEADER, *TTFT_HEADERS,
                  *TPOT_HEADERS, *REQUEST_HEADERS)  # fmt: skip
#: How a client that left before its answer is counted: nginx's code.
CLIENT_CLOSED = 499
#: The most answers one request may ask for (``n``, ``best_of``): OpenAI's cap on n.
MAX_CHOICES = 128
#: Seconds each upstream gets to list its models for ``/v1/models``.
MODELS_TIMEOUT_S = 5.0
#: The largest model listing read from an upstream.
MODELS_MAX_BYTES = 1024 * 1024
#: The door's names for the fields of a request, in its errors.
FIELD_NAMES = {
    "qos_class": CLASS_HEADER,
    "tenant": TENANT_HEADER,
    "request_id": REQUEST_ID_HEADER,
    "model": "model",
    "input_tokens": "messages",
    "expected_output_tokens": "max_tokens",
    "slo_ttft_ms": TTFT_HEADERS[0],
    "slo_tpot_ms": TPOT_HEADERS[0],
}


@dataclass(frozen=True, slots=True)
class ProxySettings:
    upstreams: Upstreams
    default_class: str
    #: Pass each request's standing (its class's rank, 0 for the top class) as vLLM's
    #: ``priority`` field: for upstreams run with ``--scheduling-policy priority``.
    priority_upstreams: bool = False
    max_body_bytes: int = 8 * 1024 * 1024
    #: API key (the bearer token) SHA-256 hex digest -> (class, tenant).
    api_keys: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: ``auth.qos``'s rule, when set: who may send requests.
    caller_check: CallerCheck | None = None
    #: The key the proxy shows upstreams (``Authorization: Bearer``), read from this
    #: file and re-read when it changes; None: no credentials upstream.
    upstream_key_file: str | None = None
    #: Seconds to connect to an upstream, and at most between two reads of its answer
    #: (a non-streaming answer comes whole, so this bounds its generation too).
    upstream_connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float = 300.0
    #: Seconds one write to a client may wait for it to read: a client that stops
    #: reading without closing is taken to have left (499), so it holds no lease.
    client_write_timeout_s: float = 60.0
    #: The largest upstream answer held whole (not streamed): beyond, a 502. A stream's
    #: lines may each be up to ``max_body_bytes`` (beyond: an error event ends it).
    max_answer_bytes: int = 64 * 1024 * 1024
    #: The upstreams' route that counts a prompt's tokens (vLLM's), asked while a
    #: model's estimate calibrates (qosd.doors.proxy.tokenize); empty: never asked.
    tokenize_path: str = TOKENIZE_PATH


@dataclass(slots=True)
class _Call:
    """One request's facts, as the proxy learned them."""

    admission: AdmissionRequest
    body: dict[str, Any]
    raw: bytes  # the body as it came
    prompt: PromptSize
    stream: bool
    wants_usage: bool
    max_tokens: int | None = None  # at most limits.max_request_tokens
    choices: int = 1  # answers generated (n, best_of)
    # What became of it, for its telemetry (filled in as it goes).
    outcome: AcquireOutcome | None = None
    progress: _Progress | None = None
    upstream: Upstream | None = None
    sent: Sent | None = None  # on its way to that upstream: in flight there until ended
    error_type: str | None = None  # why it failed, low-cardinality (error.type)
    #: The stream's answer once its status line went out: from then on, an error can
    #: only end it with an error event, never answer anew.
    response: web.StreamResponse | None = None
    ended: bool = False  # that stream's end went out (or the client is gone)
    client_left: bool = False  # while its stream was written (or it stopped reading)

    @property
    def model(self) -> str:
        return self.admission.model

    @property
    def qos_class(self) -> str:
        return self.admission.qos_class


@dataclass(slots=True)
class _Progress:
    """What the upstream's answer has shown so far."""

    sent_at: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    chunks: int = 0  # content chunks streamed: one token each, as vLLM streams
    usage: Usage | None = None
    outcome: Outcome = Outcome.CANCELLED
    used_nothing: bool = False  # the upstream refused or was unreachable
    cut: bool = False  # the answer broke off: usage unknown, the estimate stands
    response_model: str | None = None  # the model the answer names
    # A stream's choices that have no finish_reason yet, and whether any finished.
    unfinished: set[int] = field(default_factory=set)
    finished_any: bool = False

    @property
    def every_choice_finished(self) -> bool:
        """Whole without its [DONE]: as servers that write none end a stream."""
        return self.finished_any and not self.unfinished


class Proxy:
    def __init__(
        self,
        decisions: Decisions,
        settings: ProxySettings,
        session: aiohttp.ClientSession,
        telemetry: GenAiTelemetry | None = None,
    ) -> None:
        """``telemetry``: where the GenAI spans and metrics go (none: no spans, the
        process's meter provider)."""
        self._decisions = decisions
        self._telemetry = telemetry or GenAiTelemetry(None)
        self._metrics = decisions.metrics
        self.settings = settings
        self._session = session
        self._upstream_key = (
            TokenFile(settings.upstream_key_file) if settings.upstream_key_file else None
        )
        self.estimator = Estimator()
        self.prompt_counter = PromptCounter(
            session, self.estimator, self._upstream_headers, self._metrics.proxy_prompt_counts,
            path=settings.tokenize_path,
        )  # fmt: skip
        self._samples: list[Sample] = []
        self._settling: set[asyncio.Task[None]] = set()
        self._handling: set[asyncio.Task[Any]] = set()  # completions being answered

    # -- the routes -----------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions")

    async def expect_continue(self, request: web.Request) -> web.StreamResponse | None:
        """``Expect: 100-continue``: the caller is judged (``auth.qos``, its API key)
        before it is invited to send its body, not after: a caller with no key was
        told to go on and sent up to 8 MiB for its 401. Its refusal, or aiohttp's own
        answer to the header."""
        try:
            self._authorize(request)
            if self.settings.api_keys:
                self._api_key(request)
        except OpenAIError as error:
            response = error.response()
            response.force_close()  # the body it held back is not read
            return response
        await _default_expect_handler(request)
        return None

    async def models(self, request: web.Request) -> web.Response:
        """Every upstream's models, as one list (one server asked per model, all at
        once), for a caller the completions routes would take. A server that is slow,
        down or answers nonsense costs the list only its own entries: a stub instead."""
        try:
            self._authorize(request)
            self._identity(request)
            listed = await asyncio.gather(
                *(self._listed(model, servers[0])
                  for model, servers in self.settings.upstreams.by_model.items())
            )  # fmt: skip
        except OpenAIError as error:
            return error.response()
        except Exception:
            log.exception("listing the models failed")
            return OpenAIError(500, "internal error; the proxy's log has the details",
                               code="internal_error").response()  # fmt: skip
        return web.json_response({"object": "list", "data": [m for ms in listed for m in ms]})

    async def _listed(self, model: str, server: Upstream) -> list[Any]:
        """``model``'s entries as ``server`` lists them, else a stub entry."""
        stub = [{"id": model, "object": "model", "owned_by": "qosd-proxy"}]
        try:
            async with self._session.get(
                f"{server.url}/v1/models", headers=self._upstream_headers(),
                timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S),
                allow_redirects=False,  # with the upstream key: to its server only
            ) as answer:  # fmt: skip
                if answer.status != 200:
                    return stub
                listing = json.loads(await read_capped(answer, MODELS_MAX_BYTES))
        except (TimeoutError, aiohttp.ClientError, AnswerTooLarge, ValueError, RecursionError):
            return stub
        data = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(data, list):
            return stub
        return [m for m in data if isinstance(m, dict) and m.get("id") == model] or stub

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._handling.add(task)
        try:
            return await self._answer(request, path)
        finally:
            self._handling.discard(task)

    async def drain(self, grace_s: float) -> None:
        """Lets the completions being answered run up to ``grace_s``, then cancels what
        still runs (an endless stream), as a client that left cancels its own: the
        upstream request is closed and the lease ends (on shutdown, the listener
        already stopped). aiohttp's own shutdown waits its timeout twice over, once
        for the handlers and once more after cancelling them."""
        if self._handling:
            await asyncio.wait(set(self._handling), timeout=grace_s)
        left = set(self._handling)
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=grace_s)

    async def _answer(self, request: web.Request, path: str) -> web.StreamResponse:
        arrived = time.monotonic()
        code = 500
        call: _Call | None = None
        span: Span | None = None
        try:
            self._authorize(request)
            call = await self._parse(request)
            self._count_prompt(call, path)
            span = self._telemetry.start(
                path, call.model, call.max_tokens, request.headers,
                stream=call.stream, choices=call.body.get("n") or 1,  # n: checked in _parse
            )  # fmt: skip
            response = await self._admit_and_forward(request, path, call)
            code = CLIENT_CLOSED if call.client_left else response.status
            return response
        except OpenAIError as error:
            code = error.status
            if call is not None and call.error_type is None:
                call.error_type = error.code or str(error.status)
            if call is not None and call.response is not None:
                code = CLIENT_CLOSED
                code = await self._end_prepared(request, call, error)
                return call.response
            return error.response()
        except asyncio.CancelledError:
            code = CLIENT_CLOSED  # the client left: aiohttp cancels its handler
            raise
        except Exception:
            log.exception("proxying %s failed", path)
            failure = OpenAIError(500, "internal error; the proxy's log has the details",
                                  code="internal_error")  # fmt: skip
            if call is not None and call.response is not None:
                call.error_type = call.error_type or "internal_error"
                code = CLIENT_CLOSED
                code = await self._end_prepared(request, call, failure)
                return call.response
            return failure.response()
        finally:
            self._metrics.proxy_requests.labels(
                call.model if call else "", call.qos_class if call else "", str(code)
            ).inc()
            if call is not None:
                try:  # an answer that went out is not undone by its telemetry
                    self._finish_telemetry(span, path, call, code, arrived)
                except Exception:
                    log.exception("the telemetry of a request to %s failed", path)

    def _count_prompt(self, call: _Call, path: str) -> None:
        """Has an upstream count the prompt while the model's estimate calibrates, in
        the background (qosd.doors.proxy.tokenize); never in the request's way."""
        try:
            self.prompt_counter.consider(call.model, call.body, call.prompt,
                                         path.endswith("/chat/completions"),
                                         self.settings.upstreams)  # fmt: skip
        except Exception:
            log.exception("asking an upstream of %s to count a prompt failed", call.model)

    async def _end_prepared(self, request: web.Request, call: _Call, error: OpenAIError) -> int:
        """Ends a stream whose status line (200) already went out, with ``error`` as
        its last event (unless it has ended): a second answer would be a second status
        line inside the first. The code it is counted under: 200, as a stream cut
        upstream, or 499 when the client could not be written to."""
        response = call.response
        assert response is not None
        if not call.ended and await self._send(request, call, error.event()):
            await self._send(request, call, b"", eof=True)
        call.ended = True
        return CLIENT_CLOSED if call.client_left else response.status

    async def _send(
        self, request: web.Request, call: _Call, data: bytes, *, eof: bool = False
    ) -> bool:
        """Writes to the client, waiting at most ``client_write_timeout_s`` for it to
        take the bytes. False when it left or stopped reading: it is then taken to have
        left and its connection dropped, since a write it never reads never ends."""
        response = call.response
        assert response is not None
        try:
            async with asyncio.timeout(self.settings.client_write_timeout_s):
                if eof:
                    await response.write_eof(data)
                else:
                    await response.write(data)
        except (ConnectionError, TimeoutError):
            call.client_left = True
            if request.transport is not None:
                request.transport.abort()
            return False
        return True

    def _finish_telemetry(
        self, span: Span | None, path: str, call: _Call, code: int, arrived: float
    ) -> None:
        """The request's GenAI span and metrics, once its answer has ended."""
        progress, outcome = call.progress, call.outcome
        error_type = call.error_type
        if error_type is None and code != 200:
            error_type = "client_closed" if code == CLIENT_CLOSED else str(code)
        if error_type is None and progress is not None and progress.cut:
            error_type = "upstream_cut"
        usage = progress.usage if progress is not None else None
        streamed = progress is not None and progress.first_token_at is not None
        times = (
            arrived,
            progress.first_token_at if progress else None,
            progress.last_token_at if streamed and progress else None,
            time.monotonic(),
        )
        self._telemetry.finish(
            span,
            Finished(
                path=path,
                model=call.model,
                qos_class=call.qos_class,
                decision="admitted" if outcome and outcome.decision.admitted else "rejected",
                error_type=error_type,
                response_model=progress.response_model if progress else None,
                usage=(usage.prompt_tokens, usage.completion_tokens) if usage else None,
                waited_ms=outcome.waited_ms if outcome else 0,
                times=times,
                output_tokens=usage.completion_tokens
                if usage
                else (progress.chunks if progress else 0),
                upstream=call.upstream.url if call.upstream else None,
                sent_at=progress.sent_at if progress is not None and progress.sent_at else None,
            ),
        )

    # -- admission ------------------------------------------------------------------

    def _authorize(self, request: web.Request) -> None:
        """``auth.qos``, as the daemon applies it to Acquire: a bearer token or an
        allowed mTLS identity; 401 when the caller shows neither, 403 when wrong."""
        check = self.settings.caller_check
        if check is None:
            return
        header = request.headers.get("authorization")
        token = None if header is None else bearer_of(header)
        refusal_ = check.judge_credentials(token, _peer_identities(request))
        if refusal_ is not None:
            status = 401 if refusal_.code is grpc.StatusCode.UNAUTHENTICATED else 403
            self._metrics.auth_refusals.labels("proxy", refusal_.code.name).inc()
            raise OpenAIError(status, refusal_.message, "authorization",
                              code=refusal_.code.name.lower())  # fmt: skip

    async def _parse(self, request: web.Request) -> _Call:
        # Who asks, before a byte of the body is read: with API keys, an unknown
        # caller costs no reading or parsing.
        qos_class, tenant = self._identity(request)
        try:
            raw = await read_body(request, self.settings.max_body_bytes)
        except BodyTimedOut as exc:  # a body that never ends
            raise OpenAIError(408, f"body: {exc}", "body", code="request_timeout") from exc
        except BadJson as exc:  # one that cannot be decoded
            raise OpenAIError(400, f"body: {exc}", "body") from exc
        except BodyTooLarge as exc:
            raise OpenAIError(
                413,
                f"the request body exceeds the proxy's limit of "
                f"{self.settings.max_body_bytes} bytes (--max-body-bytes)",
                "body",
            ) from exc
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            # Parsing megabytes takes a while: off the event loop, which goes on
            # serving everyone else meanwhile.
            body, prompt = await asyncio.to_thread(_read_body, raw)
        else:
            body, prompt = _read_body(raw)
        qos_class, tenant = self._body_identity(request, body) or (qos_class, tenant)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise OpenAIError(400, "model: a model name is required", "model")
        if self.settings.upstreams.pick(model) is None:
            served = ", ".join(self.settings.upstreams.models())
            raise OpenAIError(404, f"model {model[:80]!r} is not served here (models: {served})",
                              "model", code="model_not_found")  # fmt: skip
        limit = self._decisions.rules.max_tokens
        max_tokens, choices = _asked_output(body, limit)
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise OpenAIError(400, "stream: must be true or false", "stream")
        options = body.get("stream_options")
        if options is not None and not isinstance(options, dict):
            raise OpenAIError(400, "stream_options: must be an object", "stream_options")
        if self.estimator.fewest_tokens(prompt.text_bytes) > limit:
            raise OpenAIError(
                400,
                f"messages: the prompt ({prompt.text_bytes} bytes) is more than {limit} tokens "
                "whatever the tokenizer (limits.max_request_tokens)",
                "messages",
            )
        try:
            admission = self._decisions.rules.acquire(
                request_id=request.headers.get(REQUEST_ID_HEADER, ""),
                tenant=tenant,
                model=model,
                qos_class=qos_class,
                input_tokens=self.estimator.prompt_tokens(model, prompt),
                expected_output_tokens=self.estimator.expected_output(
                    qos_class, max_tokens, choices
                ),
                slo_ttft_ms=_objective(request, TTFT_HEADERS),
                slo_tpot_ms=_objective(request, TPOT_HEADERS),
                estimated=True,
                names=FIELD_NAMES,
            )
        except InvalidArgument as exc:
            self._decisions.invalid("proxy", exc)
            raise OpenAIError(400, str(exc), exc.field) from exc
        return _Call(
            admission=admission,
            body=body,
            raw=raw,
            prompt=prompt,
            stream=stream is True,
            wants_usage=isinstance(options, dict) and options.get("include_usage") is True,
            max_tokens=max_tokens,
            choices=choices,
        )

    def _body_identity(self, request: web.Request, body: dict[str, Any]) -> tuple[str, str] | None:
        """The class and tenant again, where the body's Dynamo hint names a class no
        header did (Dynamo's header, when sent, overrides its hint, as in Dynamo)."""
        if DYNAMO_PRIORITY_HEADER in request.headers:
            return None
        try:
            from_body = self._decisions.peer_headers.body_class(body)
        except InvalidArgument as exc:
            raise OpenAIError(400, str(exc), exc.field) from exc
        return None if from_body is None else self._identity(request, from_body)

    def _asked_class(
        self, request: web.Request, from_body: tuple[str, str] | None
    ) -> tuple[str | None, str]:
        """(the class the request asks for, where it said so): qosd's header, the
        peers' headers, then the body's hint; (None, ...) where none names one."""
        asked = request.headers.get(CLASS_HEADER)
        if asked:
            return asked, CLASS_HEADER
        try:
            found = self._decisions.peer_headers.qos_class(request.headers.get)
        except InvalidArgument as exc:
            raise OpenAIError(400, str(exc), exc.field) from exc
        return found or from_body or (None, CLASS_HEADER)

    def _api_key(self, request: web.Request) -> tuple[str, str]:
        """The (class, tenant) of the request's API key; 401 without one, 403 for one
        not known here."""
        header = request.headers.get("authorization")
        key = bearer_of(header) if header is not None else b""
        if not key:
            self._metrics.auth_refusals.labels("proxy", "UNAUTHENTICATED").inc()
            raise OpenAIError(401, "an API key is required: 'Authorization: Bearer <key>'",
                              "authorization", code="invalid_api_key")  # fmt: skip
        found = self.settings.api_keys.get(hashlib.sha256(key).hexdigest())
        if found is None:
            self._metrics.auth_refusals.labels("proxy", "PERMISSION_DENIED").inc()
            raise OpenAIError(403, "the API key is not known here", "authorization",
                              code="invalid_api_key")  # fmt: skip
        return found

    @staticmethod
    def _given_once(request: web.Request, names: tuple[str, ...]) -> None:
        try:
            given_once(names, lambda name: len(request.headers.getall(name, ())))
        except InvalidArgument as exc:
            raise OpenAIError(400, str(exc), exc.field) from exc

    def _identity(
        self, request: web.Request, from_body: tuple[str, str] | None = None
    ) -> tuple[str, str]:
        """The request's class and tenant, each from the first that names it: qosd's
        own headers, then the peers' (``qosd.doors.dialects``), then ``from_body`` (the
        class the body's Dynamo hint names, once it is read), then the API key's, else
        the default class. With API keys, a missing or unknown key is refused, a
        header or the body may lower the key's class but never raise it, and a key
        that names a tenant fixes it (docs/security.md)."""
        headers = request.headers
        # The key first: a caller without one learns nothing of the other headers.
        self._given_once(request, ("authorization",))
        found = self._api_key(request) if self.settings.api_keys else None
        self._given_once(request, NAMING_HEADERS)
        asked, named_by = self._asked_class(request, from_body)
        tenant = headers.get(TENANT_HEADER, "")
        if not tenant:
            try:
                found_tenant = self._decisions.peer_headers.tenant(headers.get)
            except InvalidArgument as exc:
                raise OpenAIError(400, str(exc), exc.field) from exc
            tenant = found_tenant[0] if found_tenant else ""
        if found is None:
            return asked or self.settings.default_class, tenant
        key_class, key_tenant = found
        qos_class = key_class
        classes = self._decisions.admission.config.classes
        # A key's class gone from the config is refused below, as an unknown class.
        if asked and asked != key_class and key_class in classes:
            if asked not in classes:
                raise OpenAIError(400, f"{named_by}: unknown class {asked[:40]!r} "
                                  f"(classes: {', '.join(classes)})", named_by)  # fmt: skip
            raises = classes[asked].priority < classes[key_class].priority
            if raises and named_by == DYNAMO_PRIORITY_FIELD:
                # A hint Dynamo-aware clients send as a matter of course: held to the
                # key's class, not refused (a header is the caller's own ask: refused).
                return key_class, key_tenant or tenant
            if raises:
                self._metrics.auth_refusals.labels("proxy", "PERMISSION_DENIED").inc()
                raise OpenAIError(
                    403,
                    f"{named_by}: class {asked!r} is above this key's class {key_class!r}; "
                    "a header may lower a key's class, never raise it",
                    named_by,
                    code="class_not_allowed",
                )
            qos_class = asked
        return qos_class, key_tenant or tenant

    async def _admit_and_forward(
        self, request: web.Request, path: str, call: _Call
    ) -> web.StreamResponse:
        try:
            outcome = await self._decisions.acquire(call.admission)
        except DuplicateRequest as exc:
            raise OpenAIError(409, str(exc), REQUEST_ID_HEADER,
                              code="duplicate_request_id") from exc  # fmt: skip
        call.outcome = outcome
        decision = outcome.decision
        if not decision.admitted:
            call.error_type = decision.reason.name.lower()
            raise refusal(decision.reason, decision.retry_after_ms, outcome.message,
                          rate_limit_headers(decision))  # fmt: skip
        # Admitted: from here on, nothing comes before the try whose finally ends the
        # lease.
        call.progress = progress = _Progress()
        try:
            limits = rate_limit_headers(decision)
            response = await self._forward(request, path, call, outcome.server_priority,
                                           progress, limits)  # fmt: skip
            return response
        except Exception:
            if progress.outcome is Outcome.CANCELLED and not progress.used_nothing:
                progress.cut, progress.outcome = True, Outcome.ERROR  # the proxy failed
            raise
        finally:
            # In a task of its own: the answer goes out while the lease ends (a store
            # call the client need not wait for), and a client that leaves cancels
            # this handler, not the settlement.
            settling = asyncio.get_running_loop().create_task(
                self._settle(call, decision.lease_id, progress)
            )
            self._settling.add(settling)
            settling.add_done_callback(self._settling.discard)

    # -- forwarding -----------------------------------------------------------------

    def _upstream_headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self._upstream_key is not None and (key := self._upstream_key.token()):
            headers["authorization"] = f"Bearer {key}"
        return headers

    async def _forward(
        self,
        request: web.Request,
        path: str,
        call: _Call,
        priority: int,
        progress: _Progress,
        limits: dict[str, str],
    ) -> web.StreamResponse:
        """The upstream's answer, carrying ``limits`` (the rate-limit headers). The
        server is picked once the body is ready, and counted at once: a long prompt's
        body is encoded off the loop, and the requests picked meanwhile must see it."""
        payload = await self._payload(call, priority)
        headers = self._upstream_headers()
        headers.update(forwarded(request.headers))
        call.upstream = upstream = self.settings.upstreams.pick(
            call.model, tokens=call.admission.input_tokens
        )
        assert upstream is not None  # checked in _parse; upstreams never change
        try:
            answer, upstream = await self._connect(call, upstream, path, payload, headers)
        except TimeoutError as exc:  # it may have started: its estimate stands
            progress.cut, progress.outcome = True, Outcome.ERROR
            raise OpenAIError(504, "upstream did not answer in time",
                              code="upstream_timeout") from exc  # fmt: skip
        except aiohttp.ClientConnectorError as exc:  # no server connected: nothing used
            progress.used_nothing, progress.outcome = True, Outcome.ERROR
            raise OpenAIError(502, f"upstream unreachable: {what_broke(exc)}",
                              code="upstream_unreachable") from exc  # fmt: skip
        except aiohttp.ClientError as exc:  # it had the request: its estimate stands
            progress.cut, progress.outcome = True, Outcome.ERROR
            raise OpenAIError(502, f"upstream broke off: {what_broke(exc)}",
                              code="upstream_cut") from exc  # fmt: skip
        try:
            async with answer:
                try:
                    read_load(upstream, answer)
                    if answer.status != 200:
                        progress.used_nothing, progress.outcome = True, Outcome.ERROR
                        return await _passed_on(answer, limits, self.settings.max_answer_bytes)
                    if not call.stream:
                        return await self._whole(answer, progress, limits)
                    return await self._stream(request, answer, call, progress, limits)
                except BaseException:
                    answer.close()  # the client left: the upstream drops the request
                    raise
        finally:
            if call.sent is not None:
                call.sent.ended()

    async def _payload(self, call: _Call, priority: int) -> bytes:
        """The body to send upstream: as the client sent it, unless the proxy changes
        it. A client's own rank would jump the upstream's queue (vLLM's priority,
        Dynamo's agent hints): only qosd's class decides, so neither is forwarded."""
        unranked = without_ranking_hints(call.body)
        if not (
            call.stream
            or self.settings.priority_upstreams
            or "priority" in call.body
            or unranked is not None
        ):
            return call.raw
        body = dict(unranked or call.body)
        body.pop("priority", None)
        if call.stream:  # the usage to settle with, whether or not the client asked
            body["stream_options"] = {**(body.get("stream_options") or {}),
                                      "include_usage": True}  # fmt: skip
        if self.settings.priority_upstreams:
            body["priority"] = priority
        if len(call.raw) > PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(_encoded, body)
        return _encoded(body)

    async def _connect(
        self,
        call: _Call,
        upstream: Upstream,
        path: str,
        payload: bytes,
        headers: dict[str, str],
    ) -> tuple[aiohttp.ClientResponse, Upstream]:
        """The answer of the first of the model's servers that takes the connection,
        and that server (its request counted in flight). A server that refuses the
        connection got nothing, so the request goes to the next (the second probe:
        with one of two servers down, seven requests in eight failed), and the one
        that refused is passed over for a while; when none takes it, the last error."""
        tried: list[Upstream] = []
        while True:
            call.sent = sent = upstream.send(call.admission.input_tokens)
            progress = call.progress
            if progress is not None:
                progress.sent_at = time.monotonic()
            try:
                answer = await self._session.post(  # a redirect is answered, not followed
                    upstream.url + path, data=payload, headers=headers, allow_redirects=False
                )
            except aiohttp.ClientConnectorError:
                sent.ended()
                upstream.refused_connection()
                tried.append(upstream)
                following = self.settings.upstreams.pick(
                    call.model, avoid=tried, tokens=call.admission.input_tokens
                )
                if following is None:
                    raise
                call.upstream = upstream = following
                continue
            except BaseException:
                sent.ended()
                raise
            return answer, upstream

    async def _whole(
        self, answer: aiohttp.ClientResponse, progress: _Progress, limits: dict[str, str]
    ) -> web.Response:
        try:
            raw = await read_capped(answer, self.settings.max_answer_bytes)
        except (TimeoutError, aiohttp.ClientError, AnswerTooLarge) as exc:
            progress.cut, progress.outcome = True, Outcome.ERROR
            raise broke_off(exc) from exc
        progress.last_token_at = time.monotonic()
        try:
            if len(raw) > PARSE_OFF_LOOP_BYTES:
                answered = await asyncio.to_thread(json.loads, raw)
            else:
                answered = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            answered = exc
        if not isinstance(answered, dict):
            # A 200 that is no answer (half a body, an event stream, HTML): the SDKs
            # raised a bare JSONDecodeError on it, and it counted as a success.
            progress.cut, progress.outcome = True, Outcome.ERROR
            what = "not JSON" if isinstance(answered, Exception) else "not a JSON object"
            raise OpenAIError(502, f"the upstream's answer is {what}", code="upstream_invalid")
        progress.usage = Usage.parse(answered.get("usage"), self._decisions.rules.max_tokens)
        model = answered.get("model")
        progress.response_model = model if isinstance(model, str) else None
        progress.outcome = Outcome.OK
        return web.Response(status=200, body=raw, content_type="application/json",
                            headers=limits)  # fmt: skip

    async def _stream(
        self,
        request: web.Request,
        answer: aiohttp.ClientResponse,
        call: _Call,
        progress: _Progress,
        limits: dict[str, str],
    ) -> web.StreamResponse:
        """Relays the server-sent events as they come (a slow client slows the reads
        from the upstream: backpressure both ways), minus the usage chunk the client
        did not ask for. Once the status line has gone out, whatever breaks (the
        upstream's connection, its silence, a line past the limit, an event the proxy
        cannot read) ends the stream with an OpenAI error event, which the SDKs raise;
        a client that leaves or stops reading ends the upstream request."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **limits}
        )
        await response.prepare(request)
        call.response = response
        lines = Lines(answer.content, self.settings.max_body_bytes)
        limit = self._decisions.rules.max_tokens
        done = False  # its data: [DONE] came
        while True:
            try:  # reading from the upstream, and what its events say
                line = await lines.next()
                if line is None:
                    if not (done or progress.every_choice_finished):
                        raise AnswerCut("the stream ended before its data: [DONE]")
                    break
                if not line.endswith(b"\n") and not is_done(line):
                    raise AnswerCut("the stream ended in the middle of a line")
                done = done or is_done(line)
                if is_event(line):
                    usage_chunk = self._saw(line, progress, limit)
                    if progress.first_token_at is not None and call.sent is not None:
                        call.sent.first_token(progress.first_token_at)
                    if usage_chunk and not call.wants_usage:
                        continue  # the usage chunk the proxy asked for, not the client
            except (TimeoutError, aiohttp.ClientError, AnswerTooLarge, AnswerCut) as exc:
                error = broke_off(exc)
            except Exception:
                log.exception("relaying a stream from %s failed", answer.url)
                error = OpenAIError(500, "the stream could not be relayed; the proxy's log "
                                    "has the details", code="internal_error")  # fmt: skip
            else:
                if await self._send(request, call, line):
                    continue
                answer.close()  # the client left or stopped reading: so does the request
                return response
            progress.cut, progress.outcome = True, Outcome.ERROR
            call.error_type = error.code
            answer.close()
            await self._end_prepared(request, call, error)
            return response
        progress.outcome = Outcome.OK  # whole, whether or not its end reaches the client
        await self._send(request, call, b"", eof=True)
        call.ended = True
        return response

    @staticmethod
    def _saw(line: bytes, progress: _Progress, limit: int) -> bool:
        """Notes what one event of the stream shows: usage, or a token. True for the
        usage chunk (no choices, a ``usage``), whether or not its usage could be read:
        a client that did not ask for it breaks on a chunk with no choices."""
        try:
            chunk = json.loads(event_data(line) or b"")
        except (ValueError, RecursionError):
            return False
        if not isinstance(chunk, dict):
            return False
        if progress.response_model is None and isinstance(model := chunk.get("model"), str):
            progress.response_model = model
        if note_finishes(chunk, progress.unfinished):
            progress.finished_any = True
        if is_usage_chunk(chunk):
            progress.usage = Usage.parse(chunk.get("usage"), limit) or progress.usage
            return True
        if has_content(chunk):
            now = time.monotonic()
            if progress.first_token_at is None:
                progress.first_token_at = now
            progress.last_token_at = now
            progress.chunks += 1
        return False

    # -- settlement and reports -----------------------------------------------------

    async def settled(self) -> None:
        """Waits for the leases of answered requests to end (on shutdown)."""
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    async def _settle(self, call: _Call, lease_id: str, progress: _Progress) -> None:
        """Ends the lease first, in a finally that nothing before it can skip; then
        learns from the usage and records the request's latencies. Usage beyond the
        request limit is settled at the limit (``Usage.parse`` clamps it)."""
        counts: tuple[int | None, int | None] = (None, None)  # None: the estimate stands
        try:
            counts = self._used(call, progress)
        except Exception:
            log.exception("lease %s: its usage could not be read; settled with the estimate",
                          lease_id)  # fmt: skip
        finally:
            outcome = call.outcome
            if progress.used_nothing and outcome is not None and outcome.lease is not None:
                # Never reached, or refused, by the upstream: undone, its request id
                # freed, so that the SDK's retry of it (same x-request-id) is admitted
                # anew rather than refused as a reuse (409).
                await self._release(lease_id, 0, 0, Outcome.CANCELLED, undo=outcome.lease)
            else:
                # One that failed on its way (the upstream broke off or went silent) or
                # whose client left: settled, its request id freed, as the SDKs and
                # Envoy retry such a request under the same id. A request that was
                # answered keeps its id for the lease's TTL.
                lease = outcome.lease if outcome is not None else None
                retried = lease if progress.outcome is not Outcome.OK else None
                await self._release(lease_id, *counts, progress.outcome, frees_request_of=retried)
        if progress.used_nothing:
            return
        try:
            if progress.usage is not None:
                self.estimator.learn(call.model, call.qos_class, call.prompt,
                                     progress.usage, call.choices, call.max_tokens)  # fmt: skip
            self._record(call, progress, counts[1])
        except Exception:
            log.exception("lease %s: its usage and latencies were not recorded", lease_id)

    def _used(self, call: _Call, progress: _Progress) -> tuple[int | None, int | None]:
        """The tokens to settle with, each at most the request limit; None: the
        estimate stands."""
        usage = progress.usage
        input_tokens: int | None
        output_tokens: int | None
        if progress.used_nothing:
            input_tokens, output_tokens = 0, 0
        elif usage is not None:
            input_tokens, output_tokens = usage.prompt_tokens, usage.completion_tokens
        elif call.stream and not progress.cut and progress.outcome is Outcome.CANCELLED:
            # The client left mid-stream: what was streamed, the prompt as estimated.
            input_tokens, output_tokens = call.admission.input_tokens, progress.chunks
        else:  # cut, or the proxy failed: the estimates stand
            input_tokens = output_tokens = None
        limit = self._decisions.rules.max_tokens
        if input_tokens is not None:
            input_tokens = min(input_tokens, limit)
        if output_tokens is not None:
            output_tokens = min(output_tokens, limit)
        return input_tokens, output_tokens

    async def _release(
        self,
        lease_id: str,
        input_tokens: int | None,
        output_tokens: int | None,
        outcome: Outcome,
        *,
        undo: LeaseSpec | None = None,
        frees_request_of: LeaseSpec | None = None,
    ) -> None:
        decisions = self._decisions
        try:
            release = decisions.rules.release(lease_id, input_tokens, output_tokens, outcome)
            if undo is not None or frees_request_of is not None:
                release = dataclasses.replace(release, undo=undo, frees_request_of=frees_request_of)
            await decisions.release(release)
        except StoreUnavailable as exc:
            log.warning("lease %s not settled yet (retried until it lands): %s", lease_id, exc)
        except (LeaseNotFound, LeaseExpired, InvalidArgument) as exc:
            log.warning("lease %s not settled: %s", lease_id, exc)
        except Exception:
            log.exception("lease %s not settled (it ends at its TTL)", lease_id)

    def _record(self, call: _Call, progress: _Progress, output_tokens: int | None) -> None:
        """A latency sample for the SLO loop, measured at the proxy from the moment
        the request went upstream (the wait in qosd is on /metrics, not in it)."""
        end = progress.last_token_at
        if end is None:
            return
        produced = output_tokens if output_tokens is not None else progress.chunks
        ttft_ms = tpot_ms = None
        if progress.first_token_at is not None:
            ttft_ms = (progress.first_token_at - progress.sent_at) * 1000
            if produced > 1:
                tpot_ms = (end - progress.first_token_at) * 1000 / (produced - 1)
        status = progress.outcome if progress.outcome is not Outcome.UNSPECIFIED else Outcome.OK
        admission = call.admission
        limit = self._decisions.rules.max_tokens
        try:
            sample = self._decisions.rules.sample(
                model=call.model,
                qos_class=call.qos_class,
                tenant=admission.tenant,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
                e2e_ms=(end - progress.sent_at) * 1000,
                input_tokens=min(limit, progress.usage.prompt_tokens)
                if progress.usage
                else admission.input_tokens,
                output_tokens=min(limit, produced),
                status=status,
                slo_ttft_ms=admission.slo_ttft_ms,
                slo_tpot_ms=admission.slo_tpot_ms,
            )
        except InvalidArgument as exc:
            log.warning("latency sample dropped: %s", exc)
            return
        self._samples.append(sample)

    async def flush_samples(self) -> None:
        """Reports the samples gathered since the last flush, in one batch. Never
        raises: a sample the store cannot take is dropped, and the next flush goes on."""
        samples, self._samples = self._samples, []
        if not samples:
            return
        try:
            await self._decisions.admission.report(samples)
        except StoreUnavailable as exc:
            log.warning("%d latency samples not stored: %s", len(samples), exc)
            return
        except Exception:
            log.exception("%d latency samples dropped", len(samples))
            return
        metrics = self._metrics
        metrics.report_samples.labels("accepted").inc(len(samples))
        judge_samples(metrics, self._decisions.admission.config, samples)

    async def report_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.flush_samples()


#: Upstream statuses the client is answered with as they are: its request's own
#: faults (a bad field, an unknown model, too long a prompt) and the upstream's
#: overload and gateway statuses, which the SDKs retry.
PASSED_ON_STATUSES = frozenset({400, 404, 408, 409, 413, 415, 422, 429, 502, 503, 504})


async def _passed_on(
    answer: aiohttp.ClientResponse, limits: dict[str, str], limit: int
) -> web.Response:
    """An upstream's answer other than 200, with ``limits``. A status that is the
    client's to see (PASSED_ON_STATUSES) goes on, its body in OpenAI's format (the
    upstream's own when it is, else its text as the message). Any other is a 502
    naming the upstream's status: its 500 is no bug of the proxy, its 401 or 403
    refused the proxy's upstream key, not the client's, and a 204 or a 3xx is no
    answer to a completion. A body that breaks off, or is over ``limit`` bytes: a 502."""
    try:
        body = await read_capped(answer, limit)
    except (TimeoutError, aiohttp.ClientError, AnswerTooLarge) as exc:
        raise broke_off(exc) from exc
    text = body.decode("utf-8", "replace")
    status = answer.status
    # A retry cannot help a 4xx the SDKs would retry (409), nor any upstream answer but
    # a 500 (it may pass): say so, as OpenAIError does for the proxy's own.
    hopeless = {"x-should-retry": "false"}
    if status in PASSED_ON_STATUSES:
        # The upstream's own pause goes on: without it the SDKs came back after half a
        # second into a server that had asked for seven.
        limits = {**limits, **retry_after_of(answer.headers)}
        if _is_openai_error(body):
            headers = {**limits, **(hopeless if status in NEVER_RETRIED else {})}
            return web.Response(status=status, body=body, content_type="application/json",
                                headers=headers)  # fmt: skip
        failure = OpenAIError(status, f"upstream: {_excerpt(text)}", code=f"upstream_{status}")
    elif status in (401, 403, 407):
        failure = OpenAIError(502, f"the upstream refused the proxy's credentials "
                              f"({status}: {_excerpt(text)}); see --upstream-key-file",
                              code="upstream_refused_proxy", headers=hopeless)  # fmt: skip
    else:
        failure = OpenAIError(502, f"the upstream answered {status}: {_excerpt(text)}",
                              code="upstream_error",
                              headers=None if status == 500 else hopeless)  # fmt: skip
    failure.headers = {**limits, **failure.headers}
    return failure.response()


def _is_openai_error(body: bytes) -> bool:
    try:
        answered = json.loads(body)
    except (ValueError, RecursionError):
        return False
    return isinstance(answered, dict) and isinstance(answered.get("error"), dict)


def _excerpt(text: str, length: int = 200) -> str:
    """An upstream's text for a message: printable, one line, bounded."""
    flat = "".join(c if c.isprintable() else " " for c in text[: length * 2]).strip()
    return (flat[:length] + "...") if len(flat) > length else (flat or "(no body)")


def _encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _asked_output(body: dict[str, Any], limit: int) -> tuple[int | None, int]:
    """The request's ``max_tokens`` (at most ``limit``, so that every count after it
    fits an int64) and how many answers it asks to be generated: ``n``, or
    ``best_of`` (the server generates that many and returns n); 400 naming the field
    for anything else."""
    for named in ("max_completion_tokens", "max_tokens"):  # each checked, null or not
        value = body.get(named)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise OpenAIError(400, f"{named}: must be a non-negative integer", named)
        if value > limit:
            raise OpenAIError(400, f"{named}: {value} is more than the {limit} tokens a "
                              "request may have (limits.max_request_tokens)", named)  # fmt: skip
    # As vLLM reads them (max_completion_tokens or max_tokens): a null or 0 first
    # leaves the second.
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    choices = 1
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_CHOICES:
            raise OpenAIError(400, f"{name}: must be an integer from 1 to {MAX_CHOICES}", name)
        choices = max(choices, value)
    return max_tokens, choices


def _read_body(raw: bytes) -> tuple[dict[str, Any], PromptSize]:
    """The request body as a JSON object, and its prompt's size: both in one go, so
    that a large body is worked on off the loop in one hop."""
    try:
        body = parse_json(raw)
    except BadJson as exc:
        raise OpenAIError(400, str(exc), "body") from exc
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object", "body")
    return body, prompt_size(body)


def _peer_identities(request: web.Request) -> list[str]:
    """The client certificate's subject alternative names, else its common name (as
    the daemon reads them from gRPC's auth context); empty without mTLS."""
    certificate = request.transport.get_extra_info("peercert") if request.transport else None
    if not certificate:
        return []
    names = [value for _, value in certificate.get("subjectAltName", ())]
    if names:
        return names
    return [value for rdn in certificate.get("subject", ()) for key, value in rdn
            if key == "commonName"]  # fmt: skip


def _objective(request: web.Request, names: tuple[str, ...]) -> float | None:
    for name in names:
        text = request.headers.get(name)
        if text is None:
            continue
        # Plain decimal digits only: float() would also take "1_000", " 5", "1e3" and
        # "\u0661\u0660\u0660" (Arabic-Indic), none of which a client means as ms.
        value = float(text) if len(text) <= 32 and DECIMAL_MS.fullmatch(text) else math.nan
        if not (math.isfinite(value) and 0 < value <= MAX_LATENCY_MS):
            raise OpenAIError(
                400,
                f"{name}: must be a number of milliseconds above 0 and at most "
                f"{MAX_LATENCY_MS:.0f} (got {text[:40]!r})",
                name,
            )
        return value
    return None


def key_digest(key: str) -> str:
    """How an API key is known: its SHA-256, so the key itself is kept nowhere."""
    return hashlib.sha256(key.encode()).hexdigest()
