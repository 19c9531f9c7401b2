"""The decode step learned from the servers' own pass counters (qosd/control/passes.py):
vLLM's ``vllm:iteration_tokens_total`` and token counters, read by ``qosd scrape``
(qosd_client/server_load.py), reported as ``ServerLoad.passes``, kept by every store,
and fitted by the SLO loop's leader, which prefers them to the reports.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from qosd.control.passes import MAX_AGE_MS, MIN_READS, learn_from_passes, read_interval_ms
from qosd.model import PassRead
from qosd_client import PassStats, Reason, ServerLoad
from qosd_client.engine_metrics import PROFILES, EngineMetricsScraper
from qosd_client.server_load import parse_pass_counts, passes_between, to_report
from qosd_client.types import LatencySample
from qosd_sim.experiment import MODEL
from qosd_sim.gpu import GpuModel, Sequence, TokenEvent, TokenKind
from qosd_sim.openai_experiment import vllm_process
from qosd_sim.server import EnginePassCounters
from tests.conftest import DaemonFactory, RunningDaemon
from tests.test_engine_scrape import _completions
from tests.test_json_api import post

NOW_MS = 10_000_000


def read(at_ms: int, batch: float, prefill: float, step_ms: float, passes: int = 100) -> PassRead:
    """A read of ``passes`` passes that decoded ``batch`` and prefilled ``prefill``
    tokens each, at ``step_ms``."""
    return PassRead(at_ms, "s", passes, round(prefill * passes), round(batch * passes), step_ms)


# -- learning ----------------------------------------------------------------------------


def test_the_step_is_fitted_apart_from_the_prefill_the_passes_carried() -> None:
    """Reads whose passes take 12 + 0.1·B + 0.02·P ms, within 3 % noise: the decode
    model is 12 + 0.1·B, though most reads carried prefill that lengthened them."""
    rng = random.Random(3)
    reads = []
    for i in range(40):
        batch, prefill = rng.uniform(4, 120), rng.choice([0.0, rng.uniform(50, 400)])
        step = (12 + 0.1 * batch + 0.02 * prefill) * rng.uniform(0.97, 1.03)
        reads.append(read(NOW_MS - i * 5000, batch, prefill, step))
    fit = learn_from_passes(reads, NOW_MS)
    assert fit is not None and fit.reads == 40
    for batch in (8, 64, 120):
        assert fit.decode().step_ms(batch) == pytest.approx(12 + 0.1 * batch, rel=0.05)
    assert fit.per_prefill_token_ms == pytest.approx(0.02, rel=0.15)
    # Each server's pass carries its share of the pool's leases in flight: on four
    # servers, a batch of 64 leases is a pass of 16 sequences.
    assert fit.decode(servers=4).step_ms(64) == pytest.approx(fit.decode().step_ms(16))


def test_a_sequence_costs_at_least_a_prompt_token() -> None:
    """Where load moves the batch and the prefill together, a fit could put the whole
    cost on the prompt tokens and none on the sequences; a decoding sequence adds a
    token to a pass as a prompt token does, so then the two share one cost."""
    reads = [read(NOW_MS - i, b, 3 * b, 10 + 0.04 * b + 0.06 * 3 * b)
             for i, b in enumerate(range(10, 130, 10))]  # fmt: skip
    # Collinear: no three-way fit; one cost per token, batch and prompt alike.
    fit = learn_from_passes(reads, NOW_MS)
    assert fit is not None
    assert fit.per_sequence_ms == pytest.approx(fit.per_prefill_token_ms)
    assert fit.per_sequence_ms >= 0.04
    assert fit.decode().step_ms(0) == pytest.approx(10, abs=0.5)


def test_prompts_that_prefill_across_reads_leave_the_step_to_the_reports() -> None:
    """A prompt's tokens count in the read where its prefill ends: where the pool's
    usual long prompt takes more than a tenth of a read's interval, the counts cannot
    tell its prefill from the decode, and the passes teach nothing."""
    reads = [read(NOW_MS - i * 5000, 10 + 5 * i, 0, 12 + 0.5 * i) for i in range(MIN_READS)]
    assert learn_from_passes(reads, NOW_MS, usual_prefill_ms=400.0) is not None
    assert learn_from_passes(reads, NOW_MS, usual_prefill_ms=600.0) is None
    alone = [dataclasses.replace(r, server=f"s{i}") for i, r in enumerate(reads)]
    assert learn_from_passes(alone, NOW_MS) is None  # no server read twice: no interval


def test_too_few_reads_one_batch_size_or_stale_reads_learn_nothing() -> None:
    fresh = [read(NOW_MS - i, 10 + 5 * i, 0, 12 + 0.5 * i) for i in range(MIN_READS)]
    assert learn_from_passes(fresh, NOW_MS) is not None
    assert learn_from_passes(fresh[:-1], NOW_MS) is None  # too few
    one_size = [read(NOW_MS - i, 10, 0, 12 + 0.1 * i) for i in range(20)]
    assert learn_from_passes(one_size, NOW_MS) is None  # no slope to learn
    assert learn_from_passes(fresh, NOW_MS + MAX_AGE_MS + MIN_READS) is None  # all stale
    shrinking = [read(NOW_MS - i, 10 + 5 * i, 0, 40 - i) for i in range(MIN_READS)]
    assert learn_from_passes(shrinking, NOW_MS) is None  # faster with more: noise


# -- scraping ----------------------------------------------------------------------------


def vllm_counters(passes: list[tuple[int, int, list[float]]]) -> str:
    """vLLM V1's pass counters by its names and types, for passes of (prompt tokens
    finished, tokens generated, gaps between tokens in seconds), over two engines of a
    data-parallel server (the second runs a copy of each pass)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    iteration = Histogram("vllm:iteration_tokens_total", "", labels, registry=registry,
                          buckets=[1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048])  # fmt: skip
    prompt = Counter("vllm:prompt_tokens", "", labels, registry=registry)
    generated = Counter("vllm:generation_tokens", "", labels, registry=registry)
    gaps = Histogram("vllm:inter_token_latency_seconds", "", labels, registry=registry)
    for engine in ("0", "1"):
        gaps.labels("llm", engine)  # every series from the start, as vLLM makes them
        for prompt_tokens, tokens, token_gaps in passes:
            iteration.labels("llm", engine).observe(prompt_tokens + tokens)
            prompt.labels("llm", engine).inc(prompt_tokens)
            generated.labels("llm", engine).inc(tokens)
            for gap in token_gaps:
                gaps.labels("llm", engine).observe(gap)
    return generate_latest(registry).decode()


