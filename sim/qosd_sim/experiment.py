"""One replay run end to end: a simulated Triton, optionally a qosd daemon, the gateway.

Shared by ``qosd demo`` and ``benchmarks/qos_replay.py``, so that what the demo shows
is what the benchmark measures. Each part runs as its own process, talking over real
sockets, as in a deployment: the simulated GPU's timing must not depend on how busy the
gateway's event loop is.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc.aio as triton
import uvloop

from qosd.config import Config
from qosd_client import QosdClient, Status
from qosd_harness import daemon_processes, stop_process
from qosd_sim.gateway import (
    EXPECTED_OUTPUT_TOKENS,
    PATIENT,
    ClientHabits,
    Gateway,
    ReplayLoop,
    RequestRecord,
    RetryPolicy,
)
from qosd_sim.gpu import GpuModel, run_virtual, saturated_throughput
from qosd_sim.gpu import Sequence as GpuSequence
from qosd_sim.objectives import CLASSES, SCALED, Objectives, Scoring
from qosd_sim.replay import (
    SEED_LONG_PROMPT_TOKENS,
    ClassRule,
    Request,
    TraceRow,
    build_workload,
    trace_token_rate,
)
from qosd_sim.virtual import (
    InProcessGateway,
    InProcessQosd,
    in_process_daemon,
    in_process_server,
    virtual_loop,
)

MODEL = "llm"
#: Each class's priority for servers that schedule by it (0 first), as a gateway that
#: knows its classes passes it where no daemon answers with one.
CLASS_RANKS = {name: rank for rank, name in enumerate(CLASSES)}


class Policy(Enum):
    FIFO = "fifo"  # no QoS: every request straight to the server
    # FIFO whose clients give up at their TTFT objective, as real clients time out.
    FIFO_DEADLINE = "fifo-deadline"
    # No admission: the server's priority scheduling (the class's rank) with a queue
    # cap, refused beyond it, and the client retrying as the openai SDK does.
    VLLM_NATIVE = "vllm-native"
    STATIC = "static"  # qosd's buckets at the seed's fixed 60/35/5, no SLO loop
    QOSD = "qosd"  # qosd in full: buckets, waiting room and the SLO loop

    @property
    def admits(self) -> bool:
        """Whether a qosd daemon decides (static, qosd), or the server takes all."""
        return self in (Policy.STATIC, Policy.QOSD)


@dataclass(frozen=True)
class SimulatorAddresses:
    grpc: str  # HOST:PORT, for tritonclient.grpc
    http: str  # HOST:PORT, for tritonclient.http
    metrics_url: str  # Triton's /metrics


@contextlib.contextmanager
def simulator_process(
    gpu: GpuModel,
    *,
    qosd_target: str = "",
    stream_every: int = 0,
    max_queued: int | None = None,
    timeout_s: float = 20.0,
) -> Iterator[SimulatorAddresses]:
    """Runs ``qosd sim-triton`` as a child on free ports; ``max_queued``: its cap on
    requests in flight (``--max-num-queued-reqs``; None: none)."""
    options = [f"--gpu={name}={getattr(gpu, name)}" for name in gpu.__dataclass_fields__]
    if max_queued is not None:
        options.append(f"--max-num-queued-reqs={max_queued}")
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
            stop_process(process)


def workload_capacity(gpu: GpuModel, workload: Sequence[Request], output_weight: float) -> float:
    """The GPU's saturated throughput on this workload's mix, in input + weighted output
    tokens per second (``output_weight`` 1: plain tokens)."""
    return saturated_throughput(
        gpu,
        [(r.input_tokens, r.output_tokens) for r in workload],
        cost_output_weight=output_weight,
    )


#: The operator's load test, which sets the pool's capacity: Poisson arrivals of
#: requests of one shape, as vLLM's serving benchmark sends with its random dataset.
#: Nothing of the replayed trace goes into it.
LOAD_TEST_PROMPT_TOKENS = 1024
LOAD_TEST_OUTPUT_TOKENS = 256
LOAD_TEST_SECONDS = 120.0


def load_test_requests(rate_rps: float, seed: int = 0) -> list[tuple[float, int, int]]:
    """``LOAD_TEST_SECONDS`` of Poisson arrivals at ``rate_rps``, as (arrival, prompt,
    output)."""
    rng = random.Random(f"load-test:{seed}")
    arrivals: list[tuple[float, int, int]] = []
    at = rng.expovariate(rate_rps)
    while at < LOAD_TEST_SECONDS:
        arrivals.append((at, LOAD_TEST_PROMPT_TOKENS, LOAD_TEST_OUTPUT_TOKENS))
        at += rng.expovariate(rate_rps)
    return arrivals


#: The prompt lengths of the operator's prefill probe: one lone request at each.
PREFILL_PROBE_TOKENS = (1024, 8192, 32768)


@functools.cache
def prefill_probe(gpu: GpuModel) -> tuple[float, float, float]:
    """The server's prefill as an operator measures it before qosd has any report
    (``pools.<pool>.prefill_model_ms``): the TTFT of one lone request at each of
    ``PREFILL_PROBE_TOKENS`` on the idle server, as ``c + a·n + b·n²`` ms through the
    three points. Nothing of the replayed workload goes into it."""
    lengths = np.array(PREFILL_PROBE_TOKENS, dtype=float)
    ttfts = []
    for tokens in PREFILL_PROBE_TOKENS:
        (lone,) = run_virtual(gpu, [(0.0, tokens, 1)])
        assert lone.first_token_at is not None
        ttfts.append((lone.first_token_at - lone.submitted_at) * 1000)
    c, a, b = np.linalg.solve(np.vander(lengths, 3, increasing=True), np.array(ttfts))
    return max(0.0, float(c)), float(a), max(0.0, float(b))


@dataclass(frozen=True, slots=True)
class SloCapacity:
    """What an operator's load test at the top class's objectives finds: the share of
    the server's saturated throughput (on the load test's own requests) at which a
    first-come-first-served server keeps ``attainment`` of the requests within them.
    A figure the benchmark reports, never a precondition.

    - ``load``: the highest such share (to 1/256); None when even ``floor`` fails;
    - ``floor_attainment``: the share of requests within them at ``floor``.
    """

    load: float | None
    floor_attainment: float
    attainment: float
    objectives: Objectives

    @property
    def pool_load(self) -> float:
        """The share of saturation the pool's ``slo`` capacity is configured at: the
        load found, or the whole saturated throughput when none passes (a load test
        that no load passes gives no lower figure; the SLO loop must find the rate)."""
        return 1.0 if self.load is None else self.load

    @property
    def rule(self) -> str:
        test = (
            f"a load test of Poisson arrivals of {LOAD_TEST_PROMPT_TOKENS:,}-token prompts "
            f"and {LOAD_TEST_OUTPUT_TOKENS}-token outputs"
        )
        o = self.objectives
        within = " and ".join(
            f"{name} {value:g} ms"
            for name, value in (("TTFT", o.ttft_ms), ("TPOT", o.tpot_ms))
            if value is not None
        )
        if self.load is not None:
            return (
                f"saturated x {self.load:.3f}: the highest load of {test} at which FIFO keeps "
                f"{self.attainment:.0%} of requests within {within}"
            )
        return (
            f"saturated, because no load of {test} keeps {self.attainment:.0%} of requests "
            f"within {within} (at the floor, {self.floor_attainment:.1%})"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "slo_load": None if self.load is None else round(self.load, 4),
            "slo_load_status": "found" if self.load is not None else "unreachable",
            "slo_floor_attainment": round(self.floor_attainment, 4),
            "slo_attainment_target": self.attainment,
            "load_test": {
                "prompt_tokens": LOAD_TEST_PROMPT_TOKENS,
                "output_tokens": LOAD_TEST_OUTPUT_TOKENS,
                "seconds": LOAD_TEST_SECONDS,
                "arrivals": "poisson",
            },
        }


@functools.cache
def slo_capacity(
    gpu: GpuModel,
    objectives: Objectives,
    *,
    attainment: float = 0.99,
    floor: float = 0.1,
) -> SloCapacity:
    """The highest share of the server's saturated throughput at which it serves the
    load test's requests (``load_test_requests``) first come first served with
    ``attainment`` of them within ``objectives``: what an operator's load test at the
    strictest objectives finds, in virtual time, by bisection between ``floor`` and 1.
    Pure, so remembered: every seed and policy of a run asks it the same."""
    saturated_rps = saturated_throughput(
        gpu, [(LOAD_TEST_PROMPT_TOKENS, LOAD_TEST_OUTPUT_TOKENS)] * 512
    ) / (LOAD_TEST_PROMPT_TOKENS + LOAD_TEST_OUTPUT_TOKENS)

    def share(load: float) -> float:
        finished = run_virtual(gpu, load_test_requests(load * saturated_rps))
        good = sum(1 for s in finished if objectives.met(s.input_tokens, _Outcome.of(s)))
        return good / len(finished)

    at_floor = share(floor)
    if at_floor < attainment:
        return SloCapacity(None, at_floor, attainment, objectives)
    low, high = floor, 1.0
    for _ in range(8):
        middle = (low + high) / 2
        low, high = (middle, high) if share(middle) >= attainment else (low, middle)
    return SloCapacity(low, at_floor, attainment, objectives)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """A finished engine sequence, as scoring reads a gateway's record."""

    completed: bool
    ttft_ms: float | None
    tpot_ms: float | None

    @classmethod
    def of(cls, s: GpuSequence) -> _Outcome:
        if s.first_token_at is None or s.finished_at is None:
            return cls(False, None, None)
        tpot = (
            (s.finished_at - s.first_token_at) * 1000 / (s.output_tokens - 1)
            if s.output_tokens > 1
            else None
        )
        return cls(True, (s.first_token_at - s.submitted_at) * 1000, tpot)


