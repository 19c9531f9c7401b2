"""How fast can an Acquire be on this stack? A ladder of gRPC handlers, each doing a
little more of an Acquire's work, measured side by side.

    python benchmarks/acquire_floor.py --json results/acquire_floor.json   # ~2 min

The decision benchmark (benchmarks/decisions.py) compares qosd's Acquire with an empty
RPC. This one says where the gap between them comes from. It starts a throwaway
redis-server and, for each rung, one server process on grpc.aio and uvloop that h2load
drives with a real AcquireRequest (4 connections x 16 streams, alternating rounds,
median; then one stream, one request at a time, for the uncontended p50), and reads
Redis's own time per request from ``INFO commandstats``:

- ``empty``: answers an empty message (the ceiling);
- ``messages``: parses the AcquireRequest and answers an AcquireResponse;
- ``batched-script``: also awaits one script call per batch through qosd's batcher
  and Redis transport (``qosd/store/batching.py``, ``qosd/store/redis_client.py``),
  with a script that only answers: the cost of one awaited, batched Redis round trip;
- ``store``: also prices a lease and awaits ``RedisStore.acquire`` (the real acquire
  script): everything but the servicer, validation, the waiting room and metrics;
- ``daemon``: ``qosd serve`` itself.

Each rung's ratio to ``empty`` bounds what the rungs above it can reach: no Acquire
that awaits Redis once can be faster, or answer sooner, than ``batched-script``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import uvloop
import yaml

from qosd.config import Config
from qosd.model import LeaseSpec, new_lease_token
from qosd.policy import resolve_pools
from qosd.store.batching import ScriptBatcher
from qosd.store.redis import RedisStore
from qosd.store.redis_client import redis_transport
from qosd_client.v1 import qosd_pb2
from qosd_harness import (
    PortReservation,
    redis_command,
    redis_server,
    reserve_port,
    serve_raw_unary,
)

if __package__ in (None, ""):  # run as a script: python benchmarks/acquire_floor.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.decisions import (
    WARM_UP_S,
    WINDOW_SLACK_S,
    commandstats,
    grpc_frame,
    h2load_command,
    parse_h2load,
    percentile,
)

RUNGS = ("empty", "messages", "batched-script", "store", "daemon")
PATH = "/qosd.v1.QoS/Acquire"
#: Answers every call of a batch (ARGV[1] of them) at once.
ANSWER_ONLY = "local r = {} for i = 1, tonumber(ARGV[1]) do r[i] = 1 end return r"
REQUEST = qosd_pb2.AcquireRequest(
    tenant="bench", model="default", qos_class="P1", input_tokens=100,
    expected_output_tokens=50, max_wait_ms=0,
)  # fmt: skip
# An Acquire of REQUEST costs 150 on every rung: 100 prompt + 50 output tokens at
# output weight 1 (the scripts price it; the rungs without a store answer the same).
POOL: dict[str, Any] = {
    "pools": {"default": {"capacity_tokens_s": 1e9}},
    "cost": {"output_weight": 1.0},
}


def serve(rung: str, port: int, redis_url: str) -> None:
    """Runs one rung's server until killed (in a child process)."""

    async def main() -> None:
        config = Config.model_validate({**POOL, "redis": {"url": redis_url, "key_prefix": rung}})
        store = RedisStore(config.redis, tombstone_ms=120_000)
        await store.start()
        pool = resolve_pools(config)["default"]
        cls = next(c for c in pool.classes if c.name == "P1")
        transport = redis_transport(config.redis)
        sha = hashlib.sha1(ANSWER_ONLY.encode()).hexdigest()
        await transport.execute_on_primaries("SCRIPT", "LOAD", ANSWER_ONLY)

        async def answer_only(keys: Any, args: Any) -> list[Any]:
            return list(await transport.execute("k", "EVALSHA", sha, len(keys), *keys, *args))

        batcher = ScriptBatcher(answer_only, fields=1)
        parse = qosd_pb2.AcquireRequest.FromString

        async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if rung == "empty":
                return b""
            request = parse(raw)
            lease_id = f"default:P1:{new_lease_token()}"
            charged, remaining = 150.0, 1e9
            if rung == "batched-script":
                await batcher.submit("default", (), ())
            elif rung == "store":
                lease = LeaseSpec(
                    lease_id, request.request_id, request.tenant, request.input_tokens,
                    request.expected_output_tokens, 1.0, 300_000,
                )  # fmt: skip
                decision = await store.acquire(pool, cls, lease, 0)
                lease_id, charged = decision.lease_id, decision.charged
                remaining = decision.remaining
            return qosd_pb2.AcquireResponse(
                decision=qosd_pb2.DECISION_ADMITTED, lease_id=lease_id, tokens_charged=charged,
                remaining_tokens=remaining, lease_ttl_ms=300_000, pool="default",
            ).SerializeToString()  # fmt: skip

        await serve_raw_unary("qosd.v1.QoS", "Acquire", handler, port)

    uvloop.run(main())


