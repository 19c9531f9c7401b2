"""The rules that check every door's input as it builds the one request type.

Each door (gRPC, Envoy's rate limit service, the JSON API, the OpenAI proxy) reads its
own input, then builds an ``AdmissionRequest`` (``qosd.model``) here and calls
``Admission.acquire`` with it. Validation happens once, in ``RequestRules``: a
request that exists is valid, and nothing after the door checks it again. An
invalid one raises ``InvalidArgument``, whose ``field`` names what was wrong in the
door's own terms (a proto field, a header), as data: a door never parses it back out
of the message.

Every string that reaches a store key, a metric label or a log is checked here: valid
Unicode with no control characters (an HTTP header may carry any byte; a lone
surrogate from a non-UTF-8 byte cannot be encoded into Redis or onto ``/metrics``),
and bounded in length.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from qosd.config import Config
from qosd.control.windows import request_objectives
from qosd.model import (
    FAIL_OPEN_MARK,
    AdmissionRequest,
    LeaseNotFound,
    Outcome,
    PassStats,
    ReleaseRequest,
    Sample,
    ServerLoad,
)
from qosd.policy import ClassPolicy, PoolPolicy, resolve_pools

#: The longest request id, tenant, server name or class name, in characters.
MAX_ID_LENGTH = 128
#: The longest traceparent a sample may carry: W3C's version 00 is 55 characters,
#: and later versions may only append fields.
MAX_TRACEPARENT_LENGTH = 256
#: The longest model name (Hugging Face ids run to about 100).
MAX_MODEL_LENGTH = 256
#: Anything longer is a unit mistake: one day, in milliseconds.
MAX_LATENCY_MS = 86_400_000.0
#: A model server's own queue: far above any real one, far below int64 when summed.
MAX_SERVER_WAITING = 10_000_000
#: Passes or tokens of one server in one read's interval: far above any GPU's.
MAX_PASS_COUNT = 10**12
#: A pass over a minute long is a unit mistake or a stalled server, not a step.
MAX_STEP_MS = 60_000.0
#: Control characters (C0, DEL, C1) and lone surrogates: what a name must not hold.
_UNFIT = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


class InvalidArgument(ValueError):
    """A request qosd cannot interpret. ``field`` is the door's name for what is wrong;
    the message starts with it and says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


#: A door's names for the fields of a request, where they differ from these.
FieldNames = Mapping[str, str]


