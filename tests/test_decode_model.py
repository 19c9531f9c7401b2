"""Admission by predicted TPOT: the decode step by batch size, learned from reports
(qosd/control/decode.py), and the stores' use of it (lua/pool/budget.lua), on every
backend.

With a decode model, a prompt of a class below the top one is admitted at the prefill
share that keeps every stream in flight within its TPOT target (a stream's TPOT is
about step(B) / (1 - share)), and no new stream is admitted while the step of the
batch it would make passes a target in flight. Without one (none learned, or the
samples gone stale), the configured share rules, as before.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from qosd.control.decode import (
    MIN_SAMPLES,
    BatchHistory,
    DecodeModel,
    decode_points,
    learn_decode,
)
from qosd.model import Outcome, PrefillLearned, StoredSample
from qosd_client import Reason
from tests.conftest import DaemonFactory, RunningDaemon

ONE_MS_PER_TOKEN = (0.0, 1.0, 0.0)  # the prefill model: base, per token, per token²
#: P0's TPOT target, ms (its objective times control.tpot_target); P1's and P2's none.
P0_TARGET_MS = 40.0


def sample(at_ms: int, ttft_ms: float, tpot_ms: float, output: int) -> StoredSample:
    e2e = ttft_ms + tpot_ms * (output - 1)
    return StoredSample(at_ms, ttft_ms, tpot_ms, e2e, 500, output, Outcome.OK, "t")


# -- learning --------------------------------------------------------------------------


def test_the_fastest_steps_by_batch_give_the_step() -> None:
    """Points whose step is 12 + 0.1·B ms, most of them stretched by prefill the
    reports did not show (up to three times slower): the fit is the step itself."""
    rng = random.Random(7)
    points = []
    for _ in range(400):
        batch = rng.uniform(4, 120)
        stretch = 1.0 if rng.random() < 0.3 else 1 / (1 - rng.uniform(0, 0.66))
        points.append((batch, (12 + 0.1 * batch) * stretch))
    model = learn_decode(points)
    assert model is not None
    for batch in (8, 64, 120):
        assert model.step_ms(batch) == pytest.approx(12 + 0.1 * batch, rel=0.1)


def test_too_little_or_one_batch_size_learns_nothing() -> None:
    assert learn_decode([(10.0, 20.0)] * (MIN_SAMPLES - 1)) is None
    assert learn_decode([(10.0, 20.0)] * 100) is None  # one band: no slope
    two = learn_decode([(10.0, 20.0)] * 50 + [(60.0, 30.0)] * 50)
    assert two is not None
    assert two.base_ms == pytest.approx(18.0)
    assert two.per_sequence_ms == pytest.approx(0.2)


def test_a_step_that_shrinks_with_the_batch_is_taken_as_flat() -> None:
    model = learn_decode([(10.0, 40.0)] * 50 + [(60.0, 20.0)] * 50)
    assert model == DecodeModel(20.0, 0.0)


def test_a_report_decoded_in_the_mean_batch_of_its_decode() -> None:
    """The leader read 10, 30 and 50 leases in flight at 1 s, 2 s and 3 s. A request
    reported at 3 s that decoded from 1.6 s did so in the batch read at 1 s (in force
    when it began), then 30 and 50: a mean of 30. One that decoded within a turn, in
    the batch read just before; one whose decode began before the history did, in
    none known."""
    history = BatchHistory()
    for at, n in ((1000, 10), (2000, 30), (3000, 50)):
        history.record(at, n)
    whole = sample(3000, ttft_ms=100, tpot_ms=10, output=141)  # decode from 1600 ms
    brief = sample(2500, ttft_ms=100, tpot_ms=10, output=11)  # decode from 2400 ms
    early = sample(3000, ttft_ms=100, tpot_ms=10, output=300)  # decode from 10 ms
    errored = StoredSample(3000, 100, 10, 1500, 500, 141, Outcome.ERROR, "t")
    assert decode_points([whole, brief, early, errored], history) == [(30.0, 10), (30.0, 10)]


@pytest.mark.parametrize(("chunked", "step_ms"), [(False, 20.0), (True, 40 * (1 - 0.46))])
def test_a_reports_step_is_its_tpot_less_the_prefill_that_shared_its_decode(
    chunked: bool, step_ms: float
) -> None:
    """A request decoded from 1 s to 3 s at 40 ms a token while two requests with
    500-token prompts started (500 ms of prefill each, by a model of 1 ms a token):
    prefill took half its decode, so its step was 20 ms. Chunked, each prompt's pass
    also decoded a token (40 ms): 460 ms each, 46 %."""
    history = BatchHistory()
    for second in range(5):
        history.record(second * 1000, 20)
    decoding = StoredSample(3000, 100, 40.0, 2100, 100, 51, Outcome.OK, "t")
    # Started at 1.5 s and 2.5 s (reported at 4 s), and one before the decode began.
    others = [
        StoredSample(4000, 600, 10.0, 2500, 500, 2, Outcome.OK, "t"),
        StoredSample(4000, 600, 10.0, 1500, 500, 2, Outcome.OK, "t"),
        StoredSample(4000, 600, 10.0, 3500, 500, 2, Outcome.OK, "t"),
    ]
    points = decode_points([decoding, *others], history, float, chunked=chunked)
    assert points[0][0] == 20.0
    assert points[0][1] == pytest.approx(step_ms)


def test_on_several_servers_a_decode_shares_its_server_with_its_share_of_prompts() -> None:
    """The test above's decode and prompts, the pool's prompts spread over two
    servers: its own shared a quarter of its decode with prefill, not half, so its
    step was 30 ms. Counted whole, the step learned fast, and the stores let in
    streams that took P0 past its TPOT objective (2 upstreams, Azure 2x: 29 of P0's
    417 admitted requests)."""
    history = BatchHistory()
    for second in range(5):
        history.record(second * 1000, 20)
    decoding = StoredSample(3000, 100, 40.0, 2100, 100, 51, Outcome.OK, "t")
    others = [StoredSample(4000, 600, 10.0, at, 500, 2, Outcome.OK, "t") for at in (2500, 1500)]
    batch, step = decode_points([decoding, *others], history, float, servers=2)[0]
    assert batch == 20.0 and step == pytest.approx(30.0)


def test_the_history_forgets_past_its_horizon_and_keeps_order() -> None:
    history = BatchHistory(horizon_ms=2000)
    history.record(1000, 5)
    history.record(900, 7)  # a clock read that went back: ignored
    history.record(4000, 9)
    assert len(history) == 1
    assert history.mean_over(1500, 4000) is None  # before what it remembers
    assert history.mean_over(4000, 4500) == 9


# -- the stores apply it -----------------------------------------------------------------


#: Each "ms" of the store tests below is SCALE ms: prefill in seconds, steps and
#: targets alike (the shares are ratios), so that a busy machine's milliseconds
#: between two calls never decide a test.
SCALE = 100


def gated(prefill_share: float = 0.5) -> dict[str, Any]:
    """A pool of ten slots, a prefill backlog bound of 100 (scaled) ms at
    ``prefill_share``, the SLO loop off (the tests state the models themselves)."""
    pool = {
        "max_in_flight": 10,
        "top_reserve": 0,
        "max_prefill_backlog_ms": 100 * SCALE,
        "max_prefill_share": prefill_share,
    }
    big = {"max_cost_tokens": 50_000}  # prompts of seconds of prefill
    return {
        "pools": {"default": pool},
        "classes": {"P0": {"slo": {"ttft_ms": 60_000}, **big}, "P1": big, "P2": big},
        "control": {"enabled": False},
    }


async def learned(
    running: RunningDaemon, decode: tuple[float, float] | None, *, chunked: bool = True
) -> None:
    """States the prefill model (1 ms a token) and ``decode`` (base, per sequence, in
    scaled ms) of a server that chunks prefill (or, not ``chunked``, of one that does
    not), with P0's TPOT target of 40 scaled ms, as the SLO loop would."""
    admission = running.daemon.admission
    pool = admission.pool("default")
    targets = tuple(P0_TARGET_MS * SCALE if cls.name == "P0" else 0.0 for cls in pool.classes)
    await admission.store.set_prefill(
        pool,
        PrefillLearned(
            model=ONE_MS_PER_TOKEN,
            tolerance_ms=None,
            usual_tokens=0,
            decode=None if decode is None else (decode[0] * SCALE, decode[1] * SCALE),
            chunked=chunked,
            tpot_targets_ms=targets,
        ),
    )


