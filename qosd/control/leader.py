"""The SLO loop's leader: one daemon in the fleet holds the lease and retunes pools.

Every daemon runs a ``Controller``; the one holding the controller lease (a key in
the store, renewed every turn) acts. Each turn it gathers each pool's evidence from
the fleet's latency windows, judges it by the law (``qosd.control.law``), moves the
pool's rate through the store's ``adjust`` (which enforces the cooldown, so two
leaders can never both move a pool within one), learns the pool's prefill from the
reports (``qosd.control.prefill``), and restores the rates and pins a store that came
back empty has lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from qosd.config import Config
from qosd.control.decode import BatchHistory, DecodeModel, decode_points, learn_decode
from qosd.control.law import (
    HOLD,
    UNDO,
    UP,
    Evidence,
    Verdict,
    gather_evidence,
    judge,
    near_ceiling,
    step,
)
from qosd.control.passes import learn_from_passes
from qosd.control.prefill import learn, prefill_ms
from qosd.model import ControlRecord, StoredSample, StoreUnavailable
from qosd.policy import PoolPolicy
from qosd.store.base import BucketStore

log = logging.getLogger(__name__)


#: The pool's usual long prompt, as a quantile of its reported prompts: whose prefill
#: says whether the servers' pass counts can tell prefill from decode
#: (``qosd.control.passes.MAX_PREFILL_OF_READ``).
USUAL_PROMPT_QUANTILE = 0.9


def _near(a: float, b: float) -> bool:
    """Within a tenth of each other (both 0 counts as near)."""
    return a == b or (a > 0 and b > 0 and abs(a / b - 1) < 0.1)


@dataclass
class _PoolMemory:
    """What a daemon remembers of a pool between turns. All but ``record`` is the
    leader's, and losing it on failover is harmless."""

    admitted: float | None = None
    at_ms: int = 0
    long_prefill: float | None = None  # the threshold the store last derived
    # The pool's leases in flight, turn by turn: the batch each report decoded in.
    batch: BatchHistory = dataclasses.field(default_factory=BatchHistory)
    decode: DecodeModel | None = None  # the decode model last learned
    decode_source: str = ""  # what it was learned from
    # The last control record read while the pool's state existed, in every daemon:
    # what the leader writes back when the store comes back empty. Every daemon keeps
    # it because the loss takes the controller lease too, and whichever daemon takes
    # the lease next is the one that restores.
    record: ControlRecord | None = None


def _restorable(known: ControlRecord | None, record: ControlRecord) -> ControlRecord | None:
    """The record to write back if the pool's state was lost since ``known`` was
    read, and nothing was written since; None otherwise.

    The state's epoch tells (``qosd.store.epochs``): a new one (or none) means the
    state was lost and made anew. A record written since then (a restore by another
    daemon, an operator's pin, a change) carries the new epoch as ``record_epoch``,
    and stands: it is newer than what this daemon remembers. Comparing epochs, not
    times, keeps the rule right across a failover to a node whose clock is behind.
    """
    if known is None or not known.epoch or record.epoch == known.epoch:
        return None
    if record.epoch and record.record_epoch == record.epoch:
        return None
    return known


