"""Typed results and exceptions of the qosd client, free of protobuf types."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Reason(enum.IntEnum):
    """Why an Acquire was answered as it was (mirrors qosd.v1.Reason)."""

    NONE = 0
    RATE_LIMITED = 1
    COST_EXCEEDS_BURST = 2
    QUEUE_TIMEOUT = 3
    BACKEND_UNAVAILABLE = 4
    QUEUE_FULL = 5
    FAIL_OPEN = 6
    SHUTTING_DOWN = 7
    LONG_PREFILL = 8
    DEADLINE = 9


class Outcome(enum.IntEnum):
    """How a request ended (mirrors qosd.v1.Outcome)."""

    UNSPECIFIED = 0
    OK = 1
    ERROR = 2
    CANCELLED = 3


@dataclass(frozen=True, slots=True)
class AcquireResult:
    admitted: bool
    reason: Reason
    lease_id: str
    tokens_charged: float
    remaining_tokens: float
    retry_after_s: float
    waited_s: float
    lease_ttl_s: float
    replayed: bool
    pool: str
    message: str
    #: Pass to a server that schedules by priority (vLLM ``priority``): lower first.
    server_priority: int = 0


@dataclass(frozen=True, slots=True)
class ReleaseResult:
    already_released: bool
    tokens_charged: float
    adjustment: float
    remaining_tokens: float


@dataclass(frozen=True, slots=True)
class LatencySample:
    """One measured request, for ``report``. Leave a latency None if not measured."""

    model: str
    qos_class: str
    tenant: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    status: Outcome = Outcome.OK
    lease_id: str = ""
    # W3C traceparent of the request reported; LatencyReporter.record fills it from
    # the current span when empty. qosd then shows these latencies in that trace.
    traceparent: str = ""
    # The objectives the request ran under when it stated its own (acquire's
    # slo_ttft_ms / slo_tpot_ms, forwarded to the model server), ms; None: its
    # class's, which qosd scales with input_tokens.
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """One model server's own gauges at one read, for ``report(loads=...)``: the
    requests it holds waiting (Triton's nv_inference_pending_request_count, vLLM's
    vllm:num_requests_waiting) and the share of its KV cache in use (vLLM's
    vllm:kv_cache_usage_perc); None: not known. ``server`` names the instance: qosd
    keeps each one's latest read. ``passes``: what its passes carried since its
    previous read, where its metrics count them."""

    model: str
    server: str
    waiting_requests: int | None = None
    kv_cache_usage: float | None = None
    passes: PassStats | None = None


@dataclass(frozen=True, slots=True)
class PassStats:
    """What one server's engine passes carried and took between two reads of its
    metrics (``ServerLoad.passes``; ``qosd_client.server_load``): passes run, prompt
    tokens whose prefill they finished, tokens generated, and the mean time between a
    stream's tokens, ms. The SLO loop's leader learns the decode step from them."""

    passes: int
    prefill_tokens: int
    decode_tokens: int
    step_ms: float


@dataclass(frozen=True, slots=True)
class ReportResult:
    accepted: int
    rejected: tuple[tuple[int, str], ...]
    loads_accepted: int = 0
    loads_rejected: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Percentiles:
    p50_ms: float
    p95_ms: float
    p99_ms: float


@dataclass(frozen=True, slots=True)
class LatencyState:
    """A class's latency window (see qosd.v1.LatencyStatus)."""

    samples: int
    compliance: float | None  # None: no objectives, or no samples
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    slo_e2e_ms: float | None
    ttft: Percentiles | None
    tpot: Percentiles | None
    e2e: Percentiles | None
    # The 95th percentile of each sample's worst latency over its objective (what the
    # SLO loop grows and cuts by); None: nothing measured against an objective.
    tail_pressure: float | None = None


@dataclass(frozen=True, slots=True)
class TenantState:
    """One tenant of a class that shares by tokens, as GetStatus saw it (see
    qosd.v1.TenantStatus)."""

    name: str
    weight: float
    live: bool  # False once idle: no counter kept
    counter: float  # tokens charged per unit of weight; 0 when not live
    served_tokens: float  # prompt plus output tokens admitted while live
    waiting: int


