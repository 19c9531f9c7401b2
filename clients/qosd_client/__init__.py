"""Python client for the qosd admission daemon.

async with QosdClient("127.0.0.1:50051") as qos:
    async with qos.lease("P1", input_tokens=1200, model="llama-3-8b") as lease:
        reply = await call_model(...)
        lease.set_usage(input_tokens=reply.prompt_tokens, output_tokens=reply.tokens)
"""

from qosd_client.channel import ClientTls
from qosd_client.client import DEFAULT_TARGET, Lease, QosdClient, SyncQosdClient
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
    PassStats,
    Percentiles,
    PermissionDenied,
    PoolState,
    QosdError,
    RateChange,
    Reason,
    Rejected,
    ReleaseResult,
    ReportResult,
    SampleSink,
    ServerLoad,
    Status,
    TenantState,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "DEFAULT_TARGET",
    "AcquireResult",
    "ClassState",
    "ClientTls",
    "DeadlineExceeded",
    "DuplicateRequestId",
    "InvalidRequest",
    "LatencySample",
    "LatencyState",
    "Lease",
    "LeaseExpired",
    "LeaseNotFound",
    "NotFound",
    "Outcome",
    "PassStats",
    "Percentiles",
    "PermissionDenied",
    "PoolState",
    "QosdClient",
    "QosdError",
    "RateChange",
    "Reason",
    "Rejected",
    "ReleaseResult",
    "ReportResult",
    "SampleSink",
    "ServerLoad",
    "Status",
    "SyncQosdClient",
    "TenantState",
    "Unauthenticated",
    "Unavailable",
]