async def admitted_prompts(running: RunningDaemon, count: int, ms: int) -> int:
    """How many of ``count`` P2 prompts of ``ms`` (scaled) ms of prefill go in at once,
    one after another."""
    qos = running.client
    admitted = 0
    for _ in range(count):
        result = await qos.acquire("P2", ms * SCALE, max_wait_ms=0)
        if result.admitted:
            admitted += 1
        else:
            assert result.reason is Reason.RATE_LIMITED
    return admitted


@pytest.mark.parametrize(("decode", "admitted"), [((10.0, 1.0), 3), (None, 2)])
async def test_without_streams_that_have_targets_lower_classes_prefill_at_full_share(
    make_daemon: DaemonFactory, decode: tuple[float, float] | None, admitted: int
) -> None:
    """No P0 stream in flight: P2's 50 ms prompts fill the 100 ms backlog on the real
    clock (three go in: 0, 50, 100 ms ahead; not at 150). Without a decode model the
    configured share of 0.5 counts each at 100 ms: two go in (0, 100; not at 200)."""
    running = await make_daemon(gated())
    await learned(running, decode=decode)
    assert await admitted_prompts(running, 5, 50) == admitted


@pytest.mark.parametrize(("chunked", "admitted"), [(False, 2), (True, 3)])
async def test_the_decode_model_sets_the_share_where_servers_chunk_prefill(
    make_daemon: DaemonFactory, chunked: bool, admitted: int
) -> None:
    """One P0 stream in flight and a step of 30 ms: prefill may take 1 - 30/40 = 25 %
    of the servers' time. Where the pass that prefills also decodes, a 40 ms prompt
    adds 40 - 30 = 10 ms to the streams' decode: 40 ms on the share clock, and three
    go in (at 0, 40 and 80 ms, on the real clock too). Where servers do not chunk
    prefill the model sets no share (budget.lua: share_model; ADR 17): the configured
    0.5 counts the prompt 80 ms, and two go in (at 0 and 80 ms)."""
    running = await make_daemon(gated())
    await learned(running, decode=(30.0, 0.0), chunked=chunked)
    assert (await running.client.acquire("P0", 1, max_wait_ms=0)).admitted
    assert await admitted_prompts(running, 5, 40) == admitted


