"""Replays in virtual time (``qosd_sim.virtual``): the clock jumps, the parts talk in
process with the same messages and errors as over gRPC, and what a replay measures
is the engine's own timing, with nothing of the host's added."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from qosd.config import Config
from qosd_client import InvalidRequest
from qosd_sim.experiment import Clock, Policy, run_policy
from qosd_sim.gpu import GpuModel, run_virtual
from qosd_sim.replay import Request
from qosd_sim.virtual import InProcessQosd, in_process_daemon, virtual_loop


def test_the_clock_jumps_and_monotonic_reads_it_only_while_the_loop_is_open() -> None:
    real_monotonic = time.monotonic
    with virtual_loop() as loop:
        assert time.monotonic is not real_monotonic
        began_virtual, began_real = loop.time(), real_monotonic()
        loop.run_until_complete(asyncio.sleep(3_600))
        assert loop.time() - began_virtual == pytest.approx(3_600)
        assert time.monotonic() == loop.time()
        # An hour of the loop's time passes without an hour of the host's.
        assert real_monotonic() - began_real < 600
    assert time.monotonic is real_monotonic


def test_work_in_a_thread_takes_no_loop_time_however_long_it_takes() -> None:
    """The SLO loop does its arithmetic in a thread: the clock must not move on while
    it runs, or a run would depend on how fast or busy the host is."""

    async def thread_work() -> float:
        timer = asyncio.create_task(asyncio.sleep(0.001))  # the next timer, 1 ms ahead
        began = asyncio.get_running_loop().time()
        await asyncio.to_thread(real_sleep, 0.05)  # 50 ms of the host's time
        elapsed = asyncio.get_running_loop().time() - began
        await timer
        return elapsed

    real_sleep = time.sleep
    with virtual_loop() as loop:
        assert loop.run_until_complete(thread_work()) == 0


def _workload(count: int, seed: int, qos_class: str = "P1") -> list[Request]:
    rng = random.Random(seed)
    at = 0.0
    requests = []
    for index in range(count):
        at += rng.expovariate(8.0)
        requests.append(
            Request(index, at, rng.randint(100, 3_000), rng.randint(5, 200), qos_class, "t")
        )
    return requests


def test_a_replay_with_no_admission_times_every_request_as_the_engine_alone() -> None:
    """Served first come first served, each request's first token and end come when
    the engine alone (``gpu.run_virtual``) puts them, to the microsecond: the
    gateway, the server and the clock add nothing."""
    gpu = GpuModel()
    workload = _workload(60, seed=7)
    run = run_policy(
        Policy.FIFO, workload, gpu=gpu, capacity_cost_s=1.0, output_weight=1.0,
        redis_url=None, drain_s=120.0, window_s=None, clock=Clock.VIRTUAL,
    )  # fmt: skip
    alone = run_virtual(gpu, [(r.at_s, r.input_tokens, r.output_tokens) for r in workload])
    assert len(run.records) == len(alone) == 60
    by_index = {record.request.index: record for record in run.records}
    for request, sequence in zip(workload, alone, strict=True):
        record = by_index[request.index]
        assert record.completed and not record.error
        assert sequence.first_token_at is not None and sequence.finished_at is not None
        assert record.ttft_ms == pytest.approx(
            (sequence.first_token_at - request.at_s) * 1e3, abs=1e-2
        )
        assert record.e2e_ms == pytest.approx((sequence.finished_at - request.at_s) * 1e3, abs=1e-2)
        assert record.late_ms < 1e-2  # the loop's resolution is a microsecond
    assert run.gpu_lost_s == 0


def test_qosd_in_virtual_time_decides_settles_and_is_the_same_run_twice() -> None:
    """qosd's own code (its servicer, the Lua rules on the embedded store, the SLO
    loop) in the loop: every request is answered, every admitted one runs to its
    end and is released, the daemon's status is read as over gRPC, and the same
    workload gives the same run again."""
    workload = _workload(120, seed=11, qos_class="P0") + [
        Request(1_000 + r.index, r.at_s, r.input_tokens, r.output_tokens, "P2", "u")
        for r in _workload(120, seed=12)
    ]
    workload.sort(key=lambda r: r.at_s)
    options = {"gpu": GpuModel(), "capacity_cost_s": 20_000.0, "output_weight": 1.0,
               "redis_url": None, "drain_s": 60.0, "window_s": 15.0,
               "clock": Clock.VIRTUAL}  # fmt: skip
    first = run_policy(Policy.QOSD, workload, **options)  # type: ignore[arg-type]
    second = run_policy(Policy.QOSD, workload, **options)  # type: ignore[arg-type]
    assert len(first.records) == len(workload)
    unanswered = ("NONE", "ERROR", "UNANSWERED")  # NONE: admitted, for one admitted
    assert all(r.admitted or r.decision not in unanswered for r in first.records)
    admitted = [r for r in first.records if r.admitted]
    assert admitted and all(r.completed and not r.error for r in admitted)
    assert any(not r.admitted for r in first.records)  # P0 past its deadline is refused
    assert first.rates and first.rates[-1].pool_rate > 0

    def outcome(run: object) -> list[tuple[int, str, float | None, float | None]]:
        records = sorted(run.records, key=lambda r: r.request.index)  # type: ignore[attr-defined]
        return [(r.request.index, r.decision, r.ttft_ms, r.e2e_ms) for r in records]

    assert outcome(first) == outcome(second)


def test_the_in_process_client_answers_as_the_grpc_client_does() -> None:
    """Errors arrive as the client's own exceptions (the doors' checks run), and the
    status is the Admin service's."""

    async def calls() -> None:
        async with in_process_daemon(Config()) as core:
            qos = InProcessQosd(core)
            with pytest.raises(InvalidRequest, match="qos_class"):
                await qos.acquire("no-such-class", 10, tenant="t")
            decision = await qos.acquire("P0", 10, tenant="t")
            assert decision.admitted
            await qos.release(decision.lease_id, output_tokens=3)
            assert (await qos.status()).pools

    with virtual_loop() as loop:
        loop.run_until_complete(calls())
