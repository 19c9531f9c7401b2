"""Trace workloads: reading ``arrival_s,input_tokens,output_tokens`` CSVs, starting
them at a seeded point, assigning classes by a stated rule, injecting the seed's
32K-token prompts, scaling time to a target load, making any trace bursty, and
measuring the shape of its arrivals.

Everything here is deterministic for a given seed, so that policies compared side by
side replay exactly the same requests at exactly the same offsets.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

TRACE_COLUMNS = ("arrival_s", "input_tokens", "output_tokens")
SEED_LONG_PROMPT_TOKENS = 32_768


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float
    input_tokens: int
    output_tokens: int


class TraceError(ValueError):
    pass


def read_trace(path: str | Path | None = None) -> list[TraceRow]:
    """Rows of a trace CSV, in arrival order; the bundled Azure sample when ``path`` is None."""
    if path is None:
        source = resources.files("qosd_sim.traces").joinpath("azure_conv_sample.csv")
        with source.open("r", encoding="utf-8") as handle:
            return _parse(handle, "the bundled sample")
    with open(path, encoding="utf-8", newline="") as handle:
        return _parse(handle, str(path))


def _parse(lines: Iterable[str], name: str) -> list[TraceRow]:
    reader = csv.DictReader(lines)
    missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise TraceError(f"{name}: missing column(s) {', '.join(missing)}")
    rows: list[TraceRow] = []
    for line, record in enumerate(reader, start=2):
        try:
            row = TraceRow(
                float(record["arrival_s"]),
                int(record["input_tokens"]),
                int(record["output_tokens"]),
            )
        except (TypeError, ValueError) as exc:
            raise TraceError(f"{name}:{line}: {exc}") from None
        if row.arrival_s < 0 or row.input_tokens < 1 or row.output_tokens < 1:
            raise TraceError(f"{name}:{line}: need arrival_s >= 0 and token counts >= 1")
        rows.append(row)
    if not rows:
        raise TraceError(f"{name}: no rows")
    rows.sort(key=lambda r: r.arrival_s)
    return rows


@dataclass(frozen=True, slots=True)
class ClassRule:
    """Which class a request belongs to.

    By default every request is split by ``mix`` with a seeded hash of its index in
    the workload, whatever its length (the brief's default mix: P0 20 %, P1 50 %, P2
    30 %), so the same request always gets the same class. Opt-in: prompts of
    ``long_prompt_tokens`` or more go to ``long_prompt_class`` (a gateway's rule that
    long-context work is batch work).
    """

    mix: tuple[tuple[str, float], ...] = (("P0", 0.2), ("P1", 0.5), ("P2", 0.3))
    long_prompt_tokens: int | None = None
    long_prompt_class: str = "P2"
    seed: int = 7

    def __post_init__(self) -> None:
        total = sum(share for _, share in self.mix)
        if not self.mix or any(share < 0 for _, share in self.mix) or abs(total - 1) > 1e-6:
            raise ValueError(f"class mix shares must be >= 0 and add up to 1, got {total}")

    @classmethod
    def parse(cls, text: str, **kwargs: object) -> ClassRule:
        """``P0=0.2,P1=0.5,P2=0.3``: the hash mix."""
        mix: list[tuple[str, float]] = []
        for part in text.split(","):
            name, sep, share = part.strip().partition("=")
            if not sep:
                raise ValueError(f"class mix entries look like P0=0.2, got {part!r}")
            mix.append((name.strip(), float(share)))
        return cls(mix=tuple(mix), **kwargs)  # type: ignore[arg-type]

    def classify(self, index: int, input_tokens: int) -> str:
        if self.long_prompt_tokens is not None and input_tokens >= self.long_prompt_tokens:
            return self.long_prompt_class
        digest = hashlib.sha256(f"{self.seed}:{index}".encode()).digest()
        point = int.from_bytes(digest[:8], "big") / 2**64
        cumulative = 0.0
        for name, share in self.mix:
            cumulative += share
            if point < cumulative:
                return name
        return self.mix[-1][0]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload, at its replay offset in seconds."""

    index: int
    at_s: float
    input_tokens: int
    output_tokens: int
    qos_class: str
    tenant: str
    injected: bool = False

    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens


