"""The Triton-side reporter: tritonclient calls (gRPC and HTTP, sync and aio, unary and
streaming) against the simulated Triton server, measured and reported to qosd."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import tritonclient.grpc as grpc_triton
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http as http_triton
import tritonclient.http.aio as http_aio
from opentelemetry.sdk.trace import TracerProvider
from tritonclient.utils import InferenceServerException

from qosd_client import LatencySample, Outcome, QosdClient
from qosd_client.triton import ThreadedLatencyReporter, reporting
from qosd_harness import daemon_processes
from qosd_sim.experiment import SimulatorAddresses, simulator_process
from qosd_sim.gateway import token_inputs
from qosd_sim.gpu import GpuModel

FAST = GpuModel(speed=4.0)  # a decode step is ~3 ms, a 1K prefill ~7 ms


class Collected:
    """A sink that keeps what it is given (thread-safe, as reporters must be)."""

    def __init__(self) -> None:
        self.samples: list[LatencySample] = []
        self._lock = threading.Lock()

    def record(self, sample: LatencySample) -> None:
        with self._lock:
            self.samples.append(sample)

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[LatencySample]:
        deadline = time.monotonic() + timeout_s
        while len(self.samples) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return list(self.samples)


class Broken:
    def record(self, sample: LatencySample) -> None:
        raise RuntimeError("the reporter is broken")


def tokens_in(result: Any) -> int:
    """The simulated server's answer carries the tokens it produced."""
    return int(result.as_numpy("token_count")[0])


@pytest.fixture(scope="module")
def simulator() -> Iterator[SimulatorAddresses]:
    with simulator_process(FAST, stream_every=1) as addresses:
        yield addresses


def _grpc_inputs(module: Any, prompt: int, output: int) -> list[Any]:
    return token_inputs(prompt, output, module)


def _prompt_tokens(inputs: list[Any]) -> int:
    """A stand-in tokenizer: 100 tokens per input tensor."""
    return 0 if inputs is None else len(inputs) * 100


async def test_aio_grpc_unary_and_streaming(simulator: SimulatorAddresses) -> None:
    sink = Collected()
    async with reporting(
        grpc_aio.InferenceServerClient(simulator.grpc), sink, tenant="acme", tokens=tokens_in
    ) as client:
        result = await client.infer(
            "llm", _grpc_inputs(grpc_aio, 200, 12), qos_class="P1", lease_id="L1"
        )
        assert tokens_in(result) == 12  # the call's own result, untouched
        (unary,) = sink.samples
        assert (unary.model, unary.qos_class, unary.tenant, unary.lease_id) == (
            "llm", "P1", "acme", "L1",
        )  # fmt: skip
        assert unary.output_tokens == 12 and unary.status is Outcome.OK
        assert unary.ttft_ms == unary.e2e_ms and unary.e2e_ms is not None
        assert unary.e2e_ms > 12 * 2.5  # 12 decode steps at ~3 ms
        assert unary.tpot_ms is None

        async def requests() -> AsyncIterator[dict[str, Any]]:
            # Two requests on one stream, with classes from request parameters (as a
            # gateway forwards them) and from the keyword.
            yield {"model_name": "llm", "inputs": _grpc_inputs(grpc_aio, 1000, 20),
                   "parameters": {"qos_class": "P0"}}  # fmt: skip
            yield {"model_name": "llm", "inputs": _grpc_inputs(grpc_aio, 100, 5),
                   "qos_class": "P2", "request_id": "mine"}  # fmt: skip

        finals = 0
        async for response, error in client.stream_infer(requests()):
            assert error is None
            params = response.get_response().parameters
            finals += params["triton_final_response"].bool_param
            if finals == 2:
                break
    streamed = {s.qos_class: s for s in sink.samples[1:]}
    assert set(streamed) == {"P0", "P2"}
    long = streamed["P0"]
    assert long.output_tokens == 20
    assert long.ttft_ms is not None and long.e2e_ms is not None and long.tpot_ms is not None
    assert long.ttft_ms < long.e2e_ms  # the first token came before the last
    assert 1.0 < long.tpot_ms < 30.0  # one decode step per token, ~3 ms
    assert streamed["P2"].output_tokens == 5
    assert client.stats.reported == 3 and client.stats.unmatched == 0


