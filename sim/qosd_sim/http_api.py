"""KServe v2 HTTP/REST for the simulated Triton server, as Triton serves on port 8000.

Enough of the protocol for ``tritonclient.http`` (sync and aio): health, model
readiness and ``POST /v2/models/{model}[/versions/{v}]/infer`` with JSON tensors or
the binary tensor extension (``Inference-Header-Content-Length``). Requests run on
the same simulated GPU as the gRPC ones; answers are JSON. Errors are 400 with
``{"error": ...}``, as Triton answers them; a refusal for a full queue (gRPC
UNAVAILABLE) is 503, as Triton maps that status.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc
from aiohttp import web
from tritonclient.grpc import service_pb2

from qosd_sim.errors import BadRequest
from qosd_sim.metrics import TritonMetrics


class InferenceBackend(Protocol):
    """What the HTTP front end needs of the server (``SimulatedTriton``)."""

    model_name: str
    metrics: TritonMetrics

    def serve(
        self, request: service_pb2.ModelInferRequest, stream_every: int, traceparent: str = ""
    ) -> AsyncIterator[tuple[int, bool]]: ...


HEADER_LENGTH = "Inference-Header-Content-Length"
OUTPUT = "token_count"


def kserve_http_app(servicer: InferenceBackend) -> web.Application:
    async def live(_: web.Request) -> web.Response:
        return web.Response()

    async def model_ready(request: web.Request) -> web.Response:
        ok = request.match_info["model"] == servicer.model_name
        return web.Response(status=200 if ok else 400)

    async def infer(request: web.Request) -> web.Response:
        try:
            grpc_request = _to_grpc_request(request.match_info["model"], await request.read(),
                                            request.headers.get(HEADER_LENGTH))  # fmt: skip
        except (ValueError, KeyError, TypeError, struct.error) as exc:
            return _error(f"malformed inference request: {exc}")
        total = 0
        try:
            async for tokens, _ in servicer.serve(
                grpc_request, 0, request.headers.get("traceparent", "")
            ):
                total += tokens
        except BadRequest as exc:
            servicer.metrics.failure(servicer.model_name, "REJECTED")
            return _error(str(exc), 503 if exc.code == grpc.StatusCode.UNAVAILABLE else 400)
        body = {
            "model_name": servicer.model_name,
            "model_version": "1",
            "outputs": [{"name": OUTPUT, "datatype": "INT32", "shape": [1], "data": [total]}],
        }
        if grpc_request.id:
            body["id"] = grpc_request.id
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", live)
    app.router.add_get("/v2/models/{model}/ready", model_ready)
    app.router.add_post("/v2/models/{model}/infer", infer)
    app.router.add_post("/v2/models/{model}/versions/{version}/infer", infer)
    return app


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": message}, status=status)


def _to_grpc_request(
    model: str, body: bytes, header_length: str | None
) -> service_pb2.ModelInferRequest:
    """The JSON (and binary) request as the gRPC message the servicer runs."""
    length = int(header_length) if header_length is not None else len(body)
    header: dict[str, Any] = json.loads(body[:length])
    binary = body[length:]
    request = service_pb2.ModelInferRequest(model_name=model, id=str(header.get("id", "")))
    for name, value in (header.get("parameters") or {}).items():
        if isinstance(value, str):
            request.parameters[name].string_param = value
    offset = 0
    for tensor in header["inputs"]:
        entry = request.inputs.add(
            name=tensor["name"], datatype=tensor["datatype"], shape=tensor.get("shape", [])
        )
        size = (tensor.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            raw = binary[offset : offset + int(size)]
            offset += int(size)
            count = len(raw) // 4
            entry.contents.int_contents.extend(struct.unpack(f"<{count}i", raw[: count * 4]))
        else:
            entry.contents.int_contents.extend(
                int(value) for value in _flat(tensor.get("data", []))
            )
    return request


def _flat(data: Any) -> list[Any]:
    """KServe allows nested (row-major) or flat data."""
    if isinstance(data, list):
        return [item for element in data for item in _flat(element)]
    return [data]
