"""Admission by deadline in a GPU-gated pool, on every backend (qosd/store/lua/pool/deadline.lua).

A request with a TTFT objective is due at its arrival plus that objective. Its class's
waiters go earliest due first (shortest prompt first among equals, once prefill is
predicted); with the pool's prefill model (stated here, as the SLO
loop would learn it: 1 ms per prompt token) its wait is its slack, and a request that
cannot be on time is refused at once with REASON_DEADLINE and the predicted wait,
or dropped from the queue as soon as it could no longer be on time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from qosd.model import PrefillLearned
from qosd_client import QosdClient, Reason
from tests.conftest import DaemonFactory, RunningDaemon
from tests.waiting import eventually

ONE_MS_PER_TOKEN = (0.0, 1.0, 0.0)  # the prefill model: base, per token, per token²


def gated(max_in_flight: int, backlog_ms: float = 10_000) -> dict[str, Any]:
    """A pool of ``max_in_flight`` slots, the prefill share off, the SLO loop off (the
    tests state the prefill model themselves)."""
    pool = {
        "max_in_flight": max_in_flight,
        "top_reserve": 0,
        "max_prefill_backlog_ms": backlog_ms,
        "max_prefill_share": 1.0,
    }
    big = {"max_cost_tokens": 5_000}  # prompts of seconds of prefill
    return {
        "pools": {"default": pool},
        "classes": {"P0": big, "P1": big, "P2": big},
        "control": {"enabled": False},
    }


async def with_prefill_model(running: RunningDaemon) -> None:
    admission = running.daemon.admission
    await admission.store.set_prefill(
        admission.pool("default"),
        PrefillLearned(model=ONE_MS_PER_TOKEN, tolerance_ms=None, usual_tokens=0),
    )


async def modelled_pool(make_daemon: DaemonFactory, **pool: object) -> QosdClient:
    """A daemon on a pool of 10 slots and a 100 ms backlog bound, with ``pool``'s
    settings and the prefill model; its client."""
    config = gated(max_in_flight=10, backlog_ms=100)
    config["pools"]["default"].update(pool)
    running = await make_daemon(config)
    await with_prefill_model(running)
    return running.client


async def waiting(qos: QosdClient, qos_class: str, count: int) -> None:
    async def read() -> int:
        return (await qos.status("default")).pool("default").cls(qos_class).waiting

    assert await eventually(read, lambda n: n == count) == count


async def served_first(
    qos: QosdClient, qos_class: str, earlier: dict[str, Any], later: dict[str, Any]
) -> str:
    """Queues one request of ``qos_class`` (``acquire``'s arguments), then another,
    behind a P2 lease holding the pool's one slot; frees the slot. Returns which of
    the two ("earlier" or "later") it admitted, after checking that the other is
    still waiting and goes next."""
    holder = await qos.acquire("P2", 10, max_wait_ms=0)
    assert holder.admitted
    tasks = {"earlier": asyncio.create_task(qos.acquire(qos_class, **earlier))}
    await waiting(qos, qos_class, 1)
    tasks["later"] = asyncio.create_task(qos.acquire(qos_class, **later))
    await waiting(qos, qos_class, 2)
    await qos.release(holder.lease_id)
    done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
    first = done.pop()
    name = next(n for n, task in tasks.items() if task is first)
    other = tasks["later" if name == "earlier" else "earlier"]
    assert first.result().admitted and not other.done()
    await qos.release(first.result().lease_id)
    assert (await other).admitted
    return name


async def test_among_equals_the_earliest_deadline_goes_first(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon(gated(max_in_flight=1))).client
    relaxed = {"input_tokens": 10, "slo_ttft_ms": 1_900}
    urgent = {"input_tokens": 10, "slo_ttft_ms": 1_500}
    assert await served_first(qos, "P1", relaxed, urgent) == "later"


async def test_among_equal_objectives_the_shortest_prompt_goes_first(
    make_daemon: DaemonFactory,
) -> None:
    """With a prefill model, a class's waiters go by due time plus their own prefill:
    a 20-token prompt queued after a 500-token one, both due in 3 s, goes first (a
    burst that cannot all be on time keeps the most on time by serving short ones)."""
    running = await make_daemon(gated(max_in_flight=1))
    await with_prefill_model(running)
    long = {"input_tokens": 500, "slo_ttft_ms": 3_000}
    short = {"input_tokens": 20, "slo_ttft_ms": 3_000}
    assert await served_first(running.client, "P1", long, short) == "later"


async def test_without_objectives_the_first_to_queue_goes_first(
    make_daemon: DaemonFactory,
) -> None:
    qos = (await make_daemon(gated(max_in_flight=1))).client  # P2 has no objective here
    patient = {"input_tokens": 10, "max_wait_ms": 5_000}
    hurried = {"input_tokens": 10, "max_wait_ms": 1_000}  # a shorter wait, queued later
    assert await served_first(qos, "P2", patient, hurried) == "earlier"


async def test_a_long_prompt_waits_its_slack_not_its_class_max_wait(
    make_daemon: DaemonFactory,
) -> None:
    """P0's max wait is 200 ms here; a P0 prompt of 100 tokens (100 ms of prefill) with
    a 3 s objective may wait 2.9 s once the pool can predict its prefill."""
    running = await make_daemon(gated(max_in_flight=1))
    qos = running.client
    holder = await qos.acquire("P2", 10, max_wait_ms=0)
    # Before the model is known: the class's max wait.
    before = await qos.acquire("P0", 100, slo_ttft_ms=3_000)
    assert not before.admitted and before.reason is Reason.QUEUE_TIMEOUT
    assert before.waited_s < 0.5
    await with_prefill_model(running)
    patient = asyncio.create_task(qos.acquire("P0", 100, slo_ttft_ms=3_000))
    await waiting(qos, "P0", 1)

    async def oldest_wait_s() -> float:
        return (await qos.status("default")).pool("default").cls("P0").oldest_wait_s

    assert await eventually(oldest_wait_s, lambda s: s >= 0.4) >= 0.4  # twice its max wait
    assert not patient.done()
    await qos.release(holder.lease_id)
    result = await patient
    # Past its class's max wait. (Not >= 0.4: the daemon times the wait from its own
    # clock, the status from the store's, and the two may differ by a millisecond.)
    assert result.admitted and result.waited_s >= 0.3


async def test_a_request_that_cannot_be_on_time_is_refused_with_the_predicted_wait(
    make_daemon: DaemonFactory,
) -> None:
    """1 s of prefill admitted ahead (a 1,000-token prompt) and a 100 ms backlog bound:
    a 10-token P0 request due in 300 ms would wait about 900 ms for the backlog to
    drain: refused at once, retry-after the predicted wait. Due in 3 s, it waits."""
    qos = await modelled_pool(make_daemon)
    assert (await qos.acquire("P1", 1_000, max_wait_ms=0)).admitted  # alone: 1 s ahead
    hopeless = await qos.acquire("P0", 10, slo_ttft_ms=300)
    assert not hopeless.admitted and hopeless.reason is Reason.DEADLINE
    assert hopeless.waited_s == 0  # refused without queueing
    assert 0.5 <= hopeless.retry_after_s <= 0.9  # 900 ms less the time since the P1
    assert "TTFT objective" in hopeless.message
    patient = await qos.acquire("P0", 10, slo_ttft_ms=3_000)
    assert patient.admitted and patient.waited_s >= 0.5


async def test_where_servers_serve_the_top_class_first_it_waits_behind_its_own_prefill(
    make_daemon: DaemonFactory,
) -> None:
    """With ``servers_schedule_by_priority``, the 1 s of P1 prefill that makes the test
    above refuse a P0 request due in 300 ms does not: the servers start it first, so it
    is admitted at once, past the 100 ms backlog bound too. The top class's own
    prefill still counts: behind 1 s of it, the same request is refused."""
    qos = await modelled_pool(make_daemon, servers_schedule_by_priority=True)
    assert (await qos.acquire("P1", 1_000, max_wait_ms=0)).admitted  # 1 s of P1 ahead
    passing = await qos.acquire("P0", 10, slo_ttft_ms=300)
    assert passing.admitted and passing.waited_s == 0
    assert (await qos.acquire("P0", 1_000, slo_ttft_ms=5_000)).admitted  # 1 s of P0 ahead
    hopeless = await qos.acquire("P0", 10, slo_ttft_ms=300)
    assert not hopeless.admitted and hopeless.reason is Reason.DEADLINE
    assert 0.5 <= hopeless.retry_after_s <= 1.0


async def test_where_prompts_share_passes_the_top_class_prefills_beside_its_own(
    make_daemon: DaemonFactory,
) -> None:
    """Chunked servers that serve the top class first cap each prompt's tokens per
    pass, so the prompts in prefill share every pass: behind 1 s of one P0 prompt, a
    10-token P0 request due in 300 ms starts beside it and is admitted at once (the
    test above refuses it where prompts go one after another). Each top-class lease
    in flight costs it up to three times its own prefill: a 100-token request, beside
    the two, would take 2 x 300 + 100 ms, and is refused for about the 500 ms its
    backlog holds it past the 100 ms bound."""
    qos = await modelled_pool(make_daemon, servers_schedule_by_priority=True, chunked_prefill=True)
    assert (await qos.acquire("P0", 1_000, slo_ttft_ms=5_000)).admitted  # 1 s of P0 ahead
    beside = await qos.acquire("P0", 10, slo_ttft_ms=300)
    assert beside.admitted and beside.waited_s == 0
    hopeless = await qos.acquire("P0", 100, slo_ttft_ms=300)
    assert not hopeless.admitted and hopeless.reason is Reason.DEADLINE
    assert 0.3 <= hopeless.retry_after_s <= 0.5


@pytest.mark.parametrize("servers", [1, 2])
async def test_with_two_servers_a_prompt_starts_on_the_one_free_of_prefill(
    make_daemon: DaemonFactory, servers: int
) -> None:
    """``servers: 2``: the servers take each prompt onto the first free of them, so
    the 1 s of P1 prefill that makes one server refuse a P0 request due in 300 ms
    holds one of two; the request starts on the other and is admitted at once. A
    second 1-s prompt fills that one too: then the same request is refused, for
    about the wait until the first of them is free. (A 2-s backlog bound, so that
    the prompts themselves go in.)"""
    qos = await modelled_pool(make_daemon, servers=servers, max_prefill_backlog_ms=2_000)
    assert (await qos.acquire("P1", 1_000, max_wait_ms=0)).admitted  # 1 s ahead
    first = await qos.acquire("P0", 10, slo_ttft_ms=300)
    assert first.admitted is (servers == 2)
    assert first.admitted or first.reason is Reason.DEADLINE
    if servers == 1:
        return
    assert (await qos.acquire("P1", 1_000, max_wait_ms=0)).admitted  # the other server
    hopeless = await qos.acquire("P0", 10, slo_ttft_ms=300)
    assert not hopeless.admitted and hopeless.reason is Reason.DEADLINE
    assert 0.5 <= hopeless.retry_after_s <= 1.0


@pytest.mark.parametrize("backend", ["redis", "cluster"], indirect=True)
async def test_replicas_that_count_fewer_servers_keep_the_earliest_clocks(
    make_daemon: DaemonFactory,
) -> None:
    """Replicas share a pool's clocks but each passes its own count of servers (a
    rollout that changes it). Three servers take 1, 2 and 3 s of prompts; a replica
    that counts two keeps the two earliest: a P0 request due in 300 ms is refused
    for the 1-s server's wait, not the 3-s one's. A replica that counts one drops the
    others' clocks; one that counts two again finds the second server idle."""

    async def replica(servers: int) -> QosdClient:
        return await modelled_pool(make_daemon, servers=servers, max_prefill_backlog_ms=5_000)

    three = await replica(3)
    for tokens in (1_000, 2_000, 3_000):
        assert (await three.acquire("P1", tokens, max_wait_ms=0)).admitted
    late = await (await replica(2)).acquire("P0", 10, slo_ttft_ms=300)
    assert not late.admitted and late.reason is Reason.DEADLINE
    assert late.retry_after_s <= 1.0
    assert (await (await replica(1)).acquire("P2", 10, max_wait_ms=0)).admitted
    on_time = await (await replica(2)).acquire("P0", 10, slo_ttft_ms=300)
    assert on_time.admitted and on_time.waited_s == 0


