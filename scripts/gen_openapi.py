#!/usr/bin/env python3
"""Writes qosd/doors/openapi.json: the OpenAPI 3.1 document of the daemon's HTTP
listener (the JSON API, its probes) and of the proxy's OpenAI listener.

The JSON API's bodies are generated from the protobuf descriptors the daemon parses
them with (qosd_client.v1.qosd_pb2), in protobuf's JSON mapping, and described by the
.proto's own comments; its error statuses come from qosd.doors.json_api.HTTP_STATUS,
the proxy's header names from qosd.doors.proxy.handler and .forwarded. So the document cannot drift
from the code that serves it: ``--check`` writes nothing and exits 1 when the
committed file differs from what this generates (``make lint`` and
tests/test_openapi.py run it).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from google.protobuf import descriptor_pb2  # noqa: E402
from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor  # noqa: E402
from grpc_tools import protoc  # type: ignore[import-untyped]  # noqa: E402

from qosd.doors import dialects, json_api  # noqa: E402
from qosd.doors.proxy import forwarded, handler  # noqa: E402
from qosd.doors.request import MAX_ID_LENGTH, MAX_LATENCY_MS  # noqa: E402
from qosd.model import Reason  # noqa: E402
from qosd.status import MAX_HISTORY  # noqa: E402
from qosd_client.v1 import qosd_pb2  # noqa: E402

OUT_PATH = ROOT / "qosd" / "doors" / "openapi.json"
PROTO_DIR = ROOT / "proto" / "qosd" / "v1"
Schema = dict[str, Any]

# -- the .proto's comments ------------------------------------------------------------


def proto_comments() -> dict[str, str]:
    """Each message's, field's, enum's, enum value's and rpc's leading comment, by full
    name.

    The compiled descriptors carry no comments, so the .proto is compiled again with
    its source info, as scripts/gen_proto.sh compiles it; the result must be the
    descriptor the daemon runs (else the generated code is stale)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "qosd.pb"
        status = protoc.main(
            [
                "protoc",
                f"-Iqosd_client/v1={PROTO_DIR}",
                "--include_source_info",
                f"--descriptor_set_out={out}",
                "qosd_client/v1/qosd.proto",
            ]
        )
        if status != 0:
            raise SystemExit(f"protoc failed on {PROTO_DIR / 'qosd.proto'}")
        files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    (source,) = files.file
    info = descriptor_pb2.SourceCodeInfo()
    info.CopyFrom(source.source_code_info)
    source.ClearField("source_code_info")
    _clear_json_names(source.message_type)  # the embedded descriptor leaves them out
    running = descriptor_pb2.FileDescriptorProto.FromString(qosd_pb2.DESCRIPTOR.serialized_pb)
    if source != running:
        raise SystemExit(
            "qosd_client/v1/qosd_pb2.py differs from proto/qosd/v1/qosd.proto "
            "(run scripts/gen_proto.sh first)"
        )
    return _Comments(source, info).found


class _Comments:
    """The walk of a file's descriptor that names each leading comment: protoc keys
    them by path (message 4/i, its field 2/j, nested message 3/k, enum 5/i, ...)."""

    def __init__(
        self, source: descriptor_pb2.FileDescriptorProto, info: descriptor_pb2.SourceCodeInfo
    ) -> None:
        self._by_path = {
            tuple(location.path): _prose(location.leading_comments)
            for location in info.location
            if location.leading_comments
        }
        self.found: dict[str, str] = {}
        package = source.package
        for index, message in enumerate(source.message_type):
            self.message((4, index), package, message)
        for index, enum in enumerate(source.enum_type):
            self.enum((5, index), package, enum)
        for index, service in enumerate(source.service):
            for number, method in enumerate(service.method):
                name = f"{package}.{service.name}.{method.name}"
                self.found[name] = self._by_path.get((6, index, 2, number), "")

    def enum(
        self, path: tuple[int, ...], prefix: str, proto: descriptor_pb2.EnumDescriptorProto
    ) -> None:
        name = f"{prefix}.{proto.name}"
        self.found[name] = self._by_path.get(path, "")
        for index, value in enumerate(proto.value):
            self.found[f"{name}.{value.name}"] = self._by_path.get((*path, 2, index), "")

    def message(
        self, path: tuple[int, ...], prefix: str, proto: descriptor_pb2.DescriptorProto
    ) -> None:
        name = f"{prefix}.{proto.name}"
        self.found[name] = self._by_path.get(path, "")
        for index, field in enumerate(proto.field):
            self.found[f"{name}.{field.name}"] = self._by_path.get((*path, 2, index), "")
        for index, nested in enumerate(proto.nested_type):
            self.message((*path, 3, index), name, nested)
        for index, nested_enum in enumerate(proto.enum_type):
            self.enum((*path, 4, index), name, nested_enum)


