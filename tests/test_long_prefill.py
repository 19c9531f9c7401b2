"""Long prompts that cannot stall P0: the learned threshold, and the gap rule.

The SLO loop learns from reports how long a prompt's prefill stalls an unchunked
server and how long a stall P0's requests can absorb (``qosd.control.prefill``); the stores
hold a longer prompt while P0 has requests in flight or waiting, so it waits for a
gap in P0's traffic, steps aside for the requests behind it, and is refused with
REASON_LONG_PREFILL if no gap comes within its max wait. The store-level rules run on
the embedded store, a standalone Redis and a 3-node cluster; the learning is checked
directly against the simulated GPU's own prefill formula.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from qosd.config import Config, SloConfig
from qosd.control.prefill import (
    USUAL_QUANTILE,
    PrefillModel,
    idle_tolerance_ms,
    learn,
    learn_prefill,
    stall_tolerance_ms,
)
from qosd.model import Outcome, PrefillLearned, StoredSample
from qosd.policy import PoolPolicy, resolve_pools
from qosd.store.embedded import EmbeddedStore
from qosd_client import LatencySample, QosdClient, Reason
from qosd_sim.gpu import GpuModel
from tests.conftest import BASE_CONFIG, DaemonFactory, RunningDaemon
from tests.waiting import eventually

THRESHOLD = 10_000
# Long prompts must be admissible at all: debt from a full bucket up to 40,000. The
# store-level tests set the threshold themselves, so the SLO loop (which would learn
# none from an empty window) is off.
LONG_OK: dict[str, Any] = {
    "classes": {name: {"max_cost_tokens": 40_000} for name in ("P0", "P1", "P2")},
    "control": {"enabled": False},
}


async def _with_threshold(make_daemon: DaemonFactory, extra: dict[str, Any]) -> RunningDaemon:
    running = await make_daemon(extra)
    admission = running.daemon.admission
    fixed = PrefillLearned(model=None, tolerance_ms=None, usual_tokens=0, fallback_tokens=THRESHOLD)
    assert await admission.store.set_prefill(admission.pool("default"), fixed) == THRESHOLD
    status = (await running.client.status("default")).pool("default")
    assert status.long_prefill_tokens == THRESHOLD
    return running


@pytest.mark.parametrize("gated", [False, True], ids=["buckets", "gated"])
async def test_a_long_prompt_waits_for_a_gap_in_p0(make_daemon: DaemonFactory, gated: bool) -> None:
    extra = dict(LONG_OK)
    if gated:  # P0's recent peak off: its gap is the moment it holds nothing
        extra = {**extra, "pools": {"default": {"max_in_flight": 8, "top_reserve_half_life_s": 0}}}
    qos = (await _with_threshold(make_daemon, extra)).client
    p0 = await qos.acquire("P0", 100, max_wait_ms=0)
    assert p0.admitted
    # P0 is in flight: a long prompt is refused at once when it may not wait ...
    refused = await qos.acquire("P1", 20_000, max_wait_ms=0)
    assert not refused.admitted and refused.reason is Reason.LONG_PREFILL
    assert "stall" in refused.message
    # ... and waits for the gap when it may.
    long = asyncio.create_task(qos.acquire("P1", 20_000, max_wait_ms=3_000))
    await _until_waiting(qos, "P1", 1)
    # Held, it steps aside: a short P1 request behind it goes at once.
    short = await qos.acquire("P1", 100, max_wait_ms=0)
    assert short.admitted
    assert not long.done()
    await qos.release(p0.lease_id)  # the gap
    admitted = await long
    assert admitted.admitted and admitted.waited_s > 0


async def test_a_gap_between_bursts_is_no_gap(make_daemon: DaemonFactory) -> None:
    """In a gated pool, P0's recent peak (half-life 60 s) judges the gap: once P0 has
    come, a long prompt is held after its requests end, since the next burst would
    arrive while it still prefills; a short one is not."""
    extra = {**LONG_OK, "pools": {"default": {"max_in_flight": 8}}}
    qos = (await _with_threshold(make_daemon, extra)).client
    burst = [await qos.acquire("P0", 100, max_wait_ms=0) for _ in range(3)]
    assert all(lease.admitted for lease in burst)
    for lease in burst:
        await qos.release(lease.lease_id)
    pool = (await qos.status("default")).pool("default")
    assert pool.cls("P0").in_flight == 0 and pool.cls("P0").waiting == 0
    refused = await qos.acquire("P1", 20_000, max_wait_ms=0)
    assert not refused.admitted and refused.reason is Reason.LONG_PREFILL
    assert (await qos.acquire("P1", 100, max_wait_ms=0)).admitted


async def test_no_gap_means_a_clear_refusal(make_daemon: DaemonFactory) -> None:
    qos = (await _with_threshold(make_daemon, LONG_OK)).client
    assert (await qos.acquire("P0", 100, max_wait_ms=0)).admitted  # never released
    result = await qos.acquire("P2", 12_000, max_wait_ms=300)
    assert not result.admitted and result.reason is Reason.LONG_PREFILL
    assert result.waited_s == pytest.approx(0.3, abs=0.2)
    assert "no gap" in result.message


async def test_prompts_within_the_threshold_and_quiet_pools_are_admitted(
    make_daemon: DaemonFactory,
) -> None:
    qos = (await _with_threshold(make_daemon, LONG_OK)).client
    long = await qos.acquire("P1", 20_000, max_wait_ms=0)  # no P0 anywhere: a gap
    assert long.admitted
    p0 = await qos.acquire("P0", 100, max_wait_ms=0)
    assert p0.admitted
    within = await qos.acquire("P2", THRESHOLD, max_wait_ms=0)  # not above it
    assert within.admitted
    # The top class's own long prompts are never held, even with P0 in flight: that
    # would only trade one P0 request for another. (The refund of another lease
    # leaves P0's bucket full: a cost above its burst needs a full bucket.)
    other = await qos.acquire("P0", 1, max_wait_ms=0)
    await qos.release(p0.lease_id, input_tokens=0)
    assert other.admitted
    deadline = time.monotonic() + 2.0
    while (await qos.status("default")).pool("default").cls("P0").tokens < 3_000:
        assert time.monotonic() < deadline  # 1 token at 6,000/s
        await asyncio.sleep(0.01)
    assert (await qos.acquire("P0", 20_000, max_wait_ms=0)).admitted


async def test_chunked_pools_learn_a_threshold_too(make_daemon: DaemonFactory) -> None:
    """A chunked server prefills oldest first, so a long prompt delays the first
    tokens of those behind it: the loop learns a threshold there as well."""
    config = {
        "pools": {"default": {"chunked_prefill": True}},
        "control": {"interval_s": 0.05, "leader_lease_s": 0.5},
        "classes": {"P0": {"slo": {"ttft_ms": 500, "tpot_ms": 50}}},
    }
    qos = (await make_daemon(config)).client
    await _report_gpu_like(qos, 200)
    deadline = time.monotonic() + 5.0
    while not (threshold := (await qos.status("default")).pool("default").long_prefill_tokens):
        assert time.monotonic() < deadline, "the loop never learned a threshold"
        await asyncio.sleep(0.05)
    assert 5_000 < threshold < 16_000  # the usual prompts (95 %) up to 8K, or P0's slack


async def test_servers_that_serve_p0_first_learn_a_threshold_too(
    make_daemon: DaemonFactory,
) -> None:
    """Where the servers schedule by priority, P0 goes before the prompts that wait,
    but not before the chunks of one that has started: a long prompt's chunks
    lengthen every pass while P0's streams decode. (On a bursty development seed, with
    no threshold on such servers, the 32K prompts cost P0 a fifth of its requests on
    time; ADR 13.) So the loop learns a threshold there as well."""
    config = {
        "pools": {"default": {"chunked_prefill": True, "servers_schedule_by_priority": True,
                              "max_in_flight": 100}},
        "control": {"interval_s": 0.05, "leader_lease_s": 0.5},
        "classes": {"P0": {"slo": {"ttft_ms": 500, "tpot_ms": 50}, "max_cost_tokens": 40_000}},
    }  # fmt: skip
    qos = (await make_daemon(config)).client
    await _report_gpu_like(qos, 200)
    deadline = time.monotonic() + 5.0
    while not (threshold := (await qos.status("default")).pool("default").long_prefill_tokens):
        assert time.monotonic() < deadline, "the loop never learned a threshold"
        await asyncio.sleep(0.05)
    assert 5_000 < threshold < 16_000  # the usual prompts (95 %) up to 8K, or P0's slack


async def test_the_loop_learns_the_threshold_from_reports(make_daemon: DaemonFactory) -> None:
    config = {
        "control": {"interval_s": 0.05, "leader_lease_s": 0.5},
        "classes": {"P0": {"slo": {"ttft_ms": 500, "tpot_ms": 50}}},
    }
    qos = (await make_daemon(config)).client
    await _report_gpu_like(qos, 200)
    deadline = time.monotonic() + 5.0
    while not (threshold := (await qos.status("default")).pool("default").long_prefill_tokens):
        assert time.monotonic() < deadline, "the loop never learned a threshold"
        await asyncio.sleep(0.05)
    # P0's samples could each have waited about 300 ms more (TTFT 200 ms against 500):
    # the simulated GPU prefills about 10K tokens in that time.
    assert 5_000 < threshold < 16_000  # the usual prompts (95 %) up to 8K, or P0's slack


def _blocking(by_priority: bool) -> dict[str, Any]:
    """A gated pool whose prefill is 0.03 ms a token (10,000 tokens: 300 ms), with a
    backlog bound of 20 ms and a blocked share of 0.1 whose bucket holds 300 ms: a
    10,000-token prompt blocks P0 for 280 ms, which the bucket refills in 2.8 s; a
    4,000-token one for 100 ms (1 s). P0's recent peak is off, so P0 has traffic
    while it holds a lease."""
    pool = {
        "max_in_flight": 8,
        "top_reserve": 0,
        "top_reserve_half_life_s": 0,
        "max_prefill_backlog_ms": 20,
        "max_prefill_share": 1.0,
        "max_top_blocked_share": 0.1,
        "top_blocked_burst_s": 0.3,
        "servers_schedule_by_priority": by_priority,
    }
    return {**LONG_OK, "pools": {"default": pool}}


async def _with_prefill_model(make_daemon: DaemonFactory, extra: dict[str, Any]) -> QosdClient:
    running = await make_daemon(extra)
    admission = running.daemon.admission
    learned = PrefillLearned(model=(0.0, 0.03, 0.0), tolerance_ms=None, usual_tokens=0)
    assert await admission.store.set_prefill(admission.pool("default"), learned) == 0
    return running.client


@pytest.mark.parametrize("by_priority", [False, True], ids=["oldest-first", "by-priority"])
async def test_long_prompts_block_p0_for_at_most_their_share(
    make_daemon: DaemonFactory, by_priority: bool
) -> None:
    """While P0 has traffic, a prompt below P0 whose prefill outlasts the backlog bound
    waits until the bucket of blocked time holds its block, and is told how long that
    is; a prompt that blocks P0 less goes first, past one queued before it; with no P0
    traffic only the backlog bound holds them. The same on servers that serve P0
    first: there the long prompt's chunks slow every pass P0's prompt shares with them
    (budget.lua: predict.top_blocked_us). A new pool's bucket is empty: it has earned
    no blocked time yet."""
    qos = await _with_prefill_model(make_daemon, _blocking(by_priority))
    p0 = await qos.acquire("P0", 100, max_wait_ms=0)
    assert p0.admitted
    early = await qos.acquire("P1", 10_000, max_wait_ms=0)
    assert not early.admitted and early.reason is Reason.LONG_PREFILL
    assert 2.0 <= early.retry_after_s <= 2.9  # 280 ms of block, earned at 0.1
    first = await qos.acquire("P2", 10_000, max_wait_ms=5_000)  # P2 may wait 5 s
    assert first.admitted  # once the bucket holds its block: nothing of it left
    refused = await qos.acquire("P2", 10_000, max_wait_ms=0)
    assert not refused.admitted and refused.reason is Reason.LONG_PREFILL
    assert 2.0 <= refused.retry_after_s <= 2.9  # 280 ms to refill at 0.1
    longer = asyncio.create_task(qos.acquire("P2", 10_000, max_wait_ms=10_000))
    await _until_waiting(qos, "P2", 1)
    shorter = asyncio.create_task(qos.acquire("P2", 4_000, max_wait_ms=10_000))
    await _until_waiting(qos, "P2", 2)
    done, _ = await asyncio.wait({longer, shorter}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {shorter} and shorter.result().admitted  # 100 ms of block: in 0.8 s
    assert not longer.done()
    await qos.release(p0.lease_id)  # no P0 traffic: nobody to block
    assert (await longer).admitted  # once the backlog is within the bound
    behind = await qos.acquire("P1", 10_000, max_wait_ms=0)
    assert not behind.admitted and behind.reason is Reason.RATE_LIMITED  # the bound alone


async def _until_waiting(qos: QosdClient, qos_class: str, count: int) -> None:
    deadline = time.monotonic() + 5.0
    while (await qos.status("default")).pool("default").cls(qos_class).waiting != count:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def _report_gpu_like(qos: QosdClient, count: int) -> None:
    """Samples as the simulated GPU would give them: P1 and P2 TTFT of their own
    prefill plus some queueing; P0 with short prompts, TTFT 200 ms, TPOT 30 ms."""
    gpu = GpuModel()
    rng = random.Random(3)
    samples = []
    for n in range(count):
        prompt = int(2 ** rng.uniform(9, 13))  # up to 8K: the tolerance decides
        ttft = gpu.prefill_s([prompt]) * 1000 * rng.uniform(1.0, 3.0)
        other = ("P1", "P2")[n % 2]
        samples.append(
            LatencySample(other_pool := "default", other, ttft_ms=ttft, tpot_ms=30,
                          e2e_ms=ttft + 3000, input_tokens=prompt, output_tokens=100)
        )  # fmt: skip
        samples.append(
            LatencySample(other_pool, "P0", ttft_ms=200, tpot_ms=30, e2e_ms=3200,
                          input_tokens=300, output_tokens=100)
        )  # fmt: skip
    await qos.report(samples)


def _prefill_ms(model: PrefillModel, tokens: float) -> float:
    """The model's prefill of a ``tokens`` prompt: c + a n + b n^2 ms, as the scripts
    apply it (formulas.lua, formula.prefill_ms)."""
    c, a, b = model.coefficients()
    return c + tokens * (a + b * tokens)


def _default_pool() -> PoolPolicy:
    return resolve_pools(Config.model_validate(BASE_CONFIG))["default"]


def _sample(prompt: int, ttft: float, tpot: float = 30.0, output: int = 100) -> StoredSample:
    return StoredSample(0, ttft, tpot, ttft + tpot * output, prompt, output, Outcome.OK, "")


def test_prefill_is_learned_from_the_fastest_ttfts() -> None:
    gpu = GpuModel()
    rng = random.Random(1)
    samples = []
    for _ in range(400):
        prompt = int(2 ** rng.uniform(8, 17))
        # Queueing and other prefills only add to a request's own prefill.
        samples.append(_sample(prompt, gpu.prefill_s([prompt]) * 1000 * rng.uniform(1, 4)))
    model = learn_prefill(samples)
    assert model is not None
    for prompt in (2_000, 32_768, 100_000):
        truth = gpu.prefill_s([prompt]) * 1000
        assert _prefill_ms(model, prompt) == pytest.approx(truth, rel=0.35)
    assert learn_prefill(samples[:10]) is None  # too little evidence


def test_the_tolerance_is_the_slack_p0_leaves() -> None:
    slo = SloConfig(ttft_ms=500, tpot_ms=50)
    # TTFT slack 300 ms; TPOT slack (50 - 30) x 99 = 1,980 ms: TTFT binds.
    samples = [_sample(300, 200.0) for _ in range(30)]
    assert stall_tolerance_ms(samples, slo) == pytest.approx(300)
    # A few short outputs bind harder: (50 - 45) x 9 = 45 ms for one in ten.
    samples += [_sample(300, 100.0, tpot=45.0, output=10) for _ in range(4)]
    assert stall_tolerance_ms(samples, slo) == pytest.approx(45)
    # On a chunked server a prefill delays first tokens only: TPOT slack does not count.
    assert stall_tolerance_ms(samples, slo, chunked=True) == pytest.approx(300)
    assert stall_tolerance_ms(samples[:5], slo) is None
    assert stall_tolerance_ms(samples, SloConfig()) is None  # no objectives


async def test_the_store_derives_the_threshold_from_the_model_and_tolerance() -> None:
    """The store's threshold is the prompt length whose predicted prefill equals the
    tolerance, none (0) when even an empty prompt takes longer, and the fallback when
    there is no model or no tolerance."""
    store, pool = EmbeddedStore(tombstone_ms=60_000), _default_pool()
    model = PrefillModel(5.0, 0.025, 1.1e-6)
    threshold = await store.set_prefill(pool, PrefillLearned(model.coefficients(), 2_000.0, 0))
    assert _prefill_ms(model, threshold) == pytest.approx(2_000)
    assert (await store.status(pool)).long_prefill_tokens == pytest.approx(threshold)
    # Even an empty prompt takes longer than 4 ms: no rule.
    assert await store.set_prefill(pool, PrefillLearned(model.coefficients(), 4.0, 0)) == 0
    assert (await store.status(pool)).long_prefill_tokens == 0
    for model_or_none, tolerance in ((None, 2_000.0), (model.coefficients(), None)):
        learned = PrefillLearned(model_or_none, tolerance, 0, fallback_tokens=7_000)
        assert await store.set_prefill(pool, learned) == 7_000


async def test_the_threshold_never_holds_the_pools_usual_prompts() -> None:
    slo = SloConfig(ttft_ms=500, tpot_ms=50)
    rng = random.Random(2)
    p0 = [_sample(300, 480.0) for _ in range(50)]  # P0 at its limit: 20 ms of slack
    others = [_sample(p, GpuModel().prefill_s([p]) * 1000) for p in
              (int(2 ** rng.uniform(9, 14)) for _ in range(200))]  # fmt: skip
    store, pool = EmbeddedStore(tombstone_ms=60_000), _default_pool()
    threshold = await store.set_prefill(pool, learn({"P0": p0, "P1": others}, "P0", slo))
    prompts = sorted(s.input_tokens for s in [*p0, *others])
    assert threshold == pytest.approx(prompts[int(USUAL_QUANTILE * len(prompts))])
    assert (await store.status(pool)).long_prefill_tokens == pytest.approx(threshold)


async def test_a_configured_threshold_holds_until_one_is_learned(
    make_daemon: DaemonFactory,
) -> None:
    config = {
        "pools": {"default": {"long_prefill_tokens": 5_000}},
        "control": {"interval_s": 0.05, "leader_lease_s": 0.5},
        "classes": {"P0": {"slo": {"ttft_ms": 500, "tpot_ms": 50}}},
    }
    qos = (await make_daemon(config)).client
    deadline = time.monotonic() + 5.0
    while (await qos.status("default")).pool("default").long_prefill_tokens != 5_000:
        assert time.monotonic() < deadline, "the configured threshold never took effect"
        await asyncio.sleep(0.05)
    await _report_gpu_like(qos, 200)  # evidence: the learned threshold replaces it
    while (await qos.status("default")).pool("default").long_prefill_tokens == 5_000:
        assert time.monotonic() < deadline + 5.0, "the learned threshold never replaced it"
        await asyncio.sleep(0.05)


async def test_a_configured_prefill_model_holds_until_one_is_learned(
    make_daemon: DaemonFactory,
) -> None:
    """The pool's ``prefill_model_ms`` (1 ms a token: far slower than the server the
    reports come from) stands in until the loop has learned the prefill from reports:
    from the loop's first turn, before any report, a 1,000-token prompt puts 1 s of
    predicted prefill in the backlog; once the samples are in, what the simulated GPU
    takes (about 60 ms)."""
    big = {"max_cost_tokens": 5_000}
    config = {
        "pools": {
            "default": {
                "max_in_flight": 10,
                "top_reserve": 0,
                "max_prefill_backlog_ms": 10_000,
                "max_prefill_share": 1.0,
                "prefill_model_ms": [0.0, 1.0, 0.0],
            }
        },
        "control": {"interval_s": 0.05, "leader_lease_s": 0.5},
        "classes": {"P0": {**big, "slo": {"ttft_ms": 500, "tpot_ms": 50}}, "P1": big, "P2": big},
    }
    running = await make_daemon(config)
    qos, admission = running.client, running.daemon.admission

    async def backlog_of_a_prompt_ms() -> float:
        lease = await qos.acquire("P1", 1_000, max_wait_ms=0)
        if not lease.admitted:  # before any model, only within P1's share of the rate
            return 0.0
        backlog = (await admission.store.status(admission.pool("default"))).prefill_backlog_ms
        await qos.release(lease.lease_id)  # the pool empties: the next starts from 0
        return backlog

    configured = await eventually(backlog_of_a_prompt_ms, lambda ms: ms >= 900, interval_s=0.05)
    assert 900 <= configured <= 1_000
    await _report_gpu_like(qos, 200)
    learned = await eventually(backlog_of_a_prompt_ms, lambda ms: 0 < ms < 300, interval_s=0.05)
    assert 0 < learned < 300


# -- an idle server takes a long prompt the top class can wait out ---------------------

IDLE_MODEL = (0.0, 0.25, 0.0)  # 0.25 ms a token: 12,000 tokens prefill in 3 s
#: A GPU-gated pool (whose stores keep the prefill clock), P0's recent peak off (its
#: gap is the moment it holds nothing), a backlog bound above these prompts.
GATED_LONG = {"max_in_flight": 8, "top_reserve_half_life_s": 0, "max_prefill_backlog_ms": 60_000}


async def _with_idle_threshold(make_daemon: DaemonFactory) -> RunningDaemon:
    """A threshold of 4,000 tokens (a stall of 1 s) and an idle threshold of 16,000
    (4 s: the stall the top class absorbs with nothing in prefill ahead of it)."""
    running = await make_daemon({**LONG_OK, "pools": {"default": GATED_LONG}})
    admission = running.daemon.admission
    learned = PrefillLearned(IDLE_MODEL, 1_000.0, 0, idle_tolerance_ms=4_000.0)
    assert await admission.store.set_prefill(admission.pool("default"), learned) == 4_000
    return running


async def _until_prefilled(running: RunningDaemon) -> None:
    """Until the prefill admitted is done, by the store's clock of it."""
    admission = running.daemon.admission
    pool = admission.pool("default")
    status = await eventually(lambda: admission.store.status(pool),
                              lambda s: s.prefill_backlog_ms <= 0, 5.0)  # fmt: skip
    assert status.prefill_backlog_ms <= 0


