"""HTTP bodies as the doors read them: whole, bounded, and parsed as JSON that cannot
hurt the reader.

A body is read to its end, up to a limit: a request may arrive in many TCP segments,
and reading what happens to be buffered reads half a body. JSON is parsed with its
numbers bounded (a 5,000-digit integer costs quadratic time to convert and is no
token count; ``1e400`` becomes infinity, which no field takes and protobuf's
converters fail on), without NaN or Infinity (not JSON), with its nesting bounded
(deep nesting exhausts the parser's recursion), and with no name twice in one object
(which one counts is the parser's choice, and two parsers of one body, the door's and
an upstream's, may choose apart).
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from aiohttp import StreamReader, web

#: Bodies larger than this are parsed off the event loop, which goes on serving.
PARSE_OFF_LOOP_BYTES = 256 * 1024
#: How long a request's body may take to arrive once its head has: past it, a 408.
BODY_TIMEOUT_S = 30.0
#: Digits in an integer, at most: int64 has 19.
MAX_INTEGER_DIGITS = 24
#: Nesting of arrays and objects, at most: no request of qosd's or OpenAI's nests deeper.
MAX_DEPTH = 64


class BodyTooLarge(ValueError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body exceeds {limit} bytes")
        self.limit = limit


class BodyTimedOut(ValueError):
    def __init__(self) -> None:
        super().__init__(f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s")


class BadJson(ValueError):
    """The body is not JSON qosd reads; the message says why."""


async def read_within(content: StreamReader, length: int | None, limit: int) -> bytes | None:
    """The whole of ``content``, however many segments it comes in; None past ``limit``
    bytes (at once when its declared ``length`` says so). For a request's body and an
    upstream's answer alike: what comes in is never held without bound."""
    if length is not None and length > limit:
        return None
    body = bytearray()
    async for chunk in content.iter_any():
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole body; BodyTooLarge past ``limit``, BodyTimedOut past BODY_TIMEOUT_S
    (a body that never ends would hold its connection and handler for ever), BadJson
    when it cannot be decoded (``Content-Encoding: br`` with bytes that are not)."""
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            body = await read_within(request.content, request.content_length, limit)
    except TimeoutError:
        raise BodyTimedOut() from None
    except web.RequestPayloadError as exc:  # a Content-Encoding that does not decode
        raise BadJson(f"the body cannot be read: {exc}") from None
    if body is None:
        raise BodyTooLarge(limit)
    return body


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, or BadJson saying why."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadJson(f"the body is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        value = json.loads(
            text,
            parse_int=_integer,
            parse_float=_finite,
            parse_constant=_constant,
            object_pairs_hook=_unique,
        )
    except RecursionError:
        raise BadJson(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except BadJson:  # a number refused by _integer, _finite or _constant
        raise
    except ValueError as exc:  # JSONDecodeError
        raise BadJson(f"the body is not valid JSON: {exc}") from None
    if _depth_exceeds(value, MAX_DEPTH):
        raise BadJson(f"the body nests deeper than {MAX_DEPTH} levels")
    return value


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise BadJson(f"the body names {name[:40]!r} twice in one object")
            seen.add(name)
    return value


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise BadJson(f"the body has an integer of {len(text)} digits, out of range")
    return int(text)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJson(
            f"the body has the number {text[:40]}, out of range: beyond a double's, it reads "
            "as infinity, which no field takes"
        )
    return value


def _constant(name: str) -> Any:
    raise BadJson(f"the body is not valid JSON: {name} is not a JSON number")


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether ``value`` nests deeper than ``limit`` (iteratively: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
