"""What follows every decision, whichever door the request came through: one place.

A door builds its request (``qosd.doors.request``) and hands it here. ``acquire``
runs admission, then counts the decision (``qosd_acquire_decisions_total``, the wait,
the tenant's tokens) and sets its trace attributes; ``release`` settles a lease and
counts it (``qosd_releases_total``, by outcome and result); ``invalid`` counts a
request the door could not build.
"""

from __future__ import annotations

from opentelemetry.trace import Span

from qosd import tracing
from qosd.admission import AcquireOutcome, Admission
from qosd.doors.dialects import PeerHeaders
from qosd.doors.request import InvalidArgument, RequestRules
from qosd.metrics import Metrics
from qosd.model import (
    AdmissionRequest,
    LeaseExpired,
    LeaseNotFound,
    Outcome,
    ReleaseRequest,
    Settlement,
    StoreUnavailable,
)

#: A Release's result as counted, by what ended it (gRPC's status names).
_RESULTS: dict[type[Exception], str] = {
    LeaseNotFound: "NOT_FOUND",
    LeaseExpired: "FAILED_PRECONDITION",
    StoreUnavailable: "UNAVAILABLE",
}


class Decisions:
    def __init__(self, admission: Admission, metrics: Metrics, *, traced: bool = False) -> None:
        """``traced``: a tracer is on, so the current span (when it records) gets the
        decision's attributes."""
        self.admission = admission
        self.metrics = metrics
        self._traced = traced
        self._rules = RequestRules(admission.config)
        self._peers = PeerHeaders(admission.config)
        self._peers_config = admission.config

    @property
    def rules(self) -> RequestRules:
        """The rules requests are built by, under the config admission runs now (made
        anew when a reload brought another)."""
        config = self.admission.config
        if self._rules.config is not config:
            self._rules = RequestRules(config)
        return self._rules

    @property
    def peer_headers(self) -> PeerHeaders:
        """The peers' request headers, read as the config now stands."""
        config = self.admission.config
        if self._peers_config is not config:
            self._peers, self._peers_config = PeerHeaders(config), config
        return self._peers

    async def acquire(self, request: AdmissionRequest) -> AcquireOutcome:
        """Admission's answer to ``request``, counted and traced. Raises what
        ``Admission.acquire`` raises (DuplicateRequest)."""
        outcome = await self.admission.acquire(request)
        decision = outcome.decision
        metrics = self.metrics
        metrics.acquire(
            outcome.pool, request.qos_class, decision.admitted, decision.reason, outcome.waited_ms
        )
        if decision.admitted and request.tenant:
            tokens = request.input_tokens + request.expected_output_tokens
            metrics.tenant_admitted(outcome.pool, request.qos_class, request.tenant, tokens)
        if self._traced and (span := tracing.recording_span()) is not None:
            tracing.annotate_acquire(span, outcome)
        return outcome

    def invalid(self, door: str, error: InvalidArgument, span: Span | None = None) -> None:
        """Counts a request ``door`` could not build (``qosd_invalid_requests_total``)."""
        self.metrics.invalid.labels(door).inc()
        if span is not None:  # semconv leaves a caller's mistake UNSET: say what it was
            span.set_attribute("qosd.error", str(error))

    async def release(self, request: ReleaseRequest) -> Settlement:
        """Settles a lease and counts it; raises what ``Admission.release`` raises."""
        try:
            settlement = await self.admission.release(request)
        except (LeaseNotFound, LeaseExpired, StoreUnavailable) as error:
            self.count_release(request.outcome, _RESULTS[type(error)])
            raise
        self.count_release(request.outcome, "OK")
        return settlement

    def count_release(self, outcome: Outcome | int, result: str) -> None:
        """One Release, by the outcome reported and how it ended ("OK", or the gRPC
        status a caller got)."""
        try:
            name = Outcome(outcome).name
        except ValueError:
            name = "UNKNOWN"
        self.metrics.releases.labels(name, result).inc()