async def test_below_the_top_class_the_real_prefill_backlog_bounds_admission_too(
    make_daemon: DaemonFactory,
) -> None:
    """No stream with a target, a step of 50 ms, chunked: a 100 ms prompt counts
    50 ms on the share clock, but 100 ms of prefill really wait at the servers, and
    the top class's next prompt waits behind them: the real clock bounds lower
    classes as well (0, 100, then 200 ms: two go in, not three)."""
    running = await make_daemon(gated())
    await learned(running, decode=(50.0, 0.0), chunked=True)
    assert await admitted_prompts(running, 5, 100) == 2


@pytest.mark.parametrize(("decode", "admitted"), [((20.0, 1.0), 2), ((30.0, 1.0), 1)])
async def test_a_p0_stream_in_flight_narrows_the_share_to_its_tpot(
    make_daemon: DaemonFactory, decode: tuple[float, float], admitted: int
) -> None:
    """One P0 stream in flight, a step of 20 + 1·B ms: a P2 prompt makes a batch of 2,
    a 22 ms step, so prefill may take 1 - 22/40 = 45 % of the servers' time, and a
    60 ms prompt, adding 60 - 22 = 38 ms to the streams' decode, counts 84 ms on the
    share clock (the next, at a batch of 3, 87 ms). A prompt goes in while the clock
    leads by at most the 100 ms bound: at 0 and 84 ms, and not at 171 (the real
    clock, at 60 and 120 ms, agrees). With a step of 30 + 1·B (1 - 32/40 = 20 %), the
    prompt counts 28 / 0.2 = 140 ms: one goes in."""
    running = await make_daemon(gated())
    await learned(running, decode=decode)
    assert (await running.client.acquire("P0", 1, max_wait_ms=0)).admitted
    assert await admitted_prompts(running, 5, 60) == admitted


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
@pytest.mark.parametrize("decode", [None, (20.0, 0.0)], ids=["no-decode-model", "step-20"])
async def test_a_first_token_comes_a_pass_after_the_prefill_alone(
    make_daemon: DaemonFactory, decode: tuple[float, float] | None, chunked: bool
) -> None:
    """A P0 prompt of 30 (scaled) ms of prefill, due in 40, onto an idle pool: on time
    by its prefill alone. With a decode step of 20 ms it is 10 ms late: where servers
    chunk prefill, the pass that carries its last chunk also decodes the batch; where
    they do not, its prefill pass waits out the decode step in progress as it
    arrives. Refused at once for its deadline, and due in 60 ms it is admitted
    (deadline.lua: first_pass_us)."""
    running = await make_daemon(gated())
    await learned(running, decode=decode, chunked=chunked)
    qos = running.client
    tight = await qos.acquire("P0", 30 * SCALE, slo_ttft_ms=40 * SCALE, max_wait_ms=0)
    if decode is None:
        assert tight.admitted
        return
    assert not tight.admitted and tight.reason is Reason.DEADLINE
    assert tight.waited_s == 0
    assert 5 * SCALE / 1000 <= tight.retry_after_s <= 10 * SCALE / 1000  # 10 ms late
    assert (await qos.acquire("P0", 30 * SCALE, slo_ttft_ms=60 * SCALE, max_wait_ms=0)).admitted


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
async def test_below_the_top_class_a_chunked_first_token_waits_out_the_pass_in_progress(
    make_daemon: DaemonFactory, chunked: bool
) -> None:
    """A P1 prompt of 30 (scaled) ms of prefill, due in 60, a decode step of 20 ms.
    Where servers chunk prefill it waits out the pass in progress and then ends in a
    pass that decodes the batch: 30 + 2 x 20 = 70 ms, 10 ms late, refused for its
    deadline; due in 80 it is admitted. Where they do not, its own prefill pass waits
    out the step in progress alone: 50 ms, admitted (ADR 17)."""
    running = await make_daemon(gated())
    await learned(running, decode=(20.0, 0.0), chunked=chunked)
    qos = running.client
    tight = await qos.acquire("P1", 30 * SCALE, slo_ttft_ms=60 * SCALE, max_wait_ms=0)
    if not chunked:
        assert tight.admitted
        return
    assert not tight.admitted and tight.reason is Reason.DEADLINE
    assert 5 * SCALE / 1000 <= tight.retry_after_s <= 10 * SCALE / 1000  # 10 ms late
    assert (await qos.acquire("P1", 30 * SCALE, slo_ttft_ms=80 * SCALE, max_wait_ms=0)).admitted