async def test_a_waiter_is_dropped_once_prefill_admitted_ahead_makes_it_late(
    make_daemon: DaemonFactory,
) -> None:
    """A P1 waiter due in 3 s behind 2.5 s of prefill could still be on time; then a
    P0 prompt of 1 s of prefill takes the next slot ahead of it, and it cannot: it is
    answered REASON_DEADLINE at once, not admitted late at the end of its wait."""
    running = await make_daemon(gated(max_in_flight=2))
    qos = running.client
    await with_prefill_model(running)
    assert (await qos.acquire("P2", 2_500, max_wait_ms=0)).admitted  # 2.5 s of prefill ahead
    holder = await qos.acquire("P2", 10, max_wait_ms=0)  # and the last slot
    assert holder.admitted
    p1 = asyncio.create_task(qos.acquire("P1", 10, slo_ttft_ms=3_000))
    await waiting(qos, "P1", 1)
    p0 = asyncio.create_task(qos.acquire("P0", 1_000, slo_ttft_ms=10_000))
    await waiting(qos, "P0", 1)
    await qos.release(holder.lease_id)
    assert (await p0).admitted  # the better class first: now 3.5 s of prefill ahead
    late = await p1
    assert not late.admitted and late.reason is Reason.DEADLINE
    assert late.waited_s < 2.0  # its slack was 2.99 s


