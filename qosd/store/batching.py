"""Group commit of script calls: one EVALSHA carries every call that queued meanwhile.

Sending each Acquire's script call on its own costs a Redis round trip, a connection
checkout, a command encoding and a script invocation per request: most of what an
Acquire costs. A batcher sends a call at once when no call of its group (pool) is in
flight, so an uncontended Acquire still costs exactly one round trip and waits for
nobody. While a call is in flight, new calls queue; when it returns, the queue keeps
gathering the calls still on their way until the event loop has turned a few times
with nothing new (``_gather``), then goes out as one call of a script that processes
a list, in order, atomically. The batch size therefore adapts to the load with no
timer and no tuning, and a request waits at most one extra round trip and a few turns
of the loop. This is the group commit of databases,
or the auto-pipelining of ioredis and rueidis, done at the script level, where it
also saves the per-call overhead inside Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from qosd.model import StoreUnavailable

log = logging.getLogger(__name__)

Runner = Callable[[Sequence[str], Sequence[Any]], Awaitable[list[Any]]]


@dataclass(slots=True)
class _Group:
    queue: list[_Call] = field(default_factory=list)
    in_flight: int = 0
    flush_scheduled: bool = False


@dataclass(slots=True)
class _Call:
    keys: Sequence[str]
    args: Sequence[Any]
    future: asyncio.Future[list[Any]]


class ScriptBatcher:
    """Batches calls to one list-processing script, per group (a pool: one hash slot).

    The script takes the group's own keys (``batch_keys(group)``), then each call's
    keys in order; ``ARGV[1]`` is the number of calls, then the batch's own arguments
    (``batch_args(group)``, evaluated when the batch is sent), then each call's
    arguments in order. It returns ``header`` values for the batch (handed to
    ``on_header`` with the group), then ``fields`` values per call.
    """

    def __init__(
        self,
        run: Runner,
        fields: int,
        *,
        max_batch: int = 256,
        max_in_flight: int = 1,
        gather_quiet_turns: int = 4,
        max_gather_turns: int = 32,
        max_gather_s: float = 0.005,
        batch_keys: Callable[[str], Sequence[str]] | None = None,
        batch_args: Callable[[str], Sequence[Any]] | None = None,
        header: int = 0,
        on_header: Callable[[str, list[Any]], None] | None = None,
        on_orphan: Callable[[Sequence[str], Sequence[Any], list[Any]], None] | None = None,
    ) -> None:
        self._run = run
        self._fields = fields
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._gather_quiet_turns = gather_quiet_turns
        self._max_gather_turns = max_gather_turns
        self._max_gather_s = max_gather_s
        self._batch_keys = batch_keys
        self._batch_args = batch_args
        self._header = header
        self._on_header = on_header
        self._on_orphan = on_orphan
        self._groups: dict[str, _Group] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def submit(
        self, group_key: str, keys: Sequence[str], args: Sequence[Any]
    ) -> asyncio.Future[list[Any]]:
        if self._closed:
            raise StoreUnavailable("store closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        group = self._groups.get(group_key)
        if group is None:
            group = self._groups[group_key] = _Group()
        group.queue.append(_Call(keys, args, future))
        if group.in_flight < self._max_in_flight and not group.flush_scheduled:
            self._gather(group_key, group, quiet_turns=1)
        return future

    def _gather(self, group_key: str, group: _Group, quiet_turns: int) -> None:
        """Sends the group's queue once the calls on their way have joined it: after
        ``quiet_turns`` turns of the event loop in a row that added nothing to it (and
        at least two turns), or after ``max_gather_turns`` or ``max_gather_s``, or
        once the queue holds a whole batch.

        A call reaches ``submit`` a few turns of the loop after gRPC hands its request
        over (the RPC's task, the servicer, admission), and requests come in clumps:
        one poll of gRPC's completion queue brings several. A call submitted with
        nothing in flight waits for one quiet turn: two turns in all, microseconds.
        The queue that built up behind a batch waits for ``gather_quiet_turns`` (the
        load is on: more is on its way). Sent the moment the batch's reply came back,
        that queue held two or three calls; gathered, fifteen or more, with half again
        as many Acquires a second and a third of Redis's time per Acquire, measured in
        docs/performance.md. There is no timer: the loop's own turns pace it, so an
        idle loop ends the wait at once.
        """
        group.flush_scheduled = True
        loop = asyncio.get_running_loop()
        cap = self._max_gather_turns
        full = self._max_batch
        # Under heavy load a turn of the loop can take milliseconds; the wait is also
        # bounded in time, by the loop's clock read once a turn (not a timer).
        until = loop.time() + self._max_gather_s

        def turn(seen: int, turns: int, quiet: int) -> None:
            queued = len(group.queue)
            quiet = 0 if queued > seen else quiet + 1
            gathering = turns < 2 or quiet < quiet_turns
            if gathering and turns < cap and queued < full and loop.time() < until:
                loop.call_soon(turn, queued, turns + 1, quiet)
            else:
                self._flush(group_key, group)

        loop.call_soon(turn, len(group.queue), 1, 0)

    def _flush(self, group_key: str, group: _Group) -> None:
        group.flush_scheduled = False
        # A caller that left before its call was sent is not sent at all.
        group.queue = [call for call in group.queue if not call.future.done()]
        while group.queue and group.in_flight < self._max_in_flight:
            batch = group.queue[: self._max_batch]
            del group.queue[: self._max_batch]
            group.in_flight += 1
            task = asyncio.get_running_loop().create_task(self._call(group_key, batch))
            self._tasks.add(task)
            task.add_done_callback(lambda done: self._done(done, group_key, group))
        if not group.queue and group.in_flight == 0 and self._groups.get(group_key) is group:
            del self._groups[group_key]

    def _done(self, task: asyncio.Task[None], group_key: str, group: _Group) -> None:
        self._tasks.discard(task)
        group.in_flight -= 1
        if not task.cancelled() and task.exception() is not None:
            log.error("script batch failed unexpectedly", exc_info=task.exception())
        if group.queue and not group.flush_scheduled:
            # What queued behind the batch, and what is on its way.
            self._gather(group_key, group, self._gather_quiet_turns)
        else:
            self._flush(group_key, group)

    async def _call(self, group_key: str, batch: list[_Call]) -> None:
        keys: list[str] = list(self._batch_keys(group_key)) if self._batch_keys else []
        args: list[Any] = [len(batch)]
        if self._batch_args is not None:
            args.extend(self._batch_args(group_key))
        for call in batch:
            keys.extend(call.keys)
            args.extend(call.args)
        try:
            reply = await self._run(keys, args)
            if self._on_header is not None:
                self._on_header(group_key, reply[: self._header])
            fields, start = self._fields, self._header
            for index, call in enumerate(batch):
                values = reply[start + index * fields : start + (index + 1) * fields]
                if not call.future.done():
                    call.future.set_result(values)
                elif self._on_orphan is not None:
                    # The caller went away while its call was in flight; the store
                    # still acted on it. The owner undoes what must not stay.
                    self._on_orphan(call.keys, call.args, values)
        except StoreUnavailable as exc:
            _fail(batch, exc)
            # Calls queued behind this one would go to the same broken store and wait
            # out a second timeout: fail them now, so no caller waits longer than one.
            group = self._groups.get(group_key)
            if group is not None:
                queued, group.queue = group.queue, []
                _fail(queued, exc)
        except asyncio.CancelledError:
            _fail(batch, StoreUnavailable("store call cancelled"))
            raise
        except Exception as exc:
            _fail(batch, exc)
            raise

    async def close(self) -> None:
        """Refuses new calls, then waits until every queued and sent call is answered."""
        self._closed = True
        while self._tasks or any(group.queue for group in self._groups.values()):
            if self._tasks:
                await asyncio.gather(*list(self._tasks), return_exceptions=True)
            else:
                await asyncio.sleep(0)  # a flush is scheduled: let it run


def _fail(calls: list[_Call], error: BaseException) -> None:
    """Fails every call not answered yet (an answered one is left as it is)."""
    for call in calls:
        if not call.future.done():
            call.future.set_exception(error)
