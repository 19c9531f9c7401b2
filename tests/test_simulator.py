"""The simulated Triton server: its cost model, its protocol (through the real
``tritonclient``), its metrics, and its reports to a real qosd daemon."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator

import pytest
import tritonclient.grpc.aio as triton
from tritonclient.utils import InferenceServerException

from qosd_client import QosdClient
from qosd_harness import daemon_processes
from qosd_sim import calibration
from qosd_sim.experiment import read_busy_seconds, simulator_process
from qosd_sim.gateway import token_inputs
from qosd_sim.gpu import Engine, GpuModel, Sequence, run_virtual, saturated_throughput
from qosd_sim.server import RealTimeGpu

# --- the cost model, in virtual time ------------------------------------------------------

UNCHUNKED = GpuModel(prefill_chunk_tokens=None)


@pytest.mark.fast
def test_defaults_reproduce_the_published_table_and_the_seed() -> None:
    """The constants are fitted to TensorRT-LLM's LLaMA-7B A100 table (within 3 %), and
    tell the seed's story: a 32K prefill stalls for seconds, a full decode step ~25 ms."""
    for row in calibration.table(GpuModel()):
        assert abs(float(row["error"])) < 0.03, row
    assert UNCHUNKED.prefill_s([32_768]) == pytest.approx(3.3, rel=0.05)
    assert GpuModel().decode_s(128, 128 * 1_400) == pytest.approx(0.027, rel=0.05)
    assert UNCHUNKED.prefill_s([1_000]) < 0.07  # a chat prompt is cheap
    # The roofline: a small pass costs the floor, a large one its tokens.
    model = GpuModel()
    assert model.iteration_s(8) == pytest.approx(model.iteration_floor_ms / 1000)
    assert model.iteration_s(2_048) == pytest.approx(2_048 * model.us_per_token / 1e6)
    # Decode grows with the context the batch reads.
    assert model.decode_s(64, 64 * 20_000) > model.decode_s(64, 64 * 1_000) + 0.05


@pytest.mark.fast
def test_unchunked_32k_prefill_stalls_every_running_stream() -> None:
    # Short requests decoding; a 32K prompt arrives at t = 1 s.
    arrivals = [(0.0, 500, 400) for _ in range(8)] + [(1.0, 32_768, 10)]
    finished = run_virtual(UNCHUNKED, arrivals)
    short = finished[0]
    long = finished[-1]
    assert long.first_token_at is not None and long.started_at is not None
    stall = long.first_token_at - long.started_at
    assert stall == pytest.approx(UNCHUNKED.prefill_s([32_768]), rel=0.01)
    # The short streams' decode took their tokens' worth of steps plus the whole stall.
    assert short.first_token_at is not None and short.finished_at is not None
    decode = short.finished_at - short.first_token_at
    steps_without_stall = sum(UNCHUNKED.decode_s(8, 8 * (500 + g)) for g in range(1, 400))
    assert decode - steps_without_stall == pytest.approx(stall, rel=0.1)


def _token_gaps(model: GpuModel) -> list[float]:
    """Gaps between one short stream's tokens while a 32K prompt arrives at t = 1 s."""
    engine = Engine(model)
    watched = Sequence("watched", 500, 400, submitted_at=0.0)
    engine.submit(watched)
    for index in range(7):
        engine.submit(Sequence(str(index), 500, 400, submitted_at=0.0))
    long = Sequence("long", 32_768, 10, submitted_at=1.0)
    now, times, submitted = 0.0, [], False
    while not watched.done:
        if not submitted and now >= 1.0:
            engine.submit(long)
            submitted = True
        iteration = engine.plan(now)
        assert iteration is not None
        now += iteration.duration_s
        times += [now for e in engine.complete(now) if e.sequence is watched]
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.mark.fast
def test_chunked_prefill_spreads_the_stall() -> None:
    unchunked = _token_gaps(UNCHUNKED)
    assert max(unchunked) == pytest.approx(UNCHUNKED.prefill_s([32_768]), rel=0.05)
    chunked = _token_gaps(GpuModel(prefill_chunk_tokens=2048))
    # 17 passes of 2,040 prompt tokens, each carrying the decode steps: no gap of
    # seconds, but a longer stretch of slower steps (a full pass costs ~125 ms, plus
    # the attention over the prompt so far).
    assert max(chunked) < 0.3
    assert sum(1 for gap in chunked if gap > 0.1) >= 15


