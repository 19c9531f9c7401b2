"""Gateway-side clients for qosd: ``QosdClient`` (asyncio) and ``SyncQosdClient``.

Both wrap one gRPC channel. ``lease()`` is the usual entry point: it acquires,
yields a lease, and releases with the real usage when the block ends, even when it
ends in an exception, so no lease is left to expire by accident.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from qosd_client import _convert
from qosd_client.channel import ClientTls, TokenFile, aio_channel, sync_channel
from qosd_client.tracing import Metadata, trace_metadata
from qosd_client.types import (
    AcquireResult,
    LatencySample,
    Outcome,
    PoolState,
    QosdError,
    Rejected,
    ReleaseResult,
    ReportResult,
    ServerLoad,
    Status,
)
from qosd_client.v1 import qosd_pb2, qosd_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass
class Lease:
    """An admitted request. Record real usage with ``set_usage`` before the block ends."""

    result: AcquireResult
    input_tokens: int | None = None
    output_tokens: int | None = None
    release_result: ReleaseResult | None = field(default=None, init=False)
    release_error: QosdError | None = field(default=None, init=False)

    @property
    def lease_id(self) -> str:
        return self.result.lease_id

    def set_usage(self, input_tokens: int | None = None, output_tokens: int | None = None) -> None:
        if input_tokens is not None:
            self.input_tokens = input_tokens
        if output_tokens is not None:
            self.output_tokens = output_tokens


def call_metadata(token: TokenFile | None) -> Metadata | None:
    """The trace context, and the bearer token when the client has one."""
    traced = trace_metadata()
    if token is None:
        return traced
    return (*(traced or ()), token.header())


def _outcome_of(error: BaseException | None) -> Outcome:
    if error is None:
        return Outcome.OK
    if isinstance(error, asyncio.CancelledError | KeyboardInterrupt | GeneratorExit):
        return Outcome.CANCELLED
    return Outcome.ERROR


class QosdClient:
    """Asyncio client. Use as ``async with QosdClient(target) as qos: ...``."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout_s: float = 5.0,
        channel: grpc.aio.Channel | None = None,
        tls: ClientTls | None = None,
        token_file: str | None = None,
    ) -> None:
        self._channel = channel or aio_channel(target, tls)
        self._token = TokenFile(token_file) if token_file else None
        self._stub = qosd_pb2_grpc.QoSStub(self._channel)
        self._admin = qosd_pb2_grpc.AdminStub(self._channel)
        self._timeout_s = timeout_s

    def _metadata(self) -> Metadata | None:
        return call_metadata(self._token)

    async def __aenter__(self) -> QosdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def acquire(
        self,
        qos_class: str,
        input_tokens: int,
        *,
        model: str = "",
        expected_output_tokens: int = 0,
        tenant: str = "",
        request_id: str = "",
        max_wait_ms: int | None = None,
        timeout_s: float | None = None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> AcquireResult:
        """Asks for admission. Returns the decision; raises only on errors.

        ``slo_ttft_ms`` and ``slo_tpot_ms`` state the request's own objectives (the
        Gateway API Inference Extension's ``x-slo-ttft-ms``, ``x-slo-tpot-ms``), which
        replace its class's; pass them on to the model server so that its report
        carries them (``LatencySample.slo_ttft_ms``)."""
        request = _convert.acquire_request(
            qos_class=qos_class,
            input_tokens=input_tokens,
            model=model,
            expected_output_tokens=expected_output_tokens,
            tenant=tenant,
            request_id=request_id,
            max_wait_ms=max_wait_ms,
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
        )
        timeout = _convert.acquire_timeout(self._timeout_s, max_wait_ms, timeout_s)
        try:
            response = await self._stub.Acquire(request, timeout=timeout, metadata=self._metadata())
        except grpc.RpcError as error:
            raise _convert.translate(error) from error
        return _convert.acquire_result(response)

    async def release(
        self,
        lease_id: str,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        outcome: Outcome = Outcome.OK,
        timeout_s: float | None = None,
    ) -> ReleaseResult:
        request = _convert.release_request(lease_id, input_tokens, output_tokens, outcome)
        try:
            response = await self._stub.Release(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error) from error
        return _convert.release_result(response)

    async def report(
        self,
        samples: Sequence[LatencySample],
        *,
        loads: Sequence[ServerLoad] = (),
        timeout_s: float | None = None,
    ) -> ReportResult:
        """Stores latency samples and, with ``loads``, model servers' own gauges."""
        request = _convert.report_request(list(samples), list(loads))
        try:
            response = await self._stub.Report(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error) from error
        return _convert.report_result(response)

    async def status(
        self,
        pool: str = "",
        *,
        history: int = 0,
        tenants: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> Status:
        """Budgets, waiting rooms and the SLO loop's state now (the Admin service),
        fleet-wide with Redis; ``history`` past rate changes per pool; ``tenants``:
        those to show in each class that shares by tokens."""
        request = qosd_pb2.GetStatusRequest(pool=pool, history=history, tenants=tenants)
        try:
            response = await self._admin.GetStatus(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error, admin=True) from error
        return _convert.status_result(response)

    async def pin_rate(
        self, pool: str, rate_tokens_s: float, *, timeout_s: float | None = None
    ) -> PoolState:
        """Fixes the pool's admitted rate fleet-wide; the SLO loop leaves it alone."""
        request = qosd_pb2.PinRateRequest(pool=pool, rate_tokens_s=rate_tokens_s)
        try:
            response = await self._admin.PinRate(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error, admin=True) from error
        return _convert.pool_state(response.pool)

    async def unpin_rate(self, pool: str, *, timeout_s: float | None = None) -> PoolState:
        """Hands the pool's rate back to the SLO loop."""
        request = qosd_pb2.UnpinRateRequest(pool=pool)
        try:
            response = await self._admin.UnpinRate(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error, admin=True) from error
        return _convert.pool_state(response.pool)

    @asynccontextmanager
    async def lease(
        self, qos_class: str, input_tokens: int, **acquire: Any
    ) -> AsyncIterator[Lease]:
        """Acquires (raising ``Rejected`` when not admitted), yields, then releases.

        Release failures are logged and kept on ``lease.release_error`` rather than
        raised: the request has already run, and an exception from the block, if
        any, is the one that matters to the caller.
        """
        result = await self.acquire(qos_class, input_tokens, **acquire)
        if not result.admitted:
            raise Rejected(result)
        lease = Lease(result)
        error: BaseException | None = None
        try:
            yield lease
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                lease.release_result = await asyncio.shield(
                    self.release(
                        lease.lease_id,
                        input_tokens=lease.input_tokens,
                        output_tokens=lease.output_tokens,
                        outcome=_outcome_of(error),
                    )
                )
            except QosdError as release_error:
                lease.release_error = release_error
                log.warning("qosd release of %s failed: %s", lease.lease_id, release_error)


class SyncQosdClient:
    """Blocking client with the same methods as ``QosdClient``."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout_s: float = 5.0,
        channel: grpc.Channel | None = None,
        tls: ClientTls | None = None,
        token_file: str | None = None,
    ) -> None:
        self._channel = channel or sync_channel(target, tls)
        self._token = TokenFile(token_file) if token_file else None
        self._stub = qosd_pb2_grpc.QoSStub(self._channel)
        self._admin = qosd_pb2_grpc.AdminStub(self._channel)
        self._timeout_s = timeout_s

    def _metadata(self) -> Metadata | None:
        return call_metadata(self._token)

    def __enter__(self) -> SyncQosdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def acquire(
        self,
        qos_class: str,
        input_tokens: int,
        *,
        model: str = "",
        expected_output_tokens: int = 0,
        tenant: str = "",
        request_id: str = "",
        max_wait_ms: int | None = None,
        timeout_s: float | None = None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
    ) -> AcquireResult:
        request = _convert.acquire_request(
            qos_class=qos_class,
            input_tokens=input_tokens,
            model=model,
            expected_output_tokens=expected_output_tokens,
            tenant=tenant,
            request_id=request_id,
            max_wait_ms=max_wait_ms,
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
        )
        timeout = _convert.acquire_timeout(self._timeout_s, max_wait_ms, timeout_s)
        try:
            response = self._stub.Acquire(request, timeout=timeout, metadata=self._metadata())
        except grpc.RpcError as error:
            raise _convert.translate(error) from error
        return _convert.acquire_result(response)

    def release(
        self,
        lease_id: str,
        *,
        input_tokens: int | None = None,
        output_tokens: int | None = None,
        outcome: Outcome = Outcome.OK,
        timeout_s: float | None = None,
    ) -> ReleaseResult:
        request = _convert.release_request(lease_id, input_tokens, output_tokens, outcome)
        try:
            response = self._stub.Release(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error) from error
        return _convert.release_result(response)

    def report(
        self,
        samples: Sequence[LatencySample],
        *,
        loads: Sequence[ServerLoad] = (),
        timeout_s: float | None = None,
    ) -> ReportResult:
        request = _convert.report_request(list(samples), list(loads))
        try:
            response = self._stub.Report(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error) from error
        return _convert.report_result(response)

    def status(
        self,
        pool: str = "",
        *,
        history: int = 0,
        tenants: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> Status:
        request = qosd_pb2.GetStatusRequest(pool=pool, history=history, tenants=tenants)
        try:
            response = self._admin.GetStatus(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error, admin=True) from error
        return _convert.status_result(response)

    def pin_rate(
        self, pool: str, rate_tokens_s: float, *, timeout_s: float | None = None
    ) -> PoolState:
        request = qosd_pb2.PinRateRequest(pool=pool, rate_tokens_s=rate_tokens_s)
        try:
            response = self._admin.PinRate(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error, admin=True) from error
        return _convert.pool_state(response.pool)

    def unpin_rate(self, pool: str, *, timeout_s: float | None = None) -> PoolState:
        request = qosd_pb2.UnpinRateRequest(pool=pool)
        try:
            response = self._admin.UnpinRate(
                request, timeout=timeout_s or self._timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as error:
            raise _convert.translate(error, admin=True) from error
        return _convert.pool_state(response.pool)

    @contextmanager
    def lease(self, qos_class: str, input_tokens: int, **acquire: Any) -> Iterator[Lease]:
        """Blocking twin of ``QosdClient.lease``."""
        result = self.acquire(qos_class, input_tokens, **acquire)
        if not result.admitted:
            raise Rejected(result)
        lease = Lease(result)
        error: BaseException | None = None
        try:
            yield lease
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                lease.release_result = self.release(
                    lease.lease_id,
                    input_tokens=lease.input_tokens,
                    output_tokens=lease.output_tokens,
                    outcome=_outcome_of(error),
                )
            except QosdError as release_error:
                lease.release_error = release_error
                log.warning("qosd release of %s failed: %s", lease.lease_id, release_error)