def _clear_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _clear_json_names(message.nested_type)


def _prose(comment: str) -> str:
    """A // comment as Markdown: its lines, each without the space after the slashes."""
    lines = [line[1:] if line.startswith(" ") else line for line in comment.splitlines()]
    return "\n".join(lines).strip()


# -- protobuf's JSON mapping ----------------------------------------------------------

INT32 = {FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32}
UINT32 = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32}
INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_SINT64, FieldDescriptor.TYPE_SFIXED64}
UINT64 = {FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64}
FLOATS = {FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT}
#: An integer as a string (protobuf's mapping writes 64-bit integers so, and reads any
#: integer so too).
INTEGER_TEXT = "^-?[0-9]+$"
#: A number as a string: decimal, or the three names the mapping gives the others.
NUMBER_TEXT = r"^(-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?|NaN|Infinity|-Infinity)$"
NON_FINITE = ["NaN", "Infinity", "-Infinity"]
INTEGER_STRING: Schema = {"type": "string", "pattern": INTEGER_TEXT}
NUMBER_STRING: Schema = {"type": "string", "pattern": NUMBER_TEXT}
#: The types mapped alike both ways.
PLAIN: dict[int, Schema] = {
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "contentEncoding": "base64"},
}


def _range(field: FieldDescriptor) -> tuple[int, int]:
    if field.type in INT32:
        return -(2**31), 2**31 - 1
    if field.type in UINT32:
        return 0, 2**32 - 1
    if field.type in INT64:
        return -(2**63), 2**63 - 1
    return 0, 2**64 - 1


class Mapping:
    """The component schemas of the messages a route reads (``input``) and writes
    (``output``), each named after its message: protobuf's JSON mapping is looser on
    the way in (either field name, enums by number too, integers as strings) than
    what ``MessageToDict`` writes, so a message seen both ways gets two schemas."""

    def __init__(self, comments: dict[str, str]) -> None:
        self.comments = comments
        self.schemas: dict[str, Schema] = {}
        self._inputs: set[str] = set()
        self._outputs: set[str] = set()

    def collect(self, roots: list[Descriptor], output: bool) -> None:
        """Notes every message and enum reachable from ``roots``."""
        seen = self._outputs if output else self._inputs
        stack = list(roots)
        while stack:
            message = stack.pop()
            if message.full_name in seen:
                continue
            seen.add(message.full_name)
            for field in message.fields:
                if field.message_type is not None:
                    stack.append(field.message_type)
                if field.enum_type is not None:
                    seen.add(field.enum_type.full_name)

    def name(self, full_name: str, output: bool) -> str:
        short = full_name.rsplit(".", 1)[1]
        both = full_name in self._inputs and full_name in self._outputs
        return f"{short}Output" if output and both else short

    def ref(self, message: Descriptor | EnumDescriptor, output: bool) -> Schema:
        return {"$ref": f"#/components/schemas/{self.name(message.full_name, output)}"}

    def build(self, roots: list[Descriptor], output: bool) -> None:
        """The schemas of ``roots`` and of everything they hold."""
        stack = list(roots)
        while stack:
            message = stack.pop()
            key = self.name(message.full_name, output)
            if key in self.schemas:
                continue
            self.schemas[key] = self.message(message, output)
            for field in message.fields:
                if field.enum_type is not None:
                    enum_key = self.name(field.enum_type.full_name, output)
                    self.schemas.setdefault(enum_key, self.enum(field.enum_type, output))
                if field.message_type is not None:
                    stack.append(field.message_type)

    def message(self, message: Descriptor, output: bool) -> Schema:
        properties: dict[str, Schema] = {}
        required = []
        for field in message.fields:
            schema = self.field(field, output)
            text = self.comments.get(field.full_name, "")
            if text:
                schema = {**schema, "description": text}
            properties[field.name] = schema
            if output and not field.has_presence:
                required.append(field.name)  # MessageToDict writes every such field
            if not output and field.json_name != field.name:
                properties[field.json_name] = {
                    **self.field(field, output),
                    "description": f"`{field.name}`, by its JSON name.",
                }
        built: Schema = {"type": "object"}
        text = self.comments.get(message.full_name, "")
        if text:
            built["description"] = text
        built["properties"] = properties
        if output:
            built["required"] = required
        else:
            built["additionalProperties"] = False  # an unknown field is a 400
        return built

    def field(self, field: FieldDescriptor, output: bool) -> Schema:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            raise SystemExit(f"{field.full_name}: map fields are not mapped here yet")
        item = self.scalar(field, output)
        if field.is_repeated:
            item = {"type": "array", "items": item}
        if output:
            return item
        # The mapping reads null as the field's default (absent, for a field with
        # presence).
        if "$ref" in item:
            return {"oneOf": [item, {"type": "null"}]}
        if "oneOf" in item:
            return {"oneOf": [*item["oneOf"], {"type": "null"}]}
        return {**item, "type": [item["type"], "null"]}

    def scalar(self, field: FieldDescriptor, output: bool) -> Schema:
        kind = field.type
        if field.message_type is not None:
            if field.message_type.full_name.startswith("google.protobuf."):
                raise SystemExit(f"{field.full_name}: well-known types are not mapped here yet")
            return self.ref(field.message_type, output)
        if field.enum_type is not None:
            return self.ref(field.enum_type, output)
        if kind in PLAIN:
            return PLAIN[kind]
        if kind in FLOATS:
            text = {"type": "string", "enum": NON_FINITE} if output else NUMBER_STRING
            return {"oneOf": [{"type": "number"}, text]}
        low, high = _range(field)
        number = {"type": "integer", "minimum": low, "maximum": high}
        if not output:
            return {"oneOf": [number, INTEGER_STRING]}
        return INTEGER_STRING if kind in INT64 | UINT64 else number

    def enum(self, enum: EnumDescriptor, output: bool) -> Schema:
        names = [value.name for value in enum.values]
        lines = [self.comments.get(enum.full_name, "")]
        lines += [
            f"- `{value.name}`: {self.comments.get(f'{enum.full_name}.{value.name}', '')}".rstrip(
                ": "
            )
            for value in enum.values
        ]
        text = "\n".join(line for line in lines[1:] if line)
        if lines[0]:
            text = f"{lines[0]}\n\n{text}"
        if output:
            return {"type": "string", "enum": names, "description": text}
        by_number = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
        return {
            "description": text + "\n\nBy name, or by number.",
            "oneOf": [{"type": "string", "enum": names}, by_number],
        }