@pytest.mark.fast
def test_a_fused_pass_costs_its_tokens_once() -> None:
    """Chunked, a decode step that carries a chunk costs one pass over all its tokens,
    not a decode step plus a prefill."""
    model = GpuModel()
    engine = Engine(model)
    decoding = Sequence("decoding", 100, 50, submitted_at=0.0)
    engine.submit(decoding)
    first = engine.plan(0.0)
    assert first is not None
    engine.complete(first.duration_s)
    engine.submit(Sequence("long", 10_000, 5, submitted_at=first.duration_s))
    fused = engine.plan(first.duration_s)
    assert fused is not None and fused.decode == [decoding]
    [(_, chunk)] = fused.prefill
    assert chunk == 2_047  # the budget less the decode's token
    expected = model.iteration_s(2_048, [(0, chunk)], decoding.context_tokens, 2)
    assert fused.duration_s == pytest.approx(expected)
    assert fused.duration_s < model.decode_s(1, 101) + model.prefill_s([chunk])


@pytest.mark.fast
def test_an_iteration_takes_nothing_that_arrived_after_it_began() -> None:
    """A real-time server that woke late plans an iteration from its due start; a
    request that arrived after that start waits for the next one."""
    engine = Engine(GpuModel())
    early = Sequence("early", 100, 5, submitted_at=1.0)
    late = Sequence("late", 100, 5, submitted_at=1.02)
    engine.submit(early)
    engine.submit(late)
    iteration = engine.plan(1.01)
    assert iteration is not None and [s for s, _ in iteration.prefill] == [early]


@pytest.mark.fast
def test_cancelling_frees_the_batch_slot_and_kv() -> None:
    engine = Engine(GpuModel(max_batch=1))
    first = Sequence("first", 1_000, 50, submitted_at=0.0)
    second = Sequence("second", 1_000, 50, submitted_at=0.0)
    engine.submit(first)
    engine.submit(second)
    iteration = engine.plan(0.0)
    assert iteration is not None and [s for s, _ in iteration.prefill] == [first]
    engine.complete(iteration.duration_s)
    engine.cancel(first)
    assert engine.kv_used == 0
    iteration = engine.plan(1.0)
    assert iteration is not None and [s for s, _ in iteration.prefill] == [second]
    assert engine.queued == 0 and engine.pending == 1


@pytest.mark.fast
def test_batch_and_kv_limits_hold() -> None:
    model = GpuModel(max_batch=4, kv_capacity_tokens=10_000, prefill_chunk_tokens=None)
    engine = Engine(model)
    for index in range(10):
        engine.submit(Sequence(str(index), 1_000, 100, submitted_at=0.0))
    iteration = engine.plan(0.0)
    assert iteration is not None
    assert len(iteration.prefill) == 4  # max_batch
    engine.complete(iteration.duration_s)
    big = GpuModel(max_batch=64, kv_capacity_tokens=5_000, prefill_chunk_tokens=None)
    engine = Engine(big)
    for index in range(10):
        engine.submit(Sequence(str(index), 1_000, 100, submitted_at=0.0))
    iteration = engine.plan(0.0)
    assert iteration is not None
    assert len(iteration.prefill) == 4  # 4 × 1,100 fit in 5,000 KV tokens
    with pytest.raises(ValueError, match="KV cache"):
        engine.submit(Sequence("huge", 5_000, 100, submitted_at=0.0))


@pytest.mark.fast
def test_a_prompt_beyond_the_prefill_budget_runs_alone() -> None:
    """Unchunked, an iteration takes its first prompt whatever its size (up to the KV
    cache): a 191K-token prompt, 23 × max_prefill_tokens, prefills in one iteration
    of its own, and the prompts behind it wait for the next."""
    engine = Engine(UNCHUNKED)
    huge = Sequence("huge", 191_378, 6, submitted_at=0.0)
    short = Sequence("short", 1_000, 5, submitted_at=0.0)
    engine.submit(huge)
    engine.submit(short)
    iteration = engine.plan(0.0)
    assert iteration is not None and [s for s, _ in iteration.prefill] == [huge]
    assert iteration.duration_s == pytest.approx(UNCHUNKED.prefill_s([191_378]))
    engine.complete(iteration.duration_s)
    assert huge.first_token_at == pytest.approx(iteration.duration_s)
    # Whole 200K prompts, unchunked and chunked, in virtual time.
    for gpu in (UNCHUNKED, GpuModel(prefill_chunk_tokens=8_192)):
        finished = run_virtual(gpu, [(0.0, 200_000, 100), (0.0, 500, 50), (1.0, 199_000, 1)])
        assert all(s.done for s in finished)
        assert finished[0].kv_tokens + finished[2].kv_tokens <= gpu.kv_capacity_tokens


