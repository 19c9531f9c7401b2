"""Where Redis's clock stands against this process's, for the deadlines batches carry.

A batch of Acquires carries the Redis time after which it must change nothing: its
callers stop waiting after ``redis.timeout_ms``, so a batch Redis runs later (after a
pause, behind a slow script) was given up and must not charge anyone. The daemon
learns Redis time from the replies: each acquire reply's header holds Redis's TIME at
the moment the script ran.

Each such sample falls short of the true offset by however long the reply then took
to be read: the wire, and mostly a busy or throttled event loop (a sidecar at its CPU
limit is paused for tens of milliseconds at a time). Taking the latest sample as the
offset therefore shrinks the next batch's deadline by that lag, and under load
batches were refused as "run after their timeout" that had run in time. The largest
recent sample is the one read with the least lag, so that is the estimate. Recent: the
largest of the current and the previous window, so that a Redis whose clock stepped
back (a failover to another host) is followed within two windows; one that stepped
forward is followed at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: How long a sample stays a candidate for the estimate, at least (at most twice).
WINDOW_S = 5.0


def _monotonic_us() -> float:
    return time.monotonic_ns() / 1000


class RedisClock:
    """Redis time minus this process's monotonic clock, in microseconds."""

    def __init__(self, local_us: Callable[[], float] = _monotonic_us) -> None:
        self._local_us = local_us
        self._window_us = WINDOW_S * 1_000_000
        self._window_start_us = 0.0
        self._best: float | None = None  # the largest sample of the current window
        self._previous: float | None = None  # of the previous one

    def saw(self, redis_now_us: float) -> None:
        """A reply's Redis time, just read."""
        local = self._local_us()
        sample = redis_now_us - local
        if local - self._window_start_us >= self._window_us:
            # A new window; one left idle for longer keeps nothing of the old ones.
            idle = local - self._window_start_us >= 2 * self._window_us
            self._previous = None if idle else self._best
            self._best = None
            self._window_start_us = local
        if self._best is None or sample > self._best:
            self._best = sample

    @property
    def offset_us(self) -> float | None:
        """The estimate; None until a reply was seen."""
        if self._best is None:
            return self._previous
        if self._previous is None:
            return self._best
        return max(self._best, self._previous)

    def redis_time_in(self, after_us: float) -> float | None:
        """Redis time ``after_us`` from now; None while the offset is unknown."""
        offset = self.offset_us
        if offset is None:
            return None
        return self._local_us() + offset + after_us