# -- the daemon's JSON API ------------------------------------------------------------

#: What each gRPC code the handlers raise means over HTTP.
CODE_MEANINGS = {
    "INVALID_ARGUMENT": "the body is not a JSON object of the message's fields, or a field "
    "is not valid; the message names the field",
    "OUT_OF_RANGE": "a value is out of range",
    "UNAUTHENTICATED": "`auth.qos` is set and the call shows no credentials",
    "PERMISSION_DENIED": "the credentials shown are not allowed",
    "NOT_FOUND": "the lease, or the pool, is not known",
    "ALREADY_EXISTS": "the `request_id` already names another request",
    "FAILED_PRECONDITION": "the lease has expired",
    "CANCELLED": "the client went away before the answer (recorded, never seen)",
    "UNAVAILABLE": "the store could not record or answer the call; retry",
    "DEADLINE_EXCEEDED": "the call's deadline passed",
    "INTERNAL": "a bug in qosd; the daemon's log has the traceback",
}
#: Codes no handler raises over HTTP: policy answers are 200s.
UNUSED_CODES = {grpc.StatusCode.RESOURCE_EXHAUSTED}
ROUTE_MESSAGES = {"acquire": "Acquire", "release": "Release", "report": "Report"}
SECURITY: list[dict[str, list[str]]] = [{}, {"bearer": []}, {"mtls": []}]
DAEMON_SERVER = {
    "url": "{scheme}://{address}",
    "description": "the daemon's HTTP listener (`server.http_listen`; `qosd proxy --http-listen`)",
    "variables": {
        "scheme": {
            "enum": ["http", "https"],
            "default": "http",
            "description": "https with `server.tls`",
        },
        "address": {"default": "127.0.0.1:9464"},
    },
}
PROXY_SERVER = {
    "url": "{scheme}://{address}",
    "description": "`qosd proxy`'s OpenAI listener (`--listen`)",
    "variables": {
        "scheme": {
            "enum": ["http", "https"],
            "default": "http",
            "description": "https with `server.tls`",
        },
        "address": {"default": "127.0.0.1:8080"},
    },
}


