"""The simulated Triton server: its cost model, its protocol (through the real
``tritonclient``), its metrics, and its reports to a real qosd daemon."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import tritonclient.grpc.aio as triton
import tritonclient.http.aio as http_triton
from tritonclient.utils import InferenceServerException

from qosd_client import QosdClient
from qosd_harness import daemon_processes, start_command, stop_process
from qosd_sim import calibration
from qosd_sim.errors import QUEUE_FULL
from qosd_sim.experiment import read_busy_seconds, simulator_process
from qosd_sim.gateway import token_inputs
from qosd_sim.gpu import Engine, GpuModel, Sequence, run_virtual, saturated_throughput
from qosd_sim.server import MAX_CATCH_UP_S, RealTimeGpu, SimulatorSettings

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
    assert len(iteration.prefill) == 5  # 5 prompts of 1,000 fill 5,000 KV tokens
    reserving = Engine(dataclasses.replace(big, reserve_output_kv=True))
    for index in range(10):
        reserving.submit(Sequence(str(index), 1_000, 100, submitted_at=0.0))
    iteration = reserving.plan(0.0)
    assert iteration is not None
    assert len(iteration.prefill) == 4  # with outputs reserved: 4 x 1,100
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
def test_only_opt_in_preemption_lets_a_waiting_request_take_a_running_ones_slot(
    chunked: bool,
) -> None:
    """One batch slot, a low-priority request decoding in it, a top-priority arrival.
    As vLLM V1 runs (priority scheduling, no preemption for waiting requests) and
    without priority scheduling, the arrival waits for the slot. With the opt-in
    ``preempt_for_waiting`` (vLLM V0's), it takes the slot at once, and the low one
    resumes after it, recomputing its prompt and output so far, its tokens counted
    once."""

    def run(priority_scheduling: bool, preempt: bool) -> tuple[Sequence, Sequence, int, list[int]]:
        model = GpuModel(max_batch=1, priority_scheduling=priority_scheduling,
                         preempt_for_waiting=preempt,
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

    low, top, preemptions, counted = run(priority_scheduling=True, preempt=True)
    assert preemptions == 1
    assert top.finished_at is not None and low.finished_at is not None
    assert top.finished_at < low.finished_at
    assert low.recomputed == 10 and low.generated == 40
    assert counted == list(range(1, 41))  # every token once, in order, resumed at 11
    for priority_scheduling in (True, False):
        low, top, preemptions, _ = run(priority_scheduling, preempt=False)
        assert preemptions == 0
        assert low.finished_at is not None and top.started_at is not None
        assert top.started_at >= low.finished_at


@pytest.mark.fast
def test_a_better_priority_overtakes_waiting_requests_that_have_not_started() -> None:
    """As vLLM V1 admits: a request joins the running set only in an iteration whose
    budget starts it, so one that waits behind a long prompt's chunks has not started,
    and a later top-priority arrival goes before it. With the opt-in
    ``admit_beyond_budget`` (the engine before issue 37) it had joined the running
    set already, and the arrival went after it."""

    def first_tokens(admit_beyond_budget: bool) -> tuple[float, float]:
        model = GpuModel(priority_scheduling=True, admit_beyond_budget=admit_beyond_budget)
        engine = Engine(model)
        long = Sequence("long", 8_192, 4, submitted_at=0.0, priority=2)
        low = Sequence("low", 2_000, 4, submitted_at=0.0, priority=2)
        top = Sequence("top", 2_000, 4, submitted_at=0.0, priority=0)
        engine.submit(long)
        engine.submit(low)
        now = 0.0
        while not (low.done and top.done):
            if top.submitted_at == 0.0 and long.prefilled > 0 and not top.done:
                top.submitted_at = now
                engine.submit(top)
            iteration = engine.plan(now)
            assert iteration is not None
            now += iteration.duration_s
            engine.complete(now)
        assert low.first_token_at is not None and top.first_token_at is not None
        return low.first_token_at, top.first_token_at

    low_first, top_first = first_tokens(admit_beyond_budget=False)
    assert top_first < low_first
    low_first, top_first = first_tokens(admit_beyond_budget=True)
    assert low_first < top_first


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
        # Beside it, the GPU time lost to the host's lateness, in the same exposition.
        values = _scrape(server.metrics_url)
        assert values['qosd_sim_gpu_lost_seconds{model="llm"}'] >= 0.0
        assert values['qosd_sim_gpu_late_wakeups_total{model="llm"}'] >= 0
        assert "# TYPE qosd_sim_gpu_lost_seconds counter" in text
        assert "# TYPE qosd_sim_gpu_late_wakeups_total counter" in text


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
    # Triton's names, not prometheus_client's (the simulator's own are named apart).
    assert not [line for line in text.splitlines() if "nv_" in line and "_total" in line]


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


# --- the queue cap (--max-num-queued-reqs), as vLLM refuses beyond it ---------------------

ONE_SLOT = GpuModel(speed=4.0, prefill_chunk_tokens=None, max_batch=1)


@contextlib.contextmanager
def _sim_triton(directory: Path, gpu: GpuModel, *flags: str) -> Iterator[dict[str, int]]:
    """``qosd sim-triton FLAGS`` on free ports: its ready file (port, metrics_port,
    http_port)."""
    options = [f"--gpu={name}={getattr(gpu, name)}" for name in gpu.__dataclass_fields__]
    process, ready = start_command(
        ["sim-triton", "--port", "0", "--metrics-port", "0", "--http-port", "0", *options,
         *flags],
        directory,
        "sim-triton",
    )  # fmt: skip
    try:
        yield ready
    finally:
        stop_process(process)


async def _stream_outcome(
    client: triton.InferenceServerClient, input_tokens: int, output_tokens: int
) -> tuple[str | None, int]:
    """(the error's message, or None, and the tokens streamed) of one request alone on
    its own stream."""

    async def one() -> AsyncIterator[dict[str, object]]:
        yield {"model_name": "llm", "inputs": _inputs(input_tokens, output_tokens)}

    tokens = 0
    responses = client.stream_infer(one())
    try:
        async for result, error in responses:
            if error is not None:
                return error.message(), tokens
            tokens += int(result.as_numpy("token_count")[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        responses.cancel()
    return None, tokens


async def _burst_behind_a_running_request(
    ready: dict[str, int], count: int, while_full: Callable[[], Awaitable[None]] | None = None
) -> tuple[list[tuple[str | None, int]], int]:
    """A long request takes the one batch slot; ``count`` short ones then arrive at
    once, each on its own stream. Once all but one have an answer (the one that waits,
    under a cap of 1), ``while_full`` runs, if given. The short ones' outcomes, and the
    long one's tokens."""
    async with triton.InferenceServerClient(f"127.0.0.1:{ready['port']}") as client:
        running = asyncio.Event()
        blocker = asyncio.create_task(_stream_times(client, 100, 500, running))
        await asyncio.wait_for(running.wait(), 10)  # holds the slot for ~2 s
        answered: asyncio.Queue[None] = asyncio.Queue()

        async def short() -> tuple[str | None, int]:
            outcome = await _stream_outcome(client, 100, 2)
            answered.put_nowait(None)
            return outcome

        shorts = [asyncio.create_task(short()) for _ in range(count)]
        if while_full is not None:
            for _ in range(count - 1):
                await asyncio.wait_for(answered.get(), 10)
            await while_full()
        outcomes = await asyncio.gather(*shorts)
        long_tokens = sum(tokens for _, tokens in await blocker)
    return outcomes, long_tokens


def _rejected(ready: dict[str, int]) -> float:
    metrics = _scrape(f"http://127.0.0.1:{ready['metrics_port']}/metrics")
    return metrics['nv_inference_request_failure{model="llm",reason="REJECTED",version="1"}']


async def test_a_full_queue_refuses_requests_at_once(tmp_path: Path) -> None:
    """With ``--max-num-queued-reqs 2``, the running request and one more may be in
    flight; the others that arrive meanwhile are refused at once, never run, with a
    message that starts with QUEUE_FULL: a stream error, gRPC UNAVAILABLE for
    ModelInfer and HTTP 503, each counted as REJECTED. The waiting one and the running
    one complete."""
    with _sim_triton(tmp_path, ONE_SLOT, "--max-num-queued-reqs", "2") as ready:

        async def refused_unary_and_http() -> None:
            async with triton.InferenceServerClient(f"127.0.0.1:{ready['port']}") as client:
                with pytest.raises(InferenceServerException) as unary:
                    await client.infer("llm", _inputs(100, 2))
            assert unary.value.status() == "StatusCode.UNAVAILABLE"
            assert unary.value.message().startswith(QUEUE_FULL)
            async with http_triton.InferenceServerClient(f"127.0.0.1:{ready['http_port']}") as rest:
                with pytest.raises(InferenceServerException) as http:
                    await rest.infer("llm", token_inputs(100, 2, http_triton))
            assert http.value.status() == "503"
            assert http.value.message().startswith(QUEUE_FULL)

        outcomes, long_tokens = await _burst_behind_a_running_request(
            ready, 4, refused_unary_and_http
        )
        rejected = await asyncio.to_thread(_rejected, ready)
    refusals = [error for error, tokens in outcomes if error is not None]
    assert len(refusals) == 3
    assert all(error.startswith(QUEUE_FULL) for error in refusals), refusals
    assert [tokens for error, tokens in outcomes if error is None] == [2]
    assert all(tokens == 0 for error, tokens in outcomes if error is not None)
    assert long_tokens == 500
    assert rejected == 3 + 2  # the streams, the unary call and the HTTP one


async def test_without_a_queue_cap_nothing_is_refused(tmp_path: Path) -> None:
    with _sim_triton(tmp_path, ONE_SLOT) as ready:
        outcomes, long_tokens = await _burst_behind_a_running_request(ready, 4)
        rejected = await asyncio.to_thread(_rejected, ready)
    assert outcomes == [(None, 2)] * 4
    assert long_tokens == 500
    assert rejected == 0


@pytest.mark.fast
def test_a_queue_cap_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="max_queued"):
        SimulatorSettings(max_queued=0)
    assert SimulatorSettings().max_queued is None  # no cap unless asked


def test_the_command_refuses_a_queue_cap_below_one() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "qosd.cli", "sim-triton", "--max-num-queued-reqs", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--max-num-queued-reqs must be at least 1" in done.stderr


# --- GPU time lost to the host's lateness -------------------------------------------------


async def _until(
    events: AsyncIterator[object], condition: Callable[[], bool], timeout_s: float = 10.0
) -> None:
    """Reads ``events`` until ``condition`` holds after one (the GPU's own state)."""

    async def read() -> None:
        async for _ in events:
            if condition():
                return
        raise AssertionError("the stream ended first")

    await asyncio.wait_for(read(), timeout_s)


def _block_the_loop(seconds: float) -> None:
    """The fault simulated: a slow host, or a callback that blocks the event loop."""
    time.sleep(seconds)


async def test_a_blocked_event_loop_loses_gpu_time() -> None:
    """The event loop blocked for 0.3 s while an iteration is due: the GPU restarts
    MAX_CATCH_UP_S behind the clock, and the time between the due iteration's end and
    that restart is lost: about the block less 50 ms, counted with one late wake-up."""
    model = GpuModel(speed=10.0)  # ~1.6 ms decode steps: the stream iterates back to back
    gpu = RealTimeGpu(model)
    gpu.start()
    try:
        stream = gpu.generate(Sequence("long", 100, 100_000, submitted_at=time.monotonic()), 1)
        async with contextlib.aclosing(stream):
            await _until(stream, lambda: gpu.iterations >= 20)
            lost, late = gpu.lost_seconds, gpu.late_wakeups
            # The fault: the loop blocked, as by a slow callback, while an iteration is
            # in flight (the stream decodes back to back), due within one step.
            blocked_at = time.monotonic()
            _block_the_loop(0.3)
            unblocked_at = time.monotonic()
            await _until(stream, lambda: gpu.late_wakeups > late)
        step_s = model.decode_s(1, 100 + gpu.iterations)
        lost = gpu.lost_seconds - lost
        # The due iteration ended by one step after the block began (give or take the
        # few ms by which uvloop's timers, in whole ms from the loop's cached clock, may
        # fire early); the GPU woke after the block and restarted MAX_CATCH_UP_S before.
        assert lost >= unblocked_at - blocked_at - MAX_CATCH_UP_S - step_s - 0.01
        assert lost == pytest.approx(0.3 - MAX_CATCH_UP_S, abs=0.05)
        assert gpu.late_wakeups - late >= 1
    finally:
        await gpu.stop()


async def test_an_unblocked_gpu_loses_no_time() -> None:
    gpu = RealTimeGpu(GpuModel(speed=10.0))
    gpu.start()
    try:
        stream = gpu.generate(Sequence("long", 100, 100_000, submitted_at=time.monotonic()), 1)
        async with contextlib.aclosing(stream):
            await _until(stream, lambda: gpu.iterations >= 100)
        # A loop that keeps up catches up on its small delays: nothing is lost (short of
        # a stall of this busy machine's own beyond MAX_CATCH_UP_S).
        assert gpu.lost_seconds == pytest.approx(0.0, abs=0.05)
    finally:
        await gpu.stop()


async def test_time_lost_counts_from_when_the_gpu_had_work() -> None:
    """A late wake-up after the GPU ran out of work loses only the time since work
    came again (a request that arrived after the last iteration ended), not the whole
    gap since that iteration."""
    gpu = RealTimeGpu(GpuModel(speed=0.1, prefill_chunk_tokens=None))  # 160 ms passes
    gpu.start()
    try:
        first = Sequence("first", 10, 2, submitted_at=time.monotonic())
        stream = gpu.generate(first, 1)
        async with contextlib.aclosing(stream):
            await anext(stream)  # its first token: its last pass (its second) now runs
            lost, late = gpu.lost_seconds, gpu.late_wakeups
            # Arrives after that pass ends (within 160 ms), and before the GPU wakes.
            second = Sequence("second", 10, 1, submitted_at=time.monotonic() + 0.3)
            served = asyncio.create_task(_count(gpu.generate(second)))
            # The fault, once the second request is submitted: a callback that blocks
            # the loop past the first's last pass and the second's arrival.
            asyncio.get_running_loop().call_soon(_block_the_loop, 0.8)
            assert await asyncio.wait_for(served, 10) == 1
            assert [e.finished async for e in stream] == [True]
        assert first.finished_at is not None and second.started_at is not None
        assert second.submitted_at - first.finished_at > 0.1  # the GPU had nothing to do
        assert gpu.late_wakeups > late
        # The GPU restarted at the second's start; before the second arrived, it was
        # idle, not late: only the time since counts.
        lost = gpu.lost_seconds - lost
        assert lost == pytest.approx(second.started_at - second.submitted_at)
        assert lost > 0.2
    finally:
        await gpu.stop()


async def _count(events: AsyncIterator[object]) -> int:
    return sum([1 async for _ in events])


@pytest.mark.fast
def test_kv_is_held_as_passes_write_it_and_a_full_cache_preempts_the_latest() -> None:
    """As vLLM allocates: two requests whose prompts fit the cache but whose outputs do
    not both fit are admitted together; when the cache fills while they decode, the
    latest admitted is preempted, goes back to the front of the queue, and recomputes
    its prompt and output so far, its tokens counted once. With the opt-in
    ``reserve_output_kv`` (the engine before issue 37) the second waits for the first
    to finish, and nothing is preempted."""

    def run(reserve: bool) -> tuple[Engine, Sequence, Sequence, list[int]]:
        model = GpuModel(kv_capacity_tokens=1_200, reserve_output_kv=reserve)
        engine = Engine(model)
        first = Sequence("first", 400, 300, submitted_at=0.0)
        second = Sequence("second", 400, 300, submitted_at=0.0)
        engine.submit(first)
        engine.submit(second)
        now, counted = 0.0, []
        while not (first.done and second.done):
            iteration = engine.plan(now)
            assert iteration is not None
            assert engine.kv_used <= model.kv_capacity_tokens
            now += iteration.duration_s
            counted += [e.generated for e in engine.complete(now) if e.sequence is second]
        assert engine.kv_used == 0
        return engine, first, second, counted

    engine, first, second, counted = run(reserve=False)
    assert first.started_at == second.started_at == 0.0  # both prompts fit at once
    assert engine.preemptions >= 1 and second.recomputed > 0
    assert first.finished_at is not None and second.finished_at is not None
    assert first.finished_at < second.finished_at
    assert counted == list(range(1, 301))  # every token once, in order
    engine, first, second, _ = run(reserve=True)
    assert engine.preemptions == 0 and engine.kv_refusals > 0
    assert second.started_at is not None and first.finished_at is not None
    assert second.started_at >= first.finished_at