def store_calls(running: RunningDaemon) -> dict[str, float]:
    registry = running.daemon.metrics.registry
    calls: dict[str, float] = {}
    for metric in registry.collect():
        if metric.name == "qosd_store_call_seconds":
            for sample in metric.samples:
                if sample.name.endswith("_count") and sample.value:
                    calls[sample.labels["call"]] = sample.value
    return calls


async def test_an_uncontended_acquire_by_deadline_is_one_store_call(
    make_daemon: DaemonFactory,
) -> None:
    """The deadline rules run inside the acquire script: with a prefill model and an
    objective, an Acquire that finds room is still one store call (on Redis, one
    EVALSHA: tests/test_redis_store.py counts the commands)."""
    running = await make_daemon(gated(max_in_flight=10))
    qos = running.client
    await with_prefill_model(running)
    assert (await qos.acquire("P0", 10, slo_ttft_ms=500)).admitted  # scripts loaded
    before = store_calls(running)
    result = await qos.acquire("P0", 100, slo_ttft_ms=500)
    after = store_calls(running)
    assert result.admitted
    changed = {call: after[call] - before.get(call, 0) for call in after}
    assert {call: n for call, n in changed.items() if n} == {"acquire": 1}


async def test_the_answer_carries_the_class_s_priority_for_the_servers(
    make_daemon: DaemonFactory,
) -> None:
    """A server that schedules by priority (vLLM --scheduling-policy priority) is told
    each request's class rank, lower first, admitted or queued-then-refused alike."""
    running = await make_daemon(gated(max_in_flight=10))
    qos = running.client
    ranks = {}
    for qos_class in ("P0", "P1", "P2"):
        result = await qos.acquire(qos_class, 10, max_wait_ms=0)
        assert result.admitted
        ranks[qos_class] = result.server_priority
    assert ranks == {"P0": 0, "P1": 1, "P2": 2}
    refused = await qos.acquire("P2", 6_000, max_wait_ms=0)  # above its max cost
    assert not refused.admitted and refused.server_priority == 2