class RequestRules:
    """What makes a request valid under one config. Rebuilt on reload, so that a door
    always checks against the config admission runs under."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.pools: dict[str, PoolPolicy] = resolve_pools(config)
        self.policies = {
            (pool.name, cls.name): cls for pool in self.pools.values() for cls in pool.classes
        }
        self.class_names = sorted(config.classes, key=lambda n: config.classes[n].priority)
        self._pool_of: dict[str, str] = {name: name for name in config.pools}
        for pool_name, pool in config.pools.items():
            for model in pool.models:
                self._pool_of[model] = pool_name
        self._default_pool = config.default_pool
        self.max_tokens = config.limits.max_request_tokens

    # -- acquire ----------------------------------------------------------------------

    def acquire(
        self,
        *,
        qos_class: str,
        input_tokens: int,
        expected_output_tokens: int = 0,
        model: str = "",
        tenant: str = "",
        request_id: str = "",
        max_wait_ms: int | None = None,
        deadline_s: float | None = None,
        lease_ttl_ms: int | None = None,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
        estimated: bool = False,
        names: FieldNames | None = None,
    ) -> AdmissionRequest:
        """The request, or InvalidArgument naming the field (by ``names``, the door's
        own name for it). Quick on the valid path: a few comparisons and one regular
        expression per non-empty string."""
        named = names or {}
        pool = self.pool_of(model, named.get("model", "model"))
        if self.policies.get((pool, qos_class)) is None:
            self._unknown_class(qos_class, named.get("qos_class", "qos_class"))
        max_tokens = self.max_tokens
        if estimated:  # never refused on an estimate: what it cannot be is clamped
            input_tokens = min(max(1, input_tokens), max_tokens)
            expected_output_tokens = min(max(0, expected_output_tokens), max_tokens)
        elif not (1 <= input_tokens <= max_tokens and 0 <= expected_output_tokens <= max_tokens):
            self.tokens(input_tokens, named.get("input_tokens", "input_tokens"), 1)
            self.tokens(
                expected_output_tokens,
                named.get("expected_output_tokens", "expected_output_tokens"),
                0,
            )
        if tenant:
            self.name(tenant, named.get("tenant", "tenant"))
        if request_id:
            self.name(request_id, named.get("request_id", "request_id"))
        if max_wait_ms is not None and max_wait_ms < 0:
            field = named.get("max_wait_ms", "max_wait_ms")
            raise InvalidArgument(field, f"{field} must not be negative (got {max_wait_ms})")
        if slo_ttft_ms is not None:
            objective(slo_ttft_ms, named.get("slo_ttft_ms", "slo_ttft_ms"))
        if slo_tpot_ms is not None:
            objective(slo_tpot_ms, named.get("slo_tpot_ms", "slo_tpot_ms"))
        slo = self.config.classes[qos_class].slo
        ttft_ms = request_objectives(slo, input_tokens, ttft_ms=slo_ttft_ms).ttft_ms or 0.0
        return AdmissionRequest(
            pool=pool,
            qos_class=qos_class,
            tenant=tenant,
            model=model,
            request_id=request_id,
            input_tokens=input_tokens,
            expected_output_tokens=expected_output_tokens,
            ttft_ms=ttft_ms,
            max_wait_ms=max_wait_ms,
            deadline_s=deadline_s,
            lease_ttl_ms=lease_ttl_ms,
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
            estimated=estimated,
        )

    def pool_of(self, model: str, field: str = "model") -> str:
        """The pool that serves ``model``: its own, else the default pool."""
        pool = self._pool_of.get(model)
        if pool is not None:
            return pool
        if model:
            self.name(model, field, MAX_MODEL_LENGTH)
        if self._default_pool is None:
            if not model:
                raise InvalidArgument(field, f"{field} is required (no default_pool is configured)")
            raise InvalidArgument(
                field,
                f"{field} {model!r} is not served by any configured pool "
                f"(pools: {', '.join(sorted(self.config.pools))})",
            )
        return self._default_pool

    def class_policy(self, pool: str, qos_class: str, field: str = "qos_class") -> ClassPolicy:
        policy = self.policies.get((pool, qos_class))
        if policy is None:
            self._unknown_class(qos_class, field)
        assert policy is not None
        return policy

    def _unknown_class(self, qos_class: str, field: str) -> None:
        if not qos_class:
            raise InvalidArgument(field, f"{field} is required ({', '.join(self.class_names)})")
        raise InvalidArgument(
            field,
            f"{field} {_clip(qos_class)!r} is not configured; "
            f"known classes: {', '.join(self.class_names)}",
        )

    def tokens(self, value: int, field: str, minimum: int) -> int:
        if value < minimum:
            raise InvalidArgument(field, f"{field} must be at least {minimum} (got {value})")
        if value > self.max_tokens:
            raise InvalidArgument(
                field,
                f"{field} {value} exceeds the maximum of {self.max_tokens} tokens "
                "per request (limits.max_request_tokens)",
            )
        return value

    @staticmethod
    def name(value: str, field: str, limit: int = MAX_ID_LENGTH) -> str:
        """A name that becomes part of a key, a label or a log line: bounded, and free
        of control characters and of what is not Unicode."""
        if len(value) > limit:
            raise InvalidArgument(
                field, f"{field} is {len(value)} characters long; the maximum is {limit}"
            )
        if _UNFIT.search(value):
            raise InvalidArgument(
                field,
                f"{field} must be UTF-8 text without control characters (got {_clip(value, 40)!a})",
            )
        return value

    # -- release ----------------------------------------------------------------------

    def release(
        self,
        lease_id: str,
        input_tokens: int | None,
        output_tokens: int | None,
        outcome: Outcome,
        names: FieldNames | None = None,
    ) -> ReleaseRequest:
        """A Release of ``lease_id``; its (pool, class) comes from the id, with no round
        trip. LeaseNotFound for an id whose pool and class are not configured."""
        named = names or {}
        field = named.get("lease_id", "lease_id")
        if not lease_id:
            raise InvalidArgument(field, f"{field} is required")
        parts = lease_id.split(":")
        if len(parts) != 3 or not parts[2] or len(lease_id) > 3 * MAX_ID_LENGTH:
            raise InvalidArgument(
                field,
                f"{field} {_clip(lease_id)!r} is malformed; pass AcquireResponse.lease_id as is",
            )
        self.name(lease_id, field, 3 * MAX_ID_LENGTH)
        policy = self.policies.get((parts[0], parts[1]))
        if policy is None:
            raise LeaseNotFound(
                f"lease {_clip(lease_id)} names pool {parts[0]!r} and class {parts[1]!r}, "
                "which this daemon does not configure"
            )
        if input_tokens is not None:
            self.tokens(input_tokens, named.get("input_tokens", "actual_input_tokens"), 0)
        if output_tokens is not None:
            self.tokens(output_tokens, named.get("output_tokens", "actual_output_tokens"), 0)
        return ReleaseRequest(
            lease_id=lease_id,
            policy=policy,
            fail_open=parts[2].startswith(FAIL_OPEN_MARK),
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            outcome=outcome,
        )

    # -- report -----------------------------------------------------------------------

    def report_size(self, count: int, loads: int = 0) -> None:
        if count == 0 and loads == 0:
            raise InvalidArgument(
                "samples", "samples: at least one sample (or one of loads) is required"
            )
        limit = self.config.limits.max_report_batch
        for name, found in (("samples", count), ("loads", loads)):
            if found > limit:
                raise InvalidArgument(
                    name,
                    f"{name}: {found} {name} exceed the batch limit of {limit} "
                    "(limits.max_report_batch); split the batch",
                )

    def sample(
        self,
        *,
        model: str,
        qos_class: str,
        tenant: str,
        ttft_ms: float | None,
        tpot_ms: float | None,
        e2e_ms: float | None,
        input_tokens: int,
        output_tokens: int,
        status: Outcome,
        slo_ttft_ms: float | None = None,
        slo_tpot_ms: float | None = None,
        lease_id: str = "",
        traceparent: str = "",
    ) -> Sample:
        """One latency sample, or InvalidArgument naming the field. ``lease_id`` and
        ``traceparent`` are not stored, only bounded (100,000 characters of each were
        taken)."""
        pool = self.pool_of(model)
        policy = self.class_policy(pool, qos_class)
        if tenant:
            self.name(tenant, "tenant")
        if lease_id:
            self.name(lease_id, "lease_id", 3 * MAX_ID_LENGTH)
        if len(traceparent) > MAX_TRACEPARENT_LENGTH:
            raise InvalidArgument(
                "traceparent",
                f"traceparent is {len(traceparent)} characters; at most "
                f"{MAX_TRACEPARENT_LENGTH} (W3C's is 55)",
            )
        self.tokens(input_tokens, "input_tokens", 0)
        self.tokens(output_tokens, "output_tokens", 0)
        for name, value in (("ttft_ms", ttft_ms), ("tpot_ms", tpot_ms), ("e2e_ms", e2e_ms)):
            if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_LATENCY_MS):
                raise InvalidArgument(
                    name,
                    f"{name} must be a finite number of milliseconds between 0 and "
                    f"{MAX_LATENCY_MS:.0f} (got {value})",
                )
        if ttft_ms is None and tpot_ms is None and e2e_ms is None:
            raise InvalidArgument("ttft_ms", "needs at least one of ttft_ms, tpot_ms, e2e_ms")
        if slo_ttft_ms is not None:
            objective(slo_ttft_ms, "slo_ttft_ms")
        if slo_tpot_ms is not None:
            objective(slo_tpot_ms, "slo_tpot_ms")
        return Sample(
            pool=pool,
            qos_class=policy.name,
            tenant=tenant,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            e2e_ms=e2e_ms,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            status=status,
            slo_ttft_ms=slo_ttft_ms,
            slo_tpot_ms=slo_tpot_ms,
        )

    def server_load(
        self,
        *,
        model: str,
        server: str,
        waiting: int | None,
        kv_usage: float | None,
        passes: PassStats | None = None,
    ) -> tuple[str, ServerLoad]:
        """One server's load: its pool and the load, or InvalidArgument naming the field."""
        pool = self.pool_of(model)
        if not server:
            raise InvalidArgument(
                "server", "server is required: the loads of one server replace its last"
            )
        self.name(server, "server")
        if waiting is not None and not 0 <= waiting <= MAX_SERVER_WAITING:
            # Bounded so that the pool's sum over its servers fits the int64 of
            # PoolStatus.server_waiting_requests (2**63 from two servers did not).
            raise InvalidArgument(
                "waiting_requests",
                f"waiting_requests must be between 0 and {MAX_SERVER_WAITING} (got {waiting})",
            )
        if kv_usage is not None and not (math.isfinite(kv_usage) and 0 <= kv_usage <= 1):
            raise InvalidArgument(
                "kv_cache_usage", f"kv_cache_usage must be between 0 and 1 (got {kv_usage})"
            )
        if passes is not None:
            pass_stats(passes)
        return pool, ServerLoad(server, waiting, kv_usage, passes)


