"""Logs: JSON lines with trace and span ids for pipelines; level and format from the
config, the environment or flags."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace import TracerProvider

from qosd import logs
from qosd.config import ConfigError, LogFormat, load_config


def test_json_lines_carry_the_active_span() -> None:
    formatter = logs.json_formatter()
    context = logs.TraceContext()
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("acquire") as span:
        record = logging.LogRecord(
            "qosd.x", logging.WARNING, "f.py", 1, "store %s", ("down",), None
        )
        context.filter(record)
        line = json.loads(formatter.format(record))
    ids = span.get_span_context()
    assert line["level"] == "WARNING" and line["logger"] == "qosd.x"
    assert line["message"] == "store down"
    assert line["trace_id"] == format(ids.trace_id, "032x")
    assert line["span_id"] == format(ids.span_id, "016x")
    outside = logging.LogRecord("qosd.x", logging.INFO, "f.py", 1, "idle", (), None)
    context.filter(outside)
    assert "trace_id" not in json.loads(formatter.format(outside))


def test_level_and_format_settings() -> None:
    config = load_config(None, env={"QOSD_LOG_LEVEL": "debug", "QOSD_LOG_FORMAT": "json"})
    assert (config.logging.level, config.logging.format) == ("DEBUG", LogFormat.JSON)
    with pytest.raises(ConfigError, match=r"logging\.level"):
        load_config(None, env={"QOSD_LOG_LEVEL": "chatty"})
    with pytest.raises(ConfigError, match=r"logging\.format"):
        load_config(None, env={"QOSD_LOG_FORMAT": "xml"})


def test_the_daemon_logs_json_lines() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "qosd.cli", "serve", "--listen", "127.0.0.1:0",
         "--log-format", "json", "--log-level", "info"],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert process.stderr is not None
    deadline = time.monotonic() + 20
    lines = []
    for raw in process.stderr:
        lines.append(json.loads(raw))  # every line is one JSON object
        if "serving on" in lines[-1]["message"] or time.monotonic() > deadline:
            break
    process.send_signal(signal.SIGTERM)
    _, rest = process.communicate(timeout=30)
    lines += [json.loads(raw) for raw in rest.splitlines()]
    assert process.returncode == 0
    assert any("serving on" in line["message"] for line in lines)
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    assert any(line["message"] == "stopped" for line in lines)
