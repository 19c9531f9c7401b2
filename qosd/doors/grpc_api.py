"""The gRPC door: maps qosd.v1 messages onto admission and back.

Each call builds its request by the one set of rules (``qosd.doors.request``) and
goes through ``qosd.doors.decisions``. Policy answers are ordinary responses; only
requests qosd cannot interpret (INVALID_ARGUMENT), a request id already in use
(ALREADY_EXISTS), unknown or expired leases, and store outages on Release/Report
become error statuses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from opentelemetry import trace
from opentelemetry.trace import Tracer

from qosd import tracing
from qosd.admission import DuplicateRequest
from qosd.config import Config
from qosd.control.leader import Controller
from qosd.control.windows import verdict
from qosd.doors.auth import Authorizer, Group
from qosd.doors.decisions import Decisions
from qosd.doors.dialects import REQUEST_HEADERS, given_once
from qosd.doors.envoy_rls import ENVOY_SERVICE, MIRROR_SERVICE, EnvoyRateLimitService
from qosd.doors.request import InvalidArgument, RequestRules
from qosd.metrics import Metrics
from qosd.model import (
    LeaseExpired,
    LeaseNotFound,
    Outcome,
    PassStats,
    Sample,
    ServerLoad,
    StoreUnavailable,
)
from qosd.policy import PoolPolicy
from qosd.status import MAX_HISTORY, MAX_STATUS_TENANTS, StatusService
from qosd.v1 import envoy_rls_pb2

# The client's own mapping of status to protobuf, beside its inverse (one definition).
from qosd_client._convert import pool_message, status_message
from qosd_client.v1 import qosd_pb2, qosd_pb2_grpc

log = logging.getLogger(__name__)

_ADMITTED = qosd_pb2.DECISION_ADMITTED
_REJECTED = qosd_pb2.DECISION_REJECTED


class QoSService(qosd_pb2_grpc.QoSServicer):
    def __init__(self, decisions: Decisions, tracer: Tracer | None = None) -> None:
        self._decisions = decisions
        self._metrics = decisions.metrics
        # None: tracing off. The RPC's span itself comes from tracing.traced_handler
        # (see add_to_server); the servicer adds what it decided.
        self._tracer = tracer

    async def Acquire(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.AcquireResponse:
        span = tracing.recording_span() if self._tracer is not None else None
        if span is not None:
            tracing.annotate_acquire_request(span, request)
        decisions = self._decisions
        qos_class, tenant = request.qos_class, request.tenant
        try:
            if not qos_class or not tenant:  # the peers' headers, as metadata
                qos_class, tenant = _peer_identity(decisions, qos_class, tenant, context)
            admission_request = decisions.rules.acquire(
                request_id=request.request_id,
                tenant=tenant,
                model=request.model,
                qos_class=qos_class,
                input_tokens=request.input_tokens,
                expected_output_tokens=request.expected_output_tokens,
                max_wait_ms=request.max_wait_ms if request.HasField("max_wait_ms") else None,
                deadline_s=context.time_remaining(),
                slo_ttft_ms=request.slo_ttft_ms if request.HasField("slo_ttft_ms") else None,
                slo_tpot_ms=request.slo_tpot_ms if request.HasField("slo_tpot_ms") else None,
            )
        except InvalidArgument as exc:
            decisions.invalid("Acquire", exc, span)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            outcome = await decisions.acquire(admission_request)
        except DuplicateRequest as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        decision = outcome.decision
        return qosd_pb2.AcquireResponse(
            decision=_ADMITTED if decision.admitted else _REJECTED,
            reason=decision.reason,  # type: ignore[arg-type]  # same values as the wire enum
            lease_id=decision.lease_id,
            tokens_charged=decision.charged,
            remaining_tokens=decision.remaining,
            retry_after_ms=decision.retry_after_ms,
            waited_ms=outcome.waited_ms,
            lease_ttl_ms=decision.lease_ttl_ms,
            pool=outcome.pool,
            message=outcome.message,
            server_priority=outcome.server_priority,
        )

    async def Release(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.ReleaseResponse:
        span = tracing.recording_span() if self._tracer is not None else None
        if span is not None:
            tracing.annotate_release_request(span, request)
        decisions = self._decisions
        code, details = grpc.StatusCode.OK, ""
        try:
            outcome = Outcome(request.outcome) or Outcome.OK  # UNSPECIFIED means OK
            release = decisions.rules.release(
                request.lease_id,
                request.actual_input_tokens if request.HasField("actual_input_tokens") else None,
                request.actual_output_tokens if request.HasField("actual_output_tokens") else None,
                outcome,
            )
        except ValueError as exc:  # InvalidArgument, or an Outcome this version does not know
            code = grpc.StatusCode.INVALID_ARGUMENT
            details = str(exc) if isinstance(exc, InvalidArgument) else f"outcome: {exc}"
        except LeaseNotFound as exc:  # its pool or class is not configured
            code, details = grpc.StatusCode.NOT_FOUND, str(exc)
        if code is not grpc.StatusCode.OK:
            decisions.count_release(request.outcome or Outcome.OK, code.name)
        else:
            try:
                settlement = await decisions.release(release)
            except LeaseNotFound as exc:
                code, details = grpc.StatusCode.NOT_FOUND, str(exc)
            except LeaseExpired as exc:
                code, details = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
            except StoreUnavailable as exc:
                code = grpc.StatusCode.UNAVAILABLE
                details = (
                    f"release not recorded yet: {exc}; qosd retries it until the lease's "
                    "TTL, and a retry of yours is harmless"
                )
        if code is not grpc.StatusCode.OK:
            if span is not None:
                span.set_attribute("qosd.error", details)
            await context.abort(code, details)
        if span is not None:
            tracing.annotate_release(span, settlement)
        return qosd_pb2.ReleaseResponse(
            already_released=settlement.already_released,
            tokens_charged=settlement.charged,
            adjustment=settlement.adjustment,
            remaining_tokens=settlement.remaining,
        )

    async def Report(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.ReportRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.ReportResponse:
        admission = self._decisions.admission
        # One config for the whole call: the samples are judged by the classes they
        # were validated against, whatever a reload changes while they are stored.
        rules = self._decisions.rules
        try:
            rules.report_size(len(request.samples), len(request.loads))
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        accepted: list[Sample] = []
        rejected: list[qosd_pb2.RejectedSample] = []
        traced: list[tuple[qosd_pb2.LatencySample, Sample]] = []
        for index, item in enumerate(request.samples):
            try:
                accepted.append(
                    rules.sample(
                        model=item.model,
                        qos_class=item.qos_class,
                        tenant=item.tenant,
                        ttft_ms=item.ttft_ms if item.HasField("ttft_ms") else None,
                        tpot_ms=item.tpot_ms if item.HasField("tpot_ms") else None,
                        e2e_ms=item.e2e_ms if item.HasField("e2e_ms") else None,
                        input_tokens=item.input_tokens,
                        output_tokens=item.output_tokens,
                        status=_sample_status(item.status),
                        slo_ttft_ms=item.slo_ttft_ms if item.HasField("slo_ttft_ms") else None,
                        slo_tpot_ms=item.slo_tpot_ms if item.HasField("slo_tpot_ms") else None,
                        lease_id=item.lease_id,
                        traceparent=item.traceparent,
                    )
                )
            except InvalidArgument as exc:
                rejected.append(qosd_pb2.RejectedSample(index=index, reason=str(exc)))
            else:
                if item.traceparent:
                    traced.append((item, accepted[-1]))
        loads, loads_rejected = _server_loads(rules, request.loads)
        try:
            await admission.report(accepted)
            await admission.report_loads(loads)
        except StoreUnavailable as exc:
            self._metrics.report_samples.labels("unavailable").inc(len(request.samples))
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"samples not stored: {exc}; retry")
        self._metrics.report_samples.labels("accepted").inc(len(accepted))
        judge_samples(self._metrics, rules.config, accepted)
        self._metrics.report_samples.labels("rejected").inc(len(rejected))
        if self._tracer is not None:
            span = trace.get_current_span()
            if span.is_recording():
                span.set_attributes(
                    {"qosd.samples_accepted": len(accepted),
                     "qosd.samples_rejected": len(rejected)}
                )  # fmt: skip
            if traced:  # each sample's own trace decides whether it is sampled
                tracing.sample_spans(self._tracer, span, traced)
        return qosd_pb2.ReportResponse(
            accepted=len(accepted),
            rejected=rejected,
            loads_accepted=len(loads),
            loads_rejected=loads_rejected,
        )


def judge_samples(metrics: Metrics, config: Config, samples: list[Sample]) -> None:
    """Counts stored samples that met or missed their objectives
    (``qosd_slo_samples_total``), as the windows judge them (``windows.verdict``): the
    burn-rate alerts' SLI. A sample whose class ``config`` lacks (validated under
    another config) has no objective here, and is not judged: counting is no reason
    to fail a call whose samples are stored already."""
    classes = config.classes
    for sample in samples:
        cls = classes.get(sample.qos_class)
        met = verdict(sample, cls.slo) if cls is not None else None
        if met is not None:
            metrics.slo_sample(sample.pool, sample.qos_class, met)


class AdminService(qosd_pb2_grpc.AdminServicer):
    """GetStatus answers what the status service reads; PinRate and UnpinRate go to the
    SLO loop's controller, and answer with the pool's status after."""

    def __init__(self, status: StatusService, controller: Controller) -> None:
        self._status = status
        self._controller = controller

    async def GetStatus(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.GetStatusResponse:
        names = self._status.pool_names()
        if request.pool:
            if request.pool not in names:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND, f"pool {request.pool[:80]!r} is not configured"
                )
            names = [request.pool]
        if not 0 <= request.history <= MAX_HISTORY:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"history must be between 0 and {MAX_HISTORY} (got {request.history})",
            )
        tenants = list(request.tenants)
        if len(tenants) > MAX_STATUS_TENANTS or not all(tenants):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"tenants must name at most {MAX_STATUS_TENANTS} tenants, none of them empty "
                f"(got {len(tenants)})",
            )
        try:
            for tenant in tenants:
                RequestRules.name(tenant, "tenants")
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            return status_message(await self._status.status(names, request.history, tenants))
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store unavailable: {exc}")
            raise  # abort raised already; this tells the type checker

    async def PinRate(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.PinRateRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.PinRateResponse:
        pool = await self._known_pool(request.pool, context)
        rate = request.rate_tokens_s
        if not (math.isfinite(rate) and pool.min_capacity <= rate <= pool.max_capacity):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"rate_tokens_s must lie within the control bounds of pool {pool.name!r}, "
                f"{pool.min_capacity:g} to {pool.max_capacity:g} tokens/s (got {rate:g})",
            )
        return await self._pin(pool, rate, context)

    async def UnpinRate(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.UnpinRateRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.PinRateResponse:
        return await self._pin(await self._known_pool(request.pool, context), None, context)

    async def _known_pool(self, name: str, context: grpc.aio.ServicerContext) -> PoolPolicy:
        names = self._status.pool_names()
        if name not in names:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"pool {name[:80]!r} is not configured (pools: {', '.join(names)})",
            )
        return self._status.policy(name)

    async def _pin(
        self, pool: PoolPolicy, rate: float | None, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.PinRateResponse:
        try:
            await self._controller.pin(pool, rate)
            return qosd_pb2.PinRateResponse(pool=pool_message(await self._status.pool(pool.name)))
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"store unavailable: {exc}; retry")
        raise AssertionError("unreachable")  # abort raises


def _server_loads(
    rules: RequestRules, items: Iterable[qosd_pb2.ServerLoad]
) -> tuple[list[tuple[str, ServerLoad]], list[qosd_pb2.RejectedLoad]]:
    """ReportRequest.loads validated one by one: those to store (with their pool), and
    those rejected, naming the field."""
    loads: list[tuple[str, ServerLoad]] = []
    rejected: list[qosd_pb2.RejectedLoad] = []
    for index, load in enumerate(items):
        try:
            loads.append(
                rules.server_load(
                    model=load.model,
                    server=load.server,
                    waiting=load.waiting_requests if load.HasField("waiting_requests") else None,
                    kv_usage=load.kv_cache_usage if load.HasField("kv_cache_usage") else None,
                    passes=PassStats(
                        load.passes.passes,
                        load.passes.prefill_tokens,
                        load.passes.decode_tokens,
                        load.passes.step_ms,
                    )
                    if load.HasField("passes")
                    else None,
                )
            )
        except InvalidArgument as exc:
            rejected.append(qosd_pb2.RejectedLoad(index=index, reason=str(exc)))
    return loads, rejected


def _peer_identity(
    decisions: Decisions, qos_class: str, tenant: str, context: grpc.aio.ServicerContext
) -> tuple[str, str]:
    """A class or tenant the request left empty, from the peers' headers in its
    metadata (llm-d's, Dynamo's: ``qosd.doors.dialects``); the request's own win."""
    pairs = [(key, value) for key, value in context.invocation_metadata() or ()
             if isinstance(value, str)]  # fmt: skip
    given_once(REQUEST_HEADERS, lambda name: sum(key == name for key, _ in pairs))
    metadata = dict(pairs)
    peers = decisions.peer_headers
    if not qos_class:
        found = peers.qos_class(metadata.get)
        qos_class = found[0] if found else ""
    if not tenant:
        named = peers.tenant(metadata.get)
        tenant = named[0] if named else ""
    return qos_class, tenant


