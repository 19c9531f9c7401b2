"""One OpenAI-compatible request through the proxy: admit, forward, settle, report.

Every admitted request ends its lease exactly once, from ``_forward``'s ``finally``,
as its answer ends: with the usage the server reported, or with what was streamed
when the stream broke, or with nothing used when the upstream refused or was
unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from aiohttp import web

from qosd.admission import MAX_LATENCY_MS, Admission, InvalidArgument
from qosd.auth import CallerCheck, bearer_of
from qosd.metrics import Metrics
from qosd.model import LeaseExpired, LeaseNotFound, Outcome, Sample, StoreUnavailable
from qosd.proxy.estimate import Estimator, Usage, prompt_text
from qosd.proxy.openai_errors import OpenAIError, refusal
from qosd.proxy.upstreams import Upstream, Upstreams

log = logging.getLogger(__name__)

CLASS_HEADER = "x-qos-class"
TENANT_HEADER = "x-qos-tenant"
#: Per-request objectives: qosd's own headers, then llm-d's.
TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
#: Request headers passed upstream as they came (the rest are the proxy's business).
FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate", "x-request-id",
                     "endpoint-load-metrics-format")  # fmt: skip
LOAD_HEADER = "endpoint-load-metrics"


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


@dataclass(slots=True)
class _Call:
    """One request's facts, as the proxy learned them."""

    model: str
    qos_class: str
    tenant: str
    body: dict[str, Any]
    raw: bytes  # the body as it came
    prompt_bytes: int
    input_tokens: int
    output_tokens: int
    stream: bool
    wants_usage: bool
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    request_id: str


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


