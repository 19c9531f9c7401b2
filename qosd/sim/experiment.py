"""One replay run end to end: a simulated Triton, optionally a qosd daemon, the gateway.

Shared by ``qosd demo`` and ``benchmarks/qos_replay.py``, so that what the demo shows
is what the benchmark measures. Each part runs as its own process, talking over real
sockets, as in a deployment: the simulated GPU's timing must not depend on how busy the
gateway's event loop is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import tritonclient.grpc.aio as triton
import uvloop

from qosd.config import Config
from qosd.sim.gateway import Gateway, RequestRecord
from qosd.sim.gpu import GpuModel, run_virtual, saturated_throughput
from qosd.sim.replay import (
    SEED_LONG_PROMPT_TOKENS,
    ClassRule,
    Request,
    TraceRow,
    build_workload,
    trace_token_rate,
)
from qosd.testing import daemon_processes
from qosd_client import QosdClient, Status

MODEL = "llm"


class Policy(Enum):
    FIFO = "fifo"  # no QoS: every request straight to the server
    STATIC = "static"  # qosd's buckets at the seed's fixed 60/35/5, no SLO loop
    QOSD = "qosd"  # qosd in full: buckets, waiting room and the SLO loop


@dataclass(frozen=True)
class SimulatorAddresses:
    grpc: str  # HOST:PORT, for tritonclient.grpc
    http: str  # HOST:PORT, for tritonclient.http
    metrics_url: str  # Triton's /metrics


@contextlib.contextmanager
def simulator_process(
    gpu: GpuModel, *, qosd_target: str = "", stream_every: int = 0, timeout_s: float = 20.0
) -> Iterator[SimulatorAddresses]:
    """Runs ``qosd sim-triton`` as a child on free ports."""
    options = [f"--gpu={name}={getattr(gpu, name)}" for name in gpu.__dataclass_fields__]
    with tempfile.TemporaryDirectory(prefix="qosd-sim-") as directory:
        ready = Path(directory) / "ready.json"
        log_path = Path(directory) / "sim.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "qosd.cli", "sim-triton", "--port", "0",
                 "--metrics-port", "0", "--http-port", "0", "--ready-file", str(ready),
                 "--model", MODEL, "--stream-every", str(stream_every),
                 *(["--qosd", qosd_target] if qosd_target else []), *options],
                stdout=log,
                stderr=log,
            )  # fmt: skip
        try:
            deadline = time.monotonic() + timeout_s
            while not ready.exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"simulated Triton failed: {log_path.read_text()[-2000:]}")
                time.sleep(0.02)
            ports = json.loads(ready.read_text())
            yield SimulatorAddresses(
                grpc=f"127.0.0.1:{ports['port']}",
                http=f"127.0.0.1:{ports['http_port']}",
                metrics_url=f"http://127.0.0.1:{ports['metrics_port']}/metrics",
            )
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def workload_capacity(gpu: GpuModel, workload: Sequence[Request], output_weight: float) -> float:
    """The GPU's saturated throughput on this workload's mix, in input + weighted output
    tokens per second (``output_weight`` 1: plain tokens)."""
    return saturated_throughput(
        gpu,
        [(r.input_tokens, r.output_tokens) for r in workload],
        cost_output_weight=output_weight,
    )


def slo_load(
    gpu: GpuModel,
    workload: Sequence[Request],
    *,
    ttft_ms: float,
    tpot_ms: float,
    attainment: float = 0.99,
) -> float:
    """The highest fraction of saturated capacity at which the GPU, serving this
    workload's requests first come first served, keeps ``attainment`` of them within
    ``ttft_ms`` and ``tpot_ms``: what an operator's load test at the strictest SLO
    would find, and so what they would configure as the pool's capacity.

    Found by bisection over time compressions of the workload, in virtual time.
    """
    trace = sorted((r for r in workload if not r.injected), key=lambda r: r.at_s)
    if len(trace) < 20:
        raise ValueError("too few requests to find the SLO load")
    span = trace[-1].at_s - trace[0].at_s
    capacity = workload_capacity(gpu, trace, 1.0)
    offered = sum(r.tokens() for r in trace) / span

    def holds(load: float) -> bool:
        stretch = offered / (load * capacity)  # > 1 slows the arrivals down
        finished = run_virtual(
            gpu, [(r.at_s * stretch, r.input_tokens, r.output_tokens) for r in trace]
        )
        good = 0
        for s in finished:
            assert s.first_token_at is not None and s.finished_at is not None
            ttft = (s.first_token_at - s.submitted_at) * 1000
            tpot = (
                (s.finished_at - s.first_token_at) * 1000 / (s.output_tokens - 1)
                if s.output_tokens > 1
                else 0.0
            )
            good += ttft <= ttft_ms and tpot <= tpot_ms
        return good >= attainment * len(finished)

    low, high = 0.1, 1.0
    if not holds(low):
        raise ValueError(
            f"this GPU cannot serve the workload within TTFT {ttft_ms} ms and TPOT "
            f"{tpot_ms} ms even at a tenth of its capacity"
        )
    for _ in range(8):
        middle = (low + high) / 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low


def configured_capacity(
    gpu: GpuModel, workload: Sequence[Request], output_weight: float, config: Config
) -> tuple[float, float]:
    """The pool capacity, in qosd's cost units, that an operator would configure for
    this GPU and workload: the saturated throughput times the load at which the
    strictest class objectives still hold for 99 % of requests. Returns (capacity,
    that load)."""
    ttft = [c.slo.ttft_ms for c in config.classes.values() if c.slo.ttft_ms is not None]
    tpot = [c.slo.tpot_ms for c in config.classes.values() if c.slo.tpot_ms is not None]
    load = slo_load(
        gpu,
        workload,
        ttft_ms=min(ttft, default=math.inf),
        tpot_ms=min(tpot, default=math.inf),
    )
    trace = [r for r in workload if not r.injected]
    return load * workload_capacity(gpu, trace, output_weight), load


def calibrated_workload(
    rows: Sequence[TraceRow],
    gpu: GpuModel,
    rule: ClassRule,
    *,
    load: float,
    duration_s: float,
    inject_every_s: float | None = None,
    inject_tokens: int = SEED_LONG_PROMPT_TOKENS,
    inject_output_tokens: int = 128,
) -> tuple[list[Request], float, float]:
    """The trace at ``load`` × the GPU's capacity for that trace, plus the long prompts.

    Load is stated for the trace alone, and the injected prompts come on top: they are
    the disturbance, not the workload. Capacity depends on the mix of prompt and output
    lengths in the replayed window, and the window depends on the time scale, so a few
    rounds settle both. Returns (workload, capacity in tokens/s, time compression).
    """
    capacity = workload_capacity(gpu, build_workload(rows, speedup=1.0, duration_s=600), 1.0)
    speedup = load * capacity / trace_token_rate(rows)
    for _ in range(10):
        trace_only = build_workload(rows, speedup=speedup, duration_s=duration_s, rule=rule)
        capacity = workload_capacity(gpu, trace_only, 1.0)
        offered = sum(r.tokens() for r in trace_only) / duration_s
        if abs(offered / capacity - load) <= 0.01 * load:
            break
        # Damped: the window's mix, and so capacity, moves with the compression.
        speedup *= (load * capacity / offered) ** 0.7
    workload = build_workload(
        rows,
        speedup=speedup,
        duration_s=duration_s,
        rule=rule,
        inject_every_s=inject_every_s,
        inject_tokens=inject_tokens,
        inject_output_tokens=inject_output_tokens,
    )
    return workload, capacity, speedup


def daemon_config(
    policy: Policy,
    *,
    base: Config | None = None,
    capacity_cost_s: float,
    output_weight: float,
    redis_url: str | None,
    admit_long_prompts: bool = True,
    overrides: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The daemon's config for a policy: ``base``'s classes and settings (by default
    the built-in 60/35/5 classes, the seed's split), with one pool for the simulated
    model sized at ``capacity_cost_s`` in qosd's cost units.

    Bursts of half a second of a class's rate are smaller than some prompts' cost, so
    classes may go into debt for one request from a full bucket: P0 and P1 up to
    20,000 (prompts below the 16K that makes a request P2, plus its output estimate),
    P2 up to 40,000, so that the long prompts are admitted at P2's rate. With
    ``admit_long_prompts`` False, P2's limit is 20,000 too: a 32K prompt is refused at
    once with COST_EXCEEDS_BURST, as an operator would configure a pool whose servers
    cannot prefill one without stalling everyone else."""
    tree = (base or Config()).model_dump(mode="json")
    tree["redis"]["url"] = redis_url
    # Runs may share a Redis; they must not share state.
    tree["redis"]["key_prefix"] = f"{tree['redis']['key_prefix']}-{policy.value}"
    tree["pools"] = {MODEL: {"capacity_tokens_s": capacity_cost_s, "models": [MODEL]}}
    tree["default_pool"] = MODEL
    tree["cost"]["output_weight"] = output_weight
    debts = {"P0": 20_000, "P1": 20_000, "P2": 40_000 if admit_long_prompts else 20_000}
    for name, debt in debts.items():
        if name in tree["classes"] and tree["classes"][name]["max_cost_tokens"] is None:
            tree["classes"][name]["max_cost_tokens"] = debt
    tree["control"]["enabled"] = policy is Policy.QOSD
    # A run lasts about a minute: decide on 20 samples rather than 50.
    tree["control"]["min_samples"] = 20
    tree["server"].pop("listen", None)
    if overrides is not None:
        overrides(tree)
    Config.model_validate(tree)
    return tree


