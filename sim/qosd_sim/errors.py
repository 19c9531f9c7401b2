"""The simulated server's refusal of a request, shared by its gRPC and HTTP front ends."""

from __future__ import annotations

import grpc

#: How the message of a request refused for a full queue (``--max-num-queued-reqs``) starts,
#: on every front end: clients and gateways tell a refusal to retry from a failure by it.
QUEUE_FULL = "queue full"


class BadRequest(Exception):
    """A request the server refuses; ``code`` is its gRPC status (HTTP answers 400, or
    503 for UNAVAILABLE)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class QueueFull(BadRequest):
    """Refused on arrival, never run: the engine already had ``max_queued`` requests in
    flight, waiting or running. gRPC UNAVAILABLE (HTTP 503), as vLLM answers beyond
    ``--max-num-queued-reqs``; the message starts with ``QUEUE_FULL``."""

    def __init__(self, max_queued: int) -> None:
        super().__init__(
            grpc.StatusCode.UNAVAILABLE,
            f"{QUEUE_FULL}: the server has {max_queued} requests in flight, waiting or "
            "running (--max-num-queued-reqs)",
        )
