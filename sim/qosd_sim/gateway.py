"""A gateway's request loop, as a platform would write it around qosd and Triton.

For every request: ``Acquire`` from qosd (unless the policy is plain FIFO), stream the
inference from the model server through the real ``tritonclient``, then ``Release``
with the tokens actually generated. Latencies are measured here, at the gateway, from
the moment the request arrived: time spent waiting for admission counts against TTFT,
as a user would feel it. The model server separately reports its own view of the
latencies to qosd, which is what the SLO loop judges.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc.aio as triton

from qosd_client import Outcome, QosdClient, QosdError
from qosd_sim.errors import QUEUE_FULL
from qosd_sim.replay import Request

#: The output length a gateway asks qosd to budget for, before it knows the real one.
EXPECTED_OUTPUT_TOKENS = 256
#: How a record's ``error`` starts when its client gave up waiting (not a failure).
GAVE_UP = "gave up"


@dataclass(slots=True)
class RequestRecord:
    """What became of one request, as the gateway saw it."""

    request: Request
    # qosd's reason: NONE (admitted), RATE_LIMITED, QUEUE_TIMEOUT...; ERROR when Acquire
    # failed; UNANSWERED when the run ended while it waited.
    decision: str = "NONE"
    admitted: bool = False
    waited_ms: float = 0.0  # in qosd's waiting room
    ttft_ms: float | None = None  # from arrival at the gateway
    e2e_ms: float | None = None
    completed: bool = False
    tokens_seen: int = 0  # output tokens the server's responses carried
    error: str = ""
    late_ms: float = 0.0  # how far behind its scheduled arrival the gateway sent it
    retries: int = 0  # times the gateway sent it again after the server refused it

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.request.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.request.output_tokens - 1)


def token_inputs(input_tokens: int, output_tokens: int, module: Any = triton) -> list[Any]:
    """The simulated model's two INT32 inputs, as ``module``'s InferInput (any of
    tritonclient.grpc, .grpc.aio, .http, .http.aio)."""
    tensors = []
    for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
        tensor = module.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], dtype=np.int32))
        tensors.append(tensor)
    return tensors


def _inputs(request: Request) -> list[triton.InferInput]:
    return token_inputs(request.input_tokens, request.output_tokens)


class ReplayLoop:
    """Sends a workload's requests at their offsets and keeps what became of each;
    ``_infer`` is how one request is served (by a gateway around qosd and Triton
    here, through an OpenAI-compatible endpoint in ``qosd_sim.openai_gateway``)."""

    def __init__(self, on_record: Callable[[RequestRecord], None] | None = None) -> None:
        self._on_record = on_record
        self.records: list[RequestRecord] = []

    async def _infer(self, request: Request, record: RequestRecord, arrived: float) -> None:
        raise NotImplementedError

    async def _one(self, request: Request, arrived: float) -> None:
        record = RequestRecord(request, late_ms=max(0.0, (time.monotonic() - arrived) * 1000))
        self.records.append(record)
        try:
            await self._infer(request, record, arrived)
        except asyncio.CancelledError:
            record.error = record.error or "unfinished at the end of the run"
            if not record.admitted and record.decision == "NONE":
                record.decision = "UNANSWERED"  # still waiting for admission
        except Exception as exc:  # a failed request is a result, not a crash
            record.error = f"{type(exc).__name__}: {exc}"
            if not record.admitted and record.decision == "NONE":
                record.decision = "ERROR"
        finally:
            if self._on_record is not None:
                self._on_record(record)

    async def replay(self, workload: Sequence[Request], *, drain_s: float = 30.0) -> None:
        """Sends each request at its offset, then waits up to ``drain_s`` for the rest.

        What is still running after that is cancelled and recorded unfinished. Latency
        counts from each request's scheduled arrival, not from when this loop got to
        it, so a busy gateway cannot hide its own delay (no coordinated omission).
        """
        started = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        try:
            for request in workload:
                arrival = started + request.at_s
                delay = arrival - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(self._one(request, arrival)))
            if tasks:
                await asyncio.wait(tasks, timeout=drain_s)
        finally:
            pending = [task for task in tasks if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


class ServerRefused(RuntimeError):
    """The server refused the request at once (its queue was full): nothing ran."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a client retries a refusal, as the official ``openai`` Python SDK does by
    default (``_base_client``: 2 retries; ``min(0.5 x 2^n, 8)`` seconds before retry
    n+1, times a jitter of 1 - 0.25 x U[0, 1)); the server sends no Retry-After."""

    max_retries: int = 2
    initial_s: float = 0.5
    max_s: float = 8.0
    jitter: float = 0.25

    def delay_s(self, retries_so_far: int, rng: random.Random) -> float:
        base = min(self.initial_s * 2.0**retries_so_far, self.max_s)
        return base * (1 - self.jitter * rng.random())


@dataclass(frozen=True, slots=True)
class ClientHabits:
    """How the gateway's clients behave beyond sending: ``give_up_s``, seconds after
    its arrival at which a request's client stops waiting for the first token (None:
    never; per request, as clients with a timeout do); ``retry``, how a refusal by the
    server is retried (None: not)."""

    give_up_s: Callable[[Request], float | None] | None = None
    retry: RetryPolicy | None = None


#: Clients that wait as long as it takes and never retry.
PATIENT = ClientHabits()


class Gateway(ReplayLoop):
    """Replays a workload around qosd and Triton; one instance per run."""

    def __init__(
        self,
        triton_client: triton.InferenceServerClient,
        *,
        model: str,
        qos: QosdClient | None,
        expected_output_tokens: int = EXPECTED_OUTPUT_TOKENS,
        on_record: Callable[[RequestRecord], None] | None = None,
        class_ranks: Mapping[str, int] | None = None,
        replicas: Sequence[QosdClient] = (),
        habits: ClientHabits = PATIENT,
    ) -> None:
        """``class_ranks``: without qosd, each class's priority for servers that
        schedule by it (0 first), as a gateway that knows its classes would pass it;
        with qosd, its answer's ``server_priority`` is passed instead. ``replicas``:
        more daemons of the same fleet; request i calls ``[qos, *replicas][i % n]``,
        as gateway replicas behind a load balancer would."""
        super().__init__(on_record)
        self._give_up_s = habits.give_up_s
        self._retry = habits.retry
        self._class_ranks = class_ranks or {}
        self._daemons = [qos, *replicas] if qos is not None else []
        self._triton = triton_client
        self._model = model
        self._expected_output_tokens = expected_output_tokens

    async def _stream(
        self, request: Request, lease_id: str, priority: int
    ) -> AsyncGenerator[tuple[int, bool], None]:
        """The server's answer as (tokens in this response, whether it is the last):
        over gRPC here, in process in a replay in virtual time (``qosd_sim.virtual``).
        Raises ``ServerRefused`` where the server refuses it for a full queue."""

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {
                "model_name": self._model,
                "inputs": _inputs(request),
                "request_id": str(request.index),
                "priority": priority,
                "parameters": {
                    "qos_class": request.qos_class,
                    "tenant": request.tenant,
                    "lease_id": lease_id,
                    # As with Triton's LLM backends: the end is an empty response
                    # flagged final, whatever the last data response carried.
                    "triton_enable_empty_final_response": True,
                },
            }

        responses = self._triton.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    refused = QUEUE_FULL in str(error)
                    raise (ServerRefused if refused else RuntimeError)(str(error))
                response = result.get_response()
                tokens = 0
                if response.raw_output_contents:
                    tokens = int(result.as_numpy("token_count")[0])
                final = response.parameters.get("triton_final_response")
                yield tokens, final is not None and final.bool_param
        finally:
            responses.cancel()

    async def _infer(self, request: Request, record: RequestRecord, arrived: float) -> None:
        lease_id = ""
        # Triton's levels start at 1 (0: its default level).
        rank = self._class_ranks.get(request.qos_class)
        priority = 0 if rank is None else rank + 1
        qos = self._daemons[request.index % len(self._daemons)] if self._daemons else None
        if qos is not None:
            try:
                decision = await qos.acquire(
                    request.qos_class,
                    request.input_tokens,
                    model=self._model,
                    expected_output_tokens=self._expected_output_tokens,
                    tenant=request.tenant,
                )
            except QosdError:
                record.decision = "ERROR"  # no answer: neither admitted nor refused
                raise
            record.decision = decision.reason.name
            record.waited_ms = decision.waited_s * 1000
            if not decision.admitted:
                return
            lease_id = decision.lease_id
            priority = decision.server_priority + 1
        record.admitted = True
        outcome = Outcome.ERROR
        give_up = self._give_up_s(request) if self._give_up_s is not None else None
        try:
            async with asyncio.timeout(None) as patience:
                if give_up is not None:
                    left = arrived + give_up - time.monotonic()
                    patience.reschedule(asyncio.get_running_loop().time() + left)
                await self._served(request, record, arrived, lease_id, priority, patience)
            outcome = Outcome.OK if record.completed else Outcome.ERROR
        except TimeoutError:
            if give_up is None or record.ttft_ms is not None:
                raise
            record.error = f"{GAVE_UP} after {give_up * 1000:.0f} ms without a first token"
            outcome = Outcome.CANCELLED
        except asyncio.CancelledError:
            outcome = Outcome.CANCELLED
            raise
        finally:
            if lease_id and qos is not None:
                await self._release(qos, lease_id, request, record, outcome)

    async def _served(
        self,
        request: Request,
        record: RequestRecord,
        arrived: float,
        lease_id: str,
        priority: int,
        patience: asyncio.Timeout,
    ) -> None:
        """Streams the request, sent again after a refusal as ``retry`` says; once the
        first token is in, the client's ``patience`` no longer applies."""
        rng = random.Random(request.index)
        while True:
            try:
                await self._stream_once(request, record, arrived, lease_id, priority, patience)
                return
            except ServerRefused:
                if self._retry is None or record.retries >= self._retry.max_retries:
                    record.admitted = False
                    record.decision = "QUEUE_FULL"
                    return
                await asyncio.sleep(self._retry.delay_s(record.retries, rng))
                record.retries += 1

    async def _stream_once(
        self,
        request: Request,
        record: RequestRecord,
        arrived: float,
        lease_id: str,
        priority: int,
        patience: asyncio.Timeout,
    ) -> None:
        async with contextlib.aclosing(self._stream(request, lease_id, priority)) as stream:
            async for tokens, final in stream:
                now = time.monotonic()
                if tokens:
                    record.tokens_seen += tokens
                    if record.ttft_ms is None:
                        record.ttft_ms = (now - arrived) * 1000
                        patience.reschedule(None)
                if final:
                    record.e2e_ms = (now - arrived) * 1000
                    record.completed = True
                    break

    async def _release(
        self,
        qos: QosdClient,
        lease_id: str,
        request: Request,
        record: RequestRecord,
        outcome: Outcome,
    ) -> None:
        try:
            await asyncio.shield(
                qos.release(
                    lease_id,
                    input_tokens=request.input_tokens,
                    output_tokens=record.tokens_seen,  # what the GPU actually produced
                    outcome=outcome,
                )
            )
        except QosdError as exc:
            record.error = record.error or f"release: {exc}"
