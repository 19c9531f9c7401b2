"""The SLO loop against a simulated GPU server, in compressed time.

    python benchmarks/slo_stability.py --json results/slo_stability.json \\
        --plot docs/slo_stability.png

The real controller (``qosd.control.leader.Controller``) and the real embedded store run on
a simulated clock; only the server is a model. Requests arrive at twice the server's
true capacity (P0 30 %, P1 50 %, P2 20 % of requests, 200 tokens each) and ask
qosd for admission; admitted work joins a backlog that the server drains at its
true capacity K(t). A request's time to first token is a base of 100 ms, grown by
queueing as the server gets busy (x (1 + 0.2 rho / (1 - rho)), rho the last
five seconds' admitted rate over K, as in a single-server queue) and by log-normal
noise, plus the time to drain the work ahead of it; it is reported when the
request finishes. P0's objective is TTFT <= 500 ms, P1's 2 s; P2 has none. So compliance
falls smoothly as load nears capacity, then collapses beyond it, as on a GPU.

Scenarios:
- step: K = 10,000 tokens/s, halved at 120 s, restored at 360 s; 600 s in all;
- steady: K = 8,000, moderate noise, 480 s;
- noisy: K = 8,000, heavy noise (sigma 0.6), 480 s.

The script prints each trajectory's figures and the properties docs/control.md
states, and writes them (and optionally a plot) to files. tests/test_control.py
runs the same simulation and asserts the properties.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import math
import os
import random
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from qosd.config import Config
from qosd.control.leader import Controller
from qosd.model import LeaseSpec, Outcome, Sample, new_lease_token
from qosd.policy import PoolPolicy, resolve_pools
from qosd.store.embedded import EmbeddedStore

NOMINAL = 10_000.0  # the pool's configured capacity, tokens/s
COST = 200  # tokens per request
TICK_S = 0.05
MIX = (("P0", 0.3), ("P1", 0.5), ("P2", 0.2))
BASE_TTFT_MS = 100.0
QUEUEING = 0.2  # how fast latency grows with the server's utilization
BUSY_WINDOW_S = 5.0  # utilization is averaged over this (a request's lifetime)

SIM_CONFIG: dict[str, Any] = {
    "pools": {"default": {"capacity_tokens_s": NOMINAL}},
    "classes": {  # floors of a fifth of each share: the rate may follow a halved server
        "P0": {"priority": 0, "share": 0.6, "min_share": 0.12, "slo": {"ttft_ms": 500}},
        "P1": {"priority": 1, "share": 0.35, "min_share": 0.07, "slo": {"ttft_ms": 2_000}},
        "P2": {"priority": 2, "share": 0.05, "min_share": 0.01},
    },
    "control": {"interval_s": 1.0, "cooldown_s": 5.0, "min_samples": 50},
    "report": {"max_age_s": 60},
}


@dataclass(frozen=True)
class Scenario:
    name: str
    seconds: int
    capacity: Callable[[float], float]  # true server capacity at time t
    noise_sigma: float


SCENARIOS = {
    "step": Scenario("step", 600, lambda t: 5_000.0 if 120 <= t < 360 else 10_000.0, 0.25),
    "steady": Scenario("steady", 480, lambda t: 8_000.0, 0.25),
    "noisy": Scenario("noisy", 480, lambda t: 8_000.0, 0.6),
}


@dataclass
class Trajectory:
    scenario: str
    t: list[float] = field(default_factory=list)  # seconds
    admitted_rate: list[float] = field(default_factory=list)  # R, what qosd admits
    true_capacity: list[float] = field(default_factory=list)  # K, what the server has
    compliance: list[float | None] = field(default_factory=list)  # P0 and P1, per second
    changes: list[tuple[float, float, float, str]] = field(default_factory=list)


class Clock:
    def __init__(self) -> None:
        self.us = 1_000_000

    def __call__(self) -> int:
        return self.us


async def run(scenario: Scenario, seed: int = 1) -> Trajectory:
    rng = random.Random(seed)
    clock = Clock()
    config = Config.model_validate(SIM_CONFIG)
    pool: PoolPolicy = resolve_pools(config)["default"]
    classes = {cls.name: cls for cls in pool.classes}
    store = EmbeddedStore(tombstone_ms=1_000, clock=clock, daemon_id="sim")
    controller = Controller(config, store, {pool.name: pool})
    trajectory = Trajectory(scenario.name)
    backlog = 0.0  # tokens the server still has to get through
    admitted_recently: deque[float] = deque(maxlen=round(BUSY_WINDOW_S / TICK_S))
    pending: list[tuple[float, int, Sample]] = []  # (report at, seq, sample)
    sequence = 0
    carry = 0.0
    second_good = second_all = 0
    ticks_per_second = round(1 / TICK_S)
    for tick in range(scenario.seconds * ticks_per_second):
        now = tick * TICK_S
        clock.us = 1_000_000 + round(now * 1e6)
        capacity = scenario.capacity(now)
        carry += 2 * capacity * TICK_S / COST  # demand at twice the true capacity
        arrivals, carry = int(carry), carry - int(carry)
        busy = min(0.98, sum(admitted_recently) / BUSY_WINDOW_S / capacity)
        queueing = 1 + QUEUEING * busy / (1 - busy)
        admitted_now = 0.0
        for _ in range(arrivals):
            qos_class = rng.choices([name for name, _ in MIX], [w for _, w in MIX])[0]
            lease = LeaseSpec(
                f"default:{qos_class}:{new_lease_token()}", "", "", COST, 0, 1.0, 60_000
            )
            decision = await store.acquire(pool, classes[qos_class], lease, 0)
            if not decision.admitted:
                continue
            ttft_ms = (
                BASE_TTFT_MS * queueing * rng.lognormvariate(0, scenario.noise_sigma)
                + backlog / capacity * 1000
            )
            backlog += COST
            admitted_now += COST
            sample = Sample("default", qos_class, "", ttft_ms, None, None, COST, 0, Outcome.OK)
            heapq.heappush(pending, (now + ttft_ms / 1000, sequence, sample))
            sequence += 1
            if qos_class != "P2":
                second_all += 1
                limit = 500 if qos_class == "P0" else 2_000
                second_good += ttft_ms <= limit
        admitted_recently.append(admitted_now)
        backlog = max(0.0, backlog - capacity * TICK_S)
        ready: list[Sample] = []
        while pending and pending[0][0] <= now:
            ready.append(heapq.heappop(pending)[2])
        if ready:
            await store.report(ready, config.report.window_size)
        if tick % ticks_per_second == ticks_per_second - 1:
            change = await controller.evaluate(pool)
            record = await store.control(pool)
            trajectory.t.append(round(now + TICK_S, 3))
            trajectory.admitted_rate.append(round(record.capacity, 1))
            trajectory.true_capacity.append(capacity)
            trajectory.compliance.append(round(second_good / second_all, 4) if second_all else None)
            second_good = second_all = 0
            if change is not None:
                trajectory.changes.append(
                    (
                        round(now + TICK_S, 3),
                        round(change.changed_from, 1),
                        round(change.capacity, 1),
                        change.reason,
                    )
                )
    return trajectory


def simulate(name: str, seed: int = 1) -> Trajectory:
    return asyncio.run(run(SCENARIOS[name], seed))


def moves(trajectory: Trajectory, start: float, end: float) -> list[int]:
    """Directions (+1 up, -1 down) of the changes made in [start, end)."""
    return [1 if new > old else -1 for at, old, new, _ in trajectory.changes if start <= at < end]


def reversals(directions: list[int]) -> int:
    return sum(1 for a, b in itertools.pairwise(directions) if a != b)


def mean_compliance(trajectory: Trajectory, start: float, end: float) -> float:
    values = [
        c for t, c in zip(trajectory.t, trajectory.compliance, strict=True)
        if start <= t < end and c is not None
    ]  # fmt: skip
    return sum(values) / len(values) if values else math.nan


HALVED = (120.0, 360.0)  # the step scenario's halved capacity


def _series(trajectory: Trajectory, values: list[Any], start: float, end: float) -> list[Any]:
    return [v for t, v in zip(trajectory.t, values, strict=True) if start <= t < end]


def settled(trajectory: Trajectory, start: float, end: float) -> dict[str, Any]:
    """How the loop behaves in [start, end), once it has converged."""
    directions = moves(trajectory, start, end)
    steps = [abs(new / old - 1) for at, old, new, _ in trajectory.changes if start <= at < end]
    rates = _series(trajectory, trajectory.admitted_rate, start, end)
    capacity = _series(trajectory, trajectory.true_capacity, start, end)
    mean_rate = sum(rates) / len(rates)
    return {
        "window_s": [start, end],
        "moves": len(directions),
        "reversals": reversals(directions),
        "largest_step": round(max(steps), 4) if steps else 0.0,
        # the spread of the rate, relative to its mean: within one step is no cycle
        "band": round((max(rates) - min(rates)) / mean_rate, 4),
        "compliance": round(mean_compliance(trajectory, start, end), 4),
        "rate_vs_capacity": round(sum(rates) / sum(capacity), 3),
    }


def figures(trajectory: Trajectory) -> dict[str, Any]:
    """The properties docs/control.md states, measured on one trajectory."""
    out: dict[str, Any] = {"changes": len(trajectory.changes)}
    if trajectory.scenario != "step":
        out["settled"] = settled(trajectory, 240, trajectory.t[-1] + 1)
        return out
    drop, back = HALVED
    before = _series(trajectory, trajectory.admitted_rate, drop - 1, drop)[0]
    out["rate_before_halving_vs_capacity"] = round(before / 10_000, 3)
    # Capacity halves: how many changes until the SLO holds again (ten seconds of
    # compliance >= 95 %), how long, and how far below the new capacity the rate goes.
    regained = next(
        (t for t, c in zip(trajectory.t, trajectory.compliance, strict=True)
         if drop + 5 < t < back and c is not None and c >= 0.95
         and mean_compliance(trajectory, t, t + 10) >= 0.95),
        None,
    )  # fmt: skip
    out["changes_until_slo_regained"] = (
        None if regained is None
        else sum(1 for c in trajectory.changes if drop <= c[0] <= regained)
    )  # fmt: skip
    out["slo_regained_after_s"] = None if regained is None else round(regained - drop, 1)
    out["lowest_rate_vs_halved_capacity"] = round(
        min(_series(trajectory, trajectory.admitted_rate, drop, back)) / 5_000, 3
    )
    out["compliance_while_halved"] = round(mean_compliance(trajectory, drop, back), 4)
    out["settled_halved"] = settled(trajectory, back - 90, back)
    # Capacity comes back: how long until the rate is back where it was.
    climbed = next(
        (t for t, r in zip(trajectory.t, trajectory.admitted_rate, strict=True)
         if t >= back and r >= 0.95 * before),
        None,
    )  # fmt: skip
    out["back_to_95pct_of_before_after_s"] = None if climbed is None else round(climbed - back, 1)
    out["highest_rate_after_recovery_vs_capacity"] = round(
        max(_series(trajectory, trajectory.admitted_rate, back, trajectory.t[-1] + 1)) / 10_000,
        3,
    )
    out["settled_restored"] = settled(trajectory, trajectory.t[-1] + 1 - 90, trajectory.t[-1] + 1)
    return out


def plot(trajectories: list[Trajectory], path: str) -> None:
    import matplotlib  # noqa: PLC0415 - only this optional output needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(len(trajectories), 1, figsize=(10, 3.2 * len(trajectories)))
    for ax, trajectory in zip(axes, trajectories, strict=True):
        ax.plot(trajectory.t, trajectory.true_capacity, color="grey", linestyle="--",
                label="true capacity K")  # fmt: skip
        ax.plot(trajectory.t, trajectory.admitted_rate, color="tab:blue",
                label="admitted rate R")  # fmt: skip
        ax.set_ylabel("tokens/s")
        ax.set_ylim(0, 12_500)
        twin = ax.twinx()
        twin.plot(trajectory.t, [c if c is not None else math.nan for c in trajectory.compliance],
                  color="tab:green", alpha=0.35, linewidth=0.8,
                  label="P0+P1 compliance (per second)")  # fmt: skip
        twin.axhline(0.95, color="tab:red", linewidth=0.6, linestyle=":")
        twin.set_ylim(0, 1.05)
        twin.set_ylabel("compliance")
        ax.set_title(f"scenario: {trajectory.scenario}")
        lines = ax.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        ax.legend(lines[0] + more[0], lines[1] + more[1], loc="lower left", fontsize=8)
    axes[-1].set_xlabel("simulated seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# The figures summarised across seeds: (scenario, path into figures(), label).
SUMMARY = (
    ("step", ("changes_until_slo_regained",), "changes until the SLO holds again"),
    ("step", ("slo_regained_after_s",), "seconds until the SLO holds again"),
    ("step", ("lowest_rate_vs_halved_capacity",), "lowest rate / halved capacity"),
    ("step", ("settled_halved", "band"), "rate band, last 90 s halved"),
    ("step", ("back_to_95pct_of_before_after_s",), "seconds back to 95% of the rate before"),
    ("step", ("highest_rate_after_recovery_vs_capacity",), "highest rate / capacity after"),
    ("steady", ("settled", "moves"), "steady: changes in the last 240 s"),
    ("steady", ("settled", "reversals"), "steady: reversals in the last 240 s"),
    ("steady", ("settled", "band"), "steady: rate band"),
    ("steady", ("settled", "rate_vs_capacity"), "steady: rate / capacity"),
    ("steady", ("settled", "compliance"), "steady: P0+P1 compliance"),
    ("noisy", ("settled", "moves"), "noisy: changes in the last 240 s"),
    ("noisy", ("settled", "reversals"), "noisy: reversals in the last 240 s"),
    ("noisy", ("settled", "compliance"), "noisy: P0+P1 compliance"),
)


def _one_seed(seed: int) -> dict[str, dict[str, Any]]:
    return {name: figures(simulate(name, seed)) for name in SCENARIOS}


def summarise(per_seed: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for scenario, path, label in SUMMARY:
        values = []
        for figures_of in per_seed.values():
            value: Any = figures_of[scenario]
            for key in path:
                value = value[key]
            values.append(value)
        rows.append({"figure": label, "per_seed": values})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot", help="write a PNG of the trajectories here")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--seeds", type=int, default=0, help="also summarise seeds 1..N (2 processes)"
    )
    args = parser.parse_args()
    results: dict[str, Any] = {"seed": args.seed}
    # The scenarios are independent and deterministic: one process each, as CPUs allow.
    with ProcessPoolExecutor(max_workers=min(len(SCENARIOS), os.cpu_count() or 1)) as pool:
        trajectories = list(pool.map(simulate, SCENARIOS, itertools.repeat(args.seed)))
    for name, trajectory in zip(SCENARIOS, trajectories, strict=True):
        measured = figures(trajectory)
        results[name] = {"figures": measured, "trajectory": asdict(trajectory)}
        print(f"\n== {name}: {json.dumps(measured)}")
        for at, old, new, reason in trajectory.changes:
            print(f"  t={at:6.1f}s  {old:8.0f} -> {new:8.0f}  {reason}")
    if args.seeds:
        with ProcessPoolExecutor(max_workers=2) as pool:
            seeds = list(range(1, args.seeds + 1))
            per_seed = dict(zip(seeds, pool.map(_one_seed, seeds), strict=True))
        rows = summarise(per_seed)
        results["seeds"] = {"seeds": seeds, "summary": rows}
        print(f"\n== across seeds {seeds[0]}..{seeds[-1]}")
        for row in rows:
            shown = "  ".join(f"{v:>6}" for v in row["per_seed"])
            print(f"  {row['figure']:<42}{shown}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results) + "\n")
    if args.plot:
        plot(trajectories, args.plot)
        print(f"\nplot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
