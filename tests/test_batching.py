"""ScriptBatcher's group commit on a real event loop, with a runner that answers when
the test says: what goes out in which batch, counted in turns of the loop (no I/O, no
clock)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from qosd.model import StoreUnavailable
from qosd.store.batching import ScriptBatcher

pytestmark = pytest.mark.fast


class Runner:
    """Records each batch (the calls' arguments) and answers it when released."""

    def __init__(self) -> None:
        self.batches: list[list[Any]] = []
        self.pending: list[asyncio.Future[None]] = []

    async def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        count = args[0]
        self.batches.append(list(args[1:]))
        gate = asyncio.get_running_loop().create_future()
        self.pending.append(gate)
        await gate
        return [f"answer {value}" for value in args[1:]] if count else []

    def release(self) -> None:
        gate = self.pending.pop(0)
        gate.set_result(None)


async def turns(count: int) -> None:
    for _ in range(count):
        await asyncio.sleep(0)


async def test_a_lone_call_goes_out_at_once_alone() -> None:
    runner = Runner()
    batcher = ScriptBatcher(runner, fields=1)
    answer = batcher.submit("pool", (), (1,))
    await turns(4)  # two turns to gather, one to start the batch's task, one to send
    assert runner.batches == [[1]]
    runner.release()
    assert await answer == ["answer 1"]
    await batcher.close()


async def test_calls_that_trickle_in_behind_a_batch_go_out_together() -> None:
    """Behind a batch in flight, calls arrive one a turn (as gRPC hands them over):
    they all join one batch, not the first two or three of them."""
    runner = Runner()
    batcher = ScriptBatcher(runner, fields=1, gather_quiet_turns=4, max_gather_turns=32)
    first = batcher.submit("pool", (), (0,))
    await turns(4)
    assert runner.batches == [[0]]
    queued = [batcher.submit("pool", (), (1,))]
    runner.release()  # the reply is back; one call waits, more are on their way
    for value in range(2, 11):
        await asyncio.sleep(0)
        queued.append(batcher.submit("pool", (), (value,)))
    await turns(8)  # quiet turns: the gather ends and the batch goes out
    assert runner.batches == [[0], list(range(1, 11))]
    runner.release()
    assert await first == ["answer 0"]
    assert [await call for call in queued] == [[f"answer {v}"] for v in range(1, 11)]
    await batcher.close()


async def test_a_gather_ends_after_its_quiet_turns() -> None:
    runner = Runner()
    batcher = ScriptBatcher(runner, fields=1, gather_quiet_turns=4, max_gather_turns=32)
    batcher.submit("pool", (), (0,))
    await turns(4)
    late = batcher.submit("pool", (), (1,))
    runner.release()
    await turns(4)  # the reply's turn, then three quiet turns: not yet
    assert runner.batches == [[0]]
    await turns(3)  # the fourth quiet turn sends it
    assert runner.batches == [[0], [1]]
    runner.release()
    assert await late == ["answer 1"]
    await batcher.close()


async def test_a_steady_stream_is_cut_at_the_turn_cap() -> None:
    """Calls arriving every turn never leave a quiet turn: the cap sends the batch."""
    runner = Runner()
    batcher = ScriptBatcher(runner, fields=1, gather_quiet_turns=4, max_gather_turns=8)
    batcher.submit("pool", (), (0,))
    await turns(4)
    calls = [batcher.submit("pool", (), (1,))]
    runner.release()
    value = 2
    while len(runner.batches) < 2:
        await asyncio.sleep(0)
        calls.append(batcher.submit("pool", (), (value,)))
        value += 1
        assert value < 40, "the gather never ended"
    assert 2 <= len(runner.batches[1]) < value - 1  # cut while calls kept coming
    runner.release()
    await turns(20)
    runner.release()
    await batcher.close()
    assert all(call.done() for call in calls)


async def test_a_gather_ends_once_the_queue_holds_a_whole_batch() -> None:
    runner = Runner()
    batcher = ScriptBatcher(runner, fields=1, max_batch=4, gather_quiet_turns=4)
    batcher.submit("pool", (), (0,))
    await turns(4)
    calls = [batcher.submit("pool", (), (value,)) for value in range(1, 6)]  # 5 queued
    runner.release()
    await turns(4)  # the reply's turns and the send: no quiet turns waited for
    assert runner.batches == [[0], [1, 2, 3, 4]]
    runner.release()
    await turns(8)
    assert runner.batches == [[0], [1, 2, 3, 4], [5]]
    runner.release()
    assert [await call for call in calls] == [[f"answer {v}"] for v in range(1, 6)]
    await batcher.close()


async def test_a_gather_ends_at_its_time_bound() -> None:
    """Under heavy load a turn of the loop can take milliseconds: the gather is bounded
    in time too (here 0 s: the first turn after the reply sends the queue)."""
    runner = Runner()
    batcher = ScriptBatcher(runner, fields=1, gather_quiet_turns=4, max_gather_s=0.0)
    batcher.submit("pool", (), (0,))
    await asyncio.sleep(0)
    assert runner.batches == []  # the first call too goes at its first turn, bound or not
    await turns(3)
    assert runner.batches == [[0]]
    late = batcher.submit("pool", (), (1,))
    runner.release()
    await turns(4)  # the reply's turns and the send: four quiet turns would take 7
    assert runner.batches == [[0], [1]]
    runner.release()
    assert await late == ["answer 1"]
    await batcher.close()


async def test_a_failed_batch_fails_what_queued_behind_it() -> None:
    async def broken(keys: Sequence[str], args: Sequence[Any]) -> list[Any]:
        await asyncio.sleep(0)
        raise StoreUnavailable("down")

    batcher = ScriptBatcher(broken, fields=1)
    first = batcher.submit("pool", (), (1,))
    await turns(3)
    behind = batcher.submit("pool", (), (2,))
    for call in (first, behind):
        with pytest.raises(StoreUnavailable):
            await call
    await batcher.close()