async def test_aio_grpc_errors_are_reported_and_raised(simulator: SimulatorAddresses) -> None:
    sink = Collected()
    client = reporting(grpc_aio.InferenceServerClient(simulator.grpc), sink, qos_class="P1")
    with pytest.raises(InferenceServerException, match="unknown model"):
        await client.infer("nope", _grpc_inputs(grpc_aio, 10, 1))
    (failed,) = sink.samples
    assert failed.status is Outcome.ERROR and failed.ttft_ms is None
    assert failed.e2e_ms is not None and failed.e2e_ms > 0
    # A broken reporter never fails the inference.
    unbroken = reporting(grpc_aio.InferenceServerClient(simulator.grpc), Broken(), qos_class="P1")
    assert tokens_in(await unbroken.infer("llm", _grpc_inputs(grpc_aio, 10, 2))) == 2
    assert unbroken.stats.measurement_errors == 1
    # No class: not reported, counted.
    unclassified = reporting(grpc_aio.InferenceServerClient(simulator.grpc), sink)
    await unclassified.infer("llm", _grpc_inputs(grpc_aio, 10, 1))
    assert len(sink.samples) == 1 and unclassified.stats.unclassified == 1
    for wrapped in (client, unbroken, unclassified):
        await wrapped.close()


def test_sync_grpc_unary_callback_and_stream(simulator: SimulatorAddresses) -> None:
    sink = Collected()
    with reporting(
        grpc_triton.InferenceServerClient(simulator.grpc), sink, qos_class="P1",
        tokens=tokens_in, input_tokens=_prompt_tokens,
    ) as client:  # fmt: skip
        assert tokens_in(client.infer("llm", _grpc_inputs(grpc_triton, 300, 4))) == 4
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.async_infer(
            "llm", _grpc_inputs(grpc_triton, 300, 3), lambda r, e: answers.put((r, e)),
            qos_class="P0",
        )  # fmt: skip
        result, error = answers.get(timeout=10)
        assert error is None and tokens_in(result) == 3

        streamed: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(lambda r, e: streamed.put((r, e)))
        for output in (6, 9):
            client.async_stream_infer("llm", _grpc_inputs(grpc_triton, 500, output),
                                      qos_class="P2")  # fmt: skip
        finals = 0
        while finals < 2:
            response, error = streamed.get(timeout=10)
            assert error is None
            finals += response.get_response().parameters["triton_final_response"].bool_param
        client.stop_stream()
    samples = sink.wait_for(4)
    assert [s.qos_class for s in samples[:2]] == ["P1", "P0"]
    assert samples[0].output_tokens == 4 and samples[0].input_tokens == 200
    stream = sorted(samples[2:], key=lambda s: s.output_tokens)
    assert [s.output_tokens for s in stream] == [6, 9]
    assert all(s.tpot_ms is not None and s.ttft_ms is not None for s in stream)
    assert client.stats.reported == 4


def test_sync_http_infer_and_async_infer(simulator: SimulatorAddresses) -> None:
    sink = Collected()
    with reporting(
        http_triton.InferenceServerClient(simulator.http), sink, tokens=tokens_in
    ) as client:
        result = client.infer(
            "llm", _grpc_inputs(http_triton, 100, 7), parameters={"qos_class": "P1"}
        )
        assert tokens_in(result) == 7
        pending = client.async_infer("llm", _grpc_inputs(http_triton, 100, 2), qos_class="P2")
        assert tokens_in(pending.get_result()) == 2
        with pytest.raises(InferenceServerException):
            client.infer("llm", _grpc_inputs(http_triton, 100, 10**7), qos_class="P0")
    first, second, failed = sink.samples
    assert (first.qos_class, first.output_tokens, first.status) == ("P1", 7, Outcome.OK)
    assert (second.qos_class, second.output_tokens) == ("P2", 2)
    assert failed.status is Outcome.ERROR