def start(
    rung: str, redis_url: str, scratch: Path
) -> tuple[subprocess.Popen[bytes], PortReservation]:
    """The rung's server in a child, on a port reserved for it (the probe servers take
    a port, they do not report one), held until the caller closes it."""
    reservation = reserve_port()
    port = reservation.port
    if rung == "daemon":
        config = {
            **POOL,
            "redis": {"url": redis_url, "key_prefix": rung},
            "server": {"listen": [f"127.0.0.1:{port}"]},
        }
        path = scratch / "qosd.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "qosd.cli", "serve", "--config", str(path)]
    else:
        command = [sys.executable, __file__, "--serve", rung, str(port), redis_url]
    child = subprocess.Popen(command)
    # Ready when an Acquire is answered (the store's scripts loaded).
    deadline = time.monotonic() + 30
    while True:
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                channel.unary_unary(PATH)(REQUEST.SerializeToString(), timeout=2)
            return child, reservation
        except grpc.RpcError:
            if child.poll() is not None or time.monotonic() > deadline:
                child.kill()
                reservation.close()
                raise RuntimeError(f"the {rung} server did not start") from None
            time.sleep(0.1)


def evalsha(port: int) -> dict[str, float]:
    return commandstats(port).get("evalsha", {"calls": 0.0, "usec": 0.0})


def one_round(
    rung: str, redis_port: int, body: Path, scratch: Path, seconds: int
) -> dict[str, float]:
    """One rung: throughput at 4 x 16 streams, with Redis's counts over h2load's
    window; then latency, one stream with one request at a time (uncontended)."""
    child, reservation = start(rung, f"redis://127.0.0.1:{redis_port}/0", scratch)
    address = f"127.0.0.1:{reservation.port}"
    try:
        command = h2load_command(address, PATH, body, clients=4, streams=16, seconds=seconds)
        load = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        # Redis's counts start with h2load's measuring window, after its warm-up.
        time.sleep(WARM_UP_S + WINDOW_SLACK_S)
        redis_command(redis_port, "CONFIG", "RESETSTAT")
        output, _ = load.communicate()
        stats = evalsha(redis_port)
        if load.returncode != 0:
            raise RuntimeError(f"h2load exited with {load.returncode}")
        figures = parse_h2load(output)
        log = scratch / f"{rung}.log"
        log.unlink(missing_ok=True)  # h2load appends to its log
        command = h2load_command(
            address, PATH, body, clients=1, streams=1, seconds=seconds, log_file=log
        )
        subprocess.run(command, capture_output=True, check=True)
        # h2load's log: start time, HTTP status, duration in microseconds.
        durations = sorted(
            int(line.split("\t")[2]) / 1000 for line in log.read_text().splitlines() if line
        )
        figures["p50_ms"] = percentile(durations, 0.50)
        figures["p99_ms"] = percentile(durations, 0.99)
    finally:
        child.kill()
        child.wait()
        reservation.close()
    if stats["calls"]:
        figures["acquires_per_evalsha"] = figures["requests"] / stats["calls"]
        figures["redis_usec_per_evalsha"] = stats["usec"] / stats["calls"]
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rungs", default=",".join(RUNGS))
    args = parser.parse_args()
    rungs = args.rungs.split(",")
    rounds: dict[str, list[dict[str, float]]] = {rung: [] for rung in rungs}
    with redis_server() as server, tempfile.TemporaryDirectory() as directory:
        scratch = Path(directory)
        body = scratch / "acquire.bin"
        body.write_bytes(grpc_frame(REQUEST.SerializeToString()))
        for round_index in range(args.rounds):
            for rung in rungs:
                figures = one_round(rung, server.port, body, scratch, args.seconds)
                rounds[rung].append(figures)
                extra = (
                    f"; {figures['acquires_per_evalsha']:.1f} per EVALSHA, "
                    f"{figures['redis_usec_per_evalsha']:.1f} µs each in Redis"
                    if "acquires_per_evalsha" in figures
                    else ""
                )
                print(
                    f"round {round_index + 1} {rung:15s} {figures['rps']:8.0f} req/s, "
                    f"uncontended p50 {figures['p50_ms']:.3f} ms{extra}",
                    flush=True,
                )
    results: dict[str, Any] = {"rungs": {}, "rounds": rounds}
    ceiling = statistics.median(r["rps"] for r in rounds[rungs[0]])
    fastest = statistics.median(r["p50_ms"] for r in rounds[rungs[0]])
    print(f"\n{'rung':15s} {'req/s':>8s}  vs {rungs[0]}  p50 ms  vs {rungs[0]}")
    for rung in rungs:
        summary = {
            key: statistics.median(r[key] for r in rounds[rung])
            for key in rounds[rung][0]
            if key in ("rps", "p50_ms", "p99_ms", "acquires_per_evalsha", "redis_usec_per_evalsha")
        }
        summary["vs_ceiling"] = summary["rps"] / ceiling
        summary["p50_vs_ceiling"] = summary["p50_ms"] / fastest
        results["rungs"][rung] = summary
        print(
            f"{rung:15s} {summary['rps']:8.0f}  {summary['vs_ceiling']:8.2f}  "
            f"{summary['p50_ms']:6.3f}  {summary['p50_vs_ceiling']:8.2f}"
        )
    results["setup"] = {"grpcio": grpc.__version__, "seconds": args.seconds}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(main())