def trace_from(rows: Sequence[TraceRow], start_s: float) -> list[TraceRow]:
    """The trace read from ``start_s`` of its own time, wrapping round to its start:
    rows from there on come first, re-timed from 0, and the rows before follow one
    mean gap after the last. The trace's order, gaps and rows are all kept."""
    first, last = rows[0].arrival_s, rows[-1].arrival_s
    if not first <= start_s <= last:
        raise ValueError(f"start_s must lie within the trace ({first} to {last}), got {start_s}")
    gap = (last - first) / max(1, len(rows) - 1)
    later = [r for r in rows if r.arrival_s >= start_s]
    earlier = [r for r in rows if r.arrival_s < start_s]
    lap = last - start_s + gap
    moved = [dataclasses.replace(r, arrival_s=r.arrival_s - start_s) for r in later]
    moved += [dataclasses.replace(r, arrival_s=lap + r.arrival_s - first) for r in earlier]
    return moved


def seeded_start(rows: Sequence[TraceRow], seed: int) -> float:
    """Where in the trace a replay of ``seed`` starts: a seeded uniform point, so that
    each seed replays another stretch of the trace."""
    return random.Random(f"start:{seed}").uniform(rows[0].arrival_s, rows[-1].arrival_s)


def trace_token_rate(rows: Sequence[TraceRow]) -> float:
    """Input plus output tokens per second the trace offers at its own pace."""
    span = rows[-1].arrival_s - rows[0].arrival_s
    if span <= 0:
        raise TraceError("the trace needs at least two distinct arrival times")
    return sum(r.input_tokens + r.output_tokens for r in rows) / span


def speedup_for_load(rows: Sequence[TraceRow], capacity_tokens_s: float, load: float) -> float:
    """How much to compress the trace's time so it offers ``load`` × capacity."""
    if capacity_tokens_s <= 0 or load <= 0:
        raise ValueError("capacity and load must be > 0")
    return load * capacity_tokens_s / trace_token_rate(rows)


def build_workload(
    rows: Sequence[TraceRow],
    *,
    speedup: float,
    duration_s: float,
    rule: ClassRule = ClassRule(),
    inject_every_s: float | None = None,
    inject_tokens: int = SEED_LONG_PROMPT_TOKENS,
    inject_output_tokens: int = 128,
    inject_class: str | None = "P1",
    tenants: int = 8,
) -> list[Request]:
    """The requests arriving in the first ``duration_s`` of replay, trace time divided
    by ``speedup``, with a ``inject_tokens``-token prompt every ``inject_every_s``.

    The injected prompts are ``inject_class`` (P1 by default: an ordinary user whose
    long prompt hurts everyone); None: the class ``rule`` gives them. The trace is
    looped if it runs out before ``duration_s``.
    """
    if speedup <= 0 or duration_s <= 0:
        raise ValueError("speedup and duration must be > 0")
    start = rows[0].arrival_s
    period = (rows[-1].arrival_s - start) / speedup + 1.0 / speedup
    requests: list[Request] = []
    index = 0
    lap = 0
    while True:
        for row in rows:
            at = lap * period + (row.arrival_s - start) / speedup
            if at >= duration_s:
                break
            requests.append(
                Request(
                    index,
                    at,
                    row.input_tokens,
                    row.output_tokens,
                    rule.classify(index, row.input_tokens),
                    f"tenant-{index % tenants}",
                )
            )
            index += 1
        else:
            lap += 1
            continue
        break
    if inject_every_s:
        at = inject_every_s / 2
        while at < duration_s:
            requests.append(
                Request(
                    index,
                    at,
                    inject_tokens,
                    inject_output_tokens,
                    inject_class or rule.classify(index, inject_tokens),
                    "tenant-long",
                    injected=True,
                )
            )
            index += 1
            at += inject_every_s
    requests.sort(key=lambda r: (r.at_s, r.index))
    return requests


