"""Issue 37's whole matrix on the yardstick, pinned to one commit.

    python -m benchmarks.yardstick_matrix --commit HEAD            # every cell
    python -m benchmarks.yardstick_matrix --commit HEAD --jobs 2   # two cells at a time
    python -m benchmarks.yardstick_matrix --list                   # the plan, and its cost

Each cell is ``qos_replay.py --commit REV --trace T --load L --engine E [--bursty]``
with every policy, reference and seed of its defaults, written to
``docs/results/yardstick_{workload}_{load}x_{engine}.json`` (with its markdown,
records and figures beside it). The run is resumable: a cell whose JSON already records
the same commit is kept, so a matrix stopped half way goes on where it stopped, and a
cell run at another commit is run again. At the end the README's table
(``replay_summary.py --headline``) is printed for the cells that exist.

Replays run in virtual time (``qos_replay.py --clock virtual``, its default): a seed
of a cell is eight runs (qosd, static's five points, vllm-native, fifo-deadline) of
the trace's 120 s and a 30 s drain, about 6 minutes of one CPU here on the Azure
trace, 7 on its bursts, 1 on Mooncake's (fewer, longer requests), and 21 minutes of
an idle machine in real time whatever the trace; the 18 cells about 14 CPU-hours in
virtual time. A run in virtual
time is the same beside another, so ``--jobs N`` runs N cells at once, each writing
its output to ``{cell}.log`` beside its results; in real time (``--clock real``) a
replay takes a machine-wide lock, and cells run one at a time whatever ``--jobs``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.qos_replay import DEFAULT_TRACE
from qosd_sim.seeds import REPORTED_SEEDS

ROOT = Path(__file__).resolve().parents[1]
TRACES = DEFAULT_TRACE.parent
#: The matrix's workloads: a trace, and whether its arrivals are redrawn as bursts.
WORKLOADS = {
    "azure": (TRACES / "azure2023_conv.csv", False),
    "mooncake": (TRACES / "mooncake_fast25_synthetic.csv", False),
    "bursty": (TRACES / "azure2023_conv.csv", True),
}
LOADS = (1.5, 2.0)
ENGINES = ("chunked", "unchunked", "chunked-priority")
#: One seed of a cell, all policies (8 runs of 120 s and a 30 s drain), on one CPU
#: of the development VM, by workload: in virtual time (measured: Azure 2x alone
#: 5.7 min; this round's cells, three sharing two CPUs, 6.3 min a seed on Azure, 7
#: on bursts, 0.9 to 1.2 on Mooncake), and in real time (the trace's own pace).
MINUTES_PER_SEED = {
    "virtual": {"azure": 6.0, "bursty": 7.0, "mooncake": 1.2},
    "real": {"azure": 21.0, "bursty": 21.0, "mooncake": 21.0},
}


def cell_path(out: Path, workload: str, load: float, engine: str) -> Path:
    return out / f"yardstick_{workload}_{load:g}x_{engine}.json"


def cell_command(workload: str, load: float, engine: str, commit: str, path: Path,
                 seeds: str, clock: str = "virtual") -> list[str]:  # fmt: skip
    trace, bursty = WORKLOADS[workload]
    command = [sys.executable, str(ROOT / "benchmarks" / "qos_replay.py"), "--commit", commit,
               "--trace", str(trace), "--load", f"{load:g}", "--engine", engine,
               "--seeds", seeds, "--clock", clock, "--json", str(path)]  # fmt: skip
    return command + (["--bursty"] if bursty else [])


def recorded_commit(path: Path) -> str | None:
    """The commit a cell's results name, or None where there are none to keep."""
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    commit = results.get("commit")
    return commit if isinstance(commit, str) and not results.get("development_run") else None


def run_cells(commands: list[list[str]], jobs: int) -> bool:
    """Runs the cells, ``jobs`` at a time; True if all succeeded. With more than one
    at a time, each cell's output goes to ``{cell}.log`` beside its results."""
    if jobs == 1:
        return all(subprocess.run(command, check=False).returncode == 0 for command in commands)

    def run(command: list[str]) -> bool:
        log = Path(command[command.index("--json") + 1]).with_suffix(".log")
        with log.open("w") as output:
            done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, check=False)
        print(f"{log.name}: {'done' if done.returncode == 0 else 'failed'}", flush=True)
        return done.returncode == 0

    with ThreadPoolExecutor(jobs) as pool:
        return all(list(pool.map(run, commands)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", default="HEAD", help="the commit every cell runs (HEAD)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--seeds", default=",".join(map(str, REPORTED_SEEDS)))
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--clock", choices=sorted(MINUTES_PER_SEED), default="virtual")
    parser.add_argument("--jobs", type=int, default=1, help="cells at once (virtual time)")
    parser.add_argument("--list", action="store_true", help="print the plan and its cost only")
    args = parser.parse_args()
    # As the replays record it (qosd_harness.source_commit of their clean worktree).
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=12", args.commit],
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    cells = [(w, float(x), e) for w in args.workloads.split(",")
             for x in args.loads.split(",") for e in args.engines.split(",")]  # fmt: skip
    seeds = len(args.seeds.split(","))
    todo = [c for c in cells if recorded_commit(cell_path(args.out, *c)) != commit]
    minutes = sum(seeds * MINUTES_PER_SEED[args.clock][w] for w, _, _ in todo)
    print(f"{len(cells)} cells at {commit} ({len(cells) - len(todo)} done), {seeds} seeds each: "
          f"about {minutes / 60:.1f} CPU-hours to go ({args.clock} time)", flush=True)  # fmt: skip
    commands = [cell_command(w, load, e, commit, cell_path(args.out, w, load, e), args.seeds,
                             args.clock) for w, load, e in todo]  # fmt: skip
    for command in commands:
        print(" ".join(command[1:]), flush=True)
    if not args.list and not run_cells(commands, max(1, args.jobs)):
        return 1
    done = [str(p) for c in cells if (p := cell_path(args.out, *c)).exists()]
    if done and not args.list:
        summary = [sys.executable, str(ROOT / "benchmarks" / "replay_summary.py"), "--headline"]
        return subprocess.run(summary + done, check=False).returncode
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
