"""One replay run end to end: a simulated Triton, optionally a qosd daemon, the gateway.

Shared by ``qosd demo`` and ``benchmarks/qos_replay.py``, so that what the demo shows
is what the benchmark measures. Each part runs as its own process, talking over real
sockets, as in a deployment: the simulated GPU's timing must not depend on how busy the
gateway's event loop is.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import tritonclient.grpc.aio as triton
import uvloop

from qosd.config import Config
from qosd_client import QosdClient, Status
from qosd_sim.gateway import EXPECTED_OUTPUT_TOKENS, Gateway, RequestRecord
from qosd_sim.gpu import GpuModel, run_virtual, saturated_throughput
from qosd_sim.harness import daemon_processes
from qosd_sim.replay import (
    SEED_LONG_PROMPT_TOKENS,
    ClassRule,
    Request,
    TraceRow,
    build_workload,
    trace_token_rate,
)

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
                start_new_session=True,  # as DaemonProcess: Ctrl-C is for the parent
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


@dataclass(frozen=True, slots=True)
class SloCapacity:
    """What an operator's load test finds: the share of the GPU's saturated capacity
    that a first-come-first-served server can be loaded to within the strictest
    objectives. A figure the benchmark reports, never a precondition.

    - ``load``: the highest load (a fraction of saturation, to 1/256) at which
      ``attainment`` of the requests meet the objectives; None when even a tenth of
      capacity fails (unreachable): some prompts of the trace cannot meet them on an
      idle GPU, or one long prefill stalls everyone at any load;
    - ``floor_attainment``: the share of requests meeting them at a tenth of capacity.

    The pool's ``slo`` capacity is the saturated throughput times ``load``; when that
    is unreachable, the saturated throughput itself (``pool_load`` 1.0): a load test
    that no load passes gives no lower figure to configure, and the SLO loop is left
    to find the rate. Below the floor there is no figure to find either.
    """

    load: float | None
    floor_attainment: float
    attainment: float
    ttft_ms: float
    tpot_ms: float
    # Beyond ttft_free_tokens, the TTFT objective grows by this per 1,000 prompt tokens.
    ttft_ms_per_1k_tokens: float = 0.0
    ttft_free_tokens: int = 0

    @property
    def objectives_text(self) -> str:
        ttft = f"TTFT {self.ttft_ms:g} ms"
        if self.ttft_ms_per_1k_tokens:
            ttft += (
                f" (+{self.ttft_ms_per_1k_tokens:g} ms per 1K prompt tokens beyond "
                f"{self.ttft_free_tokens:,})"
            )
        return f"{ttft} and TPOT {self.tpot_ms:g} ms"

    @property
    def reachable(self) -> bool:
        return self.load is not None

    @property
    def pool_load(self) -> float:
        """The fraction of saturation the pool's ``slo`` capacity is configured at."""
        return 1.0 if self.load is None else self.load

    @property
    def rule(self) -> str:
        if self.load is not None:
            return (
                f"saturated x slo_load {self.load:.3f}, the highest load at which FIFO keeps "
                f"{self.attainment:.0%} of requests within {self.objectives_text}"
            )
        return (
            f"saturated, because slo_load is unreachable: even at 0.1 of capacity FIFO keeps "
            f"only {self.floor_attainment:.1%} of requests within {self.objectives_text}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "slo_load": None if self.load is None else round(self.load, 4),
            "slo_load_status": "found" if self.load is not None else "unreachable",
            "slo_floor_attainment": round(self.floor_attainment, 4),
            "slo_attainment_target": self.attainment,
            "slo_ttft_ms": self.ttft_ms,
            "slo_tpot_ms": self.tpot_ms,
            "slo_ttft_ms_per_1k_tokens": self.ttft_ms_per_1k_tokens,
            "slo_ttft_free_tokens": self.ttft_free_tokens,
        }


