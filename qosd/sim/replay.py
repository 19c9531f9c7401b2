"""Trace workloads: reading ``arrival_s,input_tokens,output_tokens`` CSVs, assigning
classes by a stated rule, injecting the seed's 32K-token prompts, and scaling time to a
target load.

Everything here is deterministic for a given seed, so that policies compared side by
side replay exactly the same requests at exactly the same offsets.
"""

from __future__ import annotations

import csv
import hashlib
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
        source = resources.files("qosd.examples").joinpath("azure_conv_sample.csv")
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

    Prompts of ``long_prompt_tokens`` or more go to ``long_prompt_class`` (a gateway's
    usual rule: long-context work is batch work); the rest are split by ``mix`` with a
    seeded hash of the request's index, so the same request always gets the same class.
    """

    mix: tuple[tuple[str, float], ...] = (("P0", 0.2), ("P1", 0.5), ("P2", 0.3))
    long_prompt_tokens: int | None = 16_384
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
    tenants: int = 8,
) -> list[Request]:
    """The requests arriving in the first ``duration_s`` of replay, trace time divided
    by ``speedup``, with a ``inject_tokens``-token prompt every ``inject_every_s``.

    The trace is looped if it runs out before ``duration_s``.
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
                    rule.classify(index, inject_tokens),
                    "tenant-long",
                    injected=True,
                )
            )
            index += 1
            at += inject_every_s
    requests.sort(key=lambda r: (r.at_s, r.index))
    return requests