def json_api_statuses() -> dict[int, list[str]]:
    """HTTP status -> the gRPC code names answered with it; an unmapped code is a 500."""
    statuses: dict[int, list[str]] = {}
    for code, status in json_api.HTTP_STATUS.items():
        if code is not grpc.StatusCode.OK and code not in UNUSED_CODES:
            statuses.setdefault(status, []).append(code.name)
    unmapped = [c.name for c in grpc.StatusCode if c not in json_api.HTTP_STATUS]
    statuses[500] += sorted(unmapped)
    return dict(sorted(statuses.items()))


def json_api_responses() -> dict[str, Schema]:
    responses: dict[str, Schema] = {}
    for status, codes in json_api_statuses().items():
        meanings = "; ".join(
            f"`{code}`: {CODE_MEANINGS.get(code, 'not raised by qosd')}" for code in codes
        )
        responses[f"JsonApi{status}"] = _error_response(meanings + ".", codes)
    responses["JsonApi413"] = _error_response(
        f"`INVALID_ARGUMENT`: the body is over {json_api.MAX_BODY_BYTES} bytes.",
        ["INVALID_ARGUMENT"],
    )
    return responses


def _error_response(description: str, codes: list[str]) -> Schema:
    schema = {
        "allOf": [
            {"$ref": "#/components/schemas/ApiError"},
            {"properties": {"code": {"enum": codes}}},
        ]
    }
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def json_api_operation(method: str, mapping: Mapping, post: bool) -> Schema:
    service = qosd_pb2.DESCRIPTOR.services_by_name["QoS" if post else "Admin"]
    rpc = service.methods_by_name[method]
    answer = rpc.output_type
    statuses = [*json_api_statuses(), *([413] if post else [])]
    responses: dict[str, Schema] = {
        "200": {
            "description": f"The {answer.name}, every field present, by its .proto name.",
            "content": {"application/json": {"schema": mapping.ref(answer, output=True)}},
        }
    }
    for status in sorted(statuses):
        responses[str(status)] = {"$ref": f"#/components/responses/JsonApi{status}"}
    summary = mapping.comments.get(f"{service.full_name}.{method}", "")
    operation: Schema = {
        "tags": ["json-api"],
        "operationId": method[0].lower() + method[1:],
        "summary": f"{service.name}/{method} as JSON",
        "description": (
            f"Runs `{service.full_name}/{method}`'s own handler chain: the same "
            "validation, `auth.qos` rule and trace propagation as over gRPC."
            + (f"\n\n{summary}" if summary else "")
        ),
        "security": SECURITY,
        "parameters": [
            {"$ref": "#/components/parameters/traceparent"},
            {"$ref": "#/components/parameters/tracestate"},
        ],
        "responses": responses,
    }
    if post:
        operation["requestBody"] = {
            "description": f"The {rpc.input_type.name} in protobuf's JSON mapping; an empty "
            "body is the empty message.",
            "content": {"application/json": {"schema": mapping.ref(rpc.input_type, False)}},
        }
    return operation


def status_parameters(mapping: Mapping) -> list[Schema]:
    """GetStatusRequest's fields as the query names them."""
    fields = qosd_pb2.GetStatusRequest.DESCRIPTOR.fields_by_name

    def text(name: str) -> str:
        return mapping.comments[fields[name].full_name]

    return [
        {"name": "pool", "in": "query", "description": text("pool"), "schema": {"type": "string"}},
        {
            "name": "history",
            "in": "query",
            "description": text("history"),
            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_HISTORY, "default": 0},
        },
        {
            "name": "tenant",
            "in": "query",
            "description": text("tenants") + " Repeat the parameter for each.",
            "style": "form",
            "explode": True,
            "schema": {"type": "array", "items": {"type": "string"}},
        },
    ]


# -- the proxy ------------------------------------------------------------------------

