"""Acquire throughput of the daemon on each store, side by side in one run.

    python benchmarks/store_daemons.py --against ../old-checkout --json r.json

Subjects, each ``qosd serve`` in a process of its own on free ports, loaded by h2load
(Debian's nghttp2-client) with admitted Acquires (``--clients`` connections of
``--streams`` streams) for ``--seconds``, in rounds that alternate between them, the
median round reported:

- ``embedded``: this checkout, on the embedded store;
- ``redis``: this checkout, on a Redis the benchmark starts;
- ``embedded_against``, ``redis_against``: the same for the ``--against`` checkout
  (its own ``qosd``, ``clients``, ``harness`` and ``sim`` first on ``PYTHONPATH``),
  when given: an older store, or another Redis client, beside this one.

It prints each one's Acquires per second and the ratios embedded / embedded_against
and redis / redis_against, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decisions import ACQUIRE_PATH, check_one_acquire, grpc_frame, run_h2load
from qosd_client.v1 import qosd_pb2
from qosd_harness import redis_server, source_commit, stop_process

HERE = Path(__file__).resolve().parents[1]
POOL = {"default": {"capacity_tokens_s": 1e9}}


@contextlib.contextmanager
def daemon(command: list[str], env: dict[str, str], ready: Path) -> Iterator[str]:
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"daemon failed: {process.stderr.read() if process.stderr else ''}"
                )
            time.sleep(0.05)
        yield str(json.loads(ready.read_text())["addresses"][0])
    finally:
        stop_process(process)


def tree_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("", "clients", "harness", "sim"))
    return env


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--against", help="another checkout, run beside this one")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    with redis_server() as redis, tempfile.TemporaryDirectory() as scratch:
        request = qosd_pb2.AcquireRequest(
            tenant="bench", model="default", qos_class="P1", input_tokens=100,
            expected_output_tokens=50, max_wait_ms=0,
        )  # fmt: skip
        body = Path(scratch, "acquire.bin")
        body.write_bytes(grpc_frame(request.SerializeToString()))
        subjects: dict[str, tuple[list[str], dict[str, str]]] = {}
        for tree_name, given in (("", HERE), ("_against", args.against)):
            if given is None:
                continue
            tree = Path(given).resolve()
            for store in ("embedded", "redis"):
                name = f"{store}{tree_name}"
                settings: dict[str, Any] = {"pools": POOL, "control": {"enabled": False}}
                if store == "redis":
                    settings["redis"] = {"url": redis.url, "key_prefix": f"bench-{name}"}
                config = Path(scratch, f"{name}.yaml")
                config.write_text(json.dumps(settings))
                subjects[name] = (
                    [sys.executable, "-m", "qosd.cli", "serve", "--config", str(config),
                     "--listen", "127.0.0.1:0", "--ready-file", "READY"],
                    tree_env(tree),
                )  # fmt: skip
        rounds: dict[str, list[float]] = {name: [] for name in subjects}
        for round_ in range(args.rounds):
            for name, (command, env) in subjects.items():
                ready = Path(scratch, f"{name}-{round_}.ready")
                with daemon(
                    [c if c != "READY" else str(ready) for c in command], env, ready
                ) as address:
                    check_one_acquire(address, request)
                    figures = run_h2load(
                        address, ACQUIRE_PATH, body, clients=args.clients,
                        streams=args.streams, seconds=args.seconds,
                    )  # fmt: skip
                rounds[name].append(figures["rps"])
                print(f"round {round_ + 1} {name}: {figures['rps']:,.0f} Acquires/s", flush=True)
    result: dict[str, Any] = {
        "seconds": args.seconds,
        "rounds": args.rounds,
        "clients": args.clients,
        "streams": args.streams,
        "cpus": len(os.sched_getaffinity(0)),
        "trees": {
            "this": source_commit(HERE),
            **({"against": source_commit(Path(args.against))} if args.against else {}),
        },
        "subjects": {
            name: {
                "rps_median": round(statistics.median(values)),
                "rps": [round(v) for v in values],
            }
            for name, values in rounds.items()
        },
        "ratios": {},
    }
    medians = {name: statistics.median(values) for name, values in rounds.items()}
    for numerator, denominator in (
        ("embedded", "embedded_against"),
        ("redis", "redis_against"),
    ):
        if numerator in medians and denominator in medians:
            ratio = medians[numerator] / medians[denominator]
            result["ratios"][f"{numerator}/{denominator}"] = round(ratio, 3)
            print(f"{numerator} / {denominator}: {ratio:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
