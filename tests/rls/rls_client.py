"""Sends one Envoy RLS v3 request with Envoy's own generated code (PyPI xds-protos).

Run in a separate process with only xds-protos on PYTHONPATH, so the test proves the
wire format against the real definitions, not against qosd's mirror of them:

    PYTHONPATH=.tools/xds-protos python tests/rls/rls_client.py ADDRESS REQUEST_JSON [N]

Sends the request N times (default 1), back to back, and prints a JSON list of the
RateLimitResponses (proto field names) or gRPC errors.
"""

from __future__ import annotations

import json
import sys

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import json_format


def main() -> int:
    address, body = sys.argv[1], sys.argv[2]
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    request = json_format.Parse(body, rls_pb2.RateLimitRequest())
    answers: list[object] = []
    with grpc.insecure_channel(address) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        for _ in range(count):
            try:
                response = stub.ShouldRateLimit(request, timeout=5)
            except grpc.RpcError as error:
                answers.append({"error": error.code().name, "details": error.details()})
                continue
            answers.append(
                json_format.MessageToDict(
                    response,
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                )
            )
    print(json.dumps(answers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