async def test_an_idle_server_takes_a_long_prompt_the_top_class_can_wait_out(
    make_daemon: DaemonFactory,
) -> None:
    """In a GPU-gated pool, with P0 in flight and no prefill admitted ahead, a prompt
    over the threshold but within the idle threshold goes in at once; the next one,
    behind its 3 s of prefill, is held as before; one over the idle threshold is held
    even at an idle server."""
    running = await _with_idle_threshold(make_daemon)
    qos = running.client
    assert (await qos.acquire("P0", 1, max_wait_ms=0)).admitted  # never released
    await _until_prefilled(running)  # P0's own prompt: a quarter of a millisecond
    beyond = await qos.acquire("P2", 20_000, max_wait_ms=0)
    assert not beyond.admitted and beyond.reason is Reason.LONG_PREFILL
    assert (await qos.acquire("P1", 12_000, max_wait_ms=0)).admitted
    behind = await qos.acquire("P2", 12_000, max_wait_ms=0)
    assert not behind.admitted and behind.reason is Reason.LONG_PREFILL


async def test_without_an_idle_threshold_the_gap_rule_holds_at_an_idle_server(
    make_daemon: DaemonFactory,
) -> None:
    running = await make_daemon({**LONG_OK, "pools": {"default": GATED_LONG}})
    admission = running.daemon.admission
    learned = PrefillLearned(IDLE_MODEL, 1_000.0, 0)  # no idle tolerance learned
    await admission.store.set_prefill(admission.pool("default"), learned)
    qos = running.client
    assert (await qos.acquire("P0", 1, max_wait_ms=0)).admitted
    await _until_prefilled(running)
    held = await qos.acquire("P1", 12_000, max_wait_ms=0)
    assert not held.admitted and held.reason is Reason.LONG_PREFILL