def test_a_servers_passes_are_the_differences_of_its_counters() -> None:
    before = parse_pass_counts(vllm_counters([(100, 1, [])]))
    after = parse_pass_counts(vllm_counters([(100, 1, []), (0, 2, [0.02, 0.02]),
                                             (300, 2, [0.04, 0.04])]))  # fmt: skip
    stats = passes_between(before["llm"], after["llm"])
    # Two more passes on each of two engines: 4 passes, 8 tokens, 600 prompt tokens,
    # and a mean gap of 30 ms.
    assert stats is not None and (stats.passes, stats.prefill_tokens, stats.decode_tokens) == (
        4,
        600,
        8,
    )
    assert stats.step_ms == pytest.approx(30.0)
    assert passes_between(after["llm"], before["llm"]) is None  # restarted: counts fell
    assert passes_between(after["llm"], after["llm"]) is None  # no pass decoded
    assert parse_pass_counts("# TYPE vllm:num_requests_waiting gauge\n") == {}
    # With no gauge the daemon uses, a load is still reported for its passes.
    assert to_report({}, "vllm-0", {"llm": stats}) == [ServerLoad("llm", "vllm-0", passes=stats)]


async def test_the_scraper_reports_what_sim_vllm_s_passes_carried(tmp_path: Path) -> None:
    """``qosd sim-vllm`` counts its passes as vLLM V1 does: between two reads, five
    requests of four prompt tokens and six output tokens are 20 prompt tokens and 30
    generated, over at least six passes, each stream's tokens a pass apart."""
    handed: list[list[ServerLoad]] = []

    async def on_loads(loads: list[ServerLoad]) -> None:
        handed.append(loads)

    class Discard:
        def record(self, sample: LatencySample) -> None:
            pass

    with vllm_process(GpuModel(speed=20.0), tmp_path) as url:
        scraper = EngineMetricsScraper(PROFILES["vllm"], f"{url}/metrics", Discard(), {},
                                       server="vllm-0", on_loads=on_loads)  # fmt: skip
        async with aiohttp.ClientSession() as session:
            await scraper.scrape_once(session)  # the baseline
            assert scraper.last_passes == {}
            await _completions(url, 5)
            await scraper.scrape_once(session)
    stats = scraper.last_passes[MODEL]
    assert (stats.prefill_tokens, stats.decode_tokens) == (20, 30)
    assert 6 <= stats.passes <= 30 and stats.step_ms > 0
    assert handed[-1][0].passes == stats and handed[-1][0].server == "vllm-0"


