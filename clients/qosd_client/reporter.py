"""Batched, fire-and-forget latency reporting for model servers.

A model server finishes requests one at a time, but qosd wants samples in batches: one
``Report`` call per batch costs the daemon far less than one per request. More
importantly, the inference path must never wait for qosd or fail because of it. So
``record`` only appends to a bounded buffer; a background task sends the buffer every
``flush_interval_s`` or as soon as ``batch_size`` samples wait. When qosd is slow or
down, the oldest samples are dropped (and counted) rather than letting memory grow:
the SLO loop wants the newest evidence anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
from collections import deque
from dataclasses import dataclass

from qosd_client.client import QosdClient
from qosd_client.tracing import current_traceparent
from qosd_client.types import LatencySample, QosdError

log = logging.getLogger("qosd_client.reporter")


@dataclass(slots=True)
class ReporterStats:
    recorded: int = 0
    sent: int = 0
    refused: int = 0  # samples qosd answered but would not take (unknown class, ...)
    dropped: int = 0  # samples lost to a full buffer or a failed call
    failed_calls: int = 0


class LatencyReporter:
    """Sends ``LatencySample`` batches to qosd in the background.

    Use as ``async with LatencyReporter(client) as reporter: reporter.record(sample)``;
    leaving the block flushes what is buffered, within ``close_timeout_s``.
    """

    def __init__(
        self,
        client: QosdClient,
        *,
        batch_size: int = 200,
        flush_interval_s: float = 0.25,
        max_buffered: int = 10_000,
        call_timeout_s: float = 1.0,
        close_timeout_s: float = 2.0,
    ) -> None:
        if batch_size < 1 or max_buffered < batch_size:
            raise ValueError("need 1 <= batch_size <= max_buffered")
        self._client = client
        self._batch_size = batch_size
        self._flush_interval_s = flush_interval_s
        self._buffer: deque[LatencySample] = deque(maxlen=max_buffered)
        self._call_timeout_s = call_timeout_s
        self._close_timeout_s = close_timeout_s
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self.stats = ReporterStats()

    async def __aenter__(self) -> LatencyReporter:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def start(self) -> None:
        if self._task is None:
            # A context of its own: the sender must not carry the trace of whatever
            # request was current when the reporter started.
            self._task = asyncio.create_task(
                self._run(), name="qosd-latency-reporter", context=contextvars.Context()
            )

    def record(self, sample: LatencySample) -> None:
        """Never blocks and never raises: the request being reported has its own job.

        Called inside the reported request's span, a sample without a ``traceparent``
        takes that span's, so that qosd shows its latencies in the request's trace.
        """
        if not sample.traceparent:
            traceparent = current_traceparent()
            if traceparent:
                sample = dataclasses.replace(sample, traceparent=traceparent)
        if len(self._buffer) == self._buffer.maxlen:
            self.stats.dropped += 1
        self._buffer.append(sample)
        self.stats.recorded += 1
        if len(self._buffer) >= self._batch_size:
            self._wake.set()

    async def close(self) -> None:
        """Flushes what is buffered (bounded by ``close_timeout_s``), then stops.

        Never raises: what could not be sent in time is counted as dropped."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, self._close_timeout_s)
            except TimeoutError:
                pass
            except Exception:  # pragma: no cover - _run catches what a batch raises
                log.exception("qosd latency reporter stopped")
            self._task = None
        self.stats.dropped += len(self._buffer)
        self._buffer.clear()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._flush_interval_s)
            self._wake.clear()
            while self._buffer:
                await self._send_one_batch()
                if not self._closing and len(self._buffer) < self._batch_size:
                    break
            if self._closing and not self._buffer:
                return

    async def _send_one_batch(self) -> None:
        count = min(self._batch_size, len(self._buffer))
        batch = [self._buffer.popleft() for _ in range(count)]
        try:
            result = await self._client.report(batch, timeout_s=self._call_timeout_s)
        except asyncio.CancelledError:
            self.stats.dropped += len(batch)
            raise
        except Exception as error:  # QosdError, or a closed channel: keep reporting
            self.stats.failed_calls += 1
            self.stats.dropped += len(batch)
            level = logging.WARNING if isinstance(error, QosdError) else logging.ERROR
            log.log(level, "qosd Report failed, %d samples dropped: %r", len(batch), error)
            return
        self.stats.sent += result.accepted
        self.stats.refused += len(result.rejected)
        for index, reason in result.rejected[:3]:
            log.warning("qosd refused sample %d: %s", index, reason)
