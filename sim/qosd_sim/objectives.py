"""The objectives the QoS benchmark scores every policy by, declared here, not by qosd.

The yardstick must not move when qosd's configuration does, so nothing here reads
``qosd.config``: the brief's reference table (P0 TTFT 500 ms and TPOT 50 ms, P1 2 s and
100 ms, P2 none), with the TTFT objective scaled with the prompt, as the brief allows
(a 100K-token prompt's prefill alone takes seconds). Two scorings:

- ``scaled`` (the headline): TTFT grows by 200 ms per 1,000 prompt tokens beyond 4,096;
- ``fixed_p0``: P0's TTFT is 500 ms whatever the prompt (the others as in ``scaled``),
  the strictest reading of the brief's table.

A request **attains** its objectives when it completed and its TTFT and TPOT, measured
by the gateway from the request's scheduled arrival, are within them; a class without
objectives (P2) attains them by being served.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

CLASSES = ("P0", "P1", "P2")


class Judged(Protocol):
    """What scoring needs of a request's outcome (a gateway's record)."""

    @property
    def completed(self) -> bool: ...
    @property
    def ttft_ms(self) -> float | None: ...
    @property
    def tpot_ms(self) -> float | None: ...


@dataclass(frozen=True, slots=True)
class Objectives:
    """One class's objectives, ms; ``ttft_ms`` covers prompts of up to ``free_tokens``."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    ttft_ms_per_1k_tokens: float = 0.0
    free_tokens: int = 4096

    @property
    def has_slo(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def ttft_for(self, input_tokens: int) -> float | None:
        """The TTFT objective of a request with this prompt, ms."""
        if self.ttft_ms is None:
            return None
        beyond = max(0, input_tokens - self.free_tokens)
        return self.ttft_ms + self.ttft_ms_per_1k_tokens * beyond / 1000

    def met(self, input_tokens: int, outcome: Judged) -> bool:
        if not outcome.completed:
            return False
        checks = ((self.ttft_for(input_tokens), outcome.ttft_ms), (self.tpot_ms, outcome.tpot_ms))
        return all(limit is None or value is None or value <= limit for limit, value in checks)


Scoring = Mapping[str, Objectives]

SCALED: Scoring = {
    "P0": Objectives(500.0, 50.0, 200.0),
    "P1": Objectives(2_000.0, 100.0, 200.0),
    "P2": Objectives(),
}
FIXED_P0: Scoring = {**SCALED, "P0": replace(SCALED["P0"], ttft_ms_per_1k_tokens=0.0)}

#: Every scoring the benchmark reports, by name; the first is the headline.
SCORINGS: dict[str, Scoring] = {"scaled": SCALED, "fixed_p0": FIXED_P0}


def describe(scoring: Scoring) -> dict[str, dict[str, float | int | None]]:
    """The scoring as it is written into results files."""
    return {
        name: {
            "ttft_ms": o.ttft_ms,
            "tpot_ms": o.tpot_ms,
            "ttft_ms_per_1k_tokens": o.ttft_ms_per_1k_tokens,
            "free_tokens": o.free_tokens,
        }
        for name, o in scoring.items()
    }