def test_the_idle_tolerance_is_the_slack_p0_would_have_alone() -> None:
    """Each P0 request's objective less its own prefill (100 ms a 1,000-token prompt
    here), at the tenth percentile: one in ten of 3,000 tokens leaves 200 ms."""
    slo = SloConfig(ttft_ms=500, tpot_ms=50)
    model = (0.0, 0.1, 0.0)
    samples = [_sample(1_000, 480.0) for _ in range(26)] + [_sample(3_000, 490.0)] * 4
    assert idle_tolerance_ms(samples, slo, model, chunked=True) == pytest.approx(200)
    # Unchunked, a prefill stalls P0's streams too: (50 - 45) x 9 = 45 ms for one in ten.
    samples += [_sample(1_000, 300.0, tpot=45.0, output=10)] * 4
    assert idle_tolerance_ms(samples, slo, model) == pytest.approx(45)
    assert idle_tolerance_ms(samples, slo, model, chunked=True) == pytest.approx(200)
    assert idle_tolerance_ms(samples[:5], slo, model) is None
    # Prompts too short to learn prefill from: by the operator's model, 500 - 20 ms.
    short = [_sample(200, 100.0) for _ in range(30)]
    learned = learn({"P0": short}, "P0", slo, chunked=True, fallback_model=model)
    assert learned.model == model and learned.idle_tolerance_ms == pytest.approx(480)