def slo_capacity(
    gpu: GpuModel,
    workload: Sequence[Request],
    *,
    ttft_ms: float,
    tpot_ms: float,
    attainment: float = 0.99,
    window_s: float | None = None,
    floor: float = 0.1,
    ttft_ms_per_1k_tokens: float = 0.0,
    ttft_free_tokens: int = 0,
) -> SloCapacity:
    """The highest fraction of saturated capacity at which the GPU, serving this
    workload's requests first come first served, keeps ``attainment`` of them within
    ``ttft_ms`` and ``tpot_ms`` (``SloCapacity``): what an operator's load test at the
    strictest SLO would find, and so what they would configure as the pool's capacity.
    A request's TTFT objective grows by ``ttft_ms_per_1k_tokens`` per 1,000 prompt
    tokens beyond ``ttft_free_tokens``, as ``qosd.slo.request_objectives`` has it.

    Found by bisection over time compressions of the workload's trace requests (their
    offered rate over ``window_s``, by default the span of their arrivals), in virtual
    time, between ``floor`` and 1.
    """
    trace = sorted((r for r in workload if not r.injected), key=lambda r: r.at_s)
    if not trace:
        raise ValueError("no trace requests to find the SLO load with")
    span = window_s if window_s is not None else trace[-1].at_s - trace[0].at_s
    capacity = workload_capacity(gpu, trace, 1.0)
    offered = sum(r.tokens() for r in trace) / max(span, 1e-3)

    def share(load: float) -> float:
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
            beyond = max(0, s.input_tokens - ttft_free_tokens)
            objective = ttft_ms + ttft_ms_per_1k_tokens * beyond / 1000
            good += ttft <= objective and tpot <= tpot_ms
        return good / len(finished)

    scaling = (ttft_ms_per_1k_tokens, ttft_free_tokens)
    at_floor = share(floor)
    if at_floor < attainment:
        return SloCapacity(None, at_floor, attainment, ttft_ms, tpot_ms, *scaling)
    low, high = floor, 1.0
    for _ in range(8):
        middle = (low + high) / 2
        low, high = (middle, high) if share(middle) >= attainment else (low, middle)
    return SloCapacity(low, at_floor, attainment, ttft_ms, tpot_ms, *scaling)


def slo_load(
    gpu: GpuModel,
    workload: Sequence[Request],
    *,
    ttft_ms: float,
    tpot_ms: float,
    attainment: float = 0.99,
) -> float | None:
    """``slo_capacity``'s load: None when even a tenth of capacity misses."""
    found = slo_capacity(gpu, workload, ttft_ms=ttft_ms, tpot_ms=tpot_ms, attainment=attainment)
    return found.load


class CapacityChoice(Enum):
    SLO = "slo"  # what the GPU serves within the strictest SLO (an operator's load test)
    SATURATED = "saturated"  # its saturated throughput: optimistic, the loop must cut it
    HALF = "half"  # half the SLO capacity: too low, the loop must raise it


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    cost_s: float  # the pool's configured capacity, in qosd's cost units per second
    saturated_cost_s: float  # the GPU's saturated throughput, in cost units
    choice: CapacityChoice
    slo: SloCapacity

    @property
    def rule(self) -> str:
        if self.choice is CapacityChoice.SATURATED:
            return "saturated: the GPU's saturated throughput on the trace's mix"
        if self.choice is CapacityChoice.HALF:
            return f"half of the slo capacity, which is {self.slo.rule}"
        return self.slo.rule