def pass_stats(stats: PassStats) -> PassStats:
    """A server's passes since its last read: counts a server could have run in a
    read's interval, and a sane step. Checked here, where they enter: the leader fits
    the decode step to them."""
    for name, value, least in (("passes.passes", stats.passes, 1),
                               ("passes.prefill_tokens", stats.prefill_tokens, 0),
                               ("passes.decode_tokens", stats.decode_tokens, 1)):  # fmt: skip
        if not least <= value <= MAX_PASS_COUNT:
            raise InvalidArgument(
                name, f"{name} must be between {least} and {MAX_PASS_COUNT} (got {value})"
            )
    if not (math.isfinite(stats.step_ms) and 0 < stats.step_ms <= MAX_STEP_MS):
        raise InvalidArgument(
            "passes.step_ms",
            f"passes.step_ms must be a finite number of milliseconds above 0 and at most "
            f"{MAX_STEP_MS:.0f} (got {stats.step_ms})",
        )
    return stats


def objective(value: float, field: str) -> float:
    """A request's own latency objective: a sane number of milliseconds."""
    if not (math.isfinite(value) and 0 < value <= MAX_LATENCY_MS):
        raise InvalidArgument(
            field,
            f"{field} must be a finite number of milliseconds above 0 and at most "
            f"{MAX_LATENCY_MS:.0f} (got {value})",
        )
    return value


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
