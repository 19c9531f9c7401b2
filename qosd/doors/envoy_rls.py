"""Envoy's rate limit service, v3 (``envoy.service.ratelimit.v3.RateLimitService``).

Envoy and Istio gateways already call a rate limit service before routing a request;
answering that protocol on qosd's port puts qosd in front of a model with no code in
the gateway. A ``ShouldRateLimit`` request becomes one Acquire:

- the entries of all descriptors form one map; ``envoy_rls.class_key``,
  ``tenant_key`` and ``model_key`` name the class (through ``class_aliases``), the
  tenant and the model (hence the pool);
- the cost is the ``cost_key`` entry's value in tokens when present (a header with
  the prompt's token count, say), else the hits (the descriptors' ``hits_addend``,
  else the request's, else 1) times ``tokens_per_hit``;
- OK or OVER_LIMIT for the request and each descriptor, with ``limit_remaining`` (in
  hits), ``duration_until_reset`` (the retry-after), a ``retry-after`` header and a
  JSON body saying why;
- OVER_LIMIT (``x-qosd-reason: INVALID_REQUEST``) for a request qosd cannot interpret:
  an error status would let it through, since Envoy admits on errors by default.

There is no Release in this protocol, so the lease ends on its own after
``envoy_rls.lease_ttl_ms`` and the estimate stands as the cost. The wire messages are
qosd's own mirror of Envoy's (``proto/qosd/v1/envoy_rls.proto`` says why).
"""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
from opentelemetry.trace import Tracer

from qosd import tracing
from qosd.admission import AcquireOutcome
from qosd.config import EnvoyRlsConfig
from qosd.doors.decisions import Decisions
from qosd.doors.request import InvalidArgument
from qosd.model import Reason
from qosd.policy import ClassPolicy
from qosd.v1 import envoy_rls_pb2 as rls

ENVOY_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
MIRROR_SERVICE = rls.DESCRIPTOR.services_by_name["RateLimitService"].full_name
_OK = rls.RateLimitResponse.OK
_OVER_LIMIT = rls.RateLimitResponse.OVER_LIMIT
MAX_HITS = 2**32 - 1
INVALID_REQUEST = "INVALID_REQUEST"


class EnvoyRateLimitService:
    def __init__(self, decisions: Decisions, tracer: Tracer | None = None) -> None:
        self._decisions = decisions
        self._metrics = decisions.metrics
        self._tracer = tracer
        self._counters: dict[tuple[str, str], Any] = {}

    def _count(self, code: str, reason: str) -> None:
        """qosd_envoy_rls_requests_total, with label children cached as for Acquire."""
        counter = self._counters.get((code, reason))
        if counter is None:
            counter = self._counters[(code, reason)] = self._metrics.envoy_rls.labels(code, reason)
        counter.inc()

    async def ShouldRateLimit(  # noqa: N802 - gRPC method name
        self, request: rls.RateLimitRequest, context: grpc.aio.ServicerContext
    ) -> rls.RateLimitResponse:
        # One config for the whole call, read here: a reload may change the mapping
        # and the classes (qosd.reload), and a lookup that failed half way would be an
        # error status, which Envoy answers by letting the request through.
        rules = self._decisions.rules
        config = rules.config.envoy_rls
        if config.domains and request.domain not in config.domains:
            self._count("OK", "other_domain")
            return _all(request, _OK)
        try:
            entries, hits = _read(request)
            qos_class = _class_of(config, entries)
            cost = _cost(config, entries, hits, rules.max_tokens)
            tenant = entries.get(config.tenant_key, "")
            model = entries.get(config.model_key, "")
            span = tracing.recording_span() if self._tracer is not None else None
            if span is not None:
                span.set_attributes(
                    {"qosd.class": qos_class, "qosd.tenant": tenant, "qosd.model": model,
                     "qosd.envoy.domain": request.domain, "qosd.envoy.hits": hits}
                )  # fmt: skip
            admission_request = rules.acquire(
                tenant=tenant,
                model=model,
                qos_class=qos_class,
                input_tokens=cost,
                max_wait_ms=config.max_wait_ms,
                deadline_s=context.time_remaining(),
                lease_ttl_ms=config.lease_ttl_ms,
                names=_names(config),
            )
        except InvalidArgument as exc:
            # OVER_LIMIT, not an error status: Envoy lets a request through when its
            # rate limit call fails (failure_mode_deny is false by default), so an
            # error would let any caller skip admission with a bad header.
            self._decisions.invalid("ShouldRateLimit", exc)
            self._count("OVER_LIMIT", INVALID_REQUEST)
            return _refused(request, str(exc))
        # The rate it states is the class's as this call read it: the lookup cannot
        # fail after the decision, whatever a reload changed meanwhile.
        policy = rules.policies.get((admission_request.pool, qos_class))
        outcome = await self._decisions.acquire(admission_request)
        return self._response(request, outcome, qos_class, config, policy)

    def undecodable(self, message: str) -> rls.RateLimitResponse:
        """OVER_LIMIT for bytes that are no RateLimitRequest (a descriptor value that is
        not UTF-8: Envoy copies a header's raw bytes into it), as for any request qosd
        cannot interpret: an error status would let the request through."""
        self._count("OVER_LIMIT", INVALID_REQUEST)
        return _refused(rls.RateLimitRequest(), message)

    def _response(
        self,
        request: rls.RateLimitRequest,
        outcome: AcquireOutcome,
        qos_class: str,
        config: EnvoyRlsConfig,
        policy: ClassPolicy | None,
    ) -> rls.RateLimitResponse:
        decision = outcome.decision
        per_hit = config.tokens_per_hit
        code = _OK if decision.admitted else _OVER_LIMIT
        reason = Reason(decision.reason).name
        self._count("OK" if decision.admitted else "OVER_LIMIT", reason)
        rate = policy.rate if policy is not None else 0.0
        status = rls.RateLimitResponse.DescriptorStatus(
            code=code,
            current_limit=rls.RateLimitResponse.RateLimit(
                name=f"{outcome.pool}/{qos_class}",
                requests_per_unit=min(MAX_HITS, int(rate / per_hit)),
                unit=rls.RateLimitResponse.RateLimit.SECOND,
            ),
            limit_remaining=min(MAX_HITS, max(0, int(decision.remaining / per_hit))),
        )
        response = rls.RateLimitResponse(overall_code=code)
        if not decision.admitted:
            retry_ms = decision.retry_after_ms
            status.duration_until_reset.FromMilliseconds(retry_ms)
            response.response_headers_to_add.add(key="retry-after", value=str(_seconds(retry_ms)))
            response.response_headers_to_add.add(key="x-qosd-reason", value=reason)
            response.raw_body = json.dumps(
                {"error": "rate limited by qosd", "reason": reason, "pool": outcome.pool,
                 "class": qos_class, "retry_after_ms": retry_ms, "message": outcome.message}
            ).encode()  # fmt: skip
        response.statuses.extend([status] * len(request.descriptors))
        return response


