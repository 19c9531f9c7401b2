"""Log output: text for people, or one JSON object per line for log pipelines.

JSON lines carry the trace and span ids of the OpenTelemetry span active when the line
was logged, so that a log search can jump to the trace and back. The formatting is
python-json-logger's; this module only chooses the fields.
"""

from __future__ import annotations

import logging
import sys

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