def _first_tokens(model: GpuModel, sequences: list[Sequence]) -> dict[str, float]:
    """Runs the sequences, all submitted by t = 0, to their ends; each one's first
    token time."""
    engine = Engine(model)
    for sequence in sequences:
        engine.submit(sequence)
    now = 0.0
    while not all(s.done for s in sequences):
        iteration = engine.plan(now)
        assert iteration is not None
        now += iteration.duration_s
        engine.complete(now)
    return {s.request_id: s.first_token_at for s in sequences if s.first_token_at is not None}


@pytest.mark.fast
def test_a_short_prompt_behind_a_long_one_waits_for_it_unless_capped() -> None:
    """Chunked, oldest first: a short prompt behind a 32K one starts after the 32K
    prefill (16 full passes). With vLLM's long-prefill threshold the two share each
    pass, so the short one's first token comes within the first pass or two, and the
    long one pays little for it."""

    def pair() -> list[Sequence]:
        return [Sequence("long", 32_768, 4, submitted_at=0.0),
                Sequence("short", 400, 4, submitted_at=0.0)]  # fmt: skip

    oldest_first = _first_tokens(GpuModel(), pair())
    capped = _first_tokens(GpuModel(long_prefill_token_threshold=512), pair())
    assert oldest_first["short"] > oldest_first["long"] > 2.0
    assert capped["short"] < 0.2
    assert capped["long"] < oldest_first["long"] * 1.5


@pytest.mark.fast
def test_priority_scheduling_takes_waiting_requests_by_priority() -> None:
    """Waiting for the one batch slot, requests go by priority and then arrival with
    priority scheduling, and by arrival alone without it."""

    def queue() -> list[Sequence]:
        return [
            Sequence("low-1", 100, 4, submitted_at=0.0, priority=3),
            Sequence("low-2", 100, 4, submitted_at=0.0, priority=3),
            Sequence("top-1", 100, 4, submitted_at=0.0, priority=1),
            Sequence("mid", 100, 4, submitted_at=0.0, priority=2),
            Sequence("top-2", 100, 4, submitted_at=0.0, priority=1),
        ]

    one_slot = GpuModel(max_batch=1, prefill_chunk_tokens=None)
    by_priority = _first_tokens(dataclasses.replace(one_slot, priority_scheduling=True), queue())
    order = sorted(by_priority, key=by_priority.__getitem__)
    assert order == ["top-1", "top-2", "mid", "low-1", "low-2"]
    by_arrival = _first_tokens(one_slot, queue())
    assert sorted(by_arrival, key=by_arrival.__getitem__) == [s.request_id for s in queue()]


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.fast
def test_priority_scheduling_preempts_a_running_request_of_lower_priority(
    chunked: bool,
) -> None:
    """One batch slot, a low-priority request decoding in it: a top-priority arrival
    takes the slot at once (vLLM preempts), and the low one resumes after it,
    recomputing its prompt and output so far, its tokens counted once. Without
    priority scheduling the arrival waits for the slot."""

    def run(priority_scheduling: bool) -> tuple[Sequence, Sequence, int, list[int]]:
        model = GpuModel(max_batch=1, priority_scheduling=priority_scheduling,
                         prefill_chunk_tokens=2_048 if chunked else None)  # fmt: skip
        engine = Engine(model)
        low = Sequence("low", 500, 40, submitted_at=0.0, priority=2)
        top = Sequence("top", 100, 5, submitted_at=0.0, priority=0)
        engine.submit(low)
        now, counted = 0.0, []
        while not (low.done and top.done):
            if low.generated == 10 and top.submitted_at == 0.0 and not engine.waiting:
                top.submitted_at = now
                engine.submit(top)
            iteration = engine.plan(now)
            assert iteration is not None
            now += iteration.duration_s
            counted += [e.generated for e in engine.complete(now) if e.sequence is low]
        return low, top, engine.preemptions, counted

    low, top, preemptions, counted = run(priority_scheduling=True)
    assert preemptions == 1
    assert top.finished_at is not None and low.finished_at is not None
    assert top.finished_at < low.finished_at
    assert low.recomputed == 10 and low.generated == 40
    assert counted == list(range(1, 41))  # every token once, in order, resumed at 11
    low, top, preemptions, _ = run(priority_scheduling=False)
    assert preemptions == 0
    assert low.finished_at is not None and top.started_at is not None
    assert top.started_at >= low.finished_at


