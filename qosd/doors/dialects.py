"""The peers' dialects: the request headers llm-d and Dynamo send, read as qosd's, and
the answer headers their clients and dashboards already understand.

Requests (``PeerHeaders``), after qosd's own ``x-qos-class`` and ``x-qos-tenant``:

- llm-d's ``x-llm-d-inference-objective`` (then the deprecated
  ``x-gateway-inference-objective``) names an InferenceObjective, mapped to a class
  by ``peer_headers.objectives``; Dynamo's ``x-dynamo-request-priority`` is mapped by
  ``peer_headers.dynamo_priority``'s ranges, and so, where no header names a class,
  is the body's ``nvext.agent_hints.priority`` (``body_class``: Dynamo's own form,
  which its header overrides);
- llm-d's ``x-llm-d-inference-fairness-id`` (then ``x-gateway-inference-fairness-id``)
  names the tenant.

Answers (``rate_limit_headers``, ``retry_headers``): OpenAI's ``x-ratelimit-*``
headers from the class's bucket, ``x-should-retry`` (the official SDKs read it), and
llm-d's ``x-llm-d-request-dropped-reason`` beside ``x-qos-reason``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from qosd.config import Config, PriorityRange
from qosd.doors.request import InvalidArgument, RequestRules
from qosd.model import BucketDecision, Reason

OBJECTIVE_HEADERS = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS_HEADERS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
DYNAMO_PRIORITY_HEADER = "x-dynamo-request-priority"
#: Dynamo's priority in an OpenAI body, and the field's name in answers.
DYNAMO_PRIORITY_FIELD = "nvext.agent_hints.priority"
#: The agent hints a client could rank itself by at a Dynamo upstream: the proxy
#: never forwards them (only qosd's class decides).
DYNAMO_RANKING_HINTS = ("priority", "strict_priority")
#: Dynamo reads its priority as an i32.
_I32 = (-(2**31), 2**31 - 1)
#: Every request header the peers' dialects name (the JSON API passes them on).
REQUEST_HEADERS = (*OBJECTIVE_HEADERS, *FAIRNESS_HEADERS, DYNAMO_PRIORITY_HEADER)
#: Objectives named as the Gateway API Inference Extension's former criticalities, and
#: the classes they are by default (where those classes are configured). The
#: InferenceObjective resource has only a name and an integer priority: any other
#: name needs an entry in ``peer_headers.objectives``.
DEFAULT_OBJECTIVES = {"critical": "P0", "standard": "P1", "sheddable": "P2"}

#: llm-d's dropped reasons (llm-d-router pkg/common/error), by qosd's reason; qosd's
#: own as ``rejected-<reason>`` where llm-d has none.
DROPPED_REASONS = {
    Reason.RATE_LIMITED: "rejected-saturated",
    Reason.QUEUE_FULL: "rejected-saturated",
    Reason.COST_EXCEEDS_BURST: "rejected-saturated",
    Reason.LONG_PREFILL: "rejected-saturated",
    Reason.QUEUE_TIMEOUT: "rejected-ttl-expired",
    Reason.DEADLINE: "rejected-ttl-expired",
    Reason.SHUTTING_DOWN: "rejected-shutting-down",
    Reason.BACKEND_UNAVAILABLE: "rejected-backend-unavailable",
}
#: The longest wait the official SDKs honour before a retry: openai-python's
#: ``MAX_RETRY_AFTER_DELAY`` (two minutes; one before its #3555), past which it does
#: not retry at all. A refusal that asks longer cannot be helped by the SDK's retries.
#: An SDK from before that change backs off 0.5 to 8 s instead for 60 to 120 s.
SDK_RETRY_WINDOW_MS = 120_000
#: Reasons no retry of the same request can change.
HOPELESS = frozenset({Reason.COST_EXCEEDS_BURST})

Lookup = Callable[[str], str | None]


def given_once(names: Iterable[str], count: Callable[[str], int]) -> None:
    """InvalidArgument naming the first of ``names`` that a request gives more than
    once (``count``: how many times it does). Which copy a door read was its own
    choice, made silently; one a gateway appended after the client's could name
    another class or key."""
    for name in names:
        times = count(name)
        if times > 1:
            raise InvalidArgument(name, f"{name}: given {times} times; send it once")


class PeerHeaders:
    """The class and tenant the peers' headers name, under one config."""

    def __init__(self, config: Config) -> None:
        peers = config.peer_headers
        self.enabled = peers.enabled
        classes = sorted(config.classes, key=lambda name: config.classes[name].priority)
        objectives = {name: name for name in classes}
        if peers.objectives is None:
            objectives |= {k: v for k, v in DEFAULT_OBJECTIVES.items() if v in config.classes}
        else:
            objectives |= peers.objectives
        self._objectives = {name.lower(): target for name, target in objectives.items()}
        self._ranges: tuple[PriorityRange, ...] = (
            (PriorityRange.model_validate({"min": 1, "class": classes[0]}),)
            if peers.dynamo_priority is None
            else tuple(peers.dynamo_priority)
        )

    def qos_class(self, get: Lookup) -> tuple[str, str] | None:
        """(class, the header that named it), or None when no peer header does."""
        if not self.enabled:
            return None
        for header in OBJECTIVE_HEADERS:
            value = get(header)
            if value:
                target = self._objectives.get(value.lower())
                if target is not None:
                    return target, header
        value = get(DYNAMO_PRIORITY_HEADER)
        if value is not None:
            return self._ranked(_priority(value), DYNAMO_PRIORITY_HEADER)
        return None

    def body_class(self, body: dict[str, Any]) -> tuple[str, str] | None:
        """(class, the field that named it) from Dynamo's ``nvext.agent_hints.priority``
        in an OpenAI body; None when the body has none (or the dialects are off)."""
        if not self.enabled:
            return None
        value = _agent_hints(body).get("priority")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not _I32[0] <= value <= _I32[1]:
            raise InvalidArgument(
                DYNAMO_PRIORITY_FIELD, f"{DYNAMO_PRIORITY_FIELD} must be a 32-bit integer"
            )
        return self._ranked(max(0, value), DYNAMO_PRIORITY_FIELD)

    def _ranked(self, priority: int, named_by: str) -> tuple[str, str] | None:
        for entry in self._ranges:
            if (entry.min is None or priority >= entry.min) and (
                entry.max is None or priority <= entry.max
            ):
                return entry.qos_class, named_by
        return None

    def tenant(self, get: Lookup) -> tuple[str, str] | None:
        """(tenant, the header that named it), checked as every name is; None when no
        peer header names one."""
        if not self.enabled:
            return None
        for header in FAIRNESS_HEADERS:
            value = get(header)
            if value:
                return RequestRules.name(value, header), header
        return None


