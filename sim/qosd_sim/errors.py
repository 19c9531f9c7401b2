"""The simulated server's refusal of a request, shared by its gRPC and HTTP front ends."""

from __future__ import annotations

import grpc


class BadRequest(Exception):
    """A request the server refuses; ``code`` is its gRPC status (HTTP answers 400)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