@pytest.mark.fast
def test_capacity_is_configurable() -> None:
    requests = [(1_000, 200)] * 300
    base = saturated_throughput(GpuModel(), requests)
    faster = saturated_throughput(GpuModel(speed=2.0), requests)
    assert faster == pytest.approx(2 * base, rel=0.01)
    assert saturated_throughput(GpuModel(max_batch=16), requests) < base


@pytest.mark.fast
def test_bad_model_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown GPU model options"):
        GpuModel.from_options({"warp_speed": 9})
    with pytest.raises(ValueError, match="speed"):
        GpuModel(speed=0)
    with pytest.raises(ValueError, match="exceed max_batch"):
        GpuModel(max_batch=256, prefill_chunk_tokens=200)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        GpuModel(prefill_chunk_tokens=None, long_prefill_token_threshold=512)


# --- the server, through the real tritonclient --------------------------------------------

FAST = GpuModel(speed=4.0, prefill_chunk_tokens=None)  # a 32K prefill takes ~0.8 s


@pytest.fixture(scope="module")
def simulator() -> Iterator[tuple[str, str]]:
    with simulator_process(FAST) as addresses:
        yield addresses.grpc, addresses.metrics_url


def _inputs(input_tokens: int, output_tokens: int) -> list[triton.InferInput]:
    return token_inputs(input_tokens, output_tokens, triton)


async def _stream_times(
    client: triton.InferenceServerClient,
    input_tokens: int,
    output_tokens: int,
    streaming: asyncio.Event | None = None,
    *,
    priority: int = 0,
) -> list[tuple[float, int]]:
    """(arrival time, tokens) of each streamed response, until the final one; sets
    ``streaming`` at the first."""

    async def one() -> AsyncIterator[dict[str, object]]:
        yield {
            "model_name": "llm",
            "inputs": _inputs(input_tokens, output_tokens),
            "priority": priority,
        }

    seen: list[tuple[float, int]] = []
    responses = client.stream_infer(one())
    async for result, error in responses:
        assert error is None, error
        seen.append((time.monotonic(), int(result.as_numpy("token_count")[0])))
        if streaming is not None:
            streaming.set()
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    return seen


async def test_tritonclient_sees_a_triton_server(simulator: tuple[str, str]) -> None:
    address, _ = simulator
    async with triton.InferenceServerClient(address) as client:
        assert await client.is_server_live()
        assert await client.is_server_ready()
        assert await client.is_model_ready("llm")
        assert not await client.is_model_ready("other")
        metadata = await client.get_model_metadata("llm")
        assert [i.name for i in metadata.inputs] == ["input_tokens", "output_tokens"]
        result = await client.infer("llm", _inputs(200, 7), request_id="r-1")
        assert int(result.as_numpy("token_count")[0]) == 7
        assert result.get_response().id == "r-1"
        streamed = await _stream_times(client, 200, 9)
        assert [tokens for _, tokens in streamed] == [1, 8]  # first token, then the rest


async def test_the_server_schedules_by_the_priority_tritonclient_sends() -> None:
    """With priority scheduling, two requests waiting for the one batch slot start by
    Triton's request priority (1 first, 0 the default after), not by arrival."""
    one_slot = GpuModel(speed=4.0, prefill_chunk_tokens=None, max_batch=1, priority_scheduling=True)
    with simulator_process(one_slot) as addresses:
        async with triton.InferenceServerClient(addresses.grpc) as client:
            running = asyncio.Event()
            blocker = asyncio.create_task(_stream_times(client, 100, 500, running))
            await running.wait()  # holds the slot for 500 decode steps (~2 s)
            default = asyncio.create_task(_stream_times(client, 100, 2))
            urgent = asyncio.create_task(_stream_times(client, 100, 2, priority=1))
            done = await asyncio.gather(blocker, default, urgent)
    first = [times[0][0] for times in done]
    assert first[0] < first[2] < first[1]


