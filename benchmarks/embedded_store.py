"""The embedded store's speed, at the store: Acquire and Release per second, in process.

    python benchmarks/embedded_store.py --json r.json
    python benchmarks/embedded_store.py --against ../old-checkout --json r.json

One round: ``--seconds`` of back-to-back acquire-then-release pairs on the embedded
store of a daemon with the default config (``qosd.server.make_store``), on one event
loop, as the daemon calls them; the count of pairs per second. With ``--against
TREE``, rounds alternate between this checkout and another one (its ``qosd``,
``clients`` and ``sim`` first on ``PYTHONPATH``), each round a fresh process, so that
the two are measured side by side under the same load of the machine; it reports
each one's median and the ratio of this checkout's to the other's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qosd_harness import source_commit

HERE = Path(__file__).resolve().parents[1]


async def one_round(seconds: float) -> dict[str, Any]:
    from qosd.config import Config  # noqa: PLC0415 - imported from the tree under test
    from qosd.model import LeaseSpec, Outcome, UsageReport, new_lease_token  # noqa: PLC0415
    from qosd.policy import class_in, resolve_pools  # noqa: PLC0415
    from qosd.server import make_store  # noqa: PLC0415

    config = Config.model_validate(
        {"pools": {"default": {"capacity_tokens_s": 1e9, "models": ["m"]}}}
    )
    store = make_store(config)
    await store.start()
    pool = resolve_pools(config)["default"]
    cls = class_in(pool, "P1")
    usage = UsageReport(100, 10, Outcome.OK)
    pairs = 0
    began = time.perf_counter()
    cpu = time.process_time()
    deadline = began + seconds
    while time.perf_counter() < deadline:
        for _ in range(100):
            lease = LeaseSpec(f"default:P1:{new_lease_token()}", "", "", 100, 10, 1.0, 60_000)
            decision = await store.acquire(pool, cls, lease, 0)
            assert decision.admitted, decision
            await store.release(pool, cls, lease.lease_id, usage)
            pairs += 1
    elapsed = time.perf_counter() - began
    cpu = time.process_time() - cpu
    await store.close()
    return {"pairs_per_s": pairs / elapsed, "cpu_us_per_pair": cpu / pairs * 1e6}


def run_in(tree: Path, seconds: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("", "clients", "sim"))
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--round", str(seconds)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=tree,
    )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each tree")
    parser.add_argument("--against", help="another checkout to alternate with")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--round", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.round is not None:
        print(json.dumps(asyncio.run(one_round(args.round))))
        return 0
    trees = {"this": HERE}
    if args.against:
        trees["against"] = Path(args.against).resolve()
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            rounds[name].append(run_in(tree, args.seconds))
    result: dict[str, Any] = {"seconds": args.seconds, "rounds": args.rounds, "trees": {}}
    for name, tree in trees.items():
        rates = [r["pairs_per_s"] for r in rounds[name]]
        cpu = [r["cpu_us_per_pair"] for r in rounds[name]]
        result["trees"][name] = {
            "path": str(tree),
            "commit": source_commit(tree),
            "pairs_per_s_median": round(statistics.median(rates)),
            "pairs_per_s": [round(r) for r in rates],
            "cpu_us_per_pair_median": round(statistics.median(cpu), 1),
        }
        print(
            f"{name} ({tree}): {statistics.median(rates):,.0f} acquire+release pairs/s "
            f"(median of {args.rounds}; {min(rates):,.0f} to {max(rates):,.0f}), "
            f"{statistics.median(cpu):.1f} CPU-us a pair"
        )
    if args.against:
        ratio = (
            result["trees"]["this"]["pairs_per_s_median"]
            / result["trees"]["against"]["pairs_per_s_median"]
        )
        result["ratio"] = round(ratio, 3)
        print(f"this / against: {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
