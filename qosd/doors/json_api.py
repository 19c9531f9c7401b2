"""qosd's API as JSON over HTTP, on the daemon's HTTP listener, for gateways that have no
gRPC code generation (nginx or OpenResty Lua, Kong plugins, Node, Go without protoc).

    POST /v1/acquire   AcquireRequest   -> AcquireResponse
    POST /v1/release   ReleaseRequest   -> ReleaseResponse
    POST /v1/report    ReportRequest    -> ReportResponse
    GET  /v1/status    ?pool=&history=&tenant=...  -> GetStatusResponse

Bodies are the messages of ``proto/qosd/v1/qosd.proto`` in protobuf's JSON mapping:
field names as in the .proto (``input_tokens``) or their JSON names
(``inputTokens``), enums by name, 64-bit integers as numbers or strings. Each call
runs the gRPC method's own handler chain (qosd.doors.grpc_api.add_to_server): the same
authorization (``authorization: Bearer`` and mTLS identities), the same trace
propagation (``traceparent``), the same validation. Answers are the response
messages, with every field present; an error is ``{"code": "INVALID_ARGUMENT",
"message": ...}`` with the HTTP status its gRPC code maps to, and so is an unknown path
(404) or method (405) on the listener.

A caller that leaves is treated as gRPC treats a cancelled call: the listener cancels
its handler (``handler_cancellation``), so a waiting Acquire leaves the queue and an
admission that raced its departure is undone (qosd.waiting, qosd.admission). A
Release or Report runs to its end all the same: cut half way, a lease would be left
to its TTL.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl

import grpc
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from qosd.doors import openapi
from qosd.doors.auth import Authorizer
from qosd.doors.bodies import (
    PARSE_OFF_LOOP_BYTES,
    BadJson,
    BodyTimedOut,
    BodyTooLarge,
    parse_json,
    read_body,
)
from qosd.doors.dialects import REQUEST_HEADERS, given_once
from qosd.doors.grpc_api import METHOD_GROUPS, RawHandler
from qosd.doors.request import InvalidArgument
from qosd.status import MAX_HISTORY
from qosd_client.v1 import qosd_pb2

log = logging.getLogger(__name__)

#: The gRPC codes an answer can carry, as HTTP statuses (as Google's HTTP APIs map them).
HTTP_STATUS = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
#: Request headers a call carries into the handler chain as its metadata: credentials,
#: the trace context, and the peers' headers (qosd.doors.dialects), which name a class
#: or tenant the body leaves empty.
METADATA_HEADERS = ("authorization", "traceparent", "tracestate", "baggage", *REQUEST_HEADERS)
#: The largest request body: a Report batch at limits.max_report_batch is far below it.
MAX_BODY_BYTES = 4 * 1024 * 1024
ROUTES = {"acquire": "Acquire", "release": "Release", "report": "Report"}
QOS_SERVICE = qosd_pb2.DESCRIPTOR.services_by_name["QoS"].full_name
_NUMBERS = frozenset({
    FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_UINT64,
    FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_FIXED32,
    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_SFIXED64,
})  # fmt: skip
#: The calls that run to their end when their caller leaves: they settle what exists.
FINISHED_ANYWAY = frozenset({"Release", "Report"})


async def _read_message(
    request: web.Request, message_type: type[Message]
) -> Message | web.Response:
    """The request's body as ``message_type``, or the answer that says what is wrong
    with it (413, 408, or a 400 naming the field). A large body is decoded off the
    event loop, all of it: parsing, the type checks and protobuf's conversion."""
    try:
        raw = await read_body(request, MAX_BODY_BYTES)
        if len(raw) > PARSE_OFF_LOOP_BYTES:  # megabytes take a while
            return await asyncio.to_thread(_decoded, raw, message_type)
        return _decoded(raw, message_type)
    except BodyTooLarge as exc:
        return _error(413, "INVALID_ARGUMENT", str(exc))
    except BodyTimedOut as exc:
        return _error(408, "DEADLINE_EXCEEDED", str(exc))
    except BadJson as exc:
        return _error(400, "INVALID_ARGUMENT", f"{message_type.DESCRIPTOR.name}: {exc}")


def _decoded(raw: bytes, message_type: type[Message]) -> Message:
    """``raw`` as ``message_type``; BadJson naming the field where it cannot be."""
    body = parse_json(raw) if raw else {}
    if not isinstance(body, dict):  # ParseDict would iterate it, or raise TypeError
        raise BadJson("the body must be a JSON object, the message's fields")
    check_json_types(body, message_type.DESCRIPTOR)
    try:
        return json_format.ParseDict(body, message_type())
    except json_format.ParseError as exc:
        raise BadJson(str(exc)) from None
    except (ValueError, TypeError, OverflowError) as exc:
        # protobuf's converters raise these unwrapped for a few values (an enum
        # given infinity, before bodies refused infinities): still the caller's.
        field = _failing_field(body, message_type)
        raise BadJson(
            f"{field or 'a field'}: a value it cannot take ({type(exc).__name__}: {exc})"
        ) from None


