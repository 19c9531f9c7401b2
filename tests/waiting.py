"""Waiting on real signals, never on a guessed sleep: a test that needs something to
have happened polls for it, with a deadline, and asserts on what it saw last."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T]],
    check: Callable[[T], bool],
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
) -> T:
    """Polls ``probe`` until ``check`` holds of its value or ``timeout_s`` has passed;
    returns the last value either way (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    value = await probe()
    while not check(value) and time.monotonic() < deadline:
        await asyncio.sleep(interval_s)
        value = await probe()
    return value


async def until(
    check: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.02
) -> bool:
    """Polls ``check`` (a quick, non-blocking test) until it holds or ``timeout_s`` has
    passed, letting the event loop run in between; returns whether it held."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval_s)
    return True


def wait_until(
    check: Callable[[], bool], timeout_s: float = 10.0, interval_s: float = 0.02
) -> bool:
    """Blocking (for tests without an event loop): polls ``check`` until it holds or
    ``timeout_s`` has passed; returns whether it held (the caller asserts)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def unread_bytes(port: int) -> int:
    """Bytes clients have sent to the local server on ``port`` that it has not read yet
    (Linux, from /proc/net/tcp): a Redis busy in a script or stopped reads nothing, so
    a call sent to it shows here until it runs."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            # Its end of every connection, open or closed by the client (not LISTEN).
            if state != "0A" and int(local.rpartition(":")[2], 16) == port:
                total += int(queues.partition(":")[2], 16)
    return total