@dataclass(slots=True)
class RatePoint:
    t_s: float
    pool_rate: float
    class_rates: dict[str, float]
    waiting: dict[str, int]
    compliance: dict[str, float | None]


@dataclass(slots=True)
class PolicyRun:
    policy: Policy
    records: list[RequestRecord]
    rates: list[RatePoint] = field(default_factory=list)
    duration_s: float = 0.0
    adjustments: list[str] = field(default_factory=list)


def _rate_point(t_s: float, status: Status) -> RatePoint:
    pool = status.pool(MODEL)
    return RatePoint(
        t_s,
        pool.admitted_rate_tokens_s,
        {c.name: c.rate_tokens_s for c in pool.classes},
        {c.name: c.waiting for c in pool.classes},
        {c.name: c.latency.compliance for c in pool.classes},
    )


async def _sample_rates(qos: QosdClient, into: list[RatePoint], started: float) -> None:
    while True:
        with contextlib.suppress(Exception):
            into.append(_rate_point(time.monotonic() - started, await qos.status(MODEL)))
        await asyncio.sleep(1.0)


async def _replay(
    policy: Policy,
    workload: Sequence[Request],
    *,
    triton_address: str,
    qosd_address: str | None,
    drain_s: float,
    on_record: Callable[[RequestRecord], None] | None,
    on_tick: Callable[[float, RatePoint | None], None] | None,
    acquire_timeout_s: float = 5.0,
) -> PolicyRun:
    run = PolicyRun(policy, [])
    client = triton.InferenceServerClient(triton_address)
    # The gateway's deadline for Acquire must outlast the longest class wait, or the
    # deadline, not the class's max wait, ends a P2's wait.
    qos = QosdClient(qosd_address, timeout_s=acquire_timeout_s) if qosd_address else None
    started = time.monotonic()
    background: list[asyncio.Task[None]] = []
    try:
        gateway = Gateway(client, model=MODEL, qos=qos, on_record=on_record)
        if qos is not None:
            background.append(asyncio.create_task(_sample_rates(qos, run.rates, started)))
        if on_tick is not None:

            async def ticker() -> None:
                while True:
                    await asyncio.sleep(1.0)
                    on_tick(time.monotonic() - started, run.rates[-1] if run.rates else None)

            background.append(asyncio.create_task(ticker()))
        await gateway.replay(workload, drain_s=drain_s)
        run.records = gateway.records
        run.duration_s = time.monotonic() - started
        if qos is not None:
            status = await qos.status(MODEL, history=100)
            run.adjustments = [
                f"{c.age_s:.0f}s ago {c.from_tokens_s:,.0f} -> {c.to_tokens_s:,.0f}: {c.reason}"
                for c in status.pool(MODEL).history
            ]
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        await client.close()
        if qos is not None:
            await qos.close()
    return run