def check_json_types(body: dict[str, Any], descriptor: Any, path: str = "") -> None:
    """What protobuf's JSON parser lets by and no caller means, refused as BadJson
    naming the field: a field given twice under its two names (``qos_class`` and
    ``qosClass``: the parser keeps the last); true or false for a number (it reads
    them as 1 and 0); an enum as a number it does not define (it wraps any integer
    modulo 2^32), or as a fraction or a boolean. Nested messages are checked alike."""
    named: dict[str, str] = {}
    for key, value in body.items():
        field = descriptor.fields_by_name.get(key) or _by_json_name(descriptor).get(key)
        if field is None:
            continue  # an unknown field: the parser refuses it, naming it
        name = f"{path}{field.name}"
        if field.name in named:
            raise BadJson(f"{name}: given twice (as {named[field.name]!r} and {key!r})")
        named[field.name] = key
        repeated = field.is_repeated and isinstance(value, list)
        for item in value if repeated else (value,):
            _check_json_value(item, field, name)


def _check_json_value(value: Any, field: Any, name: str) -> None:
    """One value of ``field`` (a FieldDescriptor; Any: protobuf's stubs make its
    enum and message types optional)."""
    if field.type in _NUMBERS and isinstance(value, bool):
        raise BadJson(f"{name}: must be a number, not {json.dumps(value)}")
    if field.type == FieldDescriptor.TYPE_ENUM:
        enum = field.enum_type
        # The numbers it defines as a set: upb's own map wraps a lookup modulo 2^32.
        if isinstance(value, bool | float) or (
            isinstance(value, int) and value not in {v.number for v in enum.values}
        ):
            known = ", ".join(enum.values_by_name)
            raise BadJson(f"{name}: {json.dumps(value)} is not one of {enum.name} ({known})")
    if (
        field.type == FieldDescriptor.TYPE_MESSAGE
        and isinstance(value, dict)
        and not field.message_type.GetOptions().map_entry
        and not field.message_type.full_name.startswith("google.protobuf.")
    ):
        check_json_types(value, field.message_type, f"{name}.")


@functools.cache
def _by_json_name(descriptor: Any) -> dict[str, Any]:
    return {field.json_name: field for field in descriptor.fields}