PROXY_STATUSES = {
    400: "Bad input, `error.param` naming the field or header: malformed JSON (`body`), no "
    "model, a bad `max_tokens` (or one past `limits.max_request_tokens`), a bad `n` or "
    "`best_of`, an unknown class, an objective out of range; or the upstream's own 400, "
    "passed on.",
    401: "No credentials: an API key (`--api-key`) or `auth.qos` is required.",
    403: "The credentials are not allowed, or `x-qos-class` asks above the key's class.",
    404: "No upstream serves the model (`code`: `model_not_found`).",
    409: "`x-request-id` already names another request (`code`: `duplicate_request_id`).",
    413: "The body is over `--max-body-bytes`.",
    429: "Refused by qosd's rules; the SDKs retry after `Retry-After`. `x-qos-reason`, and "
    "`code`, name the reason.",
    499: "The client left before its answer: counted on /metrics "
    "(`qosd_proxy_requests_total`), never sent.",
    500: "A bug in the proxy; its log has the traceback.",
    502: "The upstream was unreachable, or its answer broke off or was over "
    "`--max-answer-bytes` (`code`: `upstream_too_large`).",
    504: "The upstream went silent past `--upstream-read-timeout`.",
    503: "The store is down under `fail_mode: closed`, or the proxy is draining "
    "(`x-qos-reason`); or the upstream's own 503, passed on.",
}
#: The answer headers of every proxied answer (docs/integrations.md).
RATE_LIMIT_HEADERS = {
    "x-ratelimit-limit-tokens": {
        "description": "The class's bucket at the admitted rate: the most it holds, in "
        "qosd's cost units (prompt tokens with the default cost).",
        "schema": {"type": "integer", "minimum": 0},
    },
    "x-ratelimit-remaining-tokens": {
        "description": "What the class's bucket holds after this request.",
        "schema": {"type": "integer", "minimum": 0},
    },
    "x-ratelimit-reset-tokens": {
        "description": "How long the class's rate takes to fill its bucket, as OpenAI "
        "writes it (`20ms`, `1.5s`, `6m0s`).",
        "schema": {"type": "string"},
    },
    "x-ratelimit-limit-requests": {
        "description": "The pool's in-flight bound, where it has one.",
        "schema": {"type": "integer", "minimum": 0},
    },
    "x-ratelimit-remaining-requests": {
        "description": "The in-flight bound's room after this request, where there is one.",
        "schema": {"type": "integer", "minimum": 0},
    },
}
REFUSAL_HEADERS = {
    "x-should-retry": {
        "description": "`false` where no retry can help (a cost no bucket of the class "
        "holds, a wait past the SDKs' 120 s window, any 4xx); the official SDKs read it.",
        "schema": {"type": "string", "enum": ["true", "false"]},
    },
    "x-llm-d-request-dropped-reason": {
        "description": "llm-d's name for the refusal (`rejected-saturated`, "
        "`rejected-ttl-expired`, `rejected-shutting-down`, or `rejected-<qosd reason>`).",
        "schema": {"type": "string"},
    },
    "Retry-After": {
        "description": "Seconds to wait before retrying, rounded up; absent when "
        "retrying cannot help.",
        "schema": {"type": "integer", "minimum": 1},
    },
    "retry-after-ms": {
        "description": "The same in milliseconds (OpenAI's header).",
        "schema": {"type": "integer", "minimum": 1},
    },
}


def reason_header(required: bool) -> Schema:
    reasons = [r.name.lower() for r in Reason if r not in (Reason.NONE, Reason.FAIL_OPEN)]
    return {
        "description": "qosd's reason for the refusal.",
        "required": required,
        "schema": {"type": "string", "enum": reasons},
    }


def proxy_headers() -> dict[str, Schema]:
    """The request headers the proxy reads, as parameters."""
    objective = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_LATENCY_MS}
    found: dict[str, Schema] = {
        handler.CLASS_HEADER: {
            "description": "The request's QoS class (a configured class name); absent: the "
            "API key's, else `--default-class`. With API keys it may lower the key's class, "
            "never raise it.",
            "schema": {"type": "string", "maxLength": MAX_ID_LENGTH},
        },
        handler.TENANT_HEADER: {
            "description": "The tenant the request is billed to (unless its API key names one).",
            "schema": {"type": "string", "maxLength": MAX_ID_LENGTH},
        },
        forwarded.REQUEST_ID_HEADER: {
            "description": "Idempotency key (Acquire's `request_id`); passed upstream.",
            "schema": {"type": "string", "maxLength": MAX_ID_LENGTH},
        },
    }
    for latency, names in (("TTFT", handler.TTFT_HEADERS), ("TPOT", handler.TPOT_HEADERS)):
        listed = ", ".join(f"`{name}`" for name in names)
        for name in names:
            found[name] = {
                "description": f"The request's own {latency} objective, milliseconds; the "
                f"first of {listed} present is used.",
                "schema": objective,
            }
    found[dialects.OBJECTIVE_HEADERS[0]] = {
        "description": "llm-d's InferenceObjective, mapped to a class by "
        "`peer_headers.objectives` (after `x-qos-class`).",
        "schema": {"type": "string", "maxLength": MAX_ID_LENGTH},
    }
    found[dialects.OBJECTIVE_HEADERS[1]] = {
        "description": "The deprecated name of llm-d's objective header.",
        "schema": {"type": "string", "maxLength": MAX_ID_LENGTH},
    }
    for name in dialects.FAIRNESS_HEADERS:
        found[name] = {
            "description": "llm-d's tenant (after `x-qos-tenant`); the second name is the "
            "deprecated one.",
            "schema": {"type": "string", "maxLength": MAX_ID_LENGTH},
        }
    found[dialects.DYNAMO_PRIORITY_HEADER] = {
        "description": "Dynamo's request priority (higher first), mapped to a class by "
        "`peer_headers.dynamo_priority`.",
        "schema": {"type": "integer"},
    }
    for name in forwarded.FORWARDED_HEADERS:
        found.setdefault(
            name,
            {
                "description": "Passed upstream when well formed (W3C Trace Context for "
                "traceparent and tracestate), else dropped.",
                "schema": {"type": "string"},
            },
        )
    return found