def _priority(text: str) -> int:
    """A Dynamo priority: a 32-bit whole number, signed as Rust's ``i32`` parses it
    (``+5`` too); below 0 counts as 0 (as Dynamo clamps it). Where Dynamo ignores a
    malformed one, qosd refuses it, naming the header: a class is never guessed."""
    stripped = text.strip()
    digits = stripped[1:] if stripped[:1] in ("+", "-") else stripped
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 10) or not (
        _I32[0] <= int(stripped) <= _I32[1]
    ):
        raise InvalidArgument(
            DYNAMO_PRIORITY_HEADER,
            f"{DYNAMO_PRIORITY_HEADER} must be a 32-bit whole number (got {text[:40]!r})",
        )
    return max(0, int(stripped))


def _agent_hints(body: dict[str, Any]) -> dict[str, Any]:
    nvext = body.get("nvext")
    hints = nvext.get("agent_hints") if isinstance(nvext, dict) else None
    return hints if isinstance(hints, dict) else {}


def without_ranking_hints(body: dict[str, Any]) -> dict[str, Any] | None:
    """``body`` less the Dynamo agent hints a client could rank itself by (a copy;
    the rest of ``nvext`` kept), or None when it has none."""
    hints = _agent_hints(body)
    if not any(name in hints for name in DYNAMO_RANKING_HINTS):
        return None
    kept = {name: value for name, value in hints.items() if name not in DYNAMO_RANKING_HINTS}
    return {**body, "nvext": {**body["nvext"], "agent_hints": kept}}


def rate_limit_headers(decision: BucketDecision) -> dict[str, str]:
    """OpenAI's rate-limit headers from the class's bucket after ``decision``: its
    burst, what is left, and how long it takes to fill up at the class's rate, in
    qosd's cost units (prompt tokens with the default cost; docs/integrations.md);
    and, in a pool with an in-flight bound, the requests it has room for."""
    if decision.burst <= 0:
        return {}  # the store was not reached: nothing known of the bucket
    remaining = max(0.0, decision.remaining)
    refill_s = (decision.burst - remaining) / decision.rate if decision.rate > 0 else 0.0
    headers = {
        "x-ratelimit-limit-tokens": str(math.floor(decision.burst)),
        "x-ratelimit-remaining-tokens": str(math.floor(remaining)),
        "x-ratelimit-reset-tokens": duration(max(0.0, refill_s)),
    }
    if decision.requests_bound >= 0:  # the in-flight bound: a request limit at any moment
        headers["x-ratelimit-limit-requests"] = str(decision.requests_bound)
        headers["x-ratelimit-remaining-requests"] = str(decision.requests_left)
    return headers


def retry_headers(reason: Reason, retry_after_ms: int) -> dict[str, str]:
    """``x-should-retry`` (``false`` where a retry cannot help: a cost beyond what the
    class can hold, or a wait past the SDKs' retry window) and llm-d's dropped reason."""
    hopeless = reason in HOPELESS or retry_after_ms > SDK_RETRY_WINDOW_MS
    return {
        "x-should-retry": "false" if hopeless else "true",
        "x-llm-d-request-dropped-reason": DROPPED_REASONS.get(
            reason, f"rejected-{reason.name.lower().replace('_', '-')}"
        ),
    }


def duration(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it: ``6m0s``, ``1.5s``, ``120ms``."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text
