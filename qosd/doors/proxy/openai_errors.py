"""Errors in OpenAI's format, so that the official SDKs raise and retry as they do
against OpenAI: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
import math

from aiohttp import web

from qosd.doors.dialects import retry_headers
from qosd.model import Reason

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "upstream_error",
}


#: Client errors no retry can change (the SDKs retry 408, 409, 429 and 5xx).
NEVER_RETRIED = frozenset({400, 401, 403, 404, 405, 409, 413, 415, 422})


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": str(self),
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def event(self) -> bytes:
        """The error as a stream's last event, once its 200 has gone out (the SDKs
        raise it as ``APIError``)."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"

    def response(self) -> web.Response:
        body = self.body()
        headers = self.headers
        if self.status in NEVER_RETRIED and "x-should-retry" not in headers:
            # The SDKs retry 409 (and would any status told to): say what retrying does.
            headers = {**headers, "x-should-retry": "false"}
        return web.Response(
            status=self.status,
            body=json.dumps(body).encode(),
            content_type="application/json",
            headers=headers,
        )


def refusal(
    reason: Reason, retry_after_ms: int, message: str, limits: dict[str, str] | None = None
) -> OpenAIError:
    """qosd's refusal as an answer the SDKs retry: 429 with ``Retry-After`` (seconds,
    rounded up) and OpenAI's ``retry-after-ms``; a store outage under fail-closed, or
    a draining proxy, is 503. ``x-qos-reason`` names qosd's reason, and llm-d's
    ``x-llm-d-request-dropped-reason`` its counterpart; ``x-should-retry`` is false
    where no retry can help (``qosd.doors.dialects``); ``limits``: the rate-limit
    headers."""
    name = reason.name.lower()
    headers = {"x-qos-reason": name, **retry_headers(reason, retry_after_ms), **(limits or {})}
    if retry_after_ms > 0:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(retry_after_ms)
    status = 503 if reason in (Reason.BACKEND_UNAVAILABLE, Reason.SHUTTING_DOWN) else 429
    text = message or f"refused by qosd: {name}"
    return OpenAIError(status, text, code=name, headers=headers)