async def test_an_empty_pool_owes_no_prefill(make_daemon: DaemonFactory) -> None:
    """A 1,000-token prompt puts 1 s of prefill ahead of the next request. Its lease
    ended early (cancelled, say): the servers hold nothing qosd admitted, so a P0
    request due in 300 ms is admitted, not refused for prefill no server has left."""
    qos = await modelled_pool(make_daemon)
    ahead = await qos.acquire("P1", 1_000, max_wait_ms=0)
    assert ahead.admitted
    hopeless = await qos.acquire("P0", 10, slo_ttft_ms=300)
    assert not hopeless.admitted and hopeless.reason is Reason.DEADLINE  # 1 s ahead of it
    await qos.release(ahead.lease_id)
    on_time = await qos.acquire("P0", 10, slo_ttft_ms=300, max_wait_ms=0)
    assert on_time.admitted


async def test_an_empty_pool_forgives_the_share_s_debt(make_daemon: DaemonFactory) -> None:
    """At a prefill share of one half, a 1,000-token prompt of a class below P0 holds
    the next one back for 2 s (its prefill counts twice on the share clock): a debt
    the streams in flight would repay by decoding slower. Once they have all ended,
    a prompt let into the empty pool does not keep the one after it out for the rest
    of that debt."""
    qos = await modelled_pool(make_daemon, max_prefill_share=0.5)
    first = await qos.acquire("P1", 1_000, max_wait_ms=0)
    assert first.admitted
    held_back = await qos.acquire("P2", 10, max_wait_ms=0)
    assert not held_back.admitted  # 2 s of share clock ahead of it
    await qos.release(first.lease_id)
    alone = await qos.acquire("P2", 10, max_wait_ms=0)
    assert alone.admitted  # an empty pool admits anyone
    beside = await qos.acquire("P2", 10, max_wait_ms=0)
    assert beside.admitted, beside  # 20 ms of share clock ahead, not 2 s
