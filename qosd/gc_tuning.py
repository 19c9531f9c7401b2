"""The garbage collector, tuned for a daemon that allocates short-lived objects fast.

Every Acquire allocates a few dozen objects (futures, messages, records) that die
within a millisecond, while the process holds a few hundred thousand that live as
long as it does (modules, protobuf descriptors, gRPC, OpenTelemetry, the config). With
CPython's default thresholds (700, 10, 10) a collection of the young generation runs
every few dozen Acquires, and every hundredth one of them walks the whole heap. Two
changes, measured in docs/performance.md ("The garbage collector"):

- ``gc.freeze()`` once the daemon has started: what exists then is moved to a
  permanent generation that collections never walk;
- a young generation of 10,000 objects instead of 700: collections run about
  fourteen times less often, each over objects that are mostly dead already.

Reference cycles are still collected; they wait a little longer.
"""

from __future__ import annotations

import gc

#: Allocations between collections of the youngest generation (CPython's default: 700).
YOUNG_GENERATION = 10_000


def tune_for_serving() -> None:
    """Call once the daemon has started: freezes what exists, and raises the young
    generation's threshold."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION, middle, old)
