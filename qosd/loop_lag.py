"""How late the daemon's event loop runs its timers: ``qosd_event_loop_lag_seconds``.

Every deadline qosd keeps (a waiter's max wait, the store's timeout, the SLO loop's
turn, the health check) is a timer on one event loop. A loop held up, by a starved CPU,
a long callback or a garbage collection, fires them late, and a caller sees that
lateness as qosd's: a P2 that waited 480 ms against a 300 ms max wait, with nothing
wrong in the waiting room. The probe is a timer that asks to wake every
``interval_s`` and records how late it woke, so an operator can tell the daemon's
lateness from the host's, and a test can bound a wait by the daemon's own pace.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import Histogram

#: A wake every 50 ms: 20 a second, nothing next to the request path, and fine enough
#: that a stall of a tenth of a second is seen.
PROBE_INTERVAL_S = 0.05


class LoopLagProbe:
    """Observes, into ``histogram``, how late each of its own wakes came."""

    def __init__(self, histogram: Histogram, interval_s: float = PROBE_INTERVAL_S) -> None:
        self._histogram = histogram
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="qosd-loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self._interval_s
            await asyncio.sleep(self._interval_s)
            self._histogram.observe(max(0.0, loop.time() - due))
