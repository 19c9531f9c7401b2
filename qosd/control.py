"""The SLO loop: one leader in the fleet retunes each pool's admitted rate.

The controlled quantity is one number per pool, R, the tokens per second the pool
admits; class rates follow from it by a fixed allocation (``policy.effective_pool``).
Every ``control.interval_s`` the leader judges each pool and moves R by the law
below; docs/control.md argues for it and shows it stable against a simulated server.

Evidence, per class with objectives (``slo``), from its latency window. Reports come
when requests end, so what the server does now and what the current rate does are
different questions:
- *recent*: samples reported since the last change (the newest half, once there are
  twice ``min_samples``): how the server is doing now;
- *started*: requests started since the last change (the newest half, once
  plentiful): how the current rate is doing, known a request's latency later;
- *growth*: requests started since the last change and within ``growth_window_s``;
- *improving*: whether, among samples reported since the change, later-started
  requests fare better than earlier-started ones (a backlog draining).

The law:
- **Cut** when a class's recent compliance is below ``tolerance`` (95 %). If the
  last change was a growth, that growth was a failed probe: **undo** it (R returns
  to ``last_good``), and remember the level as the ceiling. Otherwise cut by
  ``step_down`` (10 %). After a cut, cut again only while the trouble persists under
  the new rate: the started evidence is not back within tolerance and later requests
  fare no better than earlier ones. A server draining a backlog recovers, and must
  not be cut into the ground; one still overloaded gets a cut per cooldown. After
  an undo, wait two cooldowns before judging again: the probe's load takes about as
  long to clear as it lasted.
- **Cut** also, by the same rules, when a class's recent tail runs hot: 95 % of its
  requests no longer within ``cut_pressure`` (95 %) of their objectives. At a
  saturated server every stream shares one decode step, so latencies bunch up and
  reach the objective together: compliance falls from 1 to below tolerance within
  one window, too late for a class that must keep 99 %.
- **Grow** when every class's growth evidence complies at ``target + margin``
  (99.5 %) or better, with headroom (95 % of its requests within ``grow_headroom``,
  85 %, of their objectives: compliance alone cannot tell a server with room from
  one at the edge, and a probe over the edge costs the top class its misses), and
  the pool uses its rate (``min_utilization``: no windup while idle): by
  ``step_up`` (5 %) while below the ceiling by more than a step, up to that point;
  near the ceiling, by the adaptive probe step, once the evidence has been good for
  ``probe_wait`` cooldowns.
- **Hold** otherwise: within the band, or without enough samples.

Probing adapts, so R settles just under the server's capacity instead of cycling,
yet finds capacity that comes back: a failed probe halves the probe step (not below
``min_step``) and doubles ``probe_wait`` (up to ``max_probe_wait``); a probe that
held doubles the step (up to ``step_up``) and halves the wait, and one that held
above the ceiling forgets it. Cuts following cuts do not lower the ceiling: they act
on evidence that lags behind them. Changes respect a cooldown, enforced by the
store's script, and the bounds ``[min_capacity, max_capacity]``; each is logged with
its reason and kept in the pool's history.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from qosd.config import Config, ControlConfig, SloConfig
from qosd.model import ControlRecord, StoredSample, StoreUnavailable
from qosd.policy import PoolPolicy
from qosd.slo import WindowStats, improving, trend, window_stats
from qosd.stall import PrefillModel, learn
from qosd.store.base import BucketStore

log = logging.getLogger(__name__)

UP = 1
DOWN = -1
HOLD = 0
UNDO = -2  # a cut back to where the last growth started (stored as the direction)


@dataclass(frozen=True, slots=True)
class Verdict:
    direction: int
    reason: str


@dataclass(frozen=True, slots=True)
class Evidence:
    """Per class, as the module's docstring defines them."""

    recent: dict[str, WindowStats]
    started: dict[str, WindowStats]
    growth: dict[str, WindowStats]
    improving: dict[str, bool] = dataclasses.field(default_factory=dict)


def _judged(stats: dict[str, WindowStats], config: ControlConfig) -> dict[str, float]:
    return {
        name: s.compliance
        for name, s in stats.items()
        if s.compliance is not None and s.samples >= config.min_samples
    }