async def test_model_config_and_empty_final_response(simulator: tuple[str, str]) -> None:
    address, _ = simulator
    async with triton.InferenceServerClient(address) as client:
        config = await client.get_model_config("llm")
        assert config.config.model_transaction_policy.decoupled

        async def one() -> AsyncIterator[dict[str, object]]:
            yield {
                "model_name": "llm",
                "inputs": _inputs(100, 6),
                "request_id": "e-1",
                "parameters": {"triton_enable_empty_final_response": True},
            }

        seen = []
        async for result, error in client.stream_infer(one()):
            assert error is None
            response = result.get_response()
            final = response.parameters["triton_final_response"].bool_param
            tokens = int(result.as_numpy("token_count")[0]) if response.outputs else None
            seen.append((response.id, tokens, final))
            if final:
                break
        # Data responses are never final; an empty one ends the request.
        assert seen == [("e-1", 1, False), ("e-1", 5, False), ("e-1", None, True)]


async def test_a_failed_stream_request_is_named(simulator: tuple[str, str]) -> None:
    address, _ = simulator
    async with triton.InferenceServerClient(address) as client:

        async def two() -> AsyncIterator[dict[str, object]]:
            yield {"model_name": "llm", "inputs": _inputs(0, 5), "request_id": "bad"}
            yield {"model_name": "llm", "inputs": _inputs(50, 2), "request_id": "good"}

        errors, finals = [], []
        async for result, error in client.stream_infer(two()):
            if error is not None:
                errors.append(str(error))
                continue
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals.append(response.id)
                break
        assert len(errors) == 1 and ">= 1" in errors[0]
        assert finals == ["good"]  # the other request on the stream is unaffected


def test_a_busy_port_fails_fast(simulator: tuple[str, str]) -> None:
    address, _ = simulator
    port = address.rsplit(":", 1)[1]
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "qosd.cli", "sim-triton", "--port", port, "--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1
    assert "cannot listen" in done.stderr
    assert time.monotonic() - began < 15


async def test_bad_requests_get_clear_errors(simulator: tuple[str, str]) -> None:
    address, _ = simulator
    async with triton.InferenceServerClient(address) as client:
        with pytest.raises(InferenceServerException, match="unknown model"):
            await client.infer("nope", _inputs(10, 10))
        with pytest.raises(InferenceServerException, match="missing input output_tokens"):
            await client.infer("llm", _inputs(10, 10)[:1])
        with pytest.raises(InferenceServerException, match=">= 1"):
            await client.infer("llm", _inputs(-5, 10))
        with pytest.raises(InferenceServerException, match="KV cache"):
            await client.infer("llm", _inputs(10_000_000, 10))


@pytest.mark.fast
async def test_a_request_that_arrived_after_the_planned_start_is_still_served() -> None:
    """The real-time GPU plans from an iteration's due start, which lags the clock
    when it catches up; a request that arrived after that start, alone, was left
    waiting for good (its submit's wake spent on the plan that could not take it).
    Here one arrives 50 ms after the idle GPU plans: it is served once it is due."""
    gpu = RealTimeGpu(GpuModel(speed=100))
    gpu.start()
    try:
        late = Sequence("late", 10, 2, submitted_at=time.monotonic() + 0.05)

        async def served() -> int:
            return sum([1 async for _ in gpu.generate(late)])

        assert await asyncio.wait_for(served(), 5.0) == 2
        assert late.started_at is not None and late.started_at >= late.submitted_at
    finally:
        await gpu.stop()