class Proxy:
    def __init__(
        self,
        admission: Admission,
        metrics: Metrics,
        settings: ProxySettings,
        session: aiohttp.ClientSession,
    ) -> None:
        self._admission = admission
        self._metrics = metrics
        self.settings = settings
        self._session = session
        self.estimator = Estimator()
        self._samples: list[Sample] = []
        self._settling: set[asyncio.Task[None]] = set()

    # -- the routes -----------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "/v1/completions")

    async def models(self, _: web.Request) -> web.Response:
        """Every upstream's models, as one list (one server asked per model)."""
        data: list[Any] = []
        for model, servers in self.settings.upstreams.by_model.items():
            try:
                async with self._session.get(f"{servers[0].url}/v1/models") as answer:
                    listed = (await answer.json()).get("data", [])
            except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
                listed = []
            found = [m for m in listed if isinstance(m, dict) and m.get("id") == model]
            data.extend(found or [{"id": model, "object": "model", "owned_by": "qosd-proxy"}])
        return web.json_response({"object": "list", "data": data})

    async def _handle(self, request: web.Request, path: str) -> web.StreamResponse:
        code = 500
        call: _Call | None = None
        try:
            self._authorize(request)
            call = await self._parse(request)
            response = await self._admit_and_forward(request, path, call)
            code = response.status
            return response
        except OpenAIError as error:
            code = error.status
            return error.response()
        finally:
            self._metrics.proxy_requests.labels(
                call.model if call else "", call.qos_class if call else "", str(code)
            ).inc()

    # -- admission ------------------------------------------------------------------

    def _authorize(self, request: web.Request) -> None:
        """``auth.qos``, as the daemon applies it to Acquire: a bearer token or an
        allowed mTLS identity; 401 when the caller shows neither, 403 when wrong."""
        check = self.settings.caller_check
        if check is None:
            return
        header = request.headers.get("authorization")
        token = None if header is None else bearer_of(header)
        refusal = check.judge_credentials(token, _peer_identities(request))
        if refusal is not None:
            status = 401 if refusal.code is grpc.StatusCode.UNAUTHENTICATED else 403
            self._metrics.auth_refusals.labels("proxy", refusal.code.name).inc()
            raise OpenAIError(status, refusal.message, "authorization",
                              code=refusal.code.name.lower())  # fmt: skip

    async def _parse(self, request: web.Request) -> _Call:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise OpenAIError(
                413,
                f"the request body exceeds the proxy's limit of "
                f"{self.settings.max_body_bytes} bytes (--max-body-bytes)",
                "body",
            ) from exc
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"the request body is not valid JSON: {exc}", "body") from exc
        if not isinstance(body, dict):
            raise OpenAIError(400, "the request body must be a JSON object", "body")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise OpenAIError(400, "model: a model name is required", "model")
        if self.settings.upstreams.pick(model) is None:
            served = ", ".join(self.settings.upstreams.models())
            raise OpenAIError(404, f"model {model!r} is not served here (models: {served})",
                              "model", code="model_not_found")  # fmt: skip
        qos_class, tenant = self._identity(request)
        if qos_class not in self._admission.config.classes:
            known = ", ".join(self._admission.config.classes)
            raise OpenAIError(400, f"{CLASS_HEADER}: unknown class {qos_class!r} "
                              f"(classes: {known})", CLASS_HEADER)  # fmt: skip
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0
        ):
            raise OpenAIError(400, "max_tokens: must be a non-negative integer", "max_tokens")
        text = prompt_text(body)
        stream = body.get("stream") is True
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and options.get("include_usage") is True
        return _Call(
            model=model,
            qos_class=qos_class,
            tenant=tenant,
            body=body,
            raw=raw,
            prompt_bytes=len(text.encode("utf-8")),
            input_tokens=self.estimator.prompt_tokens(model, text),
            output_tokens=self.estimator.expected_output(qos_class, max_tokens),
            stream=stream,
            wants_usage=wants_usage,
            slo_ttft_ms=_objective(request, TTFT_HEADERS),
            slo_tpot_ms=_objective(request, TPOT_HEADERS),
            request_id=request.headers.get("x-request-id", "")[:128],
        )

    def _identity(self, request: web.Request) -> tuple[str, str]:
        """The request's class and tenant: its API key's, else its headers', else the
        default class."""
        keys = self.settings.api_keys
        if keys:
            bearer = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            found = keys.get(key_digest(bearer)) if bearer else None
            if found is not None:
                return found
        qos_class = request.headers.get(CLASS_HEADER) or self.settings.default_class
        return qos_class, request.headers.get(TENANT_HEADER, "")

    async def _admit_and_forward(
        self, request: web.Request, path: str, call: _Call
    ) -> web.StreamResponse:
        admission = self._admission
        try:
            outcome = await admission.acquire(
                request_id=call.request_id,
                tenant=call.tenant,
                model=call.model,
                qos_class=call.qos_class,
                input_tokens=call.input_tokens,
                expected_output_tokens=call.output_tokens,
                max_wait_ms=None,
                deadline_s=None,
                slo_ttft_ms=call.slo_ttft_ms,
                slo_tpot_ms=call.slo_tpot_ms,
            )
        except InvalidArgument as exc:
            self._metrics.invalid.labels("proxy").inc()
            raise OpenAIError(400, str(exc), _header_for(str(exc))) from exc
        decision = outcome.decision
        self._metrics.acquire(
            outcome.pool, call.qos_class, decision.admitted, decision.reason, outcome.waited_ms
        )
        if not decision.admitted:
            raise refusal(decision.reason, decision.retry_after_ms, outcome.message)
        if call.tenant:
            self._metrics.tenant_admitted(
                outcome.pool, call.qos_class, call.tenant, call.input_tokens + call.output_tokens
            )
        upstream = self.settings.upstreams.pick(call.model)
        assert upstream is not None  # checked in _parse; upstreams never change
        return await self._forward(
            request, path, call, upstream, decision.lease_id, outcome.server_priority
        )

    # -- forwarding -----------------------------------------------------------------

    async def _forward(
        self,
        request: web.Request,
        path: str,
        call: _Call,
        upstream: Upstream,
        lease_id: str,
        priority: int,
    ) -> web.StreamResponse:
        payload = call.raw  # as the client sent it, unless the proxy adds to it
        if call.stream or self.settings.priority_upstreams:
            body = dict(call.body)
            if call.stream:  # the usage to settle with, whether or not the client asked
                options = body.get("stream_options") or {}
                body["stream_options"] = {**options, "include_usage": True}
            if self.settings.priority_upstreams:
                body["priority"] = priority
            payload = json.dumps(body).encode()
        headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))}
        headers["content-type"] = "application/json"
        progress = _Progress()
        upstream.in_flight += 1
        try:
            progress.sent_at = time.monotonic()
            try:
                answer = await self._session.post(
                    upstream.url + path, data=payload, headers=headers
                )
            except (TimeoutError, aiohttp.ClientError) as exc:
                progress.used_nothing, progress.outcome = True, Outcome.ERROR
                raise OpenAIError(502, f"upstream {upstream.url} unreachable: {exc}",
                                  code="upstream_unreachable") from exc  # fmt: skip
            async with answer:
                try:
                    _read_load(upstream, answer)
                    if answer.status != 200:
                        progress.used_nothing, progress.outcome = True, Outcome.ERROR
                        return web.Response(
                            status=answer.status,
                            body=await answer.read(),
                            content_type=answer.content_type,
                        )
                    if not call.stream:
                        return await self._whole(answer, progress)
                    return await self._stream(request, answer, call, progress)
                except BaseException:
                    answer.close()  # the client left: the upstream drops the request
                    raise
        finally:
            upstream.in_flight -= 1
            # In a task of its own: the answer goes out while the lease ends (a store
            # call the client need not wait for), and a client that leaves cancels
            # this handler, not the settlement.
            settling = asyncio.get_running_loop().create_task(
                self._settle(call, lease_id, progress)
            )
            self._settling.add(settling)
            settling.add_done_callback(self._settling.discard)

    async def _whole(self, answer: aiohttp.ClientResponse, progress: _Progress) -> web.Response:
        raw = await answer.read()
        progress.last_token_at = time.monotonic()
        try:
            progress.usage = Usage.parse(json.loads(raw).get("usage"))
        except (ValueError, AttributeError):
            progress.usage = None
        progress.outcome = Outcome.OK
        return web.Response(status=200, body=raw, content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        answer: aiohttp.ClientResponse,
        call: _Call,
        progress: _Progress,
    ) -> web.StreamResponse:
        """Relays the server-sent events as they come (a slow client slows the reads
        from the upstream: backpressure both ways), minus the usage chunk the client
        did not ask for."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        async for line in answer.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    chunk = None
                if isinstance(chunk, dict):
                    if _is_usage_chunk(chunk):
                        progress.usage = Usage.parse(chunk.get("usage"))
                        if not call.wants_usage:
                            continue
                    elif _has_content(chunk):
                        now = time.monotonic()
                        if progress.first_token_at is None:
                            progress.first_token_at = now
                        progress.last_token_at = now
                        progress.chunks += 1
            await response.write(line)
        await response.write_eof()
        progress.outcome = Outcome.OK
        return response

    # -- settlement and reports -----------------------------------------------------

    async def settled(self) -> None:
        """Waits for the leases of answered requests to end (on shutdown)."""
        while self._settling:
            await asyncio.gather(*self._settling, return_exceptions=True)

    async def _settle(self, call: _Call, lease_id: str, progress: _Progress) -> None:
        """Ends the lease and records the request's latencies."""
        usage = progress.usage
        if progress.used_nothing:
            input_tokens, output_tokens = 0, 0
        elif usage is not None:
            input_tokens, output_tokens = usage.prompt_tokens, usage.completion_tokens
            self.estimator.learn(call.model, call.qos_class, call.prompt_bytes, usage)
        else:  # the stream broke: what was streamed, the prompt as estimated
            input_tokens, output_tokens = call.input_tokens, progress.chunks
        if lease_id:
            try:
                await self._admission.release(
                    lease_id, input_tokens, output_tokens, progress.outcome
                )
            except (LeaseNotFound, LeaseExpired, StoreUnavailable, InvalidArgument) as exc:
                log.warning("lease %s not settled: %s", lease_id, exc)
        if not progress.used_nothing:
            self._record(call, progress, output_tokens)

    def _record(self, call: _Call, progress: _Progress, output_tokens: int) -> None:
        """A latency sample for the SLO loop, measured at the proxy from the moment
        the request went upstream (the wait in qosd is on /metrics, not in it)."""
        end = progress.last_token_at
        if end is None:
            return
        ttft_ms = tpot_ms = None
        if progress.first_token_at is not None:
            ttft_ms = (progress.first_token_at - progress.sent_at) * 1000
            if output_tokens > 1:
                tpot_ms = (end - progress.first_token_at) * 1000 / (output_tokens - 1)
        status = progress.outcome if progress.outcome is not Outcome.UNSPECIFIED else Outcome.OK
        try:
            sample = self._admission.sample(
                model=call.model,
                qos_class=call.qos_class,
                tenant=call.tenant,
                ttft_ms=ttft_ms,
                tpot_ms=tpot_ms,
                e2e_ms=(end - progress.sent_at) * 1000,
                input_tokens=progress.usage.prompt_tokens if progress.usage else call.input_tokens,
                output_tokens=output_tokens,
                status=status,
                slo_ttft_ms=call.slo_ttft_ms,
                slo_tpot_ms=call.slo_tpot_ms,
            )
        except InvalidArgument as exc:
            log.warning("latency sample dropped: %s", exc)
            return
        self._samples.append(sample)

    async def flush_samples(self) -> None:
        """Reports the samples gathered since the last flush, in one batch."""
        samples, self._samples = self._samples, []
        if samples:
            try:
                await self._admission.report(samples)
            except StoreUnavailable as exc:
                log.warning("%d latency samples not stored: %s", len(samples), exc)

    async def report_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.flush_samples()


