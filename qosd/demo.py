"""``qosd demo``: a real daemon process and a gateway-like workload replayed against it.

The workload is a slice of the Azure LLM inference trace (2023, conversation;
CC BY 4.0, see ``examples/README.md``), time-compressed so that it offers more tokens
than the pool's budget. Classes are assigned by a seeded hash of the row (P0 20 %,
P1 50 %, P2 30 %, the brief's replay mix), and every few seconds a 32K-token P1
prompt, the seed's troublemaker, is injected. Each request acquires, "runs" for a
modelled time, releases with its real token counts and reports its latencies, as a
gateway and a model server would. The summary shows what qosd decided per class.
"""

from __future__ import annotations

import asyncio
import csv
import hashlib
import random
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources

import uvloop

from qosd.config import Config
from qosd.testing import daemon_processes
from qosd_client import LatencySample, QosdClient, Reason

CLASS_MIX = (("P0", 0.20), ("P1", 0.50), ("P2", 0.30))
LONG_PROMPT_TOKENS = 32_768
LONG_PROMPT_EVERY_S = 3.0
ESTIMATED_OUTPUT_TOKENS = 256


def class_for_row(index: int, seed: int = 7) -> str:
    """Deterministic class of a trace row: a seeded hash, so every run picks the same."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    point = int.from_bytes(digest[:8], "big") / 2**64
    cumulative = 0.0
    for name, share in CLASS_MIX:
        cumulative += share
        if point < cumulative:
            return name
    return CLASS_MIX[-1][0]


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float
    input_tokens: int
    output_tokens: int


def sample_trace() -> Iterator[TraceRow]:
    path = resources.files("qosd.examples").joinpath("azure_conv_sample.csv")
    with path.open("r", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            yield TraceRow(
                float(row["arrival_s"]), int(row["input_tokens"]), int(row["output_tokens"])
            )


@dataclass
class ClassTally:
    offered: int = 0
    admitted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    waited_s: float = 0.0
    charged: float = 0.0
    refunded: float = 0.0


async def _one_request(
    qos: QosdClient,
    qos_class: str,
    row: TraceRow,
    speedup: float,
    tally: ClassTally,
    samples: list[LatencySample],
) -> tuple[str, str]:
    tally.offered += 1
    result = await qos.acquire(
        qos_class,
        row.input_tokens,
        model="default",
        expected_output_tokens=ESTIMATED_OUTPUT_TOKENS,
        tenant=f"tenant-{row.input_tokens % 7}",
    )
    tally.waited_s += result.waited_s
    if not result.admitted:
        tally.rejected[result.reason.name] += 1
        return qos_class, result.reason.name
    tally.admitted += 1
    tally.charged += result.tokens_charged
    # A toy cost model (the benchmark has the real one): prefill at 16K tokens/s,
    # then 25 ms per output token.
    ttft_ms = 30 + row.input_tokens / 16
    tpot_ms = 25 * random.uniform(0.9, 1.2)
    e2e_ms = ttft_ms + tpot_ms * row.output_tokens
    await asyncio.sleep(e2e_ms / 1000 / speedup)
    settled = await qos.release(result.lease_id, output_tokens=row.output_tokens)
    tally.refunded -= min(0.0, settled.adjustment)
    samples.append(
        LatencySample(
            "default",
            qos_class,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            e2e_ms=e2e_ms,
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            lease_id=result.lease_id,
        )
    )
    return qos_class, "ADMITTED"


async def _replay(address: str, seconds: float, speedup: float) -> dict[str, ClassTally]:
    tallies: dict[str, ClassTally] = defaultdict(ClassTally)
    samples: list[LatencySample] = []
    tasks: set[asyncio.Task[tuple[str, str]]] = set()
    async with QosdClient(address) as qos:
        started = time.monotonic()
        next_long = LONG_PROMPT_EVERY_S
        next_print = 2.0
        for index, row in enumerate(sample_trace()):
            at = row.arrival_s / speedup
            if at > seconds:
                break
            delay = at - (time.monotonic() - started)
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic() - started
            if now >= next_long:
                next_long += LONG_PROMPT_EVERY_S
                long_row = TraceRow(row.arrival_s, LONG_PROMPT_TOKENS, 200)
                task = asyncio.create_task(
                    _one_request(qos, "P1", long_row, speedup, tallies["P1 32K"], samples)
                )
                tasks.add(task)
            qos_class = class_for_row(index)
            task = asyncio.create_task(
                _one_request(qos, qos_class, row, speedup, tallies[qos_class], samples)
            )
            tasks.add(task)
            tasks = {t for t in tasks if not t.done()}
            if len(samples) >= 50:
                await qos.report(samples[:])
                samples.clear()
            if now >= next_print:
                next_print += 2.0
                line = "  ".join(
                    f"{name}: {t.admitted}/{t.offered} admitted"
                    for name, t in sorted(tallies.items())
                )
                pool = (await qos.status("default")).pool("default")
                queues = ", ".join(
                    f"{c.name} {c.waiting} (oldest {c.oldest_wait_s:.1f}s)"
                    for c in pool.classes
                    if c.waiting
                )
                print(f"t={now:4.1f}s  {line}  | waiting: {queues or 'none'}", flush=True)
        await asyncio.gather(*tasks)
        if samples:
            await qos.report(samples)
    return tallies


def _print_summary(config: Config, tallies: dict[str, ClassTally]) -> None:
    pool = config.pools[config.default_pool or next(iter(config.pools))]
    print()
    print(
        f"pool capacity {pool.capacity_tokens_s:,.0f} tokens/s; what a class leaves unused "
        "is shared, highest class first. Class budgets:"
    )
    for name, cls in sorted(config.classes.items(), key=lambda item: item[1].priority):
        rate = cls.share * pool.capacity_tokens_s
        burst = cls.burst_tokens or cls.burst_s * rate
        print(
            f"  {name}: {rate:>9,.0f} tokens/s assured, burst {burst:>8,.0f}, "
            f"max wait {cls.max_wait_ms} ms{', may borrow' if cls.can_borrow else ''}"
        )
    print()
    header = f"{'class':<8}{'offered':>8}{'admitted':>9}{'mean wait':>11}  rejected (reason: count)"
    print(header)
    print("-" * len(header))
    for name, tally in sorted(tallies.items()):
        mean_wait = tally.waited_s / tally.offered * 1000 if tally.offered else 0.0
        reasons = ", ".join(f"{r}: {n}" for r, n in tally.rejected.most_common()) or "-"
        print(f"{name:<8}{tally.offered:>8}{tally.admitted:>9}{mean_wait:>9.1f}ms  {reasons}")
    long_prompts = tallies.get("P1 32K")
    if long_prompts and long_prompts.rejected.get(Reason.COST_EXCEEDS_BURST.name):
        print(
            "\nThe 32K-token P1 prompts cost more than P1's burst, so qosd refuses them "
            "outright\n(COST_EXCEEDS_BURST) instead of letting one prefill stall every "
            "other decode.\nSet classes.P1.max_cost_tokens to admit them by borrowing "
            "against future refill."
        )


def run_demo(config: Config, *, seconds: float, speedup: float) -> int:
    """Starts ``qosd serve`` as a child process, replays the workload, prints a summary."""
    tree = config.model_dump(mode="json")
    store = f"redis {config.redis.url}" if config.redis.url else "embedded store"
    print(
        f"starting qosd ({store}) and replaying {seconds:.0f}s of the Azure conversation "
        f"trace at {speedup:.0f}x ..."
    )
    with daemon_processes(tree) as (daemon,):
        print(f"qosd pid {daemon.process.pid if daemon.process else '?'} on {daemon.address}")
        tallies = uvloop.run(_replay(daemon.address, seconds, speedup))
        code = daemon.terminate()
    _print_summary(config, tallies)
    print(f"\nqosd drained and exited with status {code}.")
    return 0 if code == 0 else 1