def openai_error_schema() -> Schema:
    return {
        "type": "object",
        "description": "OpenAI's error format, which the SDKs raise and retry on. An "
        "upstream's own error is passed on as it came (vLLM's `code` is the status, a "
        "number).",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {
                        "type": "string",
                        "description": "e.g. `invalid_request_error`, "
                        "`rate_limit_exceeded`, `upstream_error`",
                    },
                    "param": {
                        "type": ["string", "null"],
                        "description": "The field or header at fault.",
                    },
                    "code": {"type": ["string", "integer", "null"]},
                },
            }
        },
    }


#: One server-sent event of a streamed answer (the schema of each event, as OpenAI's
#: own document and schemathesis read a text/event-stream schema).
STREAM_EVENT: Schema = {
    "type": "object",
    "description": "One server-sent event, as the upstream sent it: `data` is a chunk as "
    "JSON (`chat.completion.chunk`, `text_completion`), or `[DONE]` last; a stream that "
    "broke off ends with an OpenAI error as JSON. The usage chunk comes only to a request "
    "that asked for it (`stream_options.include_usage`).",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def completion_request(chat: bool) -> Schema:
    """The fields the proxy reads; the rest goes upstream as it came."""
    count = {"type": "integer", "minimum": 0}
    properties: dict[str, Schema] = {"model": {"type": "string", "minLength": 1}}
    if chat:
        properties["messages"] = {
            "type": "array",
            "description": "Their `content` (a string, or parts with `text`) and "
            "`tool_calls` are the prompt whose bytes estimate its tokens.",
            "items": {"type": "object"},
        }
    else:
        properties["prompt"] = {
            "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]
        }
    choices = {"type": "integer", "minimum": 1, "maximum": 128}
    properties |= {
        "max_tokens": {
            **count,
            "description": "The output of each answer the request is charged for at "
            "admission (else the class's learned mean), at most `limits.max_request_tokens`. "
            "Written without a fraction: the proxy refuses `16.0`, which JSON Schema counts as "
            "an integer.",
        },
        "max_completion_tokens": {**count, "description": "As `max_tokens`, and before it."},
        "n": {
            **choices,
            "description": "Answers to generate: the expected output is charged this many times.",
        },
        "best_of": {
            **choices,
            "description": "Answers the server generates to return the best `n`: charged as "
            "`n` is, the larger of the two.",
        },
        "tools": {
            "type": "array",
            "description": "Counted in the prompt (their JSON's bytes), as are `functions` and "
            "`response_format`.",
        },
        "priority": {
            "description": "Never forwarded: with `--priority-upstreams` the proxy sets it "
            "from the class."
        },
        "stream": {"type": "boolean"},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    }
    return {
        "type": "object",
        "required": ["model", "messages" if chat else "prompt"],
        "properties": properties,
    }


def proxy_operation(chat: bool) -> Schema:
    name = "ChatCompletionRequest" if chat else "CompletionRequest"
    responses: dict[str, Schema] = {
        "200": {
            "description": "The upstream's answer as it gave it: a JSON body, or with "
            "`stream` its server-sent events, relayed as they come; with the rate-limit "
            "headers of the request's class.",
            "headers": RATE_LIMIT_HEADERS,
            "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"$ref": "#/components/schemas/StreamEvent"}},
            },
        }
    }
    for status, text in PROXY_STATUSES.items():
        response: Schema = {
            "description": text,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/OpenAIError"}}
            },
        }
        if status in (429, 503):
            response["headers"] = {
                **RATE_LIMIT_HEADERS,
                **REFUSAL_HEADERS,
                "x-qos-reason": {"$ref": f"#/components/headers/QosReason{status}"},
            }
        responses[str(status)] = response
    path = "chat/completions" if chat else "completions"
    return {
        "tags": ["proxy"],
        "operationId": "createChatCompletion" if chat else "createCompletion",
        "summary": f"OpenAI's POST /v1/{path}, admitted by qosd",
        "description": "Admitted, queued or refused by qosd's rules (class and tenant from "
        "the headers or the API key, cost estimated from the prompt and `max_tokens`), then "
        "forwarded to an upstream serving `model`; the lease ends with the usage the "
        "upstream reports. An upstream's answer other than 200 is passed on as it came.",
        "security": SECURITY,
        "parameters": [{"$ref": f"#/components/parameters/{header}"} for header in proxy_headers()],
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        },
        "responses": responses,
    }


