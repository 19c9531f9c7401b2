"""Load workers for multi-process tests: run in their own processes (spawned), so the
clients do not share an interpreter with the test or with each other."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from queue import Empty, Queue
from threading import Event
from typing import Any

import uvloop

from qosd_client import QosdClient, QosdError


@dataclass(frozen=True)
class ClassLoadResult:
    qos_class: str
    answered: int
    admitted: int
    tokens_admitted: float
    reasons: dict[str, int]
    worst_elapsed_s: float  # longest time a caller waited for its answer
    worst_waited_s: float  # longest wait qosd reported
    errors: int
    # The machine's pace while the load ran: how late this worker's own 10 ms timer
    # fired at worst. The daemons share the machine, so their timers are as late.
    worst_lateness_s: float = 0.0
    # When this worker first asked and when it last got an admission, on the machine's
    # monotonic clock (CLOCK_MONOTONIC: one clock for every process here). Every
    # admission the store made for this worker lies between the two.
    first_asked_s: float = 0.0
    last_admitted_s: float = 0.0


def admission_window_s(results: Sequence[ClassLoadResult]) -> float:
    """The span that holds every admission the workers got: from the first ask to the
    last admission's answer. Dividing by it, not by the time until the workers have
    returned, leaves out their exit and the answers that came after the last admission
    (a busy machine made a 10 s load's run 12.6 s)."""
    asked = min(r.first_asked_s for r in results)
    return max(r.last_admitted_s for r in results) - asked


async def _class_load(
    addresses: list[str],
    qos_class: str,
    clients: int,
    seconds: float,
    cost: int,
    max_wait_ms: int,
) -> ClassLoadResult:
    channels = [QosdClient(address, timeout_s=max_wait_ms / 1000 + 5) for address in addresses]
    answered = admitted = errors = 0
    tokens = 0.0
    worst_elapsed = worst_waited = 0.0
    reasons: dict[str, int] = {}
    first_asked = time.monotonic()
    last_admitted = first_asked
    stop_at = first_asked + seconds

    async def client(index: int) -> None:
        nonlocal answered, admitted, errors, tokens, worst_elapsed, worst_waited, last_admitted
        qos = channels[index % len(channels)]
        while time.monotonic() < stop_at:
            started = time.monotonic()
            try:
                result = await qos.acquire(qos_class, cost, max_wait_ms=max_wait_ms)
            except QosdError:
                errors += 1
                await asyncio.sleep(0.01)
                continue
            worst_elapsed = max(worst_elapsed, time.monotonic() - started)
            worst_waited = max(worst_waited, result.waited_s)
            answered += 1
            reasons[result.reason.name] = reasons.get(result.reason.name, 0) + 1
            if result.admitted:
                admitted += 1
                tokens += result.tokens_charged
                last_admitted = max(last_admitted, time.monotonic())
            elif result.retry_after_s:
                await asyncio.sleep(min(result.retry_after_s, 0.05))

    worst_lateness = 0.0

    async def pace() -> None:
        nonlocal worst_lateness
        while time.monotonic() < stop_at:
            began = time.monotonic()
            await asyncio.sleep(0.01)
            worst_lateness = max(worst_lateness, time.monotonic() - began - 0.01)

    try:
        await asyncio.gather(pace(), *(client(i) for i in range(clients)))
    finally:
        for channel in channels:
            await channel.close()
    return ClassLoadResult(qos_class, answered, admitted, tokens, reasons, worst_elapsed,
                           worst_waited, errors, worst_lateness, first_asked,
                           last_admitted)  # fmt: skip


def class_load(
    addresses: list[str],
    qos_class: str,
    clients: int,
    seconds: float,
    cost: int,
    max_wait_ms: int,
    start: Event,
    ready: Queue[str] | None = None,
) -> ClassLoadResult:
    """Says so on ``ready`` (its interpreter is up), waits for ``start``, then keeps
    ``clients`` callers of one class asking (and waiting up to ``max_wait_ms``) for
    ``seconds``; rejected callers back off briefly."""
    if ready is not None:
        ready.put(qos_class)
    start.wait()
    return uvloop.run(_class_load(addresses, qos_class, clients, seconds, cost, max_wait_ms))


def wait_for_workers(
    ready: Queue[str], futures: Sequence[Future[Any]], timeout_s: float = 60.0
) -> None:
    """Returns once every worker has said it is ready on ``ready``; raises the error of
    one that failed first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    waiting_for = len(futures)
    while waiting_for:
        for future in futures:
            if future.done():
                future.result()  # raises what the worker raised
        if time.monotonic() > deadline:
            raise TimeoutError(f"{waiting_for} of {len(futures)} load workers never started")
        try:
            ready.get(timeout=0.1)
        except Empty:
            continue
        waiting_for -= 1