@dataclass(frozen=True, slots=True)
class BurstTargets:
    """The statistics of bursty production traffic that ``BurstProcess`` is fitted to,
    over 1-second bins: the share of bins with no arrival, the busiest bin over the
    mean rate, and the coefficient of variation of the gaps between arrivals.

    The defaults are those of a production code-completion trace (``docs/simulator.md``):
    73 % of bins empty, one peak bin 26x the mean, inter-arrival CV 13; the non-empty
    bins then carry about 1 / (1 - 0.73) = 3.7x the mean."""

    empty_bin_share: float = 0.73
    peak_to_mean: float = 26.0
    interarrival_cv: float = 13.0

    def __post_init__(self) -> None:
        if not 0 <= self.empty_bin_share < 1:
            raise ValueError(f"empty bin share must be in [0, 1), got {self.empty_bin_share}")
        if not self.peak_to_mean >= 1 or not self.interarrival_cv > 0:
            raise ValueError("peak to mean must be >= 1 and the inter-arrival CV > 0")

    @classmethod
    def parse(cls, text: str) -> BurstTargets:
        """``EMPTY:PEAK:CV``, e.g. ``0.73:26:13``; empty: the defaults."""
        if not text.strip():
            return cls()
        parts = text.split(":")
        if len(parts) != 3:
            raise ValueError(f"burst targets look like EMPTY:PEAK:CV, got {text!r}")
        empty, peak, cv = (float(p) for p in parts)
        return cls(empty, peak, cv)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class BurstProcess:
    """Bursty arrivals as a compound Poisson process with power-law burst sizes.

    Bursts begin at the events of a Poisson process of ``bursts_per_s``. Their sizes
    follow a power law: the k-th largest of K bursts holds a share proportional to
    k^-``size_exponent`` of the requests (Zipf), in a random order in time, so a few
    bursts carry much of the traffic and one may dwarf the rest, as in production
    traces. Within a burst, requests follow its start by exponential delays of mean
    ``spread_s``. The window is treated as a circle, so that a burst near its end
    spills over into its start and the rate stays even on average. ``fit`` chooses the
    three parameters for a workload."""

    bursts_per_s: float
    size_exponent: float
    spread_s: float

    def times(self, requests: int, window_s: float, seed: int) -> list[float]:
        """``requests`` arrival offsets in [0, ``window_s``), sorted; pure for a seed."""
        return [float(t) for t in self._times(requests, window_s, seed)]

    def _times(self, requests: int, window_s: float, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        count = max(1, int(rng.poisson(self.bursts_per_s * window_s)))
        starts = rng.uniform(0.0, window_s, count)
        weights = np.arange(1, count + 1, dtype=float) ** -self.size_exponent
        rng.shuffle(weights)
        exact = requests * weights / weights.sum()
        sizes = np.floor(exact).astype(int)
        # Largest remainders first, so that the sizes add up to ``requests``.
        sizes[np.argsort(sizes - exact)[: requests - int(sizes.sum())]] += 1
        offsets = np.repeat(starts, sizes) + rng.exponential(self.spread_s, requests)
        return np.sort(np.minimum(np.mod(offsets, window_s), np.nextafter(window_s, 0)))

    def as_dict(self) -> dict[str, float]:
        return {
            "bursts_per_s": round(self.bursts_per_s, 4),
            "size_exponent": self.size_exponent,
            "spread_s": round(self.spread_s, 4),
        }

    @classmethod
    def fit(cls, requests: int, window_s: float, targets: BurstTargets) -> BurstProcess:
        """The parameters whose arrivals, for this many requests over this window,
        come closest to ``targets`` (the median over ``FIT_SEEDS``, by squared log
        error, the share of non-empty bins weighted four times): a grid search,
        deterministic, so that every seed of a run replays the same process. The
        inter-arrival CV grows with the arrival rate, so the fit is per workload."""
        best: tuple[float, BurstProcess] | None = None
        for rate in np.geomspace(0.05, 1.0, 12):
            for exponent in (0.6, 0.8, 1.0, 1.2, 1.4, 1.7, 2.0):
                for spread in np.geomspace(0.02, 2.0, 10):
                    process = cls(float(rate), exponent, float(spread))
                    error = _shape_error(process.median_shape(requests, window_s), targets)
                    if best is None or error < best[0]:
                        best = (error, process)
        assert best is not None
        return best[1]

    def median_shape(
        self, requests: int, window_s: float, seeds: Iterable[int] = ()
    ) -> dict[str, float]:
        """The median of each arrival statistic over ``seeds`` (default ``FIT_SEEDS``)."""
        shapes = [
            arrival_shape(self._times(requests, window_s, seed), window_s)
            for seed in (seeds or FIT_SEEDS)
        ]
        return {
            "empty_bin_share": statistics.median(s.empty_bin_share for s in shapes),
            "peak_to_mean": statistics.median(s.peak_to_mean for s in shapes),
            "interarrival_cv": statistics.median(s.interarrival_cv or 0.0 for s in shapes),
            "nonempty_to_mean": statistics.median(s.nonempty_to_mean for s in shapes),
            "nonempty_cv": statistics.median(s.nonempty_cv for s in shapes),
        }


#: The seeds ``BurstProcess.fit`` averages over: never a reported run's seed.
FIT_SEEDS = tuple(range(1000, 1008))


def _shape_error(shape: dict[str, float], targets: BurstTargets) -> float:
    def log_error(value: float, target: float) -> float:
        return math.log(max(value, 1e-6) / max(target, 1e-6)) ** 2

    return (
        4 * log_error(1 - shape["empty_bin_share"], 1 - targets.empty_bin_share)
        + log_error(shape["peak_to_mean"], targets.peak_to_mean)
        + log_error(shape["interarrival_cv"], targets.interarrival_cv)
    )


def bursty_workload(
    workload: Sequence[Request], window_s: float, process: BurstProcess, seed: int
) -> list[Request]:
    """The workload with its trace requests' arrivals drawn from ``process``, in the
    trace's own order (so each request keeps its size, class and tenant); the injected
    prompts keep their schedule. Every request is kept, and so is the load."""
    trace = sorted((r for r in workload if not r.injected), key=lambda r: (r.at_s, r.index))
    moved = process.times(len(trace), window_s, seed)
    result = [dataclasses.replace(r, at_s=at) for r, at in zip(trace, moved, strict=True)]
    result += [r for r in workload if r.injected]
    result.sort(key=lambda r: (r.at_s, r.index))
    return result


@dataclass(frozen=True, slots=True)
class ArrivalShape:
    """How bursty arrivals are, over a window cut into 1-second bins from its start."""

    requests: int
    window_s: float
    empty_bin_share: float  # share of 1-s bins with no arrival
    peak_to_mean: float  # most arrivals in one 1-s bin / mean arrivals per second
    interarrival_cv: float | None  # std / mean of the gaps between arrivals
    nonempty_to_mean: float  # mean arrivals of the non-empty bins / mean per second
    nonempty_cv: float  # std / mean of the arrivals of the non-empty bins

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "requests": self.requests,
            "window_s": self.window_s,
            "empty_bin_share": round(self.empty_bin_share, 4),
            "peak_to_mean_1s": round(self.peak_to_mean, 2),
            "interarrival_cv": None
            if self.interarrival_cv is None
            else round(self.interarrival_cv, 2),
            "nonempty_to_mean": round(self.nonempty_to_mean, 2),
            "nonempty_cv": round(self.nonempty_cv, 2),
        }


def arrival_shape(times: Sequence[float] | np.ndarray, window_s: float) -> ArrivalShape:
    """The shape of arrivals at ``times`` (offsets in [0, ``window_s``))."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    ordered = np.sort(np.asarray(times, dtype=float))
    count = max(1, math.ceil(window_s))
    bins = np.bincount(np.clip(ordered.astype(int), 0, count - 1), minlength=count)
    mean_per_s = len(ordered) / window_s
    gaps = np.diff(ordered)
    mean_gap = float(gaps.mean()) if len(gaps) >= 2 else 0.0
    busy = bins[bins > 0]
    busy_mean = float(busy.mean()) if len(busy) else 0.0
    return ArrivalShape(
        requests=len(ordered),
        window_s=window_s,
        empty_bin_share=float((bins == 0).mean()),
        peak_to_mean=float(bins.max()) / mean_per_s if mean_per_s > 0 else 0.0,
        interarrival_cv=float(gaps.std()) / mean_gap if mean_gap > 0 else None,
        nonempty_to_mean=busy_mean / mean_per_s if mean_per_s > 0 else 0.0,
        nonempty_cv=float(busy.std()) / busy_mean if busy_mean > 0 else 0.0,
    )
