"""Trace workloads: reading ``arrival_s,input_tokens,output_tokens`` CSVs, assigning
classes by a stated rule, injecting the seed's 32K-token prompts, scaling time to a
target load, making any trace bursty, and measuring the shape of its arrivals.

Everything here is deterministic for a given seed, so that policies compared side by
side replay exactly the same requests at exactly the same offsets.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import itertools
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

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
class Bursts:
    """An on/off modulation that makes any trace bursty (``burst_times``).

    Replay time is cut into cycles of ``period_s`` seconds (the last one may be
    shorter). Each cycle's arrivals are moved into one on-period of ``duty`` × the
    cycle's length, which starts at a seeded random offset inside the cycle; the rest
    of the cycle has no arrivals at all. Inside the on-period, the first ``front_s``
    seconds (the burst's front) arrive at ``peak`` × the mean rate, and the rest of the
    cycle's arrivals are spread evenly over the remainder of the on-period. The map is
    monotone, so the trace's own order and fine structure survive, compressed.

    Every request is kept, and each cycle keeps its own requests, so the mean rate over
    every cycle, and so the load over the window, is unchanged. With a front denser
    than the cycle holds (``peak`` × ``front_s`` > the cycle's length) the whole cycle
    arrives in its front; with ``peak`` at or below 1 / ``duty`` the on-period is even.

    The defaults give the Azure conversation trace at 1.5× load, over 120 s, about
    72 % empty 1-s bins, a 1-s peak about 25× the mean rate, and a coefficient of
    variation of inter-arrival times about 18 (``docs/simulator.md``).
    """

    duty: float = 0.25
    peak: float = 26.0
    period_s: float = 30.0
    front_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.duty <= 1:
            raise ValueError(f"burst duty must be in (0, 1], got {self.duty}")
        if not self.peak >= 1:
            raise ValueError(f"burst peak must be >= 1 (a multiple of the mean), got {self.peak}")
        if not (self.period_s > 0 and self.front_s > 0):
            raise ValueError("burst period and front must be > 0")

    @classmethod
    def parse(cls, text: str) -> Bursts:
        """``DUTY:PEAK[:PERIOD_S]``, e.g. ``0.25:26:30``; empty: the defaults."""
        if not text.strip():
            return cls()
        parts = text.split(":")
        if not 2 <= len(parts) <= 3:
            raise ValueError(f"bursts look like DUTY:PEAK[:PERIOD_S], got {text!r}")
        values = [float(p) for p in parts]
        names = ("duty", "peak", "period_s")
        return cls(**dict(zip(names, values, strict=False)))

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def burst_times(times: Sequence[float], window_s: float, bursts: Bursts, seed: int) -> list[float]:
    """``times`` (sorted replay offsets in [0, ``window_s``)) moved into bursts.

    Pure and deterministic for a seed; see ``Bursts`` for the definition. Returns the
    new offsets, in the same order, all in [0, ``window_s``).
    """
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    if any(b < a for a, b in itertools.pairwise(times)):
        raise ValueError("times must be sorted")
    if times and (times[0] < 0 or times[-1] >= window_s):
        raise ValueError(f"times must lie in [0, {window_s})")
    rng = random.Random(seed)
    period = bursts.period_s
    cycles: list[tuple[float, float, float]] = []  # (start of on-period, cycle, on-length)
    for k in range(math.ceil(window_s / period)):
        length = min(period, window_s - k * period)
        on = bursts.duty * length
        cycles.append((k * period + rng.uniform(0.0, length - on), length, on))
    moved: list[float] = []
    for t in times:
        k = min(int(t // period), len(cycles) - 1)
        start, length, on = cycles[k]
        share = (t - k * period) / length  # where it falls in its cycle, in [0, 1)
        front = min(bursts.front_s, on)
        in_front = min(1.0, bursts.peak * front / length)  # share of the cycle in the front
        if in_front <= front / on or on <= front:
            offset = share * on  # no denser than even
        elif share < in_front:
            offset = share / in_front * front
        else:
            offset = front + (share - in_front) / (1.0 - in_front) * (on - front)
        moved.append(min(start + offset, k * period + length * (1 - 1e-12)))
    return moved


def bursty_workload(
    workload: Sequence[Request], window_s: float, bursts: Bursts, seed: int
) -> list[Request]:
    """The workload with its trace requests moved into bursts (``burst_times``); the
    injected prompts keep their schedule. Sorted by arrival."""
    trace = sorted((r for r in workload if not r.injected), key=lambda r: (r.at_s, r.index))
    moved = burst_times([r.at_s for r in trace], window_s, bursts, seed)
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

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "requests": self.requests,
            "window_s": self.window_s,
            "empty_bin_share": round(self.empty_bin_share, 4),
            "peak_to_mean_1s": round(self.peak_to_mean, 2),
            "interarrival_cv": None
            if self.interarrival_cv is None
            else round(self.interarrival_cv, 2),
        }


def arrival_shape(times: Sequence[float], window_s: float) -> ArrivalShape:
    """The shape of arrivals at ``times`` (offsets in [0, ``window_s``))."""
    if window_s <= 0:
        raise ValueError("window_s must be > 0")
    ordered = sorted(times)
    bins = [0] * max(1, math.ceil(window_s))
    for t in ordered:
        bins[min(len(bins) - 1, max(0, int(t)))] += 1
    mean_per_s = len(ordered) / window_s
    gaps = [b - a for a, b in itertools.pairwise(ordered)]
    mean_gap = statistics.fmean(gaps) if len(gaps) >= 2 else 0.0
    return ArrivalShape(
        requests=len(ordered),
        window_s=window_s,
        empty_bin_share=sum(1 for b in bins if b == 0) / len(bins),
        peak_to_mean=max(bins) / mean_per_s if mean_per_s > 0 else 0.0,
        interarrival_cv=statistics.pstdev(gaps) / mean_gap if mean_gap > 0 else None,
    )