def _first_cut(
    detail: str, config: ControlConfig, last_direction: int, since_change_ms: int | None
) -> Verdict | None:
    """Trouble seen: a cut unless the last change was one (then None: the caller asks
    whether the trouble persists under it), or a hold while an undone probe clears."""
    if last_direction not in (DOWN, UNDO):
        return Verdict(DOWN, detail)
    if (
        last_direction == UNDO
        and since_change_ms is not None
        and since_change_ms < 2 * config.cooldown_s * 1000
    ):
        # The failed probe lasted a cooldown; the server needs about as long to shake
        # it off before the rate it was undone to can be judged.
        return Verdict(HOLD, f"{detail}; judging the undone probe's rate later")
    return None


def judge(
    evidence: Evidence,
    utilization: float | None,
    config: ControlConfig,
    *,
    last_direction: int = HOLD,
    since_change_ms: int | None = None,
) -> Verdict:
    """Cut, grow or hold, by the law in the module's docstring."""
    recent = _judged(evidence.recent, config)
    started_since = _judged(evidence.started, config)
    growth = _judged(evidence.growth, config)
    if recent:
        name, worst = min(recent.items(), key=lambda item: item[1])
        if worst < config.tolerance:
            samples = evidence.recent[name].samples
            detail = f"{name} compliance {worst:.3f} < {config.tolerance} ({samples} samples)"
            first = _first_cut(detail, config, last_direction, since_change_ms)
            if first is not None:
                return first
            # Just cut: cut again only while the trouble persists under the new rate.
            # Requests started since the cut that meet the objectives show it is
            # enough; so do later-started requests faring better than earlier ones (a
            # server draining a backlog, or shaking off a failed probe, recovers and
            # must not be cut into the ground). Otherwise the load is still too high.
            for cls_name, value in sorted(recent.items(), key=lambda item: item[1]):
                if value >= config.tolerance:
                    continue
                started = started_since.get(cls_name)
                if started is not None and started >= config.tolerance:
                    continue
                if evidence.improving.get(cls_name):
                    continue
                shown = "too few" if started is None else f"{started:.3f}"
                return Verdict(
                    DOWN,
                    f"{detail}; requests started since the last change: {shown}, "
                    "later ones faring no better",
                )
            return Verdict(HOLD, f"{detail}; recovering under the last cut")
    pressed = _pressed(evidence.recent, config)
    if pressed is not None:
        name, tail = pressed
        detail = f"{name}'s 95th percentile at {tail:.2f} of its objectives > {config.cut_pressure}"
        first = _first_cut(detail, config, last_direction, since_change_ms)
        if first is not None:
            return first
        since = _pressed({name: evidence.started[name]} if name in evidence.started else {}, config)
        if since is not None and not evidence.improving.get(name):
            return Verdict(DOWN, f"{detail}, and as high for requests started since the cut")
        return Verdict(HOLD, f"{detail}; recovering under the last cut")
    good = config.target + config.margin
    if not growth:
        return Verdict(
            HOLD, f"fewer than {config.min_samples} samples started since the last change"
        )
    # A class with too few requests started since the change to judge alone still
    # speaks through what it has reported since (a fifth of min_samples at least): a
    # quiet class must not stall growth, nor a troubled one allow it.
    judged = dict(growth)
    speaks = max(1, config.min_samples // 5)
    for cls_name, stats in evidence.recent.items():
        if cls_name not in judged and stats.compliance is not None and stats.samples >= speaks:
            judged[cls_name] = stats.compliance
    name, worst = min(judged.items(), key=lambda item: item[1])
    if worst >= good:
        for cls_name in judged:
            judged_on = evidence.growth if cls_name in growth else evidence.recent
            class_tail = judged_on[cls_name].tail_pressure
            if class_tail is not None and class_tail > config.grow_headroom:
                return Verdict(
                    HOLD,
                    f"compliance >= {good} but no headroom: {cls_name}'s 95th percentile "
                    f"at {class_tail:.2f} of its objectives > {config.grow_headroom}",
                )
        evidence_text = ", ".join(
            f"{n} {value:.3f} ({evidence.growth[n].samples if n in growth else 'recent'})"
            for n, value in judged.items()
        )
        if utilization is None or utilization < config.min_utilization:
            used = "unknown" if utilization is None else f"{utilization:.2f}"
            return Verdict(HOLD, f"compliance >= {good} but utilization {used}")
        return Verdict(UP, f"compliance >= {good}: {evidence_text}; utilization {utilization:.2f}")
    return Verdict(HOLD, f"{name} compliance {worst:.3f} within [{config.tolerance}, {good})")


def _pressed(stats: dict[str, WindowStats], config: ControlConfig) -> tuple[str, float] | None:
    """The class whose tail runs highest above ``cut_pressure``, with enough samples
    to say so (a fifth of ``min_samples``), and its tail pressure; None if none."""
    enough = max(1, config.min_samples // 5)
    over = [
        (name, s.tail_pressure)
        for name, s in stats.items()
        if s.tail_pressure is not None
        and s.samples >= enough
        and s.tail_pressure > config.cut_pressure
    ]
    return max(over, key=lambda item: item[1]) if over else None


def near_ceiling(record: ControlRecord, config: ControlConfig) -> bool:
    """Growth near (or above) the lowest level recently too high is a careful probe."""
    return record.ceiling > 0 and record.capacity >= record.ceiling * (1 - config.step_up) * (
        1 - 1e-9
    )


def step(
    record: ControlRecord, direction: int, config: ControlConfig, pool: PoolPolicy
) -> ControlRecord | None:
    """The record after one move; None when the bounds leave nothing to move."""
    probe = record.probe_step or config.step_up
    wait = max(1, record.probe_wait)
    last_good = record.last_good
    ceiling = record.ceiling
    if direction == DOWN:
        # The rate just left was too high: the ceiling is the lowest such level. Not
        # so for cuts following cuts: they act on evidence that lags behind them.
        if record.direction not in (DOWN, UNDO):
            ceiling = min(ceiling, record.capacity) if ceiling > 0 else record.capacity
        if record.direction == UP:  # the last growth was a failed probe: undo it
            capacity = min(last_good, record.capacity * (1 - config.min_step))
            probe = max(config.min_step, probe / 2)
            wait = min(config.max_probe_wait, wait * 2)
            direction = UNDO
        else:
            capacity = record.capacity * (1 - config.step_down)
    elif near_ceiling(record, config):
        if record.direction == UP:  # the last probe held
            probe = min(config.step_up, probe * 2)
            wait = max(1, wait // 2)
            # Held above the ceiling: the limit it stood for has gone (capacity came
            # back); grow at full speed until the next failure sets a new one.
            ceiling = 0.0 if record.capacity > ceiling else ceiling
        last_good = record.capacity
        capacity = record.capacity * (1 + probe)
    else:
        last_good = record.capacity
        capacity = record.capacity * (1 + config.step_up)
        if ceiling > 0:  # quickly back up to just under the ceiling
            capacity = min(capacity, ceiling * (1 - config.step_up))
    capacity = min(pool.max_capacity, max(pool.min_capacity, capacity))
    if abs(capacity - record.capacity) < 1e-9 * pool.capacity:
        return None
    return dataclasses.replace(
        record,
        capacity=capacity,
        probe_step=probe,
        probe_wait=wait,
        last_good=last_good,
        direction=direction,
        ceiling=ceiling,
    )


REFERENCE_PROMPT = 8_192  # prefill models are compared at this prompt length


def _near(a: float, b: float) -> bool:
    """Within a tenth of each other (both 0 counts as near)."""
    return a == b or (a > 0 and b > 0 and abs(a / b - 1) < 0.1)


@dataclass
class _PoolMemory:
    """What a daemon remembers of a pool between turns. All but ``record`` is the
    leader's, and losing it on failover is harmless."""

    admitted: float | None = None
    at_ms: int = 0
    long_prefill: float | None = None  # the threshold last told to the store
    prefill_model: PrefillModel | None = None  # and the prefill model
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


def gather_evidence(
    windows: dict[str, list[StoredSample]],
    objectives: dict[str, SloConfig],
    config: ControlConfig,
    *,
    since_ms: int,
    now_ms: int,
    max_age_ms: int | None,
) -> Evidence:
    """The evidence of each class's window (newest first), as the module's docstring
    defines it, relative to the last change at ``since_ms``."""
    enough = config.min_samples
    growth_window_ms = int(config.growth_window_s * 1000)
    recent: dict[str, WindowStats] = {}
    started: dict[str, WindowStats] = {}
    growth: dict[str, WindowStats] = {}
    getting_better: dict[str, bool] = {}
    for name, samples in windows.items():
        slo = objectives[name]

        def stats(newest: int | None = None, started_after: int | None = None) -> WindowStats:
            return window_stats(
                samples,  # noqa: B023 - used at once, in this iteration
                slo,  # noqa: B023
                reported_after=since_ms,
                started_after=started_after,
                now_ms=now_ms,
                max_age_ms=max_age_ms,
                newest=newest,
            )

        everything = stats()
        recent[name] = (
            stats(newest=everything.samples // 2)
            if everything.samples >= 2 * enough
            else everything
        )
        since = stats(started_after=since_ms)
        started[name] = (
            stats(started_after=since_ms, newest=since.samples // 2)
            if since.samples >= 2 * enough
            else since
        )
        # Growth needs the requests of the last growth_window_s to be good: an older
        # bad spell (the load a cut or an undo removed) must not stall it.
        growth[name] = stats(started_after=max(since_ms, now_ms - growth_window_ms))
        halves = trend(samples, slo, reported_after=since_ms)
        if halves is not None:
            getting_better[name] = improving(*halves, slo)
    return Evidence(recent, started, growth, getting_better)


class Controller:
    """Runs the SLO loop in every daemon; only the holder of the lease acts."""

    def __init__(
        self,
        config: Config,
        store: BucketStore,
        pools: dict[str, PoolPolicy],
        daemon_id: str,
        on_change: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_change(pool, kind)`` is told of every change this daemon makes: grow,
        cut, undo, pin or unpin (the metrics count them)."""
        self._on_change = on_change or (lambda pool, kind: None)
        self._config = config
        self._control = config.control
        self._store = store
        self._pools = pools
        self._daemon_id = daemon_id
        self._memory: dict[str, _PoolMemory] = {name: _PoolMemory() for name in pools}
        self.leader = ""
        self.last_verdicts: dict[str, Verdict] = {}
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
                await self._store.lead(self._daemon_id, 0)

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
        leader = await self._store.lead(self._daemon_id, lease_ms)
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
        memory.long_prefill = memory.prefill_model = None  # told to the store again
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
        windows = await self.windows(pool)
        await self._tune_long_prefill(pool, windows, memory)
        if record.pinned:
            self.last_verdicts[pool.name] = Verdict(HOLD, "pinned by an operator")
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
        self.last_verdicts[pool.name] = verdict
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
        """Learns which prompts would stall the top class too long (qosd.stall) and
        tells the store when the threshold moves by a tenth or more."""
        configured = self._config.pools[pool.name]
        if configured.chunked_prefill:
            return
        top = pool.classes[0].name
        learned = await asyncio.to_thread(learn, windows, top, self._config.classes[top].slo)
        threshold = learned.threshold or configured.long_prefill_tokens or 0.0  # learned first
        model = learned.model
        known, known_model = memory.long_prefill, memory.prefill_model
        if (
            known is not None
            and _near(threshold, known)
            and (model is None) == (known_model is None)
            and (
                model is None
                or known_model is None
                or _near(model.stall_ms(REFERENCE_PROMPT), known_model.stall_ms(REFERENCE_PROMPT))
            )
        ):
            return
        encoded = (
            None if model is None else (model.base_ms, model.per_token_ms, model.per_token2_ms)
        )
        await self._store.set_prefill(pool, threshold, encoded)
        memory.long_prefill, memory.prefill_model = threshold, model
        if threshold:
            log.info("pool %s: prompts over %.0f tokens wait for a gap in %s traffic",
                     pool.name, threshold, top)  # fmt: skip

    async def pin(self, pool: PoolPolicy, capacity: float | None) -> ControlRecord:
        """Fixes a pool's admitted rate (the loop leaves it alone), or frees it."""
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
