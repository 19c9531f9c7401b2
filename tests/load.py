"""Load workers for multi-process tests: run in their own processes (spawned), so the
clients do not share an interpreter with the test or with each other."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from threading import Event

import uvloop

from qosd_client import QosdClient, QosdError


@dataclass(frozen=True)
class WorkerResult:
    answered: int
    admitted: int
    tokens_admitted: float
    errors: int
    worst_answer_s: float


async def _hammer(
    addresses: list[str], clients: int, seconds: float, qos_class: str, input_tokens: int
) -> WorkerResult:
    channels = [QosdClient(address, timeout_s=5.0) for address in addresses]
    answered = admitted = errors = 0
    tokens = 0.0
    worst = 0.0
    stop_at = time.monotonic() + seconds

    async def client(index: int) -> None:
        nonlocal answered, admitted, errors, tokens, worst
        qos = channels[index % len(channels)]
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                result = await qos.acquire(qos_class, input_tokens, max_wait_ms=0)
            except QosdError:
                errors += 1
                continue
            worst = max(worst, time.monotonic() - started)
            answered += 1
            if result.admitted:
                admitted += 1
                tokens += result.tokens_charged

    try:
        await asyncio.gather(*(client(i) for i in range(clients)))
    finally:
        for channel in channels:
            await channel.close()
    return WorkerResult(answered, admitted, tokens, errors, worst)


def hammer(
    addresses: list[str],
    clients: int,
    seconds: float,
    qos_class: str,
    input_tokens: int,
    start: Event,
) -> WorkerResult:
    """Waits for ``start`` (a Manager's Event proxy), then keeps ``clients`` Acquire loops busy."""
    start.wait()
    return uvloop.run(_hammer(addresses, clients, seconds, qos_class, input_tokens))
