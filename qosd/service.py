"""The gRPC servicer: maps qosd.v1 messages onto the admission layer and back.

Policy answers are ordinary responses; only requests qosd cannot interpret, unknown
or expired leases, and store outages on Release/Report become error statuses.
"""

from __future__ import annotations

import logging

import grpc

from qosd.admission import Admission, InvalidArgument
from qosd.model import LeaseExpired, LeaseNotFound, Outcome, Sample, StoreUnavailable
from qosd.v1 import qosd_pb2, qosd_pb2_grpc

log = logging.getLogger(__name__)

_ADMITTED = qosd_pb2.DECISION_ADMITTED
_REJECTED = qosd_pb2.DECISION_REJECTED


class QoSService(qosd_pb2_grpc.QoSServicer):
    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    async def Acquire(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.AcquireRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.AcquireResponse:
        try:
            outcome = await self._admission.acquire(
                request_id=request.request_id,
                tenant=request.tenant,
                model=request.model,
                qos_class=request.qos_class,
                input_tokens=request.input_tokens,
                expected_output_tokens=request.expected_output_tokens,
                max_wait_ms=request.max_wait_ms if request.HasField("max_wait_ms") else None,
                deadline_s=context.time_remaining(),
            )
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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
            replayed=decision.replayed,
            pool=outcome.pool,
            message=outcome.message,
        )

    async def Release(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.ReleaseResponse:
        code, details = grpc.StatusCode.OK, ""
        try:
            settlement = await self._admission.release(
                request.lease_id,
                request.actual_input_tokens if request.HasField("actual_input_tokens") else None,
                request.actual_output_tokens if request.HasField("actual_output_tokens") else None,
                Outcome(request.outcome),
            )
        except InvalidArgument as exc:
            code, details = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except LeaseNotFound as exc:
            code, details = grpc.StatusCode.NOT_FOUND, str(exc)
        except LeaseExpired as exc:
            code, details = grpc.StatusCode.FAILED_PRECONDITION, str(exc)
        except StoreUnavailable as exc:
            code, details = grpc.StatusCode.UNAVAILABLE, f"release not recorded: {exc}; retry"
        except ValueError as exc:  # an Outcome value this version does not know
            code, details = grpc.StatusCode.INVALID_ARGUMENT, f"outcome: {exc}"
        if code is not grpc.StatusCode.OK:
            await context.abort(code, details)
        return qosd_pb2.ReleaseResponse(
            already_released=settlement.already_released,
            tokens_charged=settlement.charged,
            adjustment=settlement.adjustment,
            remaining_tokens=settlement.remaining,
        )

    async def Report(  # noqa: N802 - gRPC method name
        self, request: qosd_pb2.ReportRequest, context: grpc.aio.ServicerContext
    ) -> qosd_pb2.ReportResponse:
        admission = self._admission
        try:
            admission.check_report_size(len(request.samples))
        except InvalidArgument as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        accepted: list[Sample] = []
        rejected: list[qosd_pb2.RejectedSample] = []
        for index, item in enumerate(request.samples):
            try:
                accepted.append(
                    admission.sample(
                        model=item.model,
                        qos_class=item.qos_class,
                        tenant=item.tenant,
                        ttft_ms=item.ttft_ms if item.HasField("ttft_ms") else None,
                        tpot_ms=item.tpot_ms if item.HasField("tpot_ms") else None,
                        e2e_ms=item.e2e_ms if item.HasField("e2e_ms") else None,
                        input_tokens=item.input_tokens,
                        output_tokens=item.output_tokens,
                        status=Outcome(item.status),
                    )
                )
            except (InvalidArgument, ValueError) as exc:
                rejected.append(qosd_pb2.RejectedSample(index=index, reason=str(exc)))
        try:
            await admission.report(accepted)
        except StoreUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"samples not stored: {exc}; retry")
        return qosd_pb2.ReportResponse(accepted=len(accepted), rejected=rejected)