async def test_no_new_stream_while_its_step_would_pass_a_target_in_flight(
    make_daemon: DaemonFactory,
) -> None:
    """A step of 38 + 1·B ms and one P0 stream: a second stream would make the step
    40 ms, at the target; a third, 41 ms, past it: refused for room. P0 itself is not
    held by the prediction (its slots and backlog bound it). Once the P0 stream ends,
    no target is in flight, and P2 goes in again."""
    running = await make_daemon(gated(prefill_share=1.0))
    await learned(running, decode=(38.0, 1.0))
    qos = running.client
    top = await qos.acquire("P0", 1, max_wait_ms=0)
    assert top.admitted
    assert (await qos.acquire("P2", 1, max_wait_ms=0)).admitted  # batch of 2: 40 ms
    refused = await qos.acquire("P2", 1, max_wait_ms=0)  # batch of 3: 41 ms
    assert not refused.admitted and refused.reason is Reason.RATE_LIMITED
    assert (await qos.acquire("P0", 1, max_wait_ms=0)).admitted
    await qos.release(top.lease_id)
    # One P0 stream still in flight (the second): still held.
    assert not (await qos.acquire("P2", 1, max_wait_ms=0)).admitted


@pytest.mark.parametrize(("half_life_s", "admitted"), [(60.0, False), (0.0, True)])
async def test_the_top_class_s_recent_peak_counts_in_the_batch(
    make_daemon: DaemonFactory, half_life_s: float, admitted: bool
) -> None:
    """A step of 38 + 1·B ms. P0 had two streams and holds one: a P2 stream decodes
    for seconds, and P0's next burst joins its batch, so it is predicted at a batch of
    three (its own, P0's, and P0's peak less what P0 holds): 41 ms, past the 40 ms
    target, refused. With P0's peak off (a half-life of 0), the batch is two, 40 ms:
    admitted."""
    config = gated(prefill_share=1.0)
    config["pools"]["default"]["top_reserve_half_life_s"] = half_life_s
    running = await make_daemon(config)
    await learned(running, decode=(38.0, 1.0))
    qos = running.client
    first = await qos.acquire("P0", 1, max_wait_ms=0)
    second = await qos.acquire("P0", 1, max_wait_ms=0)
    assert first.admitted and second.admitted
    await qos.release(second.lease_id)
    result = await qos.acquire("P2", 1, max_wait_ms=0)
    assert result.admitted is admitted
    if not admitted:
        assert result.reason is Reason.RATE_LIMITED


async def test_the_share_never_falls_below_its_floor(make_daemon: DaemonFactory) -> None:
    """A step of 39 ms beside a P0 stream: the share that keeps 40 ms would be 2.5 %,
    and a 44 ms prompt, adding 5 ms to the streams' decode, would count 200 ms; the
    floor of 5 % counts it 100 ms, so lower classes still progress: two go in (at 0
    and 100 ms; not at 200), not one."""
    running = await make_daemon(gated())
    await learned(running, decode=(39.0, 0.0))
    assert (await running.client.acquire("P0", 1, max_wait_ms=0)).admitted
    assert await admitted_prompts(running, 4, 44) == 2


async def test_a_model_withdrawn_gives_the_configured_rules_back(
    make_daemon: DaemonFactory,
) -> None:
    """The loop withdraws the decode model when its samples go stale (too few fresh
    ones learn none): the stores fall back to today's rules at once, and a step of
    38 + 1·B ms no longer holds P2's third stream beside a P0 one."""
    running = await make_daemon(gated())
    await learned(running, decode=(38.0, 1.0))
    await learned(running, decode=None)
    assert (await running.client.acquire("P0", 1, max_wait_ms=0)).admitted
    assert await admitted_prompts(running, 5, 1) == 5