# -- the document ---------------------------------------------------------------------


def document() -> Schema:
    mapping = Mapping(proto_comments())
    services = qosd_pb2.DESCRIPTOR.services_by_name
    methods = [services["QoS"].methods_by_name[m] for m in ROUTE_MESSAGES.values()]
    methods.append(services["Admin"].methods_by_name["GetStatus"])
    inputs = [m.input_type for m in methods if m.name != "GetStatus"]
    outputs = [m.output_type for m in methods]
    mapping.collect(inputs, output=False)
    mapping.collect(outputs, output=True)
    mapping.build(inputs, output=False)
    mapping.build(outputs, output=True)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]["version"]

    paths: dict[str, Schema] = {}
    for route, method in ROUTE_MESSAGES.items():
        paths[f"/v1/{route}"] = {
            "servers": [DAEMON_SERVER],
            "post": json_api_operation(method, mapping, post=True),
        }
    status = json_api_operation("GetStatus", mapping, post=False)
    status["parameters"] = [*status_parameters(mapping), *status["parameters"]]
    paths["/v1/status"] = {"servers": [DAEMON_SERVER], "get": status}
    paths |= probe_paths()
    paths["/v1/chat/completions"] = {"servers": [PROXY_SERVER], "post": proxy_operation(True)}
    paths["/v1/completions"] = {"servers": [PROXY_SERVER], "post": proxy_operation(False)}
    paths["/v1/models"] = {"servers": [PROXY_SERVER], "get": models_operation()}
    paths["/openapi.json"] = {
        "servers": [DAEMON_SERVER, PROXY_SERVER],
        "get": {
            "tags": ["document"],
            "operationId": "getOpenApi",
            "summary": "This document",
            "description": "Served on both listeners; written by scripts/gen_openapi.py.",
            "responses": {
                "200": {
                    "description": "OpenAPI 3.1, as JSON.",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                }
            },
        },
    }
    schemas = dict(sorted(mapping.schemas.items()))
    schemas["ApiError"] = {
        "type": "object",
        "description": "The JSON API's error: the gRPC status code's name, and its message.",
        "required": ["code", "message"],
        "properties": {
            "code": {"type": "string", "enum": [c.name for c in grpc.StatusCode if c.name != "OK"]},
            "message": {"type": "string"},
        },
    }
    schemas["OpenAIError"] = openai_error_schema()
    schemas["StreamEvent"] = STREAM_EVENT
    schemas["ChatCompletionRequest"] = completion_request(chat=True)
    schemas["CompletionRequest"] = completion_request(chat=False)
    parameters: dict[str, Schema] = {
        name: {"name": name, "in": "header", **spec} for name, spec in proxy_headers().items()
    }
    for name in ("traceparent", "tracestate"):
        parameters[name] = {
            "name": name,
            "in": "header",
            "description": "W3C trace context: with tracing on, qosd's span joins the "
            "caller's trace.",
            "schema": {"type": "string"},
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "qosd",
            "version": version,
            "summary": "Request-level QoS admission control for LLM inference fleets.",
            "description": DESCRIPTION,
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "tags": [
            {
                "name": "json-api",
                "description": "qosd's gRPC API as JSON, on the daemon's "
                'HTTP listener (docs/api.md, "JSON over HTTP").',
            },
            {
                "name": "probes",
                "description": "Health, readiness and metrics, on the daemon's HTTP listener.",
            },
            {
                "name": "proxy",
                "description": "The OpenAI API in front of OpenAI-compatible "
                "servers, on `qosd proxy`'s listener (docs/proxy.md).",
            },
            {"name": "document", "description": "This document, on both listeners."},
        ],
        "paths": paths,
        "components": {
            "schemas": schemas,
            "responses": dict(sorted(json_api_responses().items())),
            "parameters": parameters,
            "headers": {
                "QosReason429": reason_header(required=True),
                "QosReason503": reason_header(required=False),
            },
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "`auth.qos`'s token; on the proxy also an API key "
                    "(`--api-key`), which decides the class and tenant. Needed only when "
                    "either is configured.",
                },
                "mtls": {
                    "type": "mutualTLS",
                    "description": "A client certificate whose identity `auth.qos` allows "
                    "(with `server.tls`).",
                },
            },
        },
    }


