"""Conversions shared by the async and sync clients: requests out, results and errors in."""

from __future__ import annotations

import grpc

from qosd_client.types import (
    AcquireResult,
    ClassState,
    DeadlineExceeded,
    DuplicateRequestId,
    InvalidRequest,
    LatencySample,
    LatencyState,
    LeaseExpired,
    LeaseNotFound,
    NotFound,
    Outcome,
    Percentiles,
    PermissionDenied,
    PoolState,
    QosdError,
    RateChange,
    Reason,
    ReleaseResult,
    ReportResult,
    ServerLoad,
    Status,
    TenantState,
    Unauthenticated,
    Unavailable,
)
from qosd_client.v1 import qosd_pb2

_ERRORS: dict[grpc.StatusCode, type[QosdError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: LeaseNotFound,
    grpc.StatusCode.FAILED_PRECONDITION: LeaseExpired,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequestId,
}

# How much longer than the requested max wait a client waits for the answer.
ANSWER_MARGIN_S = 1.0


def acquire_request(
    *,
    qos_class: str,
    input_tokens: int,
    model: str,
    expected_output_tokens: int,
    tenant: str,
    request_id: str,
    max_wait_ms: int | None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> qosd_pb2.AcquireRequest:
    request = qosd_pb2.AcquireRequest(
        request_id=request_id,
        tenant=tenant,
        model=model,
        qos_class=qos_class,
        input_tokens=input_tokens,
        expected_output_tokens=expected_output_tokens,
    )
    if max_wait_ms is not None:
        request.max_wait_ms = max_wait_ms
    if slo_ttft_ms is not None:
        request.slo_ttft_ms = slo_ttft_ms
    if slo_tpot_ms is not None:
        request.slo_tpot_ms = slo_tpot_ms
    return request


def acquire_timeout(default_s: float, max_wait_ms: int | None, timeout_s: float | None) -> float:
    """An Acquire's deadline: the call's own, else the client's default, stretched to
    cover a longer ``max_wait_ms`` and the answer after it. Never shorter than the
    default: a wait of 0 still needs the time a busy daemon takes to answer."""
    if timeout_s is not None:
        return timeout_s
    if max_wait_ms is not None:
        return max(default_s, max_wait_ms / 1000 + ANSWER_MARGIN_S)
    return default_s


def acquire_result(response: qosd_pb2.AcquireResponse) -> AcquireResult:
    return AcquireResult(
        admitted=response.decision == qosd_pb2.DECISION_ADMITTED,
        reason=Reason(response.reason),
        lease_id=response.lease_id,
        tokens_charged=response.tokens_charged,
        remaining_tokens=response.remaining_tokens,
        retry_after_s=response.retry_after_ms / 1000,
        waited_s=response.waited_ms / 1000,
        lease_ttl_s=response.lease_ttl_ms / 1000,
        replayed=response.replayed,
        pool=response.pool,
        message=response.message,
        server_priority=response.server_priority,
    )


def release_request(
    lease_id: str, input_tokens: int | None, output_tokens: int | None, outcome: Outcome
) -> qosd_pb2.ReleaseRequest:
    request = qosd_pb2.ReleaseRequest(lease_id=lease_id, outcome=int(outcome))  # type: ignore[arg-type]
    if input_tokens is not None:
        request.actual_input_tokens = input_tokens
    if output_tokens is not None:
        request.actual_output_tokens = output_tokens
    return request


def release_result(response: qosd_pb2.ReleaseResponse) -> ReleaseResult:
    return ReleaseResult(
        already_released=response.already_released,
        tokens_charged=response.tokens_charged,
        adjustment=response.adjustment,
        remaining_tokens=response.remaining_tokens,
    )


def report_request(
    samples: list[LatencySample], loads: list[ServerLoad] | None = None
) -> qosd_pb2.ReportRequest:
    request = qosd_pb2.ReportRequest()
    for load in loads or ():
        entry = request.loads.add(model=load.model, server=load.server)
        if load.waiting_requests is not None:
            entry.waiting_requests = load.waiting_requests
        if load.kv_cache_usage is not None:
            entry.kv_cache_usage = load.kv_cache_usage
        if load.passes is not None:
            entry.passes.passes = load.passes.passes
            entry.passes.prefill_tokens = load.passes.prefill_tokens
            entry.passes.decode_tokens = load.passes.decode_tokens
            entry.passes.step_ms = load.passes.step_ms
    for sample in samples:
        item = request.samples.add(
            model=sample.model,
            qos_class=sample.qos_class,
            tenant=sample.tenant,
            input_tokens=sample.input_tokens,
            output_tokens=sample.output_tokens,
            status=int(sample.status),
            lease_id=sample.lease_id,
            traceparent=sample.traceparent,
        )
        if sample.ttft_ms is not None:
            item.ttft_ms = sample.ttft_ms
        if sample.tpot_ms is not None:
            item.tpot_ms = sample.tpot_ms
        if sample.e2e_ms is not None:
            item.e2e_ms = sample.e2e_ms
        if sample.slo_ttft_ms is not None:
            item.slo_ttft_ms = sample.slo_ttft_ms
        if sample.slo_tpot_ms is not None:
            item.slo_tpot_ms = sample.slo_tpot_ms
    return request


def report_result(response: qosd_pb2.ReportResponse) -> ReportResult:
    return ReportResult(
        accepted=response.accepted,
        rejected=tuple((item.index, item.reason) for item in response.rejected),
        loads_accepted=response.loads_accepted,
        loads_rejected=tuple((item.index, item.reason) for item in response.loads_rejected),
    )


def _percentiles(message: qosd_pb2.LatencyStatus, field: str) -> Percentiles | None:
    if not message.HasField(field):  # type: ignore[arg-type]  # one of three fields
        return None
    value: qosd_pb2.Percentiles = getattr(message, field)
    return Percentiles(value.p50, value.p95, value.p99)


def _latency(message: qosd_pb2.LatencyStatus) -> LatencyState:
    return LatencyState(
        samples=message.samples,
        compliance=None if message.compliance < 0 else message.compliance,
        slo_ttft_ms=message.slo_ttft_ms or None,
        slo_tpot_ms=message.slo_tpot_ms or None,
        slo_e2e_ms=message.slo_e2e_ms or None,
        ttft=_percentiles(message, "ttft_ms"),
        tpot=_percentiles(message, "tpot_ms"),
        e2e=_percentiles(message, "e2e_ms"),
        tail_pressure=None if message.tail_pressure < 0 else message.tail_pressure,
    )


def _change(message: qosd_pb2.Adjustment) -> RateChange:
    return RateChange(
        at_ms=message.at_ms,
        from_tokens_s=message.from_tokens_s,
        to_tokens_s=message.to_tokens_s,
        reason=message.reason,
        by=message.by,
        age_s=message.age_ms / 1000,
    )


def pool_state(pool: qosd_pb2.PoolStatus) -> PoolState:
    return PoolState(
        name=pool.name,
        capacity_tokens_s=pool.capacity_tokens_s,
        shared_tokens=pool.shared_tokens,
        shared_burst_tokens=pool.shared_burst_tokens,
        classes=tuple(
            ClassState(
                name=c.name,
                priority=c.priority,
                rate_tokens_s=c.rate_tokens_s,
                burst_tokens=c.burst_tokens,
                tokens=c.tokens,
                waiting=c.waiting,
                oldest_wait_s=c.oldest_wait_ms / 1000,
                waiting_here=c.waiting_here,
                max_wait_s=c.max_wait_ms / 1000,
                max_queue=c.max_queue,
                can_borrow=c.can_borrow,
                configured_rate_tokens_s=c.configured_rate_tokens_s,
                latency=_latency(c.latency),
                in_flight=c.in_flight,
                in_flight_tokens=c.in_flight_tokens,
                fairness=c.fairness or "fifo",
                tenants=tuple(
                    TenantState(
                        name=t.name,
                        weight=t.weight,
                        live=t.live,
                        counter=t.counter,
                        served_tokens=t.served_tokens,
                        waiting=t.waiting,
                    )
                    for t in c.tenants
                ),
            )
            for c in pool.classes
        ),
        admitted_rate_tokens_s=pool.admitted_rate_tokens_s,
        pinned=pool.pinned,
        last_change=_change(pool.last_adjustment) if pool.HasField("last_adjustment") else None,
        history=tuple(_change(item) for item in pool.history),
        verdict=pool.verdict,
        min_rate_tokens_s=pool.min_rate_tokens_s,
        max_rate_tokens_s=pool.max_rate_tokens_s,
        active_leases=pool.active_leases,
        long_prefill_tokens=pool.long_prefill_tokens,
        server_waiting_requests=(
            None if pool.server_waiting_requests < 0 else pool.server_waiting_requests
        ),
        server_kv_cache_usage=None
        if pool.server_kv_cache_usage < 0
        else pool.server_kv_cache_usage,
    )


def status_result(response: qosd_pb2.GetStatusResponse) -> Status:
    return Status(
        pools=tuple(pool_state(pool) for pool in response.pools),
        daemon_id=response.daemon_id,
        store=response.store,
        controller=response.controller,
    )


# -- status out: the daemon's side of the same mapping ------------------------------
# The daemon builds its status as these dataclasses (qosd/status.py) and answers
# GetStatus with status_message; status_result above reads it back. Kept here, beside
# its inverse, so that one file holds the mapping both ways (tests/test_status.py
# checks that a round trip is the identity).


def _percentiles_message(value: Percentiles | None) -> qosd_pb2.Percentiles | None:
    if value is None:
        return None
    return qosd_pb2.Percentiles(p50=value.p50_ms, p95=value.p95_ms, p99=value.p99_ms)


def _latency_message(latency: LatencyState) -> qosd_pb2.LatencyStatus:
    return qosd_pb2.LatencyStatus(
        samples=latency.samples,
        compliance=-1.0 if latency.compliance is None else latency.compliance,
        slo_ttft_ms=latency.slo_ttft_ms or 0.0,
        slo_tpot_ms=latency.slo_tpot_ms or 0.0,
        slo_e2e_ms=latency.slo_e2e_ms or 0.0,
        ttft_ms=_percentiles_message(latency.ttft),
        tpot_ms=_percentiles_message(latency.tpot),
        e2e_ms=_percentiles_message(latency.e2e),
        tail_pressure=-1.0 if latency.tail_pressure is None else latency.tail_pressure,
    )


def _change_message(change: RateChange) -> qosd_pb2.Adjustment:
    return qosd_pb2.Adjustment(
        at_ms=change.at_ms,
        from_tokens_s=change.from_tokens_s,
        to_tokens_s=change.to_tokens_s,
        reason=change.reason,
        by=change.by,
        age_ms=round(change.age_s * 1000),
    )


def pool_message(pool: PoolState) -> qosd_pb2.PoolStatus:
    return qosd_pb2.PoolStatus(
        name=pool.name,
        capacity_tokens_s=pool.capacity_tokens_s,
        shared_tokens=pool.shared_tokens,
        shared_burst_tokens=pool.shared_burst_tokens,
        classes=[
            qosd_pb2.ClassStatus(
                name=c.name,
                priority=c.priority,
                rate_tokens_s=c.rate_tokens_s,
                burst_tokens=c.burst_tokens,
                tokens=c.tokens,
                waiting=c.waiting,
                oldest_wait_ms=round(c.oldest_wait_s * 1000),
                waiting_here=c.waiting_here,
                max_wait_ms=round(c.max_wait_s * 1000),
                max_queue=c.max_queue,
                can_borrow=c.can_borrow,
                configured_rate_tokens_s=c.configured_rate_tokens_s,
                latency=_latency_message(c.latency),
                in_flight=c.in_flight,
                in_flight_tokens=c.in_flight_tokens,
                fairness=c.fairness,
                tenants=[
                    qosd_pb2.TenantStatus(
                        name=t.name,
                        weight=t.weight,
                        live=t.live,
                        counter=t.counter,
                        served_tokens=t.served_tokens,
                        waiting=t.waiting,
                    )
                    for t in c.tenants
                ],
            )
            for c in pool.classes
        ],
        admitted_rate_tokens_s=pool.admitted_rate_tokens_s,
        pinned=pool.pinned,
        last_adjustment=None if pool.last_change is None else _change_message(pool.last_change),
        history=[_change_message(change) for change in pool.history],
        verdict=pool.verdict,
        min_rate_tokens_s=pool.min_rate_tokens_s,
        max_rate_tokens_s=pool.max_rate_tokens_s,
        active_leases=pool.active_leases,
        long_prefill_tokens=pool.long_prefill_tokens,
        server_waiting_requests=(
            -1 if pool.server_waiting_requests is None else pool.server_waiting_requests
        ),
        server_kv_cache_usage=(
            -1.0 if pool.server_kv_cache_usage is None else pool.server_kv_cache_usage
        ),
    )


def status_message(status: Status) -> qosd_pb2.GetStatusResponse:
    return qosd_pb2.GetStatusResponse(
        pools=[pool_message(pool) for pool in status.pools],
        daemon_id=status.daemon_id,
        store=status.store,
        controller=status.controller,
    )


def translate(error: grpc.RpcError, *, admin: bool = False) -> QosdError:
    """Turns a gRPC error into the client's typed exception. From the admin calls,
    NOT_FOUND names a pool, not a lease."""
    code = error.code()
    details = error.details() or code.name
    if admin and code == grpc.StatusCode.NOT_FOUND:
        return NotFound(f"{code.name}: {details}")
    return _ERRORS.get(code, QosdError)(f"{code.name}: {details}")
