"""The scrape loop shared by every engine's scraper (``qosd scrape``).

Every ``interval_s`` a scraper reads a model server's ``/metrics``, turns what
changed since the last read into latency samples for the models' classes, records
them into a sink (``LatencyReporter``), and hands the server's own gauges (its
waiting requests, KV cache usage, and what its passes carried since the last read:
``qosd_client.server_load``) to ``on_loads``. The
first read only sets the baseline: what finished before it is not reported. What a
read means is the engine's: subclasses parse it and compute the samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

import aiohttp

from qosd_client.server_load import (
    ModelLoad,
    PassCounts,
    parse_pass_counts,
    parse_server_load,
    passes_between,
    to_report,
)
from qosd_client.types import LatencySample, PassStats, SampleSink, ServerLoad

log = logging.getLogger("qosd_client.scraping")

#: What one read says about one model (the engine's counters).
Counters = TypeVar("Counters")


@dataclass(slots=True)
class ScraperStats:
    reads: int = 0
    failed_reads: int = 0
    samples: int = 0
    unmapped_models: int = 0  # models with no class (and no default class)
    loads: int = 0  # server loads handed to on_loads
    failed_loads: int = 0  # on_loads calls that raised


class MetricsScraper(ABC, Generic[Counters]):
    """Reads ``url`` every ``interval_s`` and records samples into ``sink``.

    ``classes`` maps model names to QoS classes; models it does not name use
    ``default_class``, or are skipped when that is None. ``on_loads`` receives the
    server's gauges at every read, the first included, named ``server`` (by default
    the metrics URL).
    """

    def __init__(
        self,
        url: str,
        sink: SampleSink,
        classes: Mapping[str, str],
        *,
        default_class: str | None = None,
        interval_s: float = 5.0,
        max_samples: int = 200,
        timeout_s: float = 2.0,
        server: str = "",
        on_loads: Callable[[list[ServerLoad]], Awaitable[object]] | None = None,
    ) -> None:
        if interval_s <= 0 or max_samples < 1:
            raise ValueError("need interval_s > 0 and max_samples >= 1")
        self._url = url
        self._sink = sink
        self._classes = dict(classes)
        self._default_class = default_class
        self._interval_s = interval_s
        self.max_samples = max_samples
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._last: dict[str, Counters] | None = None
        self._server = server or url
        self._on_loads = on_loads
        self.stats = ScraperStats()
        #: The server's gauges per model at the last successful read.
        self.last_loads: dict[str, ModelLoad] = {}
        #: What each model's passes carried between the last two successful reads.
        self.last_passes: dict[str, PassStats] = {}
        self._pass_counts: dict[str, PassCounts] = {}

    @abstractmethod
    def parse(self, text: str) -> dict[str, Counters]:
        """One read's counters per model. Raises ValueError on text that does not parse."""

    @abstractmethod
    def empty(self) -> Counters:
        """The counters of a model not seen before: it starts from nothing."""

    @abstractmethod
    def samples_between(
        self, before: Counters, after: Counters, *, model: str, qos_class: str
    ) -> list[LatencySample]:
        """The samples one model's counters imply between two reads."""

    async def scrape_once(self, session: aiohttp.ClientSession) -> list[LatencySample]:
        """One read; returns (and records) the samples since the previous one."""
        try:
            async with session.get(self._url, timeout=self._timeout) as response:
                response.raise_for_status()
                text = await response.text()
            current = self.parse(text)
            self.last_loads = parse_server_load(text)
            counts = parse_pass_counts(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            self.stats.failed_reads += 1
            log.warning("reading %s failed: %r", self._url, error)
            return []
        self.stats.reads += 1
        last_counts, self._pass_counts = self._pass_counts, counts
        self.last_passes = {
            model: stats
            for model, after in counts.items()
            if model in last_counts and (stats := passes_between(last_counts[model], after))
        }
        await self._hand_over_loads()
        baseline = self._last is None
        samples = self.samples_since_last(current)
        if baseline:
            log.info("baseline read from %s (%d models); reporting from the next read",
                     self._url, len(current))  # fmt: skip
        for sample in samples:
            self._sink.record(sample)
        self.stats.samples += len(samples)
        return samples

    async def _hand_over_loads(self) -> None:
        if self._on_loads is None:
            return
        loads = to_report(self.last_loads, self._server, self.last_passes)
        if not loads:
            return
        try:
            await self._on_loads(loads)
        except Exception as error:
            self.stats.failed_loads += 1
            log.warning("reporting the load of %s failed: %r", self._server, error)
        else:
            self.stats.loads += len(loads)

    @property
    def has_baseline(self) -> bool:
        """Whether a read has succeeded: requests that finish from now on are reported."""
        return self._last is not None

    def samples_since_last(self, current: dict[str, Counters]) -> list[LatencySample]:
        last, self._last = self._last, current
        if last is None:
            return []  # the first read is the baseline
        samples: list[LatencySample] = []
        for model, after in current.items():
            qos_class = self._classes.get(model, self._default_class)
            if qos_class is None:
                self.stats.unmapped_models += 1
                continue
            before = last.get(model, self.empty())
            samples += self.samples_between(before, after, model=model, qos_class=qos_class)
        return samples

    async def run(
        self,
        stop: asyncio.Event,
        after_read: Callable[[MetricsScraper[Counters]], None] | None = None,
    ) -> None:
        """Scrapes until ``stop`` is set; calls ``after_read`` after every read,
        successful or not (``stats.reads`` counts those that succeeded; the first of
        them is the baseline)."""
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                await self.scrape_once(session)
                if after_read is not None:
                    after_read(self)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._interval_s)