class Controller:
    """Runs the SLO loop in every daemon; only the holder of the lease acts."""

    def __init__(
        self,
        config: Config,
        store: BucketStore,
        pools: dict[str, PoolPolicy],
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_change(pool, kind)`` is told of every change this daemon makes: grow,
        cut, undo, pin or unpin (the metrics count them). The daemon is the store's:
        it leads, and signs its changes, as ``store.daemon_id``."""
        self._on_change = on_change or (lambda pool, kind: None)
        self._config = config
        self._control = config.control
        self._store = store
        self._pools = pools
        self._daemon_id = store.daemon_id
        self._memory: dict[str, _PoolMemory] = {name: _PoolMemory() for name in pools}
        self.leader = ""
        self.last_verdicts: dict[str, Verdict] = {}
        # Pins and unpins per pool: a turn that began before one says nothing after it.
        self._pins: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        # Set when the store shows a pool's state lost: the next turn comes at once,
        # so a leader restores rates and pins within a round trip or two, not a turn.
        self._wake = asyncio.Event()
        store.add_reset_listener(lambda pool, old, new: self._wake.set())

    def reconfigure(self, config: Config, pools: dict[str, PoolPolicy]) -> None:
        """A reloaded config: the law's settings, objectives and pools apply from the
        next read of them (a turn in progress may judge its later pools by them)."""
        self._config = config
        self._control = config.control
        self._pools = pools
        for name in pools:
            self._memory.setdefault(name, _PoolMemory())

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def leads(self) -> bool:
        """Whether this daemon held the controller lease at its last turn."""
        return self.running and self.leader == self._daemon_id

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stops the loop and hands the lease back, so that a successor takes over at
        its next turn rather than when the lease runs out (a rolling deploy restarts
        the leader too)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self.leader == self._daemon_id:
            self.leader = ""
            with contextlib.suppress(Exception):
                await self._store.lead(0)

    async def _run(self) -> None:
        store_down = False
        while True:
            try:
                await self.tick(int(self._control.leader_lease_s * 1000))
                if store_down:
                    log.warning("SLO loop: the store answers again")
                store_down = False
            except StoreUnavailable as exc:
                if not store_down:
                    log.warning("SLO loop paused while the store is unavailable: %s", exc)
                store_down = True
                self.leader = ""  # unknown until the store answers again
            except Exception:
                log.exception("SLO loop failed a turn")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._control.interval_s)
            self._wake.clear()

    async def tick(self, lease_ms: int) -> None:
        """One turn: hold (or take) the lease, and if ours, judge every pool."""
        leader = await self._store.lead(lease_ms)
        if leader != self.leader:
            log.info("SLO loop leader is now %s%s", leader,
                     " (this daemon)" if leader == self._daemon_id else "")  # fmt: skip
            self.leader = leader
        if leader != self._daemon_id:
            for pool in self._pools.values():  # what a new leader would have to restore
                self._remember(pool, await self._store.control(pool))
            return
        for pool in self._pools.values():
            try:  # one pool's trouble must not stop the others' control
                await self.evaluate(pool)
            except StoreUnavailable:
                raise
            except Exception:
                log.exception("SLO loop failed to judge pool %s", pool.name)

    async def windows(self, pool: PoolPolicy) -> dict[str, list[StoredSample]]:
        return {cls.name: await self._store.window(pool.name, cls.name) for cls in pool.classes}

    async def evidence(
        self,
        pool: PoolPolicy,
        since_ms: int,
        now_ms: int,
        windows: dict[str, list[StoredSample]] | None = None,
    ) -> Evidence:
        """Each class's evidence since ``since_ms`` (the last change). The arithmetic
        runs in a worker thread: windows can be large, and the event loop it would
        otherwise hold up also answers Acquire."""
        if windows is None:
            windows = await self.windows(pool)
        objectives = {name: self._config.classes[name].slo for name in windows}
        max_age = self._config.report.max_age_s
        return await asyncio.to_thread(
            gather_evidence,
            windows,
            objectives,
            self._control,
            since_ms=since_ms,
            now_ms=now_ms,
            max_age_ms=None if max_age is None else int(max_age * 1000),
        )

    def _remember(self, pool: PoolPolicy, record: ControlRecord) -> ControlRecord | None:
        """Keeps ``record`` as the pool's last known one, unless it shows the state
        lost with nothing written since: then returns what was known before, for the
        leader to restore (until then, what was known is kept)."""
        memory = self._memory[pool.name]
        lost = _restorable(memory.record, record)
        if lost is None and record.epoch:
            memory.record = record
        return lost

    async def _restore(self, pool: PoolPolicy, lost: ControlRecord, record: ControlRecord) -> None:
        """Writes back the rate (and pin, and probe state) the pool had before its
        store came back empty. A pool never changed has nothing to write back: it runs
        at the configured rate either way."""
        memory = self._memory[pool.name]
        memory.admitted = None  # the lost state's admitted-tokens count restarts at 0
        memory.long_prefill = None  # logged again once the store has it anew
        new = record.epoch or "none yet"
        if lost.changed_ms == 0 and not lost.pinned:
            memory.record = None  # the next record read is the one to keep
            log.warning(
                "pool %s: store came back empty (epoch %s -> %s); it ran at its "
                "configured rate, nothing to restore", pool.name, lost.epoch, new,
            )  # fmt: skip
            return
        how = "pinned" if lost.pinned else "set by the SLO loop"
        log.warning(
            "pool %s: store came back empty (epoch %s -> %s); restoring rate %.0f tokens/s (%s)",
            pool.name, lost.epoch, new, lost.capacity, how,
        )  # fmt: skip
        update = dataclasses.replace(
            lost,
            reason=f"restored after the store came back empty: {lost.reason}",
            changed_by=self._daemon_id,
            changed_from=record.capacity,
        )
        # Forgotten only once written: a write that fails (the store still settling)
        # leaves the record to restore at the next turn.
        await self._store.adjust(pool, update, 0, force=True)
        memory.record = None  # the next record read is the one to keep
        self._on_change(pool.name, "restore")
        self.last_verdicts[pool.name] = Verdict(HOLD, update.reason)

    async def evaluate(self, pool: PoolPolicy) -> ControlRecord | None:
        """Judges one pool and moves its rate if the law says so; returns the change.
        A pool whose state was lost gets its last known record back instead."""
        pins = self._pins.get(pool.name, 0)
        record = await self._store.control(pool)
        lost = self._remember(pool, record)
        if lost is not None:
            await self._restore(pool, lost, record)
            return None
        status = await self._store.status(pool)
        memory = self._memory[pool.name]
        utilization = None
        stale_ms = 3 * self._control.interval_s * 1000  # from before a gap in leadership
        if memory.admitted is not None and memory.at_ms < status.now_ms <= memory.at_ms + max(
            stale_ms, 1000
        ):
            rate = (
                (status.admitted_tokens - memory.admitted) * 1000 / (status.now_ms - memory.at_ms)
            )
            utilization = rate / status.capacity
        memory.admitted, memory.at_ms = status.admitted_tokens, status.now_ms
        memory.batch.record(status.now_ms, status.active_leases)
        windows = await self.windows(pool)
        await self._tune_long_prefill(pool, windows, memory)
        if record.pinned:
            self._say(pool, pins, Verdict(HOLD, "pinned by an operator"))
            return None
        evidence = await self.evidence(pool, record.changed_ms, status.now_ms, windows)
        verdict = judge(
            evidence,
            utilization,
            self._control,
            last_direction=record.direction,
            since_change_ms=status.now_ms - record.changed_ms,
        )
        cooldown_ms = int(self._control.cooldown_s * 1000)
        waited = status.now_ms - record.changed_ms
        if (
            verdict.direction == UP
            and near_ceiling(record, self._control)
            and waited < record.probe_wait * cooldown_ms
        ):
            needed_s = record.probe_wait * cooldown_ms / 1000
            verdict = Verdict(
                HOLD, f"good for {waited / 1000:.0f} s of the {needed_s:.0f} s a probe waits for"
            )
        if verdict.direction != HOLD and record.changed_ms and waited < cooldown_ms:
            # The store would refuse it; say so instead of a change that is not made.
            verdict = Verdict(
                HOLD, f"cooling down ({waited / 1000:.1f} of {cooldown_ms / 1000:g} s): "
                f"would {'grow' if verdict.direction == UP else 'cut'}: {verdict.reason}",
            )  # fmt: skip
        self._say(pool, pins, verdict)
        if verdict.direction == HOLD:
            return None
        update = step(record, verdict.direction, self._control, pool)
        if update is None:
            return None
        percent = (update.capacity / record.capacity - 1) * 100
        kind = "grow" if verdict.direction == UP else "cut"  # the metric's label
        if update.direction == UNDO:
            kind = "undo"
        said = {"grow": "grow", "cut": "cut", "undo": "undo the last growth"}[kind]
        update = dataclasses.replace(
            update,
            reason=f"{said} {percent:+.1f}%: {verdict.reason}",
            changed_by=self._daemon_id,
            changed_from=record.capacity,
        )
        if not await self._store.adjust(pool, update, cooldown_ms):
            return None  # cooling down (or pinned meanwhile)
        if record.epoch:  # known at once, not only at the next turn's read
            memory.record = dataclasses.replace(
                update, changed_ms=status.now_ms, record_epoch=record.epoch
            )
        self._on_change(pool.name, kind)
        log.info(
            "pool %s admitted rate %.0f -> %.0f tokens/s (%s)",
            pool.name, record.capacity, update.capacity, update.reason,
        )  # fmt: skip
        return update

    async def _tune_long_prefill(
        self, pool: PoolPolicy, windows: dict[str, list[StoredSample]], memory: _PoolMemory
    ) -> None:
        """Learns the pool's prefill and the stall its top class absorbs
        (qosd.control.prefill), and tells the store, which derives from them which
        prompts wait for a gap in the top class's traffic (prefill.lua): on servers that
        serve the top class first too, since a long prompt's chunks, once started,
        lengthen every pass its streams decode in. While reports teach it no prefill
        model, the pool's configured ``prefill_model_ms``. Logged when the threshold moves by
        a tenth or more."""
        configured = self._config.pools[pool.name]
        top = pool.classes[0].name
        # With the operator's measurement as the model until reports teach the loop
        # its own.
        learned = await asyncio.to_thread(
            functools.partial(
                learn,
                windows,
                top,
                self._config.classes[top].slo,
                chunked=configured.chunked_prefill,
                fallback_model=configured.prefill_model_ms,
            )
        )
        fallback = configured.long_prefill_tokens or 0.0
        # The steps are the reports' TPOTs less the prefill that shared them: the
        # closer estimate (benchmarks/predictor_error.py), and, with the top class's
        # peak in the predicted batch (budget.lua), no longer the P0 cost it was
        # (ADR 13). On an unchunked server the stores predict from it only the pass a
        # new prompt waits out, not the prefill share (budget.lua: share_model): there
        # the predicted share was tighter than the configured one, and goodput fell
        # from 0.680 to 0.486 on an Azure development seed (ADR 13).
        decode, source = None, ""
        if learned.model is not None:
            decode, source = await self._learn_decode(
                pool, windows, memory, learned.model, chunked=configured.chunked_prefill
            )
        if decode is not None and (memory.decode is None or source != memory.decode_source):
            log.info("pool %s: a decode step takes %.1f ms + %.3f ms a sequence (from %s)",
                     pool.name, decode.base_ms, decode.per_sequence_ms, source)  # fmt: skip
        memory.decode, memory.decode_source = decode, source
        targets = tuple(
            (self._config.classes[cls.name].slo.tpot_ms or 0.0) * self._control.tpot_target
            for cls in pool.classes
        )
        threshold = await self._store.set_prefill(
            pool,
            dataclasses.replace(
                learned,
                fallback_tokens=fallback,
                decode=None if decode is None else (decode.base_ms, decode.per_sequence_ms),
                chunked=configured.chunked_prefill,
                tpot_targets_ms=targets,
            ),
        )
        known = memory.long_prefill
        memory.long_prefill = threshold
        if threshold and (known is None or not _near(threshold, known)):
            log.info("pool %s: prompts over %.0f tokens wait for a gap in %s traffic",
                     pool.name, threshold, top)  # fmt: skip

    async def _learn_decode(
        self,
        pool: PoolPolicy,
        windows: dict[str, list[StoredSample]],
        memory: _PoolMemory,
        prefill_model: tuple[float, float, float],
        *,
        chunked: bool,
    ) -> tuple[DecodeModel | None, str]:
        """The pool's decode step, and what it was learned from: the reports' TPOTs
        less the prefill that shared them (``qosd.control.decode``), else, where they
        teach none (too few decodes, one batch size), the servers' own pass counts
        (``qosd.control.passes``). The counts' step is the closer at load 0.9 on the
        simulator, but errs fast where the reports' errs slow, and that slow step is
        the margin the stores' rules were measured with: preferred, the counts moved
        development seeds along the frontier (bursty chunked: goodput +0.032, P0
        -6 points), not past it (ADR 13)."""
        samples = [s for window in windows.values() for s in window]
        prefill = functools.partial(prefill_ms, prefill_model)
        points = decode_points(
            samples, memory.batch, prefill, chunked=chunked, servers=pool.servers
        )
        decode = learn_decode(points)
        if decode is not None:
            return decode, "the reports"
        prompts = sorted(s.input_tokens for s in samples) or [0]
        usual = prefill(prompts[int(USUAL_PROMPT_QUANTILE * (len(prompts) - 1))])
        fitted = learn_from_passes(await self._store.passes(pool), memory.at_ms, usual)
        if fitted is None:
            return None, ""
        return fitted.decode(pool.servers), "the servers' passes"

    def _say(self, pool: PoolPolicy, pins: int, verdict: Verdict) -> None:
        """Shows a turn's verdict, unless an operator pinned or unpinned the pool since
        the turn read its record: the pin's own word stands until the next turn."""
        if self._pins.get(pool.name, 0) == pins:
            self.last_verdicts[pool.name] = verdict

    async def pin(self, pool: PoolPolicy, capacity: float | None) -> ControlRecord:
        """Fixes a pool's admitted rate (the loop leaves it alone), or frees it."""
        self._pins[pool.name] = self._pins.get(pool.name, 0) + 1
        record = await self._store.control(pool)
        if capacity is None and not record.pinned:
            return record  # nothing to free: no change, no cooldown
        if capacity is None:
            update = dataclasses.replace(
                record, pinned=False, reason="unpinned by an operator",
                changed_by=self._daemon_id, changed_from=record.capacity,
            )  # fmt: skip
        else:
            update = dataclasses.replace(
                record, capacity=capacity, pinned=True, direction=HOLD, last_good=capacity,
                reason=f"pinned at {capacity:.0f} tokens/s by an operator",
                changed_by=self._daemon_id, changed_from=record.capacity,
            )  # fmt: skip
        await self._store.adjust(pool, update, 0, force=True)
        # Remembered at once, as written (a loss right after the pin must not undo it).
        self._remember(pool, await self._store.control(pool))
        self._on_change(pool.name, "pin" if update.pinned else "unpin")
        self.last_verdicts[pool.name] = Verdict(HOLD, update.reason)
        log.info("pool %s: %s", pool.name, update.reason)
        return update