class HttpCallContext:
    """What qosd's handlers use of a gRPC servicer context, for a call that came over
    HTTP: its metadata (from the headers), its peer's certificate, and an abort that
    records the status."""

    def __init__(self, request: web.Request) -> None:
        # Every copy: a header given twice is the servicers' to refuse (given_once,
        # bearer_token), not this context's to pick one of.
        self._metadata = tuple(
            (name, value)
            for name in METADATA_HEADERS
            for value in request.headers.getall(name, ())
            if value
        )
        self._request = request
        self._code = grpc.StatusCode.OK
        self._details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float | None:
        return None  # HTTP states no deadline: the class's own waits apply

    def peer(self) -> str:
        remote = self._request.remote or ""
        return f"ipv4:{remote}" if remote else "unknown"

    def auth_context(self) -> dict[str, list[bytes]]:
        """The client certificate's names, keyed as gRPC's auth context keys them."""
        transport = self._request.transport
        certificate = transport.get_extra_info("peercert") if transport else None
        if not certificate:
            return {}
        names = [value.encode() for _, value in certificate.get("subjectAltName", ())]
        common = [value.encode() for rdn in certificate.get("subject", ())
                  for key, value in rdn if key == "commonName"]  # fmt: skip
        found: dict[str, list[bytes]] = {}
        if names:
            found["x509_subject_alternative_name"] = names
        if common:
            found["x509_common_name"] = common
        return found

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details
        raise grpc.aio.AbortError()

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class JsonApi:
    """The routes, over the handler chains ``add_to_server`` returned. ``authorizer``:
    the chains' own, asked once more before a body is read, so that a caller the
    chain would refuse costs no reading or parsing."""

    def __init__(
        self,
        chains: dict[str, tuple[type[Message], RawHandler]],
        authorizer: Authorizer | None = None,
    ) -> None:
        self._chains = chains
        self._authorizer = authorizer
        self._unfinished: set[asyncio.Task[Any]] = set()  # calls whose callers left

    def add_routes(self, app: web.Application) -> None:
        for path in ROUTES:
            app.router.add_post(f"/v1/{path}", _guarded(self._post))
        app.router.add_get("/v1/status", _guarded(self._status))
        openapi.add_route(app)  # this API's document, and the proxy's
        app.middlewares.append(_routing_errors)
        app.on_cleanup.append(self._finish)

    async def _post(self, request: web.Request) -> web.Response:
        method = ROUTES[request.path.rsplit("/", 1)[1]]
        if self._authorizer is not None:
            refused = self._authorizer.judge(
                f"{QOS_SERVICE}/{method}", METHOD_GROUPS[method], HttpCallContext(request)
            )
            if refused is not None:
                return _error(HTTP_STATUS[refused.code], refused.code.name, refused.message)
        message = await _read_message(request, self._chains[method][0])
        if isinstance(message, web.Response):
            return message  # the body's fault, answered
        return await self._call(method, message, request)

    async def _status(self, request: web.Request) -> web.Response:
        try:  # aiohttp reads percent-escapes that are not UTF-8 as U+FFFD, silently
            parse_qsl(request.rel_url.raw_query_string, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            return _error(400, "INVALID_ARGUMENT", "the query string is not UTF-8")
        query = request.query
        try:
            given_once(("pool", "history"), lambda name: len(query.getall(name, ())))
        except InvalidArgument as exc:
            return _error(400, "INVALID_ARGUMENT", str(exc))
        text = query.get("history", "0")
        if not (text.isascii() and text.isdigit() and len(text) <= len(str(MAX_HISTORY))):
            return _error(
                400, "INVALID_ARGUMENT", f"history: must be a whole number from 0 to {MAX_HISTORY}"
            )
        message = _status_request(query.get("pool", ""), int(text), query.getall("tenant", []))
        return await self._call("GetStatus", message, request)

    async def _call(self, method: str, message: Message, request: web.Request) -> web.Response:
        context = HttpCallContext(request)
        call = self._chains[method][1](message.SerializeToString(), context)
        try:
            answer = await (self._finished(call) if method in FINISHED_ANYWAY else call)
        except grpc.aio.AbortError:
            code = context.code()
            return _error(HTTP_STATUS.get(code, 500), code.name, context.details())
        body = json_format.MessageToDict(
            answer, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        return web.json_response(body)

    def _finished(self, call: Awaitable[Any]) -> Awaitable[Any]:
        """``call``, run to its end even if its caller leaves (the listener cancels a
        departed caller's handler): a Release cut inside its store call would leave
        its lease to the TTL, and its caller, gone, cannot retry it."""
        task = asyncio.ensure_future(call)
        self._unfinished.add(task)
        task.add_done_callback(self._forget)
        return asyncio.shield(task)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        self._unfinished.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an answer nobody is left to read is no error

    async def _finish(self, app: web.Application) -> None:
        """At the listener's stop, before the store closes: the calls whose callers
        left end first."""
        await asyncio.gather(*self._unfinished, return_exceptions=True)


@web.middleware
async def _routing_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """An unknown path or method answered in this door's format, not as aiohttp's
    text page: a gateway reads one error format from the listener, whatever it got
    wrong."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _error(
            404,
            "NOT_FOUND",
            f"nothing is served at {request.path[:100]!r}: the JSON API is POST /v1/acquire, "
            "/v1/release and /v1/report, and GET /v1/status (/openapi.json lists every path)",
        )
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        answer = _error(
            405,
            "UNIMPLEMENTED",
            f"{request.method} is not served at {request.path[:100]!r}: use {allowed}",
        )
        answer.headers["Allow"] = allowed
        return answer


def _failing_field(body: dict[str, Any], message_type: type[Message]) -> str | None:
    """The first top-level field of ``body`` that protobuf refuses on its own, to name
    it in the error (on the error path only: each is parsed again)."""
    for name, value in body.items():
        try:
            json_format.ParseDict({name: value}, message_type())
        except Exception:  # whatever protobuf raises, this is the field
            return str(name)[:100]
    return None


def _guarded(
    handler: Callable[[web.Request], Awaitable[web.Response]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``handler``, answering in this door's format whatever goes wrong: a bug is a 500
    with ``{"code": "INTERNAL"}``, its traceback in the log, never aiohttp's text page."""

    async def run(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            return _error(500, "INTERNAL", "internal error; the daemon's log has the details")

    return run


def _status_request(pool: str, history: int, tenants: Sequence[str]) -> Message:
    return qosd_pb2.GetStatusRequest(pool=pool, history=history, tenants=list(tenants))


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps({"code": code, "message": message}).encode(),
        content_type="application/json",
    )