def _names(config: EnvoyRlsConfig) -> dict[str, str]:
    """The descriptor entries that carry each field, for errors."""
    return {
        "qos_class": f"descriptor entry {config.class_key!r}",
        "tenant": f"descriptor entry {config.tenant_key!r}",
        "model": f"descriptor entry {config.model_key!r}",
    }


def _class_of(config: EnvoyRlsConfig, entries: dict[str, str]) -> str:
    value = entries.get(config.class_key)
    if value is None:
        if config.default_class is None:
            raise InvalidArgument(
                config.class_key,
                f"no descriptor entry {config.class_key!r} names the QoS class, and "
                "envoy_rls.default_class is not set",
            )
        return config.default_class
    return config.class_aliases.get(value, value)


def _cost(config: EnvoyRlsConfig, entries: dict[str, str], hits: int, limit: int) -> int:
    if config.cost_key is not None and config.cost_key in entries:
        raw = entries[config.cost_key]
        # ASCII digits only: int() would also take " 5", "1_000" and "\u0665" (an
        # Arabic-Indic five), none of which a gateway means as a token count.
        cost = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 20 else 0
        if not 1 <= cost <= limit:
            raise InvalidArgument(
                config.cost_key,
                f"descriptor entry {config.cost_key!r} must be a whole number of tokens "
                f"from 1 to {limit} (got {raw[:40]!r})",
            )
        return cost
    return max(1, math.ceil(hits * config.tokens_per_hit))


def _read(request: rls.RateLimitRequest) -> tuple[dict[str, str], int]:
    """All descriptors' entries as one map, and the hits this request adds."""
    if not request.descriptors:
        raise InvalidArgument("descriptors", "descriptors: at least one descriptor is required")
    entries: dict[str, str] = {}
    hits = 0
    for index, descriptor in enumerate(request.descriptors):
        # The constraints of Envoy's own proto validation (min_items, min_len).
        if not descriptor.entries:
            raise InvalidArgument(
                "descriptors", f"descriptors[{index}]: at least one entry is required"
            )
        for entry in descriptor.entries:
            if not entry.key or not entry.value:
                raise InvalidArgument(
                    "descriptors", f"descriptors[{index}]: entry keys and values must not be empty"
                )
            entries[entry.key] = entry.value
        if descriptor.HasField("hits_addend"):
            hits = max(hits, descriptor.hits_addend.value)
    if not hits:
        hits = request.hits_addend or 1
    return entries, hits


def _all(
    request: rls.RateLimitRequest, code: rls.RateLimitResponse.Code.ValueType
) -> rls.RateLimitResponse:
    response = rls.RateLimitResponse(overall_code=code)
    for _ in request.descriptors:
        response.statuses.add(code=code)
    return response


def _refused(request: rls.RateLimitRequest, message: str) -> rls.RateLimitResponse:
    """OVER_LIMIT for a request qosd cannot interpret, saying why (Envoy sends
    ``raw_body`` as its 429's body)."""
    response = _all(request, _OVER_LIMIT)
    response.response_headers_to_add.add(key="x-qosd-reason", value=INVALID_REQUEST)
    response.raw_body = json.dumps(
        {"error": "refused by qosd", "reason": INVALID_REQUEST, "message": message}
    ).encode()
    if not request.descriptors:
        response.statuses.add(code=_OVER_LIMIT)
    return response


def _seconds(milliseconds: int) -> int:
    return max(1, math.ceil(milliseconds / 1000))