@dataclass(frozen=True, slots=True)
class ClassState:
    """One class in one pool, as GetStatus saw it (see qosd.v1.ClassStatus)."""

    name: str
    priority: int
    rate_tokens_s: float  # at the pool's admitted rate now
    burst_tokens: float
    tokens: float
    waiting: int
    oldest_wait_s: float  # the worst current wait
    waiting_here: int
    max_wait_s: float
    max_queue: int
    can_borrow: bool
    configured_rate_tokens_s: float
    latency: LatencyState
    in_flight: int = 0  # leases admitted, neither released nor expired (fleet-wide)
    in_flight_tokens: float = 0.0  # their prompt plus expected output tokens (KV)
    fairness: str = "fifo"  # how its waiters take turns: "fifo" or "vtc"
    tenants: tuple[TenantState, ...] = ()  # those asked for, in a "vtc" class

    def tenant(self, name: str) -> TenantState:
        """The tenant ``name`` (asked for in the status call); KeyError if absent."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class RateChange:
    """One change of a pool's admitted rate (see qosd.v1.Adjustment)."""

    at_ms: int  # store time
    from_tokens_s: float
    to_tokens_s: float
    reason: str
    by: str
    age_s: float  # how long before the status was read


@dataclass(frozen=True, slots=True)
class PoolState:
    name: str
    capacity_tokens_s: float  # configured
    shared_tokens: float
    shared_burst_tokens: float
    classes: tuple[ClassState, ...]
    admitted_rate_tokens_s: float  # set by the SLO loop or a pin
    pinned: bool
    last_change: RateChange | None
    history: tuple[RateChange, ...]
    verdict: str  # the SLO loop's latest, when the answering daemon leads it
    min_rate_tokens_s: float
    max_rate_tokens_s: float
    active_leases: int = 0  # neither released nor expired
    long_prefill_tokens: float = 0.0  # longer prompts wait for a gap in P0 traffic; 0: none
    # What the pool's servers last said of their load, while fresh; None: not known.
    server_waiting_requests: int | None = None
    server_kv_cache_usage: float | None = None

    def cls(self, name: str) -> ClassState:
        return next(c for c in self.classes if c.name == name)


@dataclass(frozen=True, slots=True)
class Status:
    pools: tuple[PoolState, ...]
    daemon_id: str
    store: str
    controller: str  # the daemon running the SLO loop, as the answering daemon saw it

    def pool(self, name: str) -> PoolState:
        return next(p for p in self.pools if p.name == name)


class QosdError(Exception):
    """Base of every error the client raises."""


class Rejected(QosdError):
    """Raised by ``lease()`` when qosd does not admit the request."""

    def __init__(self, result: AcquireResult) -> None:
        super().__init__(
            f"not admitted: {result.reason.name}"
            + (f", retry after {result.retry_after_s:.3f}s" if result.retry_after_s else "")
            + (f" ({result.message})" if result.message else "")
        )
        self.result = result

    @property
    def reason(self) -> Reason:
        return self.result.reason

    @property
    def retry_after_s(self) -> float:
        return self.result.retry_after_s


class InvalidRequest(QosdError):
    """qosd could not interpret the request (gRPC INVALID_ARGUMENT)."""


class NotFound(QosdError):
    """NOT_FOUND: the lease, or (from the admin calls) the pool, is unknown."""


class LeaseNotFound(NotFound):
    """The lease is unknown to qosd (gRPC NOT_FOUND)."""


class LeaseExpired(QosdError):
    """The lease expired before Release; its estimate stood (gRPC FAILED_PRECONDITION)."""


class DuplicateRequestId(QosdError):
    """The request id names another request, admitted or waiting, or a lease that
    ended (gRPC ALREADY_EXISTS): a request id names one lease while it lives, and a
    released one admits nothing until the lease's TTL. Give each request its own."""


class Unavailable(QosdError):
    """qosd or its store could not be reached (gRPC UNAVAILABLE); safe to retry."""


class DeadlineExceeded(QosdError):
    """The call's deadline passed before qosd answered."""


class Unauthenticated(QosdError):
    """The daemon wants credentials this client did not send (gRPC UNAUTHENTICATED):
    a bearer token (``token_file``) or a client certificate (``ClientTls``)."""


class PermissionDenied(QosdError):
    """The credentials are not allowed this call (gRPC PERMISSION_DENIED), or it is a
    control call on a listener that serves none without ``auth.control``."""


class SampleSink(Protocol):
    """Where samples go: ``LatencyReporter``, ``ThreadedLatencyReporter``, or a list's
    wrapper in a test. ``record`` must never block or raise."""

    def record(self, sample: LatencySample) -> None: ...