async def test_a_32k_prefill_delays_other_streams_next_token() -> None:
    """The seed's stall, in real time: a short stream's token gap grows by the prefill."""
    with simulator_process(FAST, stream_every=1) as per_token_server:
        per_token = per_token_server.grpc
        async with triton.InferenceServerClient(per_token) as client:
            decoding = asyncio.Event()
            short = asyncio.create_task(_stream_times(client, 300, 120, decoding))
            await asyncio.wait_for(decoding.wait(), 10)  # its first token: it decodes now
            await _stream_times(client, 32_768, 2)
            times = [at for at, _ in await short]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    expected = FAST.prefill_s([32_768])
    # Loose bounds: this runs in real time on a shared machine. Unchunked, the gap is
    # the whole prefill (0.8 s here); a typical gap is one decode step (~4 ms).
    assert max(gaps) == pytest.approx(expected + FAST.decode_s(2), abs=0.15)
    typical = sorted(gaps)[len(gaps) // 2]
    assert typical < 0.05


async def test_a_200k_prompt_end_to_end_and_the_busy_counter() -> None:
    """A 200K-token prompt through tritonclient (the input checks allow it, the GPU
    prefills it in one iteration), and the simulator's own busy-seconds counter."""
    # A 200K prefill (~60 s at speed 1) takes ~0.15 s, in one unchunked iteration.
    fast = GpuModel(speed=400.0, prefill_chunk_tokens=None)
    with simulator_process(fast) as server:
        began = time.monotonic()
        clock, busy = read_busy_seconds(server.metrics_url)
        assert busy == 0.0 and began <= clock <= time.monotonic()  # the same clock
        async with triton.InferenceServerClient(server.grpc) as client:
            result = await client.infer("llm", _inputs(200_000, 20))
            assert int(result.as_numpy("token_count")[0]) == 20
            with pytest.raises(InferenceServerException, match="KV cache"):
                await client.infer("llm", _inputs(400_000, 1))
        _, busy = read_busy_seconds(server.metrics_url)
        expected = fast.prefill_s([200_000]) + sum(
            fast.decode_s(1, 200_000 + g) for g in range(1, 20)
        )
        assert busy == pytest.approx(expected, rel=0.01)
        text = await asyncio.to_thread(_fetch, server.metrics_url)
        assert "# TYPE qosd_sim_gpu_busy_seconds counter" in text


async def test_metrics_use_tritons_names(simulator: tuple[str, str]) -> None:
    address, metrics_url = simulator
    async with triton.InferenceServerClient(address) as client:
        before = _scrape(metrics_url)
        await asyncio.gather(*(client.infer("llm", _inputs(100, 5)) for _ in range(3)))
        with pytest.raises(InferenceServerException):
            await client.infer("llm", _inputs(-1, 5))
    after = _scrape(metrics_url)
    key = 'nv_inference_request_success{model="llm",version="1"}'
    assert after[key] - before.get(key, 0) == 3
    rejected = 'nv_inference_request_failure{model="llm",reason="REJECTED",version="1"}'
    assert after[rejected] - before.get(rejected, 0) == 1
    assert after['nv_inference_pending_request_count{model="llm",version="1"}'] == 0
    assert after['nv_inference_request_duration_us{model="llm",version="1"}'] > before.get(
        'nv_inference_request_duration_us{model="llm",version="1"}', 0
    )
    assert after['nv_inference_queue_duration_us{model="llm",version="1"}'] >= 0
    count = 'nv_inference_first_response_histogram_ms_count{model="llm",version="1"}'
    assert after[count] - before.get(count, 0) == 3
    inf = 'nv_inference_first_response_histogram_ms_bucket{model="llm",version="1",le="+Inf"}'
    assert after[inf] == after[count]
    text = await asyncio.to_thread(_fetch, metrics_url)
    assert "# TYPE nv_inference_request_success counter" in text
    assert "_total" not in text  # Triton's names, not prometheus_client's


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _scrape(url: str) -> dict[str, float]:
    text = _fetch(url)
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def test_reports_reach_qosd() -> None:
    """Requests that name a class are reported; qosd's window for the class fills."""
    tree = {
        "pools": {"llm": {"capacity_tokens_s": 100_000, "models": ["llm"]}},
        "default_pool": "llm",
    }
    with (
        daemon_processes(tree) as (daemon,),
        simulator_process(FAST, qosd_target=daemon.address) as simulated,
    ):
        async with (
            triton.InferenceServerClient(simulated.grpc) as client,
            QosdClient(daemon.address) as qos,
        ):
            await asyncio.gather(
                *(
                    client.infer("llm", _inputs(300, 20), parameters={"qos_class": "P0"})
                    for _ in range(12)
                ),
                client.infer("llm", _inputs(300, 20)),  # no class: not reported
            )
            window = None
            for _ in range(50):
                window = (await qos.status("llm")).pool("llm").cls("P0").latency
                if window.samples >= 12:
                    break
                await asyncio.sleep(0.1)
            assert window is not None and window.samples == 12
            assert window.ttft is not None and window.tpot is not None
            # 20 tokens at speed 4: TPOT is about one decode step, ~3 ms.
            assert 1.0 < window.tpot.p50_ms < 20.0
            assert window.compliance == 1.0
