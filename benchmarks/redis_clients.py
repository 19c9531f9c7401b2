"""What one Redis round trip costs inside a grpc.aio handler, per Redis client.

    python benchmarks/redis_clients.py --json results/redis_clients.json

Starts a throwaway redis-server and, for each variant, a grpc.aio server on uvloop
whose only RPC awaits one Redis PING (or nothing, for the baseline). h2load drives
each in alternating rounds; the figure is RPCs per second and its ratio to the
empty handler. Variants: no Redis call; redis-py's asyncio client; qosd's pipelined
hiredis client (``qosd.store.resp``). Run it under another grpcio version (in a
venv of its own) to compare gRPC releases the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import redis
import redis.asyncio as aioredis
import uvloop

from qosd.store.resp import RespClient
from qosd_sim.harness import free_port, redis_server, serve_raw_unary

VARIANTS = ("empty", "redis-py", "qosd-resp")


def serve(variant: str, port: int, redis_url: str) -> None:
    """Runs one probe server until killed (in a child process)."""

    async def main() -> None:
        redis_py = aioredis.Redis.from_url(redis_url)
        resp = RespClient(
            redis_url, cluster=False, timeout_s=1.0, connect_timeout_s=1.0,
            connections_per_node=int(os.environ.get("PROBE_CONNECTIONS", "2")),
        )  # fmt: skip

        async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            if variant == "redis-py":
                await redis_py.ping()
            elif variant == "qosd-resp":
                await resp.execute("probe", "PING")
            return b""

        await serve_raw_unary("probe.Probe", "Call", handler, port)

    uvloop.run(main())


def h2load_rps(port: int, body: Path, seconds: int) -> float:
    output = subprocess.run(
        ["h2load", "-c", "4", "-m", "16", "-t", "1", "-D", str(seconds),
         "--warm-up-time", "1", "-H", "content-type: application/grpc",
         "-H", "te: trailers", "-d", str(body), f"http://127.0.0.1:{port}/probe.Probe/Call"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    line = next(line for line in output.splitlines() if line.startswith("finished in"))
    return float(line.split(",")[1].split()[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--seconds", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    with redis_server() as server, tempfile.TemporaryDirectory() as scratch:
        body = Path(scratch, "empty.bin")
        body.write_bytes(b"\x00\x00\x00\x00\x00")  # an empty gRPC message
        for round_index in range(args.rounds):
            for variant in VARIANTS:
                port = free_port()
                child = subprocess.Popen(
                    [sys.executable, __file__, "--serve", variant, str(port), server.url]
                )
                try:
                    time.sleep(1.5)
                    rps = h2load_rps(port, body, args.seconds)
                finally:
                    child.kill()
                    child.wait()
                rounds[variant].append(rps)
                print(f"round {round_index + 1} {variant:10s} {rps:9.0f} RPCs/s", flush=True)
    results: dict[str, object] = {}
    baseline = statistics.median(rounds["empty"])
    for variant, values in rounds.items():
        results[f"{variant}_rps"] = statistics.median(values)
        results[f"{variant}_vs_empty"] = statistics.median(values) / baseline
    results["setup"] = {"grpcio": grpc.__version__, "redis_py": redis.__version__}
    print(json.dumps(results, indent=2))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        raise SystemExit(main())