# -- the stores keep them, and the leader learns from them -------------------------------


def chunked_pool(**extra: Any) -> dict[str, Any]:
    pool = {"max_in_flight": 100, "chunked_prefill": True, "prefill_model_ms": [0.0, 0.1, 0.0]}
    return {"pools": {"default": {**pool, **extra}}, "control": {"enabled": False}}


async def test_passes_are_validated_kept_and_read_back_newest_first(
    make_daemon: DaemonFactory,
) -> None:
    running = await make_daemon(chunked_pool())
    qos = running.client
    good = [PassStats(100, 0, 1200, 14.5), PassStats(90, 4096, 900, 30.25)]
    result = await qos.report(
        [],
        loads=[
            ServerLoad("llama-3-8b", "a", waiting_requests=0, passes=good[0]),
            ServerLoad("llama-3-8b", "b", passes=good[1]),
            ServerLoad("llama-3-8b", "c", passes=PassStats(0, 0, 10, 14.0)),
            ServerLoad("llama-3-8b", "d", passes=PassStats(10, -1, 10, 14.0)),
            ServerLoad("llama-3-8b", "e", passes=PassStats(10, 0, 10, float("nan"))),
            ServerLoad("llama-3-8b", "f", passes=PassStats(10, 0, 10, 61_000.0)),
        ],
    )
    assert result.loads_accepted == 2
    reasons = dict(result.loads_rejected)
    assert reasons[2].startswith("passes.passes must be between 1")
    assert reasons[3].startswith("passes.prefill_tokens must be between 0")
    assert reasons[4].startswith("passes.step_ms") and reasons[5].startswith("passes.step_ms")
    admission = running.daemon.admission
    kept = await admission.store.passes(admission.pool("default"))
    assert [(r.server, r.passes, r.prefill_tokens, r.decode_tokens, r.step_ms) for r in kept] == [
        ("b", 90, 4096, 900, 30.25),
        ("a", 100, 0, 1200, 14.5),
    ]
    assert kept[0].at_ms >= kept[1].at_ms > 0  # stamped by the store's clock


async def report_reads(running: RunningDaemon) -> None:
    """Reads of two servers at batches 4 to 4·MIN_READS, passes of 12 + 0.25·B ms,
    each server's reads stamped apart (a read's interval is known)."""
    admission = running.daemon.admission
    for b in range(4, 4 + 4 * MIN_READS, 4):
        stats = PassStats(100, 0, 100 * b, 12 + 0.25 * b)
        await running.client.report([], loads=[ServerLoad("llama-3-8b", f"s{b % 8}", passes=stats)])
    while read_interval_ms(await admission.store.passes(admission.pool("default"))) is None:
        await running.client.report([], loads=[ServerLoad("llama-3-8b", "s0", passes=stats)])