def _sample_status(value: int) -> Outcome:
    try:
        return Outcome(value) or Outcome.OK
    except ValueError:
        raise InvalidArgument("status", f"status {value} is not a known Outcome") from None


Methods = dict[str, tuple[type[Message], Callable[..., Awaitable[Any]]]]


# The group of every method on the shared listeners (qosd/doors/auth.py). Anything new that
# changes shared state belongs in CONTROL.
METHOD_GROUPS: dict[str, Group] = {
    "Acquire": Group.QOS,
    "Release": Group.QOS,
    "Report": Group.QOS,
    "ShouldRateLimit": Group.QOS,
    "GetStatus": Group.QOS,
    "PinRate": Group.CONTROL,
    "UnpinRate": Group.CONTROL,
}


#: A method as a handler of raw request bytes: the chain a call runs through.
RawHandler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]


def add_to_server(
    service: QoSService | None,
    admin: AdminService,
    server: grpc.aio.Server,
    envoy_rls: EnvoyRateLimitService | None = None,
    tracer: Tracer | None = None,
    authorizer: Authorizer | None = None,
) -> dict[str, tuple[type[Message], RawHandler]]:
    """Registers qosd's services so that an undecodable request is INVALID_ARGUMENT.

    The generated registration lets grpc.aio decode requests before any servicer
    code runs, and it answers a malformed message with UNKNOWN. Decoding inside the
    handler instead costs nothing extra and gives the caller a status that says what
    is wrong. With a tracer, each handler also runs in a server span. With an
    authorizer, each call is judged first (``METHOD_GROUPS``); none: every call is
    served (the admin listener). ``service`` None: the Admin service alone.

    Returns each method's request type and handler chain, by method name (``Acquire``,
    ``GetStatus``...): what the JSON API runs, so that its calls are judged, traced
    and validated exactly as gRPC calls are (qosd.doors.json_api).
    """
    chains: dict[str, tuple[type[Message], RawHandler]] = {}

    def register(
        service_name: str,
        methods: Methods,
        names: tuple[str, ...] = (),
        undecodable: Callable[[str], Message] | None = None,
    ) -> None:
        handlers = {}
        for method_name, (message_type, method) in methods.items():
            handler = _decoding(message_type, method, undecodable)
            group = METHOD_GROUPS[method_name]
            if authorizer is not None and authorizer.guards(group):
                handler = _authorized(authorizer, f"{service_name}/{method_name}", group, handler)
            if tracer is not None:
                handler = tracing.traced_handler(tracer, service_name, method_name, handler)
            chains[method_name] = (message_type, handler)
            handlers[method_name] = grpc.unary_unary_rpc_method_handler(
                handler, request_deserializer=None, response_serializer=_serialize
            )
        server.add_generic_rpc_handlers(
            tuple(
                grpc.method_handlers_generic_handler(name, handlers)
                for name in (service_name, *names)
            )
        )

    services = qosd_pb2.DESCRIPTOR.services_by_name
    if service is not None:
        register(
            services["QoS"].full_name,
            {
                "Acquire": (qosd_pb2.AcquireRequest, service.Acquire),
                "Release": (qosd_pb2.ReleaseRequest, service.Release),
                "Report": (qosd_pb2.ReportRequest, service.Report),
            },
        )
    register(
        services["Admin"].full_name,
        {
            "GetStatus": (qosd_pb2.GetStatusRequest, admin.GetStatus),
            "PinRate": (qosd_pb2.PinRateRequest, admin.PinRate),
            "UnpinRate": (qosd_pb2.UnpinRateRequest, admin.UnpinRate),
        },
    )
    if envoy_rls is not None:
        # Envoy's name, which gateways call; and the mirror's, which reflection lists
        # (so grpcurl can call it with no .proto files).
        register(
            ENVOY_SERVICE,
            {"ShouldRateLimit": (envoy_rls_pb2.RateLimitRequest, envoy_rls.ShouldRateLimit)},
            (MIRROR_SERVICE,),
            envoy_rls.undecodable,
        )
    return chains


def _authorized(
    authorizer: Authorizer,
    name: str,
    group: Group,
    handler: Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    async def guarded(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        refusal = authorizer.judge(name, group, context)
        if refusal is not None:
            await context.abort(refusal.code, refusal.message)
        return await handler(raw, context)

    return guarded


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def _decoding(
    message_type: type[Message],
    method: Callable[..., Awaitable[Any]],
    undecodable: Callable[[str], Message] | None = None,
) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Any]]:
    """``method`` on the request decoded; one that does not decode is INVALID_ARGUMENT,
    or ``undecodable``'s answer where an error status would be read as a yes (Envoy's
    rate limit filter lets a request through when its call fails)."""
    parse = message_type.FromString
    full_name = message_type.DESCRIPTOR.full_name

    async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            request = parse(raw)
        except DecodeError as exc:
            message = f"request is not a valid {full_name}: {exc}"
            if undecodable is not None:
                return undecodable(message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        try:
            return await method(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            # A bug, not a policy answer: say so with INTERNAL rather than grpc.aio's
            # UNKNOWN, and keep the traceback in the log.
            log.exception("%s failed", full_name)
            await context.abort(
                grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
            )

    return handler
