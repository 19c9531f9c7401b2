"""EpochWatch (qosd/store/epochs.py): when a pool's epoch tells that the store came back
empty, and when it does not: the first epoch, an empty one, a late reply carrying an
epoch already replaced, and a listener that fails."""

from __future__ import annotations

import logging

import pytest

from qosd.store.epochs import EpochWatch

pytestmark = pytest.mark.fast


def watch_with_log() -> tuple[EpochWatch, list[tuple[str, str, str]]]:
    watch = EpochWatch()
    resets: list[tuple[str, str, str]] = []
    watch.add_listener(lambda pool, old, new: resets.append((pool, old, new)))
    return watch, resets


def test_the_first_epoch_of_a_pool_is_known_and_is_no_reset() -> None:
    watch, resets = watch_with_log()
    assert watch.known("gpu") == ""
    watch.saw("gpu", "e1")
    watch.saw("gpu", "e1")
    assert watch.known("gpu") == "e1"
    assert resets == []


def test_a_new_epoch_after_a_known_one_is_a_reset_told_once() -> None:
    watch, resets = watch_with_log()
    watch.saw("gpu", "e1")
    watch.saw("gpu", "e2")
    watch.saw("gpu", "e2")
    assert watch.known("gpu") == "e2"
    assert resets == [("gpu", "e1", "e2")]


def test_an_empty_epoch_says_nothing() -> None:
    watch, resets = watch_with_log()
    watch.saw("gpu", "")
    assert watch.known("gpu") == ""
    watch.saw("gpu", "e1")
    watch.saw("gpu", "")  # a read that ran before the state was made anew
    assert watch.known("gpu") == "e1"
    assert resets == []


def test_a_late_reply_with_a_replaced_epoch_is_ignored() -> None:
    watch, resets = watch_with_log()
    watch.saw("gpu", "e1")
    watch.saw("gpu", "e2")
    watch.saw("gpu", "e1")  # answered after a reply that carried e2
    assert watch.known("gpu") == "e2"
    watch.saw("gpu", "e3")
    assert resets == [("gpu", "e1", "e2"), ("gpu", "e2", "e3")]


def test_pools_are_watched_apart() -> None:
    watch, resets = watch_with_log()
    watch.saw("gpu", "e1")
    watch.saw("cpu", "e1")
    watch.saw("cpu", "e2")
    assert (watch.known("gpu"), watch.known("cpu")) == ("e1", "e2")
    assert resets == [("cpu", "e1", "e2")]


def test_only_the_last_eight_epochs_are_remembered() -> None:
    watch, resets = watch_with_log()
    epochs = [f"e{index}" for index in range(10)]
    for epoch in epochs:
        watch.saw("gpu", epoch)
    assert len(resets) == 9
    watch.saw("gpu", "e2")  # among the last eight replaced: a late reply
    assert watch.known("gpu") == "e9"
    watch.saw("gpu", "e0")  # forgotten: taken for a new loss
    assert watch.known("gpu") == "e0"
    assert resets[-1] == ("gpu", "e9", "e0")


def test_a_failing_listener_is_logged_and_the_others_are_still_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = EpochWatch()
    told: list[str] = []

    def fails(pool: str, old: str, new: str) -> None:
        raise RuntimeError("listener bug")

    watch.add_listener(fails)
    watch.add_listener(lambda pool, old, new: told.append(new))
    watch.saw("gpu", "e1")
    with caplog.at_level(logging.WARNING, logger="qosd.store.epochs"):
        watch.saw("gpu", "e2")
    assert told == ["e2"]
    messages = [record.getMessage() for record in caplog.records]
    assert any("came back empty (epoch e1 -> e2)" in message for message in messages)
    assert any(message == "a store reset listener failed" for message in messages)
