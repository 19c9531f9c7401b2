"""RedisClock: the offset to Redis time that batch deadlines are built on, on a hand-
driven local clock. A reply read late must not pull the estimate (and so the next
deadline) earlier; a Redis clock that steps is followed."""

from __future__ import annotations

import pytest

from qosd.store.redis_clock import WINDOW_S, RedisClock

pytestmark = pytest.mark.fast

OFFSET = 1_000_000_000.0  # Redis time is the local clock plus this, in us
WINDOW_US = WINDOW_S * 1_000_000


class Local:
    def __init__(self) -> None:
        self.us = 10_000_000.0

    def __call__(self) -> float:
        return self.us


def test_unknown_until_a_reply_is_seen() -> None:
    clock = RedisClock(Local())
    assert clock.offset_us is None
    assert clock.redis_time_in(90_000) is None


def test_a_reply_read_on_time_gives_the_offset() -> None:
    local = Local()
    clock = RedisClock(local)
    clock.saw(local.us + OFFSET)
    assert clock.offset_us == OFFSET
    assert clock.redis_time_in(90_000) == local.us + OFFSET + 90_000


def test_a_reply_read_late_does_not_shrink_the_next_deadline() -> None:
    """The failure seen under load: a reply read 80 ms after Redis stamped it made the
    next batch's deadline 80 ms early, and Redis refused batches that ran in time."""
    local = Local()
    clock = RedisClock(local)
    clock.saw(local.us + OFFSET)
    stamped = local.us + 1_000 + OFFSET
    local.us += 81_000  # the loop was busy: read 80 ms after Redis ran the script
    clock.saw(stamped)
    assert clock.offset_us == OFFSET
    assert clock.redis_time_in(90_000) == local.us + OFFSET + 90_000


def test_a_clock_stepped_forward_is_followed_at_once() -> None:
    local = Local()
    clock = RedisClock(local)
    clock.saw(local.us + OFFSET)
    local.us += 1_000
    clock.saw(local.us + OFFSET + 2_000_000)  # a failover to a host 2 s ahead
    assert clock.offset_us == OFFSET + 2_000_000


def test_a_clock_stepped_back_is_followed_within_two_windows() -> None:
    local = Local()
    clock = RedisClock(local)
    clock.saw(local.us + OFFSET)
    behind = OFFSET - 2_000_000  # a failover to a host 2 s behind
    local.us += WINDOW_US  # a new window: the old best is still a candidate
    clock.saw(local.us + behind)
    assert clock.offset_us == OFFSET
    local.us += WINDOW_US  # and after the next, it is not
    clock.saw(local.us + behind)
    assert clock.offset_us == behind


def test_after_an_idle_spell_only_new_replies_count() -> None:
    local = Local()
    clock = RedisClock(local)
    clock.saw(local.us + OFFSET + 5_000)
    local.us += 3 * WINDOW_US  # nothing for three windows
    clock.saw(local.us + OFFSET)
    assert clock.offset_us == OFFSET
