"""What an admission proxy costs: qosd's proxy beside LiteLLM's, against calling the
server directly, in one run.

    python -m benchmarks.proxy_overhead --json docs/results/proxy_overhead.json

The server is ``qosd sim-vllm`` with a GPU 1,000 times faster than the cost model's
A100 (an iteration takes microseconds), so that what is measured is HTTP and the
proxies, not the GPU. Three ways to it: directly, through ``qosd proxy`` (embedded
store, the built-in config), and through LiteLLM's proxy (from PyPI, in its own
virtual environment, ``--litellm-venv``; one worker, no database, no limits).

- **Overhead at low load**: ``--requests`` rounds; in each, one non-streaming chat
  completion (8 words in, 1 token out) to each of the three, in a shuffled order, one
  at a time, on keep-alive connections, nothing pinned. p50 and p99 of each, and
  what each proxy adds to the direct p50 and p99.
- **Requests per second on one core**: then each proxy is pinned to CPU 1 (``taskset``),
  the server and this load generator to CPU 0; ``--concurrency`` connections send
  requests back to back for ``--seconds``; completed requests per second. Direct
  shows what the server and the load generator sustain without a proxy: a proxy
  cannot exceed it here.

``--against TREE`` (repeatable) adds the qosd proxy of another checkout (a clean
``git worktree`` of an older commit, say) as one more target, started with that
tree on PYTHONPATH, so that a change to the proxy is measured before and after in one
run, in the same shuffled rounds. ``--no-litellm`` leaves LiteLLM out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.litellm_peer import MASTER_KEY, group_pids, litellm_proxy, model_entry, version
from qosd_harness import source_commit, start_command, stop_process

MODEL = "llm"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": " ".join(["word"] * 8)}],
        "max_tokens": 1}  # fmt: skip
PROXY_CPU, SERVER_CPU = 1, 0


@contextmanager
def qosd_command(
    args: list[str], directory: Path, name: str, tree: Path | None = None
) -> Iterator[dict[str, Any]]:
    """``qosd ARGS`` running, from this checkout, or from ``tree`` when one is given."""
    env = None
    if tree is not None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(str(tree / p) for p in ("", "clients", "harness"))
    process, ready = start_command(args, directory, name, env=env)
    try:
        yield {**ready, "pid": process.pid}
    finally:
        stop_process(process)


def pin_tree(pid: int, cpu: int) -> None:
    """Pins a process and its threads (``taskset -a``) to one CPU."""
    subprocess.run(["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True,
                   capture_output=True)  # fmt: skip


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def low_load(targets: dict[str, str], rounds: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    latencies: dict[str, list[float]] = {name: [] for name in targets}
    headers = {"authorization": f"Bearer {MASTER_KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        for url in targets.values():  # warm: connections, caches, the estimator
            for _ in range(20):
                async with session.post(f"{url}/v1/chat/completions", json=BODY) as answer:
                    await answer.read()
        for _ in range(rounds):
            order = list(targets)
            rng.shuffle(order)
            for name in order:
                began = time.perf_counter()
                async with session.post(
                    f"{targets[name]}/v1/chat/completions", json=BODY
                ) as answer:
                    await answer.read()
                    assert answer.status == 200, (name, answer.status)
                latencies[name].append((time.perf_counter() - began) * 1000)
    direct = latencies["direct"]
    out: dict[str, Any] = {}
    for name, values in latencies.items():
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        out[name] = {"p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
                     "mean_ms": round(statistics.fmean(values), 3)}  # fmt: skip
        if name != "direct":
            out[name]["added_p50_ms"] = round(p50 - percentile(direct, 0.5), 3)
            out[name]["added_p99_ms"] = round(p99 - percentile(direct, 0.99), 3)
    for name in (n for n in latencies if n.startswith("qosd@")):
        # The same round's two requests, paired: the median of what this tree adds
        # over the other, less swayed by the machine's moods than two p50s apart.
        mine, theirs = latencies["qosd"], latencies[name]
        paired = [a - b for a, b in zip(mine, theirs, strict=True)]
        difference = percentile(mine, 0.5) - percentile(theirs, 0.5)
        out["qosd"][f"minus_{name}_p50_ms"] = round(difference, 3)
        out["qosd"][f"minus_{name}_paired_median_ms"] = round(statistics.median(paired), 3)
    return out


async def throughput(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    done = failed = 0
    stop_at = time.monotonic() + seconds
    headers = {"authorization": f"Bearer {MASTER_KEY}"}
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done, failed
        while time.monotonic() < stop_at:
            async with session.post(f"{url}/v1/chat/completions", json=BODY) as answer:
                await answer.read()
                if answer.status == 200:
                    done += 1
                else:
                    failed += 1

    began = time.monotonic()
    async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    elapsed = time.monotonic() - began
    return {"requests_s": round(done / elapsed, 1), "failed": failed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=500, help="rounds at low load")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0, help="per throughput run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--litellm-venv", type=Path, default=Path(tempfile.gettempdir()) / "litellm-venv"
    )
    parser.add_argument(
        "--against", type=Path, action="append", default=[], metavar="TREE",
        help="also measure the qosd proxy of this checkout (repeatable)",
    )  # fmt: skip
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM out")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pin = len(os.sched_getaffinity(0)) >= 2
    # Recorded as the run starts: a tree edited while it runs must not name the result.
    commit = source_commit(Path(__file__).resolve().parents[1])
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        work = Path(scratch)
        server = stack.enter_context(qosd_command(
            ["sim-vllm", "--listen", "127.0.0.1:0", "--model", MODEL, "--gpu", "speed=1000",
             "--max-waiting", "100000"], work, "vllm"))  # fmt: skip
        upstream = f"http://127.0.0.1:{server['port']}"
        proxy_args = ["proxy", "--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0",
                      "--upstream", f"{MODEL}={upstream}", "--log-level", "WARNING"]  # fmt: skip
        proxies = {"qosd": stack.enter_context(qosd_command(proxy_args, work, "proxy"))}
        trees = {}
        for tree in args.against:
            name = f"qosd@{source_commit(tree.resolve())}"
            trees[name] = {"path": str(tree.resolve()), "commit": source_commit(tree.resolve())}
            proxies[name] = stack.enter_context(
                qosd_command(proxy_args, work, name.replace("@", "-"), tree.resolve())
            )
        targets = {"direct": upstream}
        targets.update({name: f"http://{p['address']}" for name, p in proxies.items()})
        litellm_leader = None
        if not args.no_litellm:
            targets["litellm"], litellm_leader = stack.enter_context(litellm_proxy(
                args.litellm_venv, {"model_list": [model_entry(MODEL, upstream)],
                                    "litellm_settings": {"drop_params": True}},
                work / "litellm"))  # fmt: skip
        print(f"low load: {args.requests} rounds", flush=True)
        low = asyncio.run(low_load(targets, args.requests, args.seed))
        print(json.dumps(low, indent=2), flush=True)
        if pin:  # the proxies on a core of their own; the server and load here
            os.sched_setaffinity(0, {SERVER_CPU})
            pin_tree(server["pid"], SERVER_CPU)
            for running in proxies.values():
                pin_tree(running["pid"], PROXY_CPU)
            for pid in group_pids(litellm_leader) if litellm_leader is not None else []:
                pin_tree(pid, PROXY_CPU)
        peak: dict[str, Any] = {}
        for name, url in targets.items():
            peak[name] = asyncio.run(throughput(url, args.concurrency, args.seconds))
            print(f"{name}: {peak[name]}", flush=True)
    result = {
        "low_load": low,
        "one_core": peak,
        "pinned": pin,
        "litellm_version": None if args.no_litellm else version(args.litellm_venv),
        "commit": commit,
        "against": trees,
        "load_average_at_start": load_at_start,
        "command": "python -m benchmarks.proxy_overhead "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("requests", "concurrency", "seconds", "seed")
        )
        + "".join(f" --against {tree}" for tree in args.against)
        + (" --no-litellm" if args.no_litellm else ""),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
