"""What the proxy reads from its upstreams: whole answers and streams, held within
limits, judged for tokens and usage, and the load an upstream reports. Bytes from an
upstream are as untrusted as a client's: a size, a shape or a cut connection ends the
answer with an OpenAI error, never a hang or a 500 (docs/reliability.md)."""

from __future__ import annotations

import contextlib
import email.utils
import math
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from qosd.doors.bodies import read_within
from qosd.doors.proxy.openai_errors import OpenAIError
from qosd.doors.proxy.upstreams import Upstream

#: vLLM's ORCA load header, read from every answer.
LOAD_HEADER = "endpoint-load-metrics"


class AnswerTooLarge(Exception):
    """An upstream answer held whole, or one line of a stream, past the proxy's limit."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"over {limit} bytes")
        self.limit = limit


class AnswerCut(Exception):
    """A stream that ended early on a cleanly closed connection: in the middle of a
    line, or before its ``data: [DONE]`` with a choice unfinished. OpenAI, vLLM,
    SGLang and TensorRT-LLM end a whole stream with ``[DONE]``; TGI before 2.2 and
    llama.cpp's server before September 2024 close it after each choice's
    ``finish_reason`` instead, which is whole too."""


async def read_capped(answer: aiohttp.ClientResponse, limit: int) -> bytes:
    """An answer's whole body, or AnswerTooLarge past ``limit`` bytes."""
    body = await read_within(answer.content, answer.content_length, limit)
    if body is None:
        raise AnswerTooLarge(limit)
    return body


class Lines:
    """A stream's lines, each up to ``limit`` bytes. aiohttp's own line reader stops at
    128 KiB (twice its read buffer), and not every version lets a caller raise that:
    an event that large (a long tool call, an image) is still a valid event."""

    def __init__(self, content: aiohttp.StreamReader, limit: int) -> None:
        self._content = content
        self._limit = limit
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline

    async def next(self) -> bytes | None:
        """The next line, its newline included; None at the end of the stream."""
        buffer = self._buffer
        while True:
            end = buffer.find(b"\n", self._scanned)
            if end >= self._limit:
                raise AnswerTooLarge(self._limit)
            if end >= 0:
                line = bytes(buffer[: end + 1])
                del buffer[: end + 1]
                self._scanned = 0
                return line
            self._scanned = len(buffer)
            if self._scanned >= self._limit:
                raise AnswerTooLarge(self._limit)
            piece = await self._content.readany()
            if not piece:
                line = bytes(buffer)
                buffer.clear()
                return line or None
            buffer += piece


def broke_off(error: BaseException) -> OpenAIError:
    """An answer that stopped coming: 504 when the upstream went silent past the read
    timeout, 502 when it broke the connection."""
    if isinstance(error, TimeoutError):
        return OpenAIError(504, "the upstream went silent past --upstream-read-timeout",
                           code="upstream_timeout")  # fmt: skip
    if isinstance(error, AnswerTooLarge):
        return OpenAIError(502, f"the upstream's answer is too large: {error} "
                           "(--max-answer-bytes; a stream's lines: --max-body-bytes)",
                           code="upstream_too_large")  # fmt: skip
    return OpenAIError(502, f"the upstream's answer broke off: {what_broke(error)}",
                       code="upstream_cut")  # fmt: skip


def what_broke(error: BaseException) -> str:
    return str(error) or type(error).__name__


def event_data(line: bytes) -> bytes | None:
    """A data event's JSON (not the final ``[DONE]``), else None. The space after
    ``data:`` is optional, as server-sent events define it: an upstream that wrote
    ``data:{...}`` had its usage left unread, and its usage chunk sent to a client
    that had not asked for one."""
    if not line.startswith(b"data:") or is_done(line):
        return None
    return line[6:] if line.startswith(b"data: ") else line[5:]


def is_done(line: bytes) -> bool:
    """The stream's last event, ``data: [DONE]``."""
    return line.startswith(b"data:") and line[5:].strip() == b"[DONE]"


def is_event(line: bytes) -> bool:
    """A data event with JSON in it (not the final ``[DONE]``)."""
    return event_data(line) is not None


def is_usage_chunk(chunk: dict[str, Any]) -> bool:
    """The stream's usage chunk: no choices, and a ``usage``, readable or not."""
    return chunk.get("choices") == [] and chunk.get("usage") is not None


def note_finishes(chunk: dict[str, Any], unfinished: set[int]) -> bool:
    """Keeps ``unfinished``, the indices of the stream's choices without their
    ``finish_reason`` yet, up to date with ``chunk``; True if a choice finished in it."""
    finished = False
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        index = choice.get("index", 0) if isinstance(choice, dict) else None
        if not isinstance(index, int):
            continue
        if choice.get("finish_reason"):
            unfinished.discard(index)
            finished = True
        else:
            unfinished.add(index)
    return finished


def has_content(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    if not isinstance(choices, list):  # "choices": 5 is no token
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
        if choice.get("text"):
            return True
    return False


def read_load(upstream: Upstream, answer: aiohttp.ClientResponse) -> None:
    """vLLM's ORCA header (``TEXT named_metrics.num_requests_waiting=N, ...``), when
    the upstream sent one: the server's own queue, for picking among servers."""
    value = answer.headers.get(LOAD_HEADER, "")
    if not value.startswith("TEXT "):
        return
    for item in value[5:].split(","):
        name, _, number = item.strip().partition("=")
        if name == "named_metrics.num_requests_waiting":
            with contextlib.suppress(ValueError):
                waiting = float(number)
                if math.isfinite(waiting):
                    upstream.waiting = waiting


#: The longest pause an upstream may ask for that is passed on (a day).
MAX_UPSTREAM_RETRY_AFTER_S = 86_400


def retry_after_of(headers: Mapping[str, str]) -> dict[str, str]:
    """An upstream's ``Retry-After`` (seconds, or an HTTP date: as seconds from now)
    and OpenAI's ``retry-after-ms``, each passed on only when well formed and within
    a day: bytes from an upstream are checked as a client's are."""
    found: dict[str, str] = {}
    seconds = headers.get("retry-after", "").strip()
    if _whole_number(seconds, 6):
        if int(seconds) <= MAX_UPSTREAM_RETRY_AFTER_S:
            found["Retry-After"] = str(int(seconds))
    elif seconds:
        with contextlib.suppress(TypeError, ValueError, IndexError, OverflowError):
            when = email.utils.parsedate_to_datetime(seconds)
            if when.tzinfo is not None:
                left = math.ceil(when.timestamp() - time.time())
                if left <= MAX_UPSTREAM_RETRY_AFTER_S:
                    found["Retry-After"] = str(max(0, left))
    millis = headers.get("retry-after-ms", "").strip()
    if _whole_number(millis, 9) and int(millis) <= MAX_UPSTREAM_RETRY_AFTER_S * 1000:
        found["retry-after-ms"] = str(int(millis))
    return found


def _whole_number(text: str, digits: int) -> bool:
    """ASCII digits only (``isdigit`` takes ``²`` and Arabic-Indic digits), at most
    ``digits`` of them."""
    return text.isascii() and text.isdigit() and len(text) <= digits