async def test_aio_http_infer(simulator: SimulatorAddresses) -> None:
    sink = Collected()
    async with reporting(
        http_aio.InferenceServerClient(simulator.http), sink, qos_class="P0", tokens=tokens_in
    ) as client:
        results = await asyncio.gather(
            *(client.infer("llm", _grpc_inputs(http_aio, 50, n)) for n in (1, 2, 3))
        )
    assert sorted(tokens_in(r) for r in results) == [1, 2, 3]
    assert sorted(s.output_tokens for s in sink.samples) == [1, 2, 3]


async def test_the_trace_goes_to_the_model_server_and_into_the_sample(
    simulator: SimulatorAddresses,
) -> None:
    sink = Collected()
    tracer = TracerProvider().get_tracer("gateway")
    client = reporting(grpc_aio.InferenceServerClient(simulator.grpc), sink, qos_class="P1")
    with tracer.start_as_current_span("gateway.request") as span:
        await client.infer("llm", _grpc_inputs(grpc_aio, 10, 1))
    await client.close()
    context = span.get_span_context()
    version, trace_id, span_id, flags = sink.samples[0].traceparent.split("-")
    assert (version, trace_id, span_id) == (
        "00",
        f"{context.trace_id:032x}",
        f"{context.span_id:016x}",
    )
    assert int(flags, 16) & 1  # sampled


def test_reports_reach_qosd_from_blocking_code() -> None:
    """The whole path: sync tritonclient → simulated Triton, samples → a daemon."""
    tree = {"pools": {"llm": {"capacity_tokens_s": 100_000}}, "default_pool": "llm"}
    with (
        daemon_processes(tree) as (daemon,),
        simulator_process(FAST) as simulated,
        ThreadedLatencyReporter(daemon.address, flush_interval_s=0.05) as reporter,
    ):
        client = reporting(
            grpc_triton.InferenceServerClient(simulated.grpc), reporter, qos_class="P0",
            tokens=tokens_in,
        )  # fmt: skip
        for _ in range(5):
            client.infer("llm", _grpc_inputs(grpc_triton, 100, 3))
        deadline = time.monotonic() + 10
        samples = 0
        while samples < 5 and time.monotonic() < deadline:
            samples = asyncio.run(_window_samples(daemon.address))
            time.sleep(0.05)
        assert samples == 5
        assert reporter.stats.sent == 5 and reporter.stats.dropped == 0


async def _window_samples(address: str) -> int:
    async with QosdClient(address) as qos:
        return (await qos.status("llm")).pool("llm").cls("P0").latency.samples


def test_a_reporter_that_cannot_start_says_why() -> None:
    reporter = ThreadedLatencyReporter("127.0.0.1:1", batch_size=0)
    with pytest.raises(ValueError, match="batch_size"):
        reporter.start()
    # Nothing half-started: recording is a counted loss, closing a no-op.
    reporter.record(LatencySample("llm", "P1", e2e_ms=1.0))
    assert reporter.stats.dropped == 1
    reporter.close()


async def test_the_simulated_http_api_refuses_bad_requests(simulator: SimulatorAddresses) -> None:
    base = f"http://{simulator.http}/v2"
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/health/ready") as ready:
            assert ready.status == 200
        for path, body, words in (
            ("/models/llm/infer", b"{not json", "malformed"),
            ("/models/llm/infer", b'{"inputs": [{"name": "x"}]}', "malformed"),
            ("/models/nope/infer", b'{"inputs": []}', "unknown model"),
            ("/models/llm/infer", b'{"inputs": []}', "missing input"),
        ):
            async with session.post(base + path, data=body) as answer:
                assert answer.status == 400
                assert words in (await answer.json())["error"]