def _is_usage_chunk(chunk: dict[str, Any]) -> bool:
    return chunk.get("choices") == [] and isinstance(chunk.get("usage"), dict)


def _has_content(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
        if choice.get("text"):
            return True
    return False


def _read_load(upstream: Upstream, answer: aiohttp.ClientResponse) -> None:
    """vLLM's ORCA header (``TEXT named_metrics.num_requests_waiting=N, ...``), when
    the upstream sent one: the server's own queue, for picking among servers."""
    value = answer.headers.get(LOAD_HEADER, "")
    if not value.startswith("TEXT "):
        return
    for item in value[5:].split(","):
        name, _, number = item.strip().partition("=")
        if name == "named_metrics.num_requests_waiting":
            with contextlib.suppress(ValueError):
                upstream.waiting = float(number)


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
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0 < value <= MAX_LATENCY_MS):
            raise OpenAIError(
                400,
                f"{name}: must be a number of milliseconds above 0 and at most "
                f"{MAX_LATENCY_MS:.0f} (got {text!r})",
                name,
            )
        return value
    return None


def _header_for(message: str) -> str | None:
    """The request field an admission error names, in the proxy's terms."""
    field_name = message.split(" ", 1)[0].rstrip(":")
    return {
        "slo_ttft_ms": TTFT_HEADERS[0],
        "slo_tpot_ms": TPOT_HEADERS[0],
        "tenant": TENANT_HEADER,
        "qos_class": CLASS_HEADER,
        "input_tokens": "messages",
        "expected_output_tokens": "max_tokens",
    }.get(field_name, field_name or None)


def key_digest(key: str) -> str:
    """How an API key is known: its SHA-256, so the key itself is kept nowhere."""
    return hashlib.sha256(key.encode()).hexdigest()
