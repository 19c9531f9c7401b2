"""Bucket and lease semantics, run unchanged against every backend.

Each test starts a daemon on the embedded store, a standalone Redis or a 3-node
Redis Cluster (see ``conftest.backend``) and talks to it over gRPC on a real socket.
Refill between two calls is real time, so assertions allow for the refill that a
slow machine can add between calls (``slack``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from qosd.model import LeaseSpec, UsageReport
from qosd.model import Outcome as SettledAs
from qosd_client import (
    DuplicateRequestId,
    InvalidRequest,
    LatencySample,
    LeaseExpired,
    LeaseNotFound,
    Outcome,
    Reason,
    Rejected,
)
from tests.conftest import DaemonFactory, merge
from tests.waiting import eventually

#: BASE_CONFIG's bursts (P0 3,000, P1 1,500, P2 500) refilled at a hundredth of its
#: rates: 300 tokens take P0 5 s, not 50 ms, however slowly a busy machine makes the
#: calls, for tests that tell a refund or a second charge from refill.
SLOW_REFILL: dict[str, Any] = {
    "pools": {"default": {"capacity_tokens_s": 100}},
    "classes": {name: {"burst_s": 50} for name in ("P0", "P1", "P2")},
}


def slack(rate: float, seconds: float) -> float:
    """Tokens a bucket may refill while a test moves between two calls."""
    return rate * seconds


async def test_fresh_bucket_starts_full_and_charges_cost(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    result = await qos.acquire("P1", 400, model="llama-3-8b")
    assert result.admitted and result.reason is Reason.NONE
    assert result.tokens_charged == 400
    assert result.remaining_tokens == pytest.approx(1500 - 400)
    assert result.pool == "default"
    assert result.lease_id.startswith("default:P1:")
    assert result.lease_ttl_s == pytest.approx(300)


async def test_refill_over_time(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    drained = await qos.acquire("P1", 1500, max_wait_ms=0)  # the whole burst
    assert drained.admitted
    started = time.monotonic()
    refused = await qos.acquire("P1", 600, max_wait_ms=0)
    assert not refused.admitted and refused.reason is Reason.RATE_LIMITED
    # 600 tokens at 3,000/s take 200 ms to refill (less whatever refilled already).
    assert 0.1 <= refused.retry_after_s <= 0.2 + 0.001
    await asyncio.sleep(0.25)
    later = await qos.acquire("P1", 600, max_wait_ms=0)
    elapsed = time.monotonic() - started
    assert later.admitted
    assert later.remaining_tokens == pytest.approx(
        min(1500, 3000 * elapsed) - 600, abs=slack(3000, 0.05) + 3000 * 0.05
    )


async def test_burst_caps_the_bucket(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    await qos.acquire("P2", 100, max_wait_ms=0)
    await asyncio.sleep(0.6)  # far more than the 0.1 s needed to refill 100 at 1,000/s
    result = await qos.acquire("P2", 1, max_wait_ms=0)
    assert result.admitted
    assert result.remaining_tokens == pytest.approx(499)  # burst 500, never above


async def test_cost_is_input_times_class_weight(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"classes": {"P1": {"weight": 2.5}}})).client
    result = await qos.acquire("P1", 100, expected_output_tokens=40)
    assert result.tokens_charged == pytest.approx(250)
    assert result.remaining_tokens == pytest.approx(1500 - 250, abs=1e-6)


async def test_output_weight_prices_expected_output(make_daemon: DaemonFactory) -> None:
    qos = (
        await make_daemon({"classes": {"P1": {"weight": 2.0}}, "cost": {"output_weight": 1}})
    ).client
    result = await qos.acquire("P1", 100, expected_output_tokens=40)
    assert result.tokens_charged == pytest.approx((100 + 40) * 2.0)


async def test_cost_above_burst_is_rejected_at_once(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    result = await qos.acquire("P2", 501, max_wait_ms=5_000)
    assert not result.admitted
    assert result.reason is Reason.COST_EXCEEDS_BURST
    assert result.retry_after_s == 0
    assert result.waited_s == 0
    assert result.tokens_charged == 501
    after = await qos.acquire("P2", 500, max_wait_ms=0)  # the bucket was not touched
    assert after.admitted and after.remaining_tokens == pytest.approx(0, abs=1)


async def test_oversized_cost_borrows_only_from_a_full_bucket(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"classes": {"P2": {"max_cost_tokens": 2000}}})).client
    big = await qos.acquire("P2", 1500, max_wait_ms=0)
    assert big.admitted
    assert big.remaining_tokens == pytest.approx(500 - 1500, abs=slack(1000, 0.05))
    # The debt is paid back before anything else fits: 1,000 tokens at 1,000/s.
    small = await qos.acquire("P2", 10, max_wait_ms=0)
    assert not small.admitted and small.reason is Reason.RATE_LIMITED
    assert 0.9 <= small.retry_after_s <= 1.02
    too_big = await qos.acquire("P2", 2001, max_wait_ms=0)
    assert too_big.reason is Reason.COST_EXCEEDS_BURST


async def test_release_refunds_the_overestimate(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    lease = await qos.acquire("P1", 1000, max_wait_ms=0)
    settled = await qos.release(lease.lease_id, input_tokens=400)
    assert not settled.already_released
    assert settled.adjustment == pytest.approx(-600)
    assert settled.tokens_charged == pytest.approx(400)
    assert settled.remaining_tokens == pytest.approx(1500 - 400, abs=slack(3000, 0.2))


async def test_release_charges_the_underestimate_bounded_by_burst(
    make_daemon: DaemonFactory,
) -> None:
    qos = (await make_daemon()).client
    lease = await qos.acquire("P1", 100, max_wait_ms=0)
    settled = await qos.release(lease.lease_id, input_tokens=100_000)
    assert settled.adjustment == pytest.approx(1500)  # bounded by one burst
    assert settled.tokens_charged == pytest.approx(1600)
    assert settled.remaining_tokens == pytest.approx(1500 - 100 - 1500, abs=slack(3000, 0.2))


async def test_release_without_actuals_keeps_the_estimate(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    lease = await qos.acquire("P1", 700, max_wait_ms=0)
    settled = await qos.release(lease.lease_id, outcome=Outcome.ERROR)
    assert settled.adjustment == 0
    assert settled.tokens_charged == pytest.approx(700)


async def test_release_is_idempotent(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    lease = await qos.acquire("P1", 1000, max_wait_ms=0)
    first = await qos.release(lease.lease_id, input_tokens=200)
    second = await qos.release(lease.lease_id, input_tokens=5)
    assert second.already_released
    assert (second.tokens_charged, second.adjustment) == (first.tokens_charged, first.adjustment)
    # The second call refunded nothing: the bucket only moved by refill.
    assert second.remaining_tokens <= first.remaining_tokens + slack(3000, 0.2)
    assert second.remaining_tokens >= first.remaining_tokens


async def test_expired_lease_keeps_its_charge(make_daemon: DaemonFactory) -> None:
    running = await make_daemon({"lease": {"ttl_s": 0.3}})
    qos = running.client
    lease = await qos.acquire("P1", 1000, max_wait_ms=0)
    assert lease.lease_ttl_s == pytest.approx(0.3)
    store = running.daemon.admission.store
    assert (await store.status(running.daemon.admission.pool("default"))).active_leases == 1
    await asyncio.sleep(0.45)
    with pytest.raises(LeaseExpired, match="expired before it was released"):
        await qos.release(lease.lease_id, input_tokens=1)
    # A lease never released stops counting in flight once the second of store time
    # its expiry falls in has passed: within about a second of its expiry.
    pool = running.daemon.admission.pool("default")
    deadline = time.monotonic() + 2.0
    while (await store.status(pool)).active_leases != 0:
        assert time.monotonic() < deadline, "the expired lease still counts in flight"
        await asyncio.sleep(0.05)


async def test_a_lease_id_edited_to_another_class_is_unknown(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon(SLOW_REFILL)).client
    assert (await qos.acquire("P0", 3000, max_wait_ms=0)).admitted  # drain P0
    p2 = await qos.acquire("P2", 400, max_wait_ms=0)
    forged = p2.lease_id.replace(":P2:", ":P0:")
    with pytest.raises(LeaseNotFound):
        await qos.release(forged, input_tokens=0)  # would move 400 tokens into P0
    assert not (await qos.acquire("P0", 300, max_wait_ms=0)).admitted
    settled = await qos.release(p2.lease_id, input_tokens=0)
    assert not settled.already_released and settled.adjustment == pytest.approx(-400)


async def test_unknown_and_malformed_leases(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    with pytest.raises(LeaseNotFound, match="unknown"):
        await qos.release("default:P1:00000000deadbeef00000000")
    with pytest.raises(LeaseNotFound, match="does not configure"):
        await qos.release("nopool:P1:00000000deadbeef00000000")
    for malformed in ("", "garbage", "a:b", "default:P1:"):
        with pytest.raises(InvalidRequest, match="lease_id"):
            await qos.release(malformed)


async def test_acquire_with_a_repeated_request_id_is_refused_and_charged_once(
    make_daemon: DaemonFactory,
) -> None:
    """Idempotence by refusal: a second Acquire under a request id that names a lease
    gets ALREADY_EXISTS, never a second lease or a second charge."""
    qos = (await make_daemon(SLOW_REFILL)).client
    first = await qos.acquire("P1", 800, request_id="req-42", max_wait_ms=0)
    assert first.admitted
    with pytest.raises(DuplicateRequestId):
        await qos.acquire("P1", 800, request_id="req-42", max_wait_ms=0)
    # Charged once: 1500 - 800 = 700 left, not -100; one lease in flight.
    status = (await qos.status("default")).pool("default")
    assert status.cls("P1").tokens == pytest.approx(700, abs=slack(30, 2))
    assert status.active_leases == 1
    other = await qos.acquire("P1", 800, request_id="req-43", max_wait_ms=0)
    assert not other.admitted


async def test_a_release_that_frees_its_request_id_lets_the_retry_in(
    make_daemon: DaemonFactory,
) -> None:
    """A release that names its admission (the proxy's, of a request that failed on
    its way) frees the request id if it still names the lease: the retry under the id
    is admitted. A plain release keeps the id until the lease's TTL, and a repeated
    release frees nothing (the id names the retry's lease by then). Ids are a
    tenant's own: another tenant's use of one blocks nothing."""
    running = await make_daemon()
    qos, admission = running.client, running.daemon.admission
    pool = admission.pool("default")
    p1 = next(cls for cls in pool.classes if cls.name == "P1")
    kept = await qos.acquire("P1", 10, tenant="acme", request_id="req-kept", max_wait_ms=0)
    await qos.release(kept.lease_id, input_tokens=10, output_tokens=0)
    with pytest.raises(DuplicateRequestId):
        await qos.acquire("P1", 10, tenant="acme", request_id="req-kept", max_wait_ms=0)
    assert (await qos.acquire("P1", 10, tenant="other", request_id="req-kept")).admitted
    failed = await qos.acquire("P1", 10, tenant="acme", request_id="req-failed", max_wait_ms=0)
    usage = UsageReport(None, None, SettledAs.ERROR)  # the estimate stands
    admitted = LeaseSpec(failed.lease_id, "req-failed", "acme", 10, 0, 1.0, 60_000)
    await admission.store.release(pool, p1, failed.lease_id, usage, admitted)
    retry = await qos.acquire("P1", 10, tenant="acme", request_id="req-failed", max_wait_ms=0)
    assert retry.admitted
    # The first lease's release again, naming the id the retry now holds: kept.
    await admission.store.release(pool, p1, failed.lease_id, usage, admitted)
    with pytest.raises(DuplicateRequestId):
        await qos.acquire("P1", 10, tenant="acme", request_id="req-failed", max_wait_ms=0)


async def test_a_queued_request_that_ends_unserved_frees_its_id(make_daemon: DaemonFactory) -> None:
    """A review: a queued request whose caller left, or that was refused from the
    queue (timeout, deadline, drain), kept its request id until its max wait ran
    out, so the retry its refusal invites (retry-after, the SDK's own) was refused as
    a reuse. Taking it out of its queue now frees the id, if it still names it."""
    patient = merge(SLOW_REFILL, {"classes": {"P2": {"max_wait_ms": 60_000}}})
    running = await make_daemon(patient)  # P2: 10 tokens/s, burst 500
    qos = running.client
    assert (await qos.acquire("P2", 500, max_wait_ms=0)).admitted  # drained for a minute

    async def waiting() -> int:
        return int((await qos.status("default")).pool("default").cls("P2").waiting)

    leaving = asyncio.create_task(qos.acquire("P2", 100, request_id="q-1", max_wait_ms=30_000))
    assert await eventually(waiting, lambda count: count == 1) == 1
    leaving.cancel()  # its caller leaves
    assert await eventually(waiting, lambda count: count == 0) == 0
    retry = await qos.acquire("P2", 100, request_id="q-1", max_wait_ms=0)
    assert not retry.admitted and retry.reason is Reason.RATE_LIMITED  # decided, not a reuse
    head = asyncio.create_task(qos.acquire("P2", 100, max_wait_ms=30_000))
    assert await eventually(waiting, lambda count: count == 1) == 1
    # Half a second of refill, behind the head (first come, first served): it times out.
    timed_out = await qos.acquire("P2", 5, request_id="q-2", max_wait_ms=1_000)
    assert timed_out.reason is Reason.QUEUE_TIMEOUT
    assert await eventually(waiting, lambda count: count == 1) == 1
    again = await qos.acquire("P2", 5, request_id="q-2", max_wait_ms=0)
    assert not again.admitted and again.reason is Reason.RATE_LIMITED
    head.cancel()


async def test_waiting_for_refill_admits_within_max_wait(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    await qos.acquire("P1", 1500, max_wait_ms=0)
    result = await qos.acquire("P1", 300, max_wait_ms=1000)  # needs ~100 ms of refill
    assert result.admitted
    assert 0.05 <= result.waited_s <= 0.6


# P1 at 300 tokens/s (a 1,000-token/s pool) from a 1,500-token burst: a refill of
# seconds, so that "at once" can be told from "after the wait" with a wait of 1 s, and a
# busy machine's slow round trip has most of that second as its margin.
SLOW_P1 = {"pools": {"default": {"capacity_tokens_s": 1_000}},
           "classes": {"P1": {"burst_tokens": 1_500}}}  # fmt: skip


async def test_wait_too_short_for_the_refill_answers_at_once(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon(SLOW_P1)).client
    await qos.acquire("P1", 1500, max_wait_ms=0, timeout_s=10)
    started = time.monotonic()
    result = await qos.acquire("P1", 1500, max_wait_ms=1_000, timeout_s=10)  # needs 5 s
    assert not result.admitted and result.reason is Reason.RATE_LIMITED
    assert time.monotonic() - started < 0.9  # not after waiting its 1 s
    assert result.retry_after_s > 1.0


async def test_wait_capped_by_class_max_wait(make_daemon: DaemonFactory) -> None:
    # P0 at 600 tokens/s (a 1,000-token/s pool) from a 3,000-token burst, its max wait
    # 1 s: refilling 2,400 tokens takes 4 s, so the caller's 60 s would admit it.
    slow = {"pools": {"default": {"capacity_tokens_s": 1_000}},
            "classes": {"P0": {"burst_tokens": 3_000, "max_wait_ms": 1_000}}}  # fmt: skip
    qos = (await make_daemon(slow)).client
    await qos.acquire("P0", 3000, max_wait_ms=0, timeout_s=10)
    started = time.monotonic()
    result = await qos.acquire("P0", 2400, max_wait_ms=60_000)
    assert not result.admitted and result.reason is Reason.RATE_LIMITED
    assert time.monotonic() - started < 0.9  # at once: not after the class's 1 s


async def test_lease_context_manager_releases_on_error(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    with pytest.raises(RuntimeError, match="model server failed"):
        async with qos.lease("P1", 1000, max_wait_ms=0) as lease:
            lease.set_usage(input_tokens=250)
            raise RuntimeError("model server failed")
    assert lease.release_result is not None
    assert lease.release_result.adjustment == pytest.approx(-750)
    again = await qos.release(lease.lease_id)
    assert again.already_released


async def test_lease_context_manager_raises_rejected(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon()).client
    with pytest.raises(Rejected) as info:
        async with qos.lease("P2", 600, max_wait_ms=0):
            pytest.fail("a rejected lease must not run the block")
    assert info.value.reason is Reason.COST_EXCEEDS_BURST


INVALID_ACQUIRES = [
    ({"qos_class": "P9", "input_tokens": 10}, "qos_class 'P9' is not configured"),
    ({"qos_class": "", "input_tokens": 10}, "qos_class is required"),
    ({"qos_class": "P1", "input_tokens": 0}, "input_tokens must be at least 1"),
    ({"qos_class": "P1", "input_tokens": -5}, "input_tokens must be at least 1"),
    ({"qos_class": "P1", "input_tokens": 2**62}, "exceeds the maximum"),
    (
        {"qos_class": "P1", "input_tokens": 1, "expected_output_tokens": -1},
        "expected_output_tokens must be at least 0",
    ),
    ({"qos_class": "P1", "input_tokens": 1, "max_wait_ms": -1}, "max_wait_ms must not be negative"),
    ({"qos_class": "P1", "input_tokens": 1, "tenant": "t" * 129}, "tenant is 129 characters"),
    ({"qos_class": "P1", "input_tokens": 1, "request_id": "r" * 500}, "request_id is 500"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID_ACQUIRES)
async def test_invalid_acquire_gets_invalid_argument(
    make_daemon: DaemonFactory, fields: dict[str, object], message: str
) -> None:
    qos = (await make_daemon()).client
    fields = dict(fields)
    qos_class = str(fields.pop("qos_class"))
    input_tokens = int(fields.pop("input_tokens"))  # type: ignore[call-overload]
    with pytest.raises(InvalidRequest, match=message):
        await qos.acquire(qos_class, input_tokens, **fields)  # type: ignore[arg-type]


async def test_unknown_model_without_default_pool(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"default_pool": None})).client
    with pytest.raises(InvalidRequest, match="'gpt-9' is not served by any configured pool"):
        await qos.acquire("P1", 10, model="gpt-9")
    assert (await qos.acquire("P1", 10, model="llama-3-8b")).admitted
    assert (await qos.acquire("P1", 10, model="default")).admitted  # a pool name


async def test_report_stores_valid_samples_and_names_bad_ones(make_daemon: DaemonFactory) -> None:
    running = await make_daemon({"report": {"window_size": 3}})
    qos = running.client
    samples = [
        LatencySample("llama-3-8b", "P0", tenant="a", ttft_ms=120.5, tpot_ms=22, e2e_ms=900,
                      input_tokens=100, output_tokens=30),
        LatencySample("llama-3-8b", "P9", ttft_ms=1),
        LatencySample("llama-3-8b", "P0", ttft_ms=-3),
        LatencySample("llama-3-8b", "P0", ttft_ms=float("nan")),
        LatencySample("llama-3-8b", "P0"),
        LatencySample("llama-3-8b", "P1", e2e_ms=50, status=Outcome.ERROR),
        LatencySample("llama-3-8b", "P1", e2e_ms=50, status=8),  # type: ignore[arg-type]
    ]  # fmt: skip
    result = await qos.report(samples)
    assert result.accepted == 2
    assert [index for index, _ in result.rejected] == [1, 2, 3, 4, 6]
    reasons = dict(result.rejected)
    assert reasons[6] == "status 8 is not a known Outcome"
    assert "P9" in reasons[1]
    assert "ttft_ms" in reasons[2] and "ttft_ms" in reasons[3]
    assert "at least one of" in reasons[4]
    store = running.daemon.admission.store
    [p0] = await store.window("default", "P0")
    assert (p0.ttft_ms, p0.tpot_ms, p0.e2e_ms) == (120.5, 22.0, 900.0)
    assert (p0.input_tokens, p0.output_tokens, p0.tenant) == (100, 30, "a")
    [p1] = await store.window("default", "P1")
    assert p1.ttft_ms is None and p1.e2e_ms == 50 and int(p1.status) == int(Outcome.ERROR)


async def test_report_window_keeps_the_newest_samples(make_daemon: DaemonFactory) -> None:
    running = await make_daemon({"report": {"window_size": 3}})
    for value in range(5):
        await running.client.report([LatencySample("llama-3-8b", "P2", e2e_ms=float(value))])
    window = await running.daemon.admission.store.window("default", "P2")
    assert [sample.e2e_ms for sample in window] == [4.0, 3.0, 2.0]
    assert window[0].at_ms >= window[-1].at_ms


async def test_report_rejects_empty_and_oversized_batches(make_daemon: DaemonFactory) -> None:
    qos = (await make_daemon({"limits": {"max_report_batch": 2}})).client
    with pytest.raises(InvalidRequest, match="at least one sample"):
        await qos.report([])
    with pytest.raises(InvalidRequest, match="exceed the batch limit of 2"):
        await qos.report([LatencySample("llama-3-8b", "P0", e2e_ms=1.0)] * 3)