class CapacityChoice(Enum):
    SLO = "slo"  # what the load test finds within the top class's objectives
    SATURATED = "saturated"  # the load test's saturated throughput: optimistic
    HALF = "half"  # half the SLO capacity: too low, the loop must raise it


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    cost_s: float  # the pool's configured capacity, in qosd's cost units per second
    saturated_cost_s: float  # the load test's saturated throughput, in cost units
    choice: CapacityChoice
    slo: SloCapacity

    @property
    def rule(self) -> str:
        if self.choice is CapacityChoice.SATURATED:
            return "saturated: the server's saturated throughput on the load test's requests"
        if self.choice is CapacityChoice.HALF:
            return f"half of the slo capacity, which is {self.slo.rule}"
        return self.slo.rule


def configured_capacity(
    gpu: GpuModel,
    output_weight: float,
    objectives: Objectives,
    *,
    choice: CapacityChoice = CapacityChoice.SLO,
) -> PoolCapacity:
    """The pool capacity, in qosd's cost units, that an operator configures from a load
    test of their server (``load_test_requests``): its saturated throughput times the
    SLO capacity's load, or the saturated throughput itself, or half the SLO capacity,
    by ``choice``. Nothing of the replayed workload goes into it."""
    slo = slo_capacity(gpu, objectives)
    saturated = saturated_throughput(
        gpu,
        [(LOAD_TEST_PROMPT_TOKENS, LOAD_TEST_OUTPUT_TOKENS)] * 512,
        cost_output_weight=output_weight,
    )
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


