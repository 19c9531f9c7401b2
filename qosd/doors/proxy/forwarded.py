"""The caller's headers the proxy passes upstream, each checked first.

The proxy passes on a request's trace context (W3C ``traceparent`` and
``tracestate``), its ``x-request-id`` and vLLM's ``endpoint-load-metrics-format``; the
rest of a caller's headers are the proxy's business (``authorization`` never goes
on: it is the caller's credential for qosd). Each passes only when well formed: a
malformed ``traceparent`` went upstream as it came, and bytes that were not UTF-8
arrived there as an empty value. Trace context that does not parse is dropped, as
W3C Trace Context asks of a receiver (the upstream starts a trace of its own); the
request is not refused for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: The request's own id, checked where it enters (``RequestRules.name``).
REQUEST_ID_HEADER = "x-request-id"
#: ORCA's load-report format a client asks an upstream for (vLLM: ``TEXT``, ``JSON``).
LOAD_METRICS_FORMAT_HEADER = "endpoint-load-metrics-format"
#: What the proxy may pass on of a caller's headers.
FORWARDED_HEADERS = ("traceparent", "tracestate", REQUEST_ID_HEADER, LOAD_METRICS_FORMAT_HEADER)

#: W3C traceparent: version, trace id, parent id, flags; a later version may append
#: fields after a dash.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-[!-~]*)?")
#: W3C tracestate: at most 32 list members, printable ASCII; 512 characters is what a
#: receiver must keep.
_TRACESTATE = re.compile(r"[ -~]{1,512}")
_FORMAT = re.compile(r"[A-Za-z0-9_-]{1,32}")


def forwarded(headers: Mapping[str, str]) -> dict[str, str]:
    """The headers of ``headers`` to pass upstream: those of FORWARDED_HEADERS that
    are well formed (the request id is checked at admission, before this)."""
    passed: dict[str, str] = {}
    if _trace_parent(headers.get("traceparent", "")):
        passed["traceparent"] = headers["traceparent"]
        state = headers.get("tracestate", "")
        if _TRACESTATE.fullmatch(state) and state.count(",") < 32:
            passed["tracestate"] = state
    if request_id := headers.get(REQUEST_ID_HEADER, ""):
        passed[REQUEST_ID_HEADER] = request_id
    load_format = headers.get(LOAD_METRICS_FORMAT_HEADER, "")
    if _FORMAT.fullmatch(load_format):
        passed[LOAD_METRICS_FORMAT_HEADER] = load_format
    return passed


def _trace_parent(value: str) -> bool:
    """A traceparent W3C Trace Context accepts: version ff and all-zero ids are not."""
    found = _TRACEPARENT.fullmatch(value)
    if found is None:
        return False
    version, trace_id, parent_id, extra = found.groups()
    if version == "ff" or trace_id == "0" * 32 or parent_id == "0" * 16:
        return False
    return version != "00" or extra is None  # version 00 has exactly four fields