async def test_the_leader_learns_the_step_from_passes_before_reports(
    make_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """With no reports, the leader of a chunked pool learns its decode step from the
    servers' passes: 12 ms + 0.25 ms a sequence; without passes, nothing."""
    running = await make_daemon(chunked_pool())
    controller = running.daemon.controller
    caplog.set_level(logging.INFO, logger="qosd.control.leader")
    await controller.tick(5000)
    assert "decode step" not in caplog.text  # no reports, no passes: nothing learned
    await report_reads(running)
    await controller.tick(5000)
    assert "a decode step takes 12.0 ms + 0.250 ms a sequence (from the servers' passes)" in (
        caplog.text
    )


async def test_an_unchunked_pool_learns_the_step_a_first_token_waits_out(
    make_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """An unchunked pool learns its step from passes too, 12 ms + 0.25 ms a sequence,
    for the decode step in progress that a prompt's prefill pass waits out (ADR 17;
    it keeps its configured prefill share, ADR 13). A P0 prompt of 490 tokens, by a
    configured 1 ms a token, prefills in 490 ms: on time for 500 ms by its prefill
    alone, 2.25 ms late with the step of a batch of one: refused for its deadline.
    One of 480 tokens is admitted."""
    running = await make_daemon(
        chunked_pool(chunked_prefill=False, prefill_model_ms=[0.0, 1.0, 0.0])
    )
    caplog.set_level(logging.INFO, logger="qosd.control.leader")
    await report_reads(running)
    await running.daemon.controller.tick(5000)
    assert "a decode step takes 12.0 ms + 0.250 ms a sequence" in caplog.text
    qos = running.client
    late = await qos.acquire("P0", 490, slo_ttft_ms=500, max_wait_ms=0)
    assert not late.admitted and late.reason is Reason.DEADLINE
    assert (await qos.acquire("P0", 480, slo_ttft_ms=500, max_wait_ms=0)).admitted


async def test_passes_come_through_the_json_door_checked_as_over_grpc(
    make_daemon: DaemonFactory,
) -> None:
    """curl posts a load with passes to /v1/report: one well formed is kept, one with
    a step of "NaN" is rejected naming passes.step_ms, and a string for a count is a
    400 naming the field."""
    running = await make_daemon({**chunked_pool(), "server": {"http_listen": "127.0.0.1:0"}})
    assert running.daemon.http is not None
    base = f"http://{running.daemon.http.address}"
    good = {"passes": 50, "prefill_tokens": 0, "decode_tokens": 400, "step_ms": 18.5}
    body = {"loads": [
        {"model": "llama-3-8b", "server": "v0", "passes": good},
        {"model": "llama-3-8b", "server": "v1", "passes": {**good, "step_ms": "NaN"}},
    ]}  # fmt: skip
    code, answer = await post(base, "/v1/report", json.dumps(body))
    assert code == 200 and answer["loads_accepted"] == 1
    (rejected,) = answer["loads_rejected"]
    assert rejected["index"] == 1 and rejected["reason"].startswith("passes.step_ms")
    admission = running.daemon.admission
    (kept,) = await admission.store.passes(admission.pool("default"))
    assert (kept.server, kept.passes, kept.decode_tokens, kept.step_ms) == ("v0", 50, 400, 18.5)
    bad = {"loads": [{"model": "llama-3-8b", "server": "v2", "passes": {"passes": "many"}}]}
    code, answer = await post(base, "/v1/report", json.dumps(bad))
    assert code == 400 and "passes" in json.dumps(answer)


def test_the_replay_s_server_counts_its_passes_as_vllm_does() -> None:
    """qosd_sim's pass counter, which the replay reports with ``--engine-passes``: a
    prompt's tokens in the pass that finishes its prefill, every token generated, and
    a gap of one pass for each token after a stream's first."""
    counter = EnginePassCounters()
    assert counter.take() is None
    one, two = Sequence("a", 300, 4, 0.0), Sequence("b", 20, 4, 0.0)
    counter.record([TokenEvent(one, TokenKind.FIRST, False, 1)], 0.05)
    counter.record([TokenEvent(one, TokenKind.NEXT, False, 2),
                    TokenEvent(two, TokenKind.FIRST, False, 1)], 0.02)  # fmt: skip
    counter.record([TokenEvent(one, TokenKind.NEXT, False, 3),
                    TokenEvent(two, TokenKind.NEXT, False, 2)], 0.03)  # fmt: skip
    stats = counter.take()
    assert stats is not None
    assert (stats.passes, stats.prefill_tokens, stats.decode_tokens) == (3, 320, 5)
    assert stats.step_ms == pytest.approx((20 + 30 + 30) / 3)
    assert counter.take() is None  # nothing since
