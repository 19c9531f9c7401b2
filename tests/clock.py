"""A clock a test moves by hand, for ``EmbeddedStore(clock=...)``: the scripts' TIME."""

from __future__ import annotations


class Clock:
    """Microseconds since the epoch, from a fixed start; moves only when told."""

    def __init__(self) -> None:
        self.now_us = 1_000_000_000_000

    def __call__(self) -> int:
        return self.now_us

    def advance(self, ms: float) -> None:
        self.now_us += int(ms * 1000)