def run_policy(
    policy: Policy,
    workload: Sequence[Request],
    *,
    gpu: GpuModel,
    capacity_cost_s: float,
    output_weight: float,
    redis_url: str | None,
    drain_s: float = 20.0,
    admit_long_prompts: bool = True,
    base_config: Config | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_tick: Callable[[float, RatePoint | None], None] | None = None,
    config_overrides: Callable[[dict[str, Any]], None] | None = None,
) -> PolicyRun:
    """Starts the parts a policy needs, replays the workload, stops everything."""
    if policy is Policy.FIFO:
        with simulator_process(gpu) as simulator:
            return uvloop.run(
                _replay(
                    policy,
                    workload,
                    triton_address=simulator.grpc,
                    qosd_address=None,
                    drain_s=drain_s,
                    on_record=on_record,
                    on_tick=on_tick,
                )
            )
    tree = daemon_config(
        policy,
        base=base_config,
        capacity_cost_s=capacity_cost_s,
        output_weight=output_weight,
        redis_url=redis_url,
        admit_long_prompts=admit_long_prompts,
        overrides=config_overrides,
    )
    with (
        daemon_processes(tree) as (daemon,),
        simulator_process(gpu, qosd_target=daemon.address) as simulator,
    ):
        return uvloop.run(
            _replay(
                policy,
                workload,
                triton_address=simulator.grpc,
                qosd_address=daemon.address,
                drain_s=drain_s,
                on_record=on_record,
                on_tick=on_tick,
                acquire_timeout_s=max(c["max_wait_ms"] for c in tree["classes"].values()) / 1000
                + 2.0,
            )
        )
