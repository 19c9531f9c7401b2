"""The SLO loop's law: from the latency evidence, cut, grow or hold a pool's rate.

Pure: no store, no clock, no I/O (``qosd.control.leader`` runs it). The controlled
quantity is one number per pool, R, the tokens per second the pool admits; class
rates follow from it by a fixed allocation (``lua/pool/allocation.lua``). Every
``control.interval_s`` the leader judges each pool and moves R by the law below;
docs/control.md argues for it and shows it stable against a simulated server.

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

import dataclasses
import enum
from dataclasses import dataclass

from qosd.config import ControlConfig, SloConfig
from qosd.control.windows import WindowStats, improving, trend, window_stats
from qosd.model import ControlRecord, StoredSample
from qosd.policy import PoolPolicy


class Move(enum.IntEnum):
    """A verdict's direction, and a record's last move (``ControlRecord.direction``)."""

    UP = 1
    DOWN = -1
    HOLD = 0
    UNDO = -2  # a cut back to where the last growth started


UP, DOWN, HOLD, UNDO = Move.UP, Move.DOWN, Move.HOLD, Move.UNDO


@dataclass(frozen=True, slots=True)
class Verdict:
    direction: Move
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
    record: ControlRecord, direction: Move, config: ControlConfig, pool: PoolPolicy
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