DESCRIPTION = """\
Two listeners. The daemon's HTTP listener (`server.http_listen`) serves qosd's
gRPC calls as JSON (`/v1/acquire`, `/v1/release`, `/v1/report`, `/v1/status`) and its
probes; `qosd proxy`'s listener serves the OpenAI API (`/v1/chat/completions`,
`/v1/completions`, `/v1/models`). Both serve this document at `/openapi.json`.

JSON API bodies are the messages of `proto/qosd/v1/qosd.proto` in protobuf's JSON
mapping, and their schemas here are generated from its descriptors: field names as in
the .proto (`input_tokens`), also accepted by their lowerCamelCase JSON names
(`inputTokens`, not both at once); enums by name (numbers accepted too); 64-bit
integers as strings or numbers (answers write strings); doubles as numbers, or the
strings `NaN`, `Infinity`, `-Infinity`; `null` for a field's default; unknown fields
are a 400. Answers carry every field without presence, by its .proto name. A policy
refusal is a 200 with decision `DECISION_REJECTED`, never an error status; an error is
`{"code": "<gRPC code name>", "message": ...}` with the HTTP status of its code.

The proxy's errors are in OpenAI's format; its refusals are 429s with `Retry-After`,
`retry-after-ms` and `x-qos-reason`, which the official SDKs retry."""


def probe_paths() -> dict[str, Schema]:
    def probe(operation_id: str, summary: str, responses: Schema) -> Schema:
        return {
            "servers": [DAEMON_SERVER],
            "get": {
                "tags": ["probes"],
                "operationId": operation_id,
                "summary": summary,
                "responses": responses,
            },
        }

    ready = {
        "type": "object",
        "required": ["ready", "reason", "store_reachable"],
        "properties": {
            "ready": {"type": "boolean"},
            "reason": {"type": "string"},
            "store_reachable": {"type": "boolean"},
        },
    }
    text = {"text/plain": {"schema": {"type": "string"}}}
    return {
        "/healthz": probe(
            "healthz",
            "The process and its event loop answer",
            {"200": {"description": "`ok`", "content": text}},
        ),
        "/readyz": probe(
            "readyz",
            "The daemon can answer as configured",
            {
                "200": {
                    "description": "Ready.",
                    "content": {"application/json": {"schema": ready}},
                },
                "503": {
                    "description": "Not ready: the store is unreachable under "
                    "`fail_mode: closed`, or the daemon is draining.",
                    "content": {"application/json": {"schema": ready}},
                },
            },
        ),
        "/metrics": probe(
            "metrics",
            "Prometheus metrics, in the text format 0.0.4",
            {"200": {"description": "The exposition.", "content": text}},
        ),
    }


def models_operation() -> Schema:
    model = {
        "type": "object",
        "required": ["id"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "owned_by": {"type": "string"},
        },
    }
    listing = {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": model}},
    }
    return {
        "tags": ["proxy"],
        "operationId": "listModels",
        "summary": "OpenAI's GET /v1/models: every upstream's models",
        "description": "Each model as its first server lists it (all asked at once, each "
        "for up to 5 s), else a stub entry: a server that is down, silent or answers "
        "nonsense costs only its own entries.",
        "responses": {
            "200": {
                "description": "The models served.",
                "content": {"application/json": {"schema": listing}},
            }
        },
    }


def text() -> str:
    return json.dumps(document(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    check = parser.parse_args().check
    generated = text()
    current = OUT_PATH.read_text("utf-8") if OUT_PATH.exists() else None
    if current == generated:
        if check:
            print("qosd/doors/openapi.json matches the proto and the routes")
        return 0
    if check:
        print(
            f"{OUT_PATH.relative_to(ROOT)} differs from what scripts/gen_openapi.py "
            "generates (run it)",
            file=sys.stderr,
        )
        return 1
    OUT_PATH.write_text(generated, "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