def configured_capacity(
    gpu: GpuModel,
    workload: Sequence[Request],
    output_weight: float,
    config: Config,
    *,
    choice: CapacityChoice = CapacityChoice.SLO,
    window_s: float | None = None,
) -> PoolCapacity:
    """The pool capacity, in qosd's cost units, that an operator would configure for
    this GPU and workload: the saturated throughput times the SLO capacity's load
    (``SloCapacity.pool_load``: the load at which the strictest class objectives
    still hold for 99 % of requests; 1.0 when no load does), or the saturated
    throughput itself, or half the SLO capacity, by ``choice``. Measure it on the
    trace's own arrivals, as a load test would, not on a bursty variant of them."""
    # The strictest objectives: the class with the tightest TTFT (P0), each request's
    # scaled with its prompt as qosd judges it.
    judged = [c.slo for c in config.classes.values() if c.slo.ttft_ms is not None]
    strictest = min(judged, key=lambda slo: slo.ttft_ms or math.inf, default=None)
    slo = slo_capacity(
        gpu,
        workload,
        ttft_ms=(strictest.ttft_ms or math.inf) if strictest else math.inf,
        tpot_ms=(strictest.tpot_ms or math.inf) if strictest else math.inf,
        window_s=window_s,
        ttft_ms_per_1k_tokens=strictest.ttft_ms_per_1k_tokens if strictest else 0.0,
        ttft_free_tokens=strictest.ttft_free_tokens if strictest else 0,
    )
    trace = [r for r in workload if not r.injected]
    saturated = workload_capacity(gpu, trace, output_weight)
    factor = {
        CapacityChoice.SLO: slo.pool_load,
        CapacityChoice.SATURATED: 1.0,
        CapacityChoice.HALF: slo.pool_load / 2,
    }[choice]
    return PoolCapacity(saturated * factor, saturated, choice, slo)


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
    inject_class: str | None = "P1",
) -> tuple[list[Request], float, float]:
    """The trace at ``load`` × the GPU's capacity for that trace, plus the long prompts.

    Load is stated for the trace alone, and the injected prompts come on top: they are
    the disturbance, not the workload. Capacity depends on the mix of prompt and output
    lengths in the replayed window, and the window depends on the time scale, so a few
    rounds settle both. ``bursty_workload`` may then move the trace's arrivals into
    bursts: it keeps every request of the window, and so the load. Returns (workload,
    capacity in tokens/s, time compression).
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
        inject_class=inject_class,
    )
    return workload, capacity, speedup


def largest_cost(workload: Sequence[Request], output_weight: float, expected_output: int) -> float:
    """The largest cost (input + output_weight × the gateway's output estimate) of a
    request of the workload, before class weights."""
    return max((r.input_tokens + output_weight * expected_output for r in workload), default=0.0)


def prompt_for_prefill(gpu: GpuModel, ms: float) -> int:
    """The longest prompt ``gpu`` prefills, unloaded and unchunked, within ``ms``."""
    low, high = 1, gpu.kv_capacity_tokens
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if gpu.prefill_s([middle]) * 1000 <= ms else (low, middle - 1)
    return low


def daemon_config(
    policy: Policy,
    *,
    base: Config | None = None,
    capacity_cost_s: float,
    output_weight: float,
    redis_url: str | None,
    admit_long_prompts: bool = True,
    largest_request_cost: float = 0.0,
    gpu: GpuModel | None = None,
    overrides: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The daemon's config for a policy: ``base``'s classes and settings (by default
    the built-in 60/35/5 classes, the seed's split), with one pool for the simulated
    model sized at ``capacity_cost_s`` in qosd's cost units.

    Bursts of half a second of a class's rate are smaller than some prompts' cost, so
    classes may go into debt for one request from a full bucket (``max_cost_tokens``,
    where the base config leaves it unset): with ``admit_long_prompts``, every class up
    to the largest of 20,000 (40,000 for P2) and ``largest_request_cost`` (the
    workload's largest request, times the class's weight), so that any request of the
    workload, a 32K or a 191K prompt in any class, is admitted at its class's rate.
    With ``admit_long_prompts`` False, every class's limit is 20,000: a request costing
    more (a 32K prompt) is refused at once with COST_EXCEEDS_BURST, as an operator
    would configure a pool whose servers cannot prefill one without stalling everyone
    else. A limit is never below the class's burst (config validation requires it).

    The ``qosd`` policy's pool is GPU-gated by ``gpu``'s own limits, as an operator
    would set them from the server's: ``max_in_flight`` its batch slots,
    ``max_in_flight_tokens`` its KV cache, ``chunked_prefill`` as the server runs, and
    until the SLO loop has learned one, ``long_prefill_tokens``, the prompt whose
    prefill alone takes P0's TTFT objective.
    ``static`` keeps the seed's design: token buckets alone."""
    tree = (base or Config()).model_dump(mode="json")
    tree["redis"]["url"] = redis_url
    # Runs may share a Redis; they must not share state.
    tree["redis"]["key_prefix"] = f"{tree['redis']['key_prefix']}-{policy.value}"
    tree["pools"] = {MODEL: {"capacity_tokens_s": capacity_cost_s, "models": [MODEL]}}
    tree["default_pool"] = MODEL
    tree["cost"]["output_weight"] = output_weight
    for name, cls in tree["classes"].items():
        if cls["max_cost_tokens"] is not None:
            continue
        debt = 20_000.0
        if admit_long_prompts:
            debt = max(40_000.0 if name == "P2" else debt, largest_request_cost * cls["weight"])
        burst = cls["burst_tokens"] or cls["burst_s"] * cls["share"] * capacity_cost_s
        cls["max_cost_tokens"] = float(math.ceil(max(debt, burst)))
    if policy is Policy.QOSD and gpu is not None:
        tree["pools"][MODEL].update(
            max_in_flight=gpu.max_batch,
            max_in_flight_tokens=float(gpu.kv_capacity_tokens),
            chunked_prefill=gpu.prefill_chunk_tokens is not None,
        )
        top = min(tree["classes"].values(), key=lambda c: c["priority"])
        if gpu.prefill_chunk_tokens is None and top["slo"]["ttft_ms"]:
            # Until learned: the prompt whose prefill alone takes P0's TTFT objective.
            tree["pools"][MODEL]["long_prefill_tokens"] = float(
                prompt_for_prefill(gpu, top["slo"]["ttft_ms"])
            )
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
    # (seconds since the replay began, the simulated GPU's cumulative busy seconds),
    # read from its /metrics every second and at the end of the arrival window.
    busy: list[tuple[float, float]] = field(default_factory=list)


BUSY_METRIC = "qosd_sim_gpu_busy_seconds"


def read_busy_seconds(metrics_url: str, model: str = MODEL) -> tuple[float, float]:
    """The simulated GPU's cumulative busy seconds, from its /metrics, and the
    server's ``time.monotonic()`` at that reading (the same clock as this host's)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    busy = clock = None
    prefix = f'{BUSY_METRIC}{{model="{model}"'
    for line in text.splitlines():
        if line.startswith(prefix):
            busy = float(line.rpartition(" ")[2])
        elif line.startswith("qosd_sim_monotonic_seconds "):
            clock = float(line.rpartition(" ")[2])
    if busy is None or clock is None:
        raise RuntimeError(f"{metrics_url} has no {BUSY_METRIC} for {model!r}")
    return clock, busy


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


async def _busy_sample(metrics_url: str, started: float) -> tuple[float, float]:
    """(seconds since ``started``, busy seconds), timed by the server's own clock."""
    clock, busy = await asyncio.to_thread(read_busy_seconds, metrics_url)
    return (clock - started, busy)


async def _sample_busy(
    metrics_url: str, into: list[tuple[float, float]], started: float, window_s: float | None
) -> None:
    """Every whole second from the start, and at the end of the arrival window."""
    window_pending = window_s is not None
    for tick in itertools.count():
        marks = [float(tick)]
        if window_pending and window_s is not None and window_s <= tick:
            window_pending = False
            if window_s < tick:
                marks.insert(0, window_s)
        for at in marks:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            with contextlib.suppress(Exception):
                into.append(await _busy_sample(metrics_url, started))


async def _replay(
    policy: Policy,
    workload: Sequence[Request],
    *,
    triton_address: str,
    metrics_url: str,
    qosd_address: str | None,
    drain_s: float,
    window_s: float | None,
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
        background.append(
            asyncio.create_task(_sample_busy(metrics_url, run.busy, started, window_s))
        )
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
        with contextlib.suppress(Exception):
            run.busy.append(await _busy_sample(metrics_url, started))
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
    window_s: float | None = None,
    admit_long_prompts: bool = True,
    base_config: Config | None = None,
    on_record: Callable[[RequestRecord], None] | None = None,
    on_tick: Callable[[float, RatePoint | None], None] | None = None,
    config_overrides: Callable[[dict[str, Any]], None] | None = None,
) -> PolicyRun:
    """Starts the parts a policy needs, replays the workload, stops everything.

    ``window_s``: the arrival window, at whose end the GPU's busy time is read too."""
    if policy is Policy.FIFO:
        with simulator_process(gpu) as simulator:
            return uvloop.run(
                _replay(
                    policy,
                    workload,
                    triton_address=simulator.grpc,
                    metrics_url=simulator.metrics_url,
                    qosd_address=None,
                    drain_s=drain_s,
                    window_s=window_s,
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
        largest_request_cost=largest_cost(workload, output_weight, EXPECTED_OUTPUT_TOKENS),
        gpu=gpu,
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
                metrics_url=simulator.metrics_url,
                qosd_address=daemon.address,
                drain_s=drain_s,
                window_s=window_s,
                on_record=on_record,
                on_tick=on_tick,
                acquire_timeout_s=max(c["max_wait_ms"] for c in tree["classes"].values()) / 1000
                + 2.0,
            )
        )