def daemon_config(
    policy: Policy,
    *,
    base: Config | None = None,
    capacity_cost_s: float,
    output_weight: float,
    redis_url: str | None,
    gpu: GpuModel,
    admit_long_prompts: bool = True,
    overrides: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The daemon's config for a policy, as an operator writes it: ``base``'s classes
    and settings (by default the built-in 60/35/5 classes, the seed's split), with one
    pool for the simulated model at ``capacity_cost_s`` (their load test's figure, in
    qosd's cost units), and only what the operator knows of their servers: their
    flags. Nothing comes from the replayed workload or the cost model's constants.

    - A prompt may cost more than a class's burst: each class may go into debt for one
      request from a full bucket (``max_cost_tokens``, where the base config leaves it
      unset), up to what the server accepts (its largest context, the KV cache here,
      plus the gateway's output estimate at ``output_weight``), times the class's
      weight. With ``admit_long_prompts`` False, 20,000 for every class: a request
      costing more (a 32K prompt) is refused at once with COST_EXCEEDS_BURST. Never
      below the class's burst (config validation requires it).
    - Every policy that admits gates the pool by the server's own limits:
      ``max_in_flight`` its batch slots (vLLM's ``max_num_seqs``),
      ``max_in_flight_tokens`` its KV cache, and ``chunked_prefill`` and
      ``servers_schedule_by_priority`` as the server runs, and ``prefill_model_ms``
      its prefill, probed on the idle server (``prefill_probe``). What else it needs
      it learns from reports, which also replace the probe once there are enough.
    - ``static`` keeps the seed's design otherwise: token buckets and the gate, no SLO
      loop."""
    tree = (base or Config()).model_dump(mode="json")
    tree["redis"]["url"] = redis_url
    # Runs may share a Redis; they must not share state.
    tree["redis"]["key_prefix"] = f"{tree['redis']['key_prefix']}-{policy.value}"
    tree["pools"] = {MODEL: {"capacity_tokens_s": capacity_cost_s, "models": [MODEL]}}
    tree["default_pool"] = MODEL
    tree["cost"]["output_weight"] = output_weight
    largest = gpu.kv_capacity_tokens + output_weight * EXPECTED_OUTPUT_TOKENS
    for cls in tree["classes"].values():
        if cls["max_cost_tokens"] is not None:
            continue
        debt = largest * cls["weight"] if admit_long_prompts else 20_000.0
        burst = cls["burst_tokens"] or cls["burst_s"] * cls["share"] * capacity_cost_s
        cls["max_cost_tokens"] = float(math.ceil(max(debt, burst)))
    if policy.admits:
        tree["pools"][MODEL].update(
            max_in_flight=gpu.max_batch,
            max_in_flight_tokens=float(gpu.kv_capacity_tokens),
            chunked_prefill=gpu.chunked,
            servers_schedule_by_priority=gpu.priority_scheduling,
            prefill_model_ms=list(prefill_probe(gpu)),
        )
    tree["control"]["enabled"] = policy is Policy.QOSD
    # A run lasts about two minutes: decide on 20 samples rather than 50.
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
    #: Times the pool's configured capacity (static's sweep); None: as configured.
    capacity_factor: float | None = None
    #: GPU seconds the simulated server lost to its host's late wake-ups, and how
    #: many there were, read at the end of the run (None: not read).
    gpu_lost_s: float | None = None
    gpu_late_wakeups: int | None = None

    @property
    def name(self) -> str:
        """The run's name in results: the policy, and ``@factor`` for a sweep point."""
        if self.capacity_factor is None:
            return self.policy.value
        return f"{self.policy.value}@{self.capacity_factor:g}"


BUSY_METRIC = "qosd_sim_gpu_busy_seconds"


LOST_METRIC = "qosd_sim_gpu_lost_seconds"
LATE_WAKEUPS_METRIC = "qosd_sim_gpu_late_wakeups_total"


def read_gpu_losses(metrics_url: str, model: str = MODEL) -> tuple[float, int]:
    """The simulated GPU's seconds lost to late wake-ups of its host, and how many
    late wake-ups there were, from its /metrics."""
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for metric in (LOST_METRIC, LATE_WAKEUPS_METRIC):
        prefix = f'{metric}{{model="{model}"'
        for line in text.splitlines():
            if line.startswith(prefix):
                found[metric] = float(line.rpartition(" ")[2])
    if len(found) < 2:
        raise RuntimeError(f"{metrics_url} has no {LOST_METRIC} for {model!r}")
    return found[LOST_METRIC], int(found[LATE_WAKEUPS_METRIC])


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


async def sample_rates(qos: QosdClient, into: list[RatePoint], started: float) -> None:
    while True:
        with contextlib.suppress(Exception):
            into.append(_rate_point(time.monotonic() - started, await qos.status(MODEL)))
        await asyncio.sleep(1.0)


#: Reads the simulated GPU's (clock, cumulative busy seconds): over /metrics in real
#: time, from the server object in virtual time.
BusyReader = Callable[[], Awaitable[tuple[float, float]]]


#: Reads the GPU seconds the simulated server lost to its host, and its late wake-ups.
LossReader = Callable[[], Awaitable[tuple[float, int]]]


def busy_over_http(metrics_url: str) -> BusyReader:
    async def read() -> tuple[float, float]:
        return await asyncio.to_thread(read_busy_seconds, metrics_url)

    return read


def losses_over_http(metrics_url: str) -> LossReader:
    async def read() -> tuple[float, int]:
        return await asyncio.to_thread(read_gpu_losses, metrics_url)

    return read


async def busy_sample(read: BusyReader, started: float) -> tuple[float, float]:
    """(seconds since ``started``, busy seconds), timed by the server's own clock."""
    clock, busy = await read()
    return (clock - started, busy)


async def sample_busy(
    read: BusyReader, into: list[tuple[float, float]], started: float, window_s: float | None
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
                into.append(await busy_sample(read, started))


@dataclass(frozen=True)
class ReplayParts:
    """What a replay drives and reads: the gateway, the daemon it asks (None: the
    policy admits nothing), and the simulated GPU's busy time and losses."""

    gateway: ReplayLoop
    qos: QosdClient | None
    read_busy: BusyReader
    read_losses: LossReader


async def replay_through(
    policy: Policy,
    workload: Sequence[Request],
    parts: ReplayParts,
    *,
    drain_s: float,
    window_s: float | None,
    on_tick: Callable[[float, RatePoint | None], None] | None,
) -> PolicyRun:
    """Replays ``workload`` through ``parts``, sampling the GPU's busy time and the
    daemon's rates as it goes; the same in real and in virtual time."""
    run = PolicyRun(policy, [])
    started = time.monotonic()
    qos = parts.qos
    background: list[asyncio.Task[None]] = []
    try:
        background.append(
            asyncio.create_task(sample_busy(parts.read_busy, run.busy, started, window_s))
        )
        if qos is not None:
            background.append(asyncio.create_task(sample_rates(qos, run.rates, started)))
        if on_tick is not None:

            async def ticker() -> None:
                while True:
                    await asyncio.sleep(1.0)
                    on_tick(time.monotonic() - started, run.rates[-1] if run.rates else None)

            background.append(asyncio.create_task(ticker()))
        await parts.gateway.replay(workload, drain_s=drain_s)
        run.records = parts.gateway.records
        run.duration_s = time.monotonic() - started
        with contextlib.suppress(Exception):
            run.busy.append(await busy_sample(parts.read_busy, started))
        with contextlib.suppress(Exception):
            run.gpu_lost_s, run.gpu_late_wakeups = await parts.read_losses()
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
    return run


async def _replay(
    policy: Policy,
    workload: Sequence[Request],
    *,
    triton_address: str,
    metrics_url: str,
    qosd_address: str | None,
    drain_s: float,
    replica_addresses: Sequence[str] = (),
    window_s: float | None,
    on_record: Callable[[RequestRecord], None] | None,
    on_tick: Callable[[float, RatePoint | None], None] | None,
    acquire_timeout_s: float = 5.0,
    habits: ClientHabits = PATIENT,
) -> PolicyRun:
    client = triton.InferenceServerClient(triton_address)
    # The gateway's deadline for Acquire must outlast the longest class wait, or the
    # deadline, not the class's max wait, ends a P2's wait.
    qos = QosdClient(qosd_address, timeout_s=acquire_timeout_s) if qosd_address else None
    replicas = [QosdClient(address, timeout_s=acquire_timeout_s) for address in replica_addresses]
    try:
        gateway = Gateway(
            client, model=MODEL, qos=qos, on_record=on_record, class_ranks=CLASS_RANKS,
            replicas=replicas, habits=habits,
        )  # fmt: skip
        parts = ReplayParts(
            gateway, qos, busy_over_http(metrics_url), losses_over_http(metrics_url)
        )
        return await replay_through(
            policy, workload, parts, drain_s=drain_s, window_s=window_s, on_tick=on_tick
        )
    finally:
        await client.close()
        for daemon in [qos, *replicas]:
            if daemon is not None:
                await daemon.close()


class Clock(Enum):
    """How a replay keeps time: ``real``, each part its own process over sockets
    (``simulator_process``, ``daemon_processes``), or ``virtual``, all of them in one
    process on a virtual clock (``qosd_sim.virtual``)."""

    REAL = "real"
    VIRTUAL = "virtual"


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
    daemons: int = 1,
    capacity_factor: float | None = None,
    objectives: Scoring = SCALED,
    queue_cap: int | None = None,
    clock: Clock = Clock.REAL,
    passes_every_s: float | None = None,
) -> PolicyRun:
    """Starts the parts a policy needs, replays the workload, stops everything.

    ``window_s``: the arrival window, at whose end the GPU's busy time is read too.
    ``daemons``: how many qosd daemons share the store (``redis_url``); the gateway
    spreads requests over them, and the servers report to the first.
    ``capacity_factor``: the pool's capacity is ``capacity_cost_s`` times this (a
    point of static's sweep). ``objectives``: where fifo-deadline's clients give up.
    ``queue_cap``: vllm-native's server refuses beyond this many in flight, waiting and
    running, as vLLM's ``--max-num-queued-reqs`` counts them. ``clock``: in virtual
    time the daemon runs on the embedded store (``redis_url`` is not used), alone."""
    native = policy is Policy.VLLM_NATIVE
    server_gpu = dataclasses.replace(gpu, priority_scheduling=True) if native else gpu
    max_queued = queue_cap if native else None
    habits = PATIENT
    if not policy.admits:
        give_up = give_up_at_ttft(objectives) if policy is Policy.FIFO_DEADLINE else None
        habits = ClientHabits(give_up, RetryPolicy() if native else None)
    virtual = clock is Clock.VIRTUAL
    if virtual and daemons != 1:
        raise ValueError("a replay in virtual time runs one daemon")
    tree = None
    acquire_timeout_s = 5.0
    if policy.admits:
        tree = daemon_config(
            policy,
            base=base_config,
            capacity_cost_s=capacity_cost_s * (capacity_factor or 1.0),
            output_weight=output_weight,
            redis_url=None if virtual else redis_url,
            admit_long_prompts=admit_long_prompts,
            gpu=gpu,
            overrides=config_overrides,
        )
        # The gateway's deadline for Acquire must outlast the longest class wait.
        waits = [c["max_wait_ms"] for c in tree["classes"].values()]
        acquire_timeout_s = max(waits) / 1000 + 2.0
    if virtual:
        config = Config.model_validate(tree) if tree is not None else None
        run = _run_virtual(
            policy, workload, gpu=server_gpu, config=config, habits=habits,
            max_queued=max_queued, acquire_timeout_s=acquire_timeout_s, drain_s=drain_s,
            window_s=window_s, on_record=on_record, on_tick=on_tick,
            passes_every_s=passes_every_s,
        )  # fmt: skip
    else:
        with contextlib.ExitStack() as parts:
            qosd_address, replicas = "", []
            if tree is not None:
                daemon, *replicas = parts.enter_context(daemon_processes(tree, daemons))
                qosd_address = daemon.address
            simulator = parts.enter_context(
                simulator_process(server_gpu, qosd_target=qosd_address, max_queued=max_queued)
            )
            run = uvloop.run(
                _replay(
                    policy,
                    workload,
                    triton_address=simulator.grpc,
                    metrics_url=simulator.metrics_url,
                    qosd_address=qosd_address or None,
                    replica_addresses=[replica.address for replica in replicas],
                    drain_s=drain_s,
                    window_s=window_s,
                    on_record=on_record,
                    on_tick=on_tick,
                    acquire_timeout_s=acquire_timeout_s,
                    habits=habits,
                )
            )
    run.capacity_factor = capacity_factor
    return run


def _run_virtual(
    policy: Policy,
    workload: Sequence[Request],
    *,
    gpu: GpuModel,
    config: Config | None,
    habits: ClientHabits,
    max_queued: int | None,
    acquire_timeout_s: float,
    drain_s: float,
    window_s: float | None,
    on_record: Callable[[RequestRecord], None] | None,
    on_tick: Callable[[float, RatePoint | None], None] | None,
    passes_every_s: float | None = None,
) -> PolicyRun:
    """One replay in virtual time: the daemon (``config``; None: none), the server and
    the gateway in this process, on a virtual clock."""

    async def replay() -> PolicyRun:
        async with contextlib.AsyncExitStack() as parts:
            qos = None
            if config is not None:
                core = await parts.enter_async_context(in_process_daemon(config))
                qos = InProcessQosd(core, timeout_s=acquire_timeout_s)
            server = await parts.enter_async_context(
                in_process_server(
                    gpu, qos, model=MODEL, max_queued=max_queued, passes_every_s=passes_every_s
                )
            )
            gateway = InProcessGateway(
                server, model=MODEL, qos=qos, on_record=on_record, class_ranks=CLASS_RANKS,
                habits=habits,
            )  # fmt: skip

            async def read_busy() -> tuple[float, float]:
                return time.monotonic(), server.gpu.busy_seconds()

            async def read_losses() -> tuple[float, int]:
                return server.gpu.lost_seconds, server.gpu.late_wakeups

            return await replay_through(
                policy, workload, ReplayParts(gateway, qos, read_busy, read_losses),
                drain_s=drain_s, window_s=window_s, on_tick=on_tick,
            )  # fmt: skip
        raise AssertionError("unreachable")  # for mypy: the stack does not swallow errors

    with virtual_loop() as loop:
        return loop.run_until_complete(replay())


def give_up_at_ttft(objectives: Scoring) -> Callable[[Request], float | None]:
    """A client's patience for its first token: its class's TTFT objective for its
    prompt, in seconds (None where the class has none: it waits)."""

    def give_up_s(request: Request) -> float | None:
        ttft_ms = objectives[request.qos_class].ttft_for(request.input_tokens)
        return None if ttft_ms is None else ttft_ms / 1000

    return give_up_s
