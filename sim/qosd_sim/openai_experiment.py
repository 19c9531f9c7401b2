"""The QoS benchmark's policies against ``qosd sim-vllm``, through the OpenAI API: the
same workloads and scoring as ``experiment.run_policy`` (a simulated Triton and a
gateway calling Acquire), with no gateway code.

- ``fifo``: the official ``openai`` async client straight to the simulated vLLM;
- ``static`` and ``qosd``: the same client through ``qosd proxy``, configured as
  ``experiment.daemon_config`` configures the daemon.

Where the simulated GPU schedules by priority, requests carry their class's rank in
vLLM's ``priority`` field (``--priority-upstreams`` through the proxy).

Several servers of one model: ``proxy_process`` takes a list of upstreams (one
``--upstream MODEL=URL`` each), and ``replay_openai`` a list of base URLs, which the
client takes in turn (``RoundRobinGateway``: what a plain Kubernetes Service in front
of them does), and a list of ``/metrics`` URLs, whose busy seconds it averages.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from qosd_client import QosdClient
from qosd_harness import start_command, stop_process
from qosd_sim.experiment import (
    MODEL,
    BusyReader,
    LossReader,
    Policy,
    PolicyRun,
    ReplayParts,
    busy_over_http,
    daemon_config,
    losses_over_http,
    read_busy_seconds,
    read_gpu_losses,
    replay_through,
)
from qosd_sim.gateway import ReplayLoop, RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import CLASSES
from qosd_sim.openai_gateway import OpenAIGateway, rank_priorities
from qosd_sim.replay import Request

#: Server chunks of this many tokens: every way to the server pays the same per chunk,
#: and the replay's client keeps up with a GPU's worth of streams on a small machine.
STREAM_EVERY = 8


@contextlib.contextmanager
def vllm_process(gpu: GpuModel, directory: Path, name: str = "vllm") -> Iterator[str]:
    """``qosd sim-vllm`` on a free port with ``gpu``'s constants; its base URL."""
    options: list[str] = []
    for item in fields(gpu):
        if item.name == "priority_scheduling":
            continue
        options += ["--gpu", f"{item.name}={getattr(gpu, item.name)}"]
    policy = "priority" if gpu.priority_scheduling else "fcfs"
    process, ready = start_command(
        ["sim-vllm", "--listen", "127.0.0.1:0", "--model", MODEL, "--max-waiting", "1000000",
         "--stream-every", str(STREAM_EVERY), "--scheduling-policy", policy, *options],
        directory, name,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{ready['port']}"
    finally:
        stop_process(process)


def _as_list(value: str | Sequence[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


@contextlib.contextmanager
def proxy_process(
    tree: dict[str, Any],
    upstream: str | Sequence[str],
    directory: Path,
    *,
    priority_upstreams: bool,
    extra_args: Sequence[str] = (),
) -> Iterator[tuple[str, str]]:
    """``qosd proxy`` with the config ``tree`` in front of ``upstream`` (one base URL,
    or several servers of the model, one ``--upstream`` each), ``extra_args`` added to
    its command line: its OpenAI base URL and its gRPC address."""
    path = directory / "qosd.yaml"
    path.write_text(yaml.safe_dump(tree))
    upstreams = [arg for url in _as_list(upstream) for arg in ("--upstream", f"{MODEL}={url}")]
    process, ready = start_command(
        ["proxy", "--config", str(path), "--listen", "127.0.0.1:0", "--grpc-listen",
         "127.0.0.1:0", *upstreams, "--log-level", "WARNING",
         *(["--priority-upstreams"] if priority_upstreams else []), *extra_args],
        directory, "proxy",
    )  # fmt: skip
    try:
        yield f"http://{ready['address']}/v1", ready["grpc"][0]
    finally:
        stop_process(process)


class RoundRobinGateway(ReplayLoop):
    """Each request to the next of several OpenAI endpoints in turn (one client each),
    as a plain Kubernetes Service spreads requests over a model's servers: no
    admission, no look at their load."""

    def __init__(self, gateways: Sequence[OpenAIGateway]) -> None:
        super().__init__()
        self._gateways = list(gateways)
        self._next = 0

    async def close(self) -> None:
        for gateway in self._gateways:
            await gateway.close()

    async def _infer(self, request: Request, record: RequestRecord, arrived: float) -> None:
        gateway = self._gateways[self._next % len(self._gateways)]
        self._next += 1
        await gateway._infer(request, record, arrived)


def busy_over_servers(metrics_urls: Sequence[str]) -> BusyReader:
    """The servers' mean cumulative busy seconds (so that a busy fraction stays the
    share of the servers' time), with the latest of their clocks (one host's)."""
    if len(metrics_urls) == 1:
        return busy_over_http(metrics_urls[0])

    async def read() -> tuple[float, float]:
        readings = await asyncio.gather(
            *(asyncio.to_thread(read_busy_seconds, url) for url in metrics_urls)
        )
        return max(c for c, _ in readings), sum(b for _, b in readings) / len(readings)

    return read


def losses_over_servers(metrics_urls: Sequence[str]) -> LossReader:
    """The GPU seconds the servers lost to late wake-ups, and how many, summed."""
    if len(metrics_urls) == 1:
        return losses_over_http(metrics_urls[0])

    async def read() -> tuple[float, int]:
        readings = await asyncio.gather(
            *(asyncio.to_thread(read_gpu_losses, url) for url in metrics_urls)
        )
        return sum(lost for lost, _ in readings), sum(n for _, n in readings)

    return read


async def replay_openai(
    policy: Policy,
    workload: Sequence[Request],
    *,
    url: str | Sequence[str],
    metrics_url: str | Sequence[str],
    qosd_address: str | None,
    priorities: dict[str, int] | None,
    drain_s: float,
    window_s: float | None,
    api_key: str = "unused",
) -> PolicyRun:
    """One replay through ``url`` (several: each request to the next in turn), with
    the GPU's busy seconds (several ``metrics_url``: their mean) and (through qosd)
    the pool's rates sampled every second."""
    urls, metrics_urls = _as_list(url), _as_list(metrics_url)
    clients = [
        OpenAIGateway(base, model=MODEL, api_key=api_key, priorities=priorities) for base in urls
    ]
    gateway: OpenAIGateway | RoundRobinGateway = (
        clients[0] if len(clients) == 1 else RoundRobinGateway(clients)
    )
    qos = QosdClient(qosd_address) if qosd_address else None
    try:
        parts = ReplayParts(
            gateway, qos, busy_over_servers(metrics_urls), losses_over_servers(metrics_urls)
        )
        return await replay_through(
            policy, workload, parts, drain_s=drain_s, window_s=window_s, on_tick=None
        )
    finally:
        await gateway.close()
        if qos is not None:
            await qos.close()


def run_policy_openai(
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
    config_overrides: Callable[[dict[str, Any]], None] | None = None,
) -> PolicyRun:
    """``experiment.run_policy``'s counterpart with ``--server vllm``."""
    priorities = rank_priorities(list(CLASSES)) if gpu.priority_scheduling else None
    with tempfile.TemporaryDirectory(prefix="qosd-openai-") as scratch:
        directory = Path(scratch)
        with vllm_process(gpu, directory) as upstream:
            metrics_url = f"{upstream}/metrics"
            if policy is Policy.FIFO:
                return asyncio.run(
                    replay_openai(policy, workload, url=f"{upstream}/v1", metrics_url=metrics_url,
                                  qosd_address=None, priorities=priorities, drain_s=drain_s,
                                  window_s=window_s)
                )  # fmt: skip
            tree = daemon_config(
                policy,
                capacity_cost_s=capacity_cost_s,
                output_weight=output_weight,
                redis_url=redis_url,
                gpu=gpu,
                admit_long_prompts=admit_long_prompts,
                overrides=config_overrides,
            )
            tree["redis"]["key_prefix"] += f"-{time.monotonic_ns()}"  # runs share a Redis
            with proxy_process(
                tree, upstream, directory, priority_upstreams=gpu.priority_scheduling
            ) as (url, grpc):
                return asyncio.run(
                    replay_openai(policy, workload, url=url, metrics_url=metrics_url,
                                  qosd_address=grpc, priorities=None, drain_s=drain_s,
                                  window_s=window_s)
                )  # fmt: skip
