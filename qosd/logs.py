"""Log output: text for people, or one JSON object per line for log pipelines.

JSON lines carry the trace and span ids of the OpenTelemetry span active when the line
was logged, so that a log search can jump to the trace and back. The formatting is
python-json-logger's; this module only chooses the fields.
"""

from __future__ import annotations

import logging
import math
import sys
import time

from aiohttp.http_exceptions import HttpProcessingError
from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

from qosd.config import LogFormat

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TraceContext(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` (W3C hex) while a span is active."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return True


class MalformedHttpQuieted(logging.Filter):
    """aiohttp's server logs every malformed request (a bad chunk size, a header past
    its limit, a duplicate Content-Length) at ERROR with a traceback and an excerpt of
    the sender's bytes: anyone who can reach a listener can fill the log. This keeps
    one line a second of them, at WARNING, without the traceback; an error of the
    daemon's own (not the client's bytes) is left as it is."""

    def __init__(self, interval_s: float = 1.0) -> None:
        super().__init__()
        self._interval_s = interval_s
        self._last = -math.inf
        self._quieted = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self._last < self._interval_s:
            self._quieted += 1
            return False
        self._last = now
        if record.levelno > logging.WARNING:  # aiohttp's DEBUG lines stay DEBUG
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.msg = f"{record.msg}: %s%s"
        more = f" ({self._quieted} more since the last, not logged)" if self._quieted else ""
        record.args = (*(record.args if isinstance(record.args, tuple) else ()),
                       f"{type(error).__name__}: {str(error)[:120]}", more)  # fmt: skip
        record.exc_info, record.exc_text = None, None
        self._quieted = 0
        return True


def json_formatter() -> logging.Formatter:
    return JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        timestamp=False,
    )


def configure(level: str, log_format: LogFormat = LogFormat.TEXT) -> None:
    """Sends the root logger to standard error in the chosen format (idempotent)."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format is LogFormat.JSON:
        handler.setFormatter(json_formatter())
        handler.addFilter(TraceContext())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    quiet_malformed_http()


def quiet_malformed_http() -> None:
    """Puts MalformedHttpQuieted on aiohttp's server logger (once)."""
    aiohttp_server = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, MalformedHttpQuieted) for f in aiohttp_server.filters):
        aiohttp_server.addFilter(MalformedHttpQuieted())
