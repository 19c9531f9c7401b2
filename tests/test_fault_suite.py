"""Faults end to end, under steady traffic: Redis hung (SIGSTOP for 2, 5 and 10 s),
SIGKILLed and back 2 s later with its data (AOF), and SIGKILLed and back 2 s later
empty, each in both fail modes; the upstream (``qosd sim-vllm``, a process of its
own) SIGKILLed and started again, SIGSTOPped past the proxy's 1 s read timeout, and
cutting its answers mid-body (``--cut-after-tokens``); and clients that leave at
random points.

Each case drives ~20 requests a second through the OpenAI proxy (streaming and not,
all three classes) and a gateway's acquire/release pairs through the daemon's JSON
API while the fault lasts, then checks what must hold whatever broke:

- every answer is one the doors document for that fault (named per case; an
  upstream gone silent is a 504, one that broke the connection a 502): never a 500,
  never a connection the proxy broke, never a hang (every call is bounded), and no
  stream that ends without its [DONE] or an error event;
- every lease the store counts in flight ends once the traffic stops, within the
  settlement retry's window (15 s here) rather than the lease TTL (300 s): a Release
  that the outage refused is retried by the daemon (qosd/settlements.py). Leases held
  through the JSON API are released one every 20 ms at the start of each Redis
  outage, so that most queue behind a store call already in flight and are failed
  without ever reaching Redis: only a retry ends them. Under "kill" Redis keeps its
  data (AOF), so those leases are still in flight when it is back;
- the SLO loop still gets samples afterwards: requests' latency samples are accepted
  (``qosd_report_samples_total{result="accepted"}``) and reach the class windows the
  status service reads from the store.

Each test starts its own proxy; a Redis case starts its own Redis. Nothing may be
logged at ERROR meanwhile (qosd logs a bug there, never an outage). The file runs in
about 80 s, most of it the faults' own durations.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from qosd_harness import RedisServer
from tests.conftest import TEST_REDIS_TIMEOUT_MS
from tests.fault_rig import (
    CALL_TIMEOUT_S,
    CLASSES,
    RATE_PER_S,
    Answer,
    Rig,
    Stack,
    Traffic,
    VllmProcess,
    chat,
    rig,
    settled,
    window_samples,
)
from tests.waiting import eventually, until

#: Leases in flight must end within this long after the traffic stops (the retry's
#: backoff tops out at 2 s; the lease TTL is 300 s).
SETTLE_WITHIN_S = 15.0
#: A store outage is noticed within one store timeout, and probed every retry interval
#: (generous for a healthy call on a loaded machine: the outages are seconds long).
REDIS_TIMEOUTS = {"timeout_ms": 500, "connect_timeout_ms": 500, "retry_interval_ms": 500}
#: Redis that keeps its data across a SIGKILL: every write is on disk before its reply.
AOF = ("--appendonly", "yes", "--appendfsync", "always")
#: Leases a gateway holds when the fault begins, and releases during it.
HELD = 8
#: The proxy gives up on an upstream that does not connect, or goes silent, this long.
UPSTREAM_TIMEOUTS: dict[str, Any] = {
    "upstream_connect_timeout_s": 1.0,
    "upstream_read_timeout_s": 1.0,
}
#: Tokens of a long answer: about a second of a stream (16 ms a token).
LONG = 60
#: How a proxied answer may end: whole, or a stream with its [DONE].
WHOLE = frozenset({"answer", "done"})
#: ... or, when the upstream broke the connection, a 502 body or a stream's last event
#: naming why (unreachable: before its answer began; cut: during it).
BROKEN = WHOLE | {"error:upstream_cut", "error:upstream_unreachable"}
#: ... or, when it went silent past the read timeout, a 504 body or a last event.
SILENT = WHOLE | {"error:upstream_timeout"}


@pytest.fixture
async def faults(tmp_path: Path) -> AsyncIterator[Rig]:
    async with rig(tmp_path) as made:
        yield made


@pytest.fixture(scope="module")
def healthy_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """One simulated vLLM process for the cases whose upstream stays healthy."""
    upstream = VllmProcess(tmp_path_factory.mktemp("vllm")).start()
    try:
        yield upstream
    finally:
        upstream.stop()


def shared_redis(server: RedisServer) -> dict[str, Any]:
    """The session's Redis, under a key prefix of the test's own."""
    return {"url": server.url, "key_prefix": f"t{uuid.uuid4().hex[:12]}",
            "timeout_ms": TEST_REDIS_TIMEOUT_MS}  # fmt: skip


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


# -- what every case checks ---------------------------------------------------------------


def tally(answers: list[Answer]) -> Counter[tuple[str, int | None, str]]:
    return Counter((a.door, a.status, a.reason or a.ending) for a in answers)


def check_answers(
    answers: list[Answer],
    proxy_codes: set[int],
    json_codes: set[int],
    endings: frozenset[str] = WHOLE,
) -> None:
    """Every call was answered (no hang, no broken connection), with a status allowed
    for its door, and every 200 from the proxy ended as ``endings`` allow."""
    print(f"\n{len(answers)} answers: {sorted(tally(answers).items(), key=str)}")
    unanswered = [a for a in answers if a.status is None]
    assert not unanswered, unanswered[:5]
    wrong = [a for a in answers
             if a.status not in (proxy_codes if a.door == "proxy" else json_codes)]  # fmt: skip
    assert not wrong, (tally(wrong), wrong[:5])
    cut_short = [a for a in answers
                 if a.door == "proxy" and a.status == 200 and a.ending not in endings]  # fmt: skip
    assert not cut_short, cut_short[:5]


def assert_no_errors(caplog: pytest.LogCaptureFixture) -> None:
    """Nothing logged at ERROR by qosd: it logs a bug there (a failed handler, a batch
    or a retry that raised), never an outage or a client that left."""
    errors = [r for r in caplog.get_records("call")
              if r.levelno >= logging.ERROR and r.name.startswith("qosd")]  # fmt: skip
    assert not errors, [f"{r.name}: {r.getMessage()}" for r in errors]


def describe(pool: Any) -> str:
    if pool is None:
        return "the store did not answer"
    return f"active_leases={pool.active_leases} " + ", ".join(
        f"{c.name}: in_flight={c.in_flight} waiting={c.waiting}" for c in pool.classes
    )


async def leases_end(stack: Stack) -> None:
    """Every lease the store counts in flight ends (released, not expired: the TTL is
    300 s), and the daemon has no Release left to retry. Both are waited for: a store
    restarted empty counts no lease at once, while the daemon still holds the
    Releases it will find gone at its next retry (up to 2 s of backoff away)."""

    async def state() -> tuple[Any, int]:
        return await stack.pool(), stack.daemon.admission.settlements.pending

    pool, pending = await eventually(
        state, lambda s: settled(s[0]) and s[1] == 0, timeout_s=SETTLE_WITHIN_S, interval_s=0.1
    )
    assert settled(pool), describe(pool)
    assert pending == 0, f"{pending} releases still to retry"


async def upstream_idle(stack: Stack, upstream: VllmProcess) -> None:
    """The upstream runs nothing and has nothing waiting: every request the proxy sent
    was answered or dropped (a client that left took its upstream request with it)."""

    async def busy() -> float:
        return await upstream.busy(stack.session)

    left = await eventually(busy, lambda n: n == 0, timeout_s=SETTLE_WITHIN_S, interval_s=0.1)
    assert left == 0, f"{left} requests still running or waiting upstream"


async def samples_reach_the_window(stack: Stack, max_tokens: int = 6) -> None:
    """After the fault the SLO loop still gets its samples: once the store admits again
    (a gateway's Acquire is admitted with no qualification), six requests through the
    proxy, two per class, are answered, and their latency samples are accepted and
    reach the class windows in the store."""
    probe = await eventually(
        lambda: stack.acquire("P0"),
        lambda a: a.ending == "DECISION_ADMITTED" and a.reason == "REASON_UNSPECIFIED",
        timeout_s=SETTLE_WITHIN_S,
        interval_s=0.1,
    )
    assert probe.reason == "REASON_UNSPECIFIED", probe
    assert (await stack.release(probe.lease_id)).status == 200
    accepted = stack.metric("qosd_report_samples_total", result="accepted")
    before = window_samples(await stack.pool())
    answers = await asyncio.gather(
        *(stack.ask(qos_class, max_tokens, stream) for qos_class in CLASSES
          for stream in (False, True))
    )  # fmt: skip
    assert [(a.status, a.ending) for a in answers] == [(200, "answer"), (200, "done")] * 3, answers

    async def in_windows() -> int:
        return window_samples(await stack.pool())

    after = await eventually(in_windows, lambda n: n >= before + 6, timeout_s=SETTLE_WITHIN_S)
    assert after >= before + 6, f"window samples {before} -> {after}"
    assert stack.metric("qosd_report_samples_total", result="accepted") >= accepted + 6


# -- Redis hung, killed, restarted empty --------------------------------------------------

REDIS_FAULTS = [
    pytest.param("stop", 2.0, "closed", id="stop-2s-closed"),
    pytest.param("stop", 2.0, "open", id="stop-2s-open"),
    pytest.param("stop", 5.0, "closed", id="stop-5s-closed"),
    pytest.param("stop", 5.0, "open", id="stop-5s-open"),
    pytest.param("stop", 10.0, "closed", id="stop-10s-closed"),
    pytest.param("stop", 10.0, "open", id="stop-10s-open"),
    pytest.param("kill", 2.0, "closed", id="kill-closed"),
    pytest.param("kill", 2.0, "open", id="kill-open"),
    pytest.param("restart-empty", 2.0, "closed", id="restart-empty-closed"),
    pytest.param("restart-empty", 2.0, "open", id="restart-empty-open"),
]


async def release_held(stack: Stack, held: list[Answer]) -> list[Answer]:
    """Releases the held leases one every 20 ms: the first goes to the broken store and
    waits out its timeout, the next queue behind it and are failed unsent."""
    tasks = []
    for lease in held:
        tasks.append(asyncio.create_task(stack.release(lease.lease_id, door="held")))
        await asyncio.sleep(0.02)  # pacing: several arrive while one store call is out
    return list(await asyncio.gather(*tasks))


async def break_redis(
    redis: RedisServer, fault: str, seconds: float, stack: Stack, held: list[Answer]
) -> list[Answer]:
    """Redis is down for ``seconds`` (stopped, or killed and then started again on its
    port); the held leases are released meanwhile. Their answers."""
    began = time.monotonic()
    if fault == "stop":
        redis.pause()
    else:
        await asyncio.to_thread(redis.kill)
    try:
        released = await release_held(stack, held)
        await asyncio.sleep(max(0.0, began + seconds - time.monotonic()))  # the outage itself
    finally:
        if fault == "stop":
            redis.resume()
        else:  # "kill" finds its data again (AOF); "restart-empty" has none to find
            await asyncio.to_thread(redis.start)
    return released


def check_fail_mode(stack: Stack, answers: list[Answer], fail_mode: str) -> None:
    """During the outage the doors answered by the fail mode: closed, the proxy's 503
    with x-qos-reason backend_unavailable and the JSON API's REJECTED; open, admitted
    with a local lease (REASON_FAIL_OPEN), and no 503 from the proxy."""
    failed_open = stack.metric("qosd_acquire_decisions_total", reason="FAIL_OPEN")
    if fail_mode == "closed":
        assert any(a.door == "proxy" and a.status == 503 and a.reason == "backend_unavailable"
                   for a in answers)  # fmt: skip
        assert any(a.door == "acquire" and a.ending == "DECISION_REJECTED"
                   and a.reason == "REASON_BACKEND_UNAVAILABLE" for a in answers)  # fmt: skip
        assert failed_open == 0
    else:
        assert not any(a.door == "proxy" and a.status == 503 for a in answers)
        assert any(a.door == "acquire" and a.ending == "DECISION_ADMITTED"
                   and a.reason == "REASON_FAIL_OPEN" for a in answers)  # fmt: skip
        assert failed_open > 0


@pytest.mark.parametrize(("fault", "seconds", "fail_mode"), REDIS_FAULTS)
async def test_a_redis_fault_under_traffic(
    faults: Rig,
    healthy_vllm: VllmProcess,
    caplog: pytest.LogCaptureFixture,
    fault: str,
    seconds: float,
    fail_mode: str,
) -> None:
    """Redis hung or down for ``seconds`` under traffic, eight gateway leases released
    at its start. The doors answer by the fail mode (closed: the proxy's 503 and the
    JSON API's REJECTED; open: admitted with local leases, never a 503 from the proxy);
    the held leases' Releases get 503 and are retried until they land; once traffic
    stops no lease is in flight in the store; samples reach the windows again. Killed
    with AOF, the store keeps its state (no reset counted); restarted empty, the reset
    is counted, a bucket may refuse (429) and a lease from before may be gone (404)."""
    redis = faults.redis(*(AOF if fault == "kill" else ()))
    stack = await faults.stack(
        {"url": redis.url, "key_prefix": "faults", **REDIS_TIMEOUTS},
        healthy_vllm.url,
        {"fail_mode": fail_mode},
    )
    held = [await stack.acquire(CLASSES[index % 3]) for index in range(HELD)]
    assert all(a.ending == "DECISION_ADMITTED" and a.reason == "REASON_UNSPECIFIED"
               for a in held), held  # fmt: skip
    traffic = Traffic(stack, seed_of(fault, seconds, fail_mode)).start()
    assert await until(lambda: len(traffic.answers) >= 10, timeout_s=20)
    began = time.monotonic()
    released = await break_redis(redis, fault, seconds, stack, held)
    ended = time.monotonic()
    assert await until(lambda: traffic.answered_since(ended) >= 10, timeout_s=20)
    answers = await traffic.stop()

    restarted = fault == "restart-empty"
    # Restarted empty, the buckets start empty (a request may be refused, 429) and a
    # gateway's lease from before is gone (its Release: 404).
    proxy_codes = {200, 503} if fail_mode == "closed" else {200}
    json_codes = {200, 503}
    if restarted:
        proxy_codes, json_codes = proxy_codes | {429}, json_codes | {404}
    check_answers(answers, proxy_codes, json_codes)
    check_fail_mode(stack, [a for a in answers if a.during(began, ended)], fail_mode)
    # The held leases' Releases met the outage: refused (503), kept and retried.
    assert [a.status for a in released] == [503] * HELD, released
    assert stack.metric("qosd_releases_total", result="UNAVAILABLE") >= HELD
    await leases_end(stack)
    # Killed, Redis kept its state (no reset): the leases were still there to release.
    resets = stack.metric("qosd_store_resets_total", pool="default")
    assert resets >= 1 if restarted else resets == 0
    await samples_reach_the_window(stack)
    assert_no_errors(caplog)


# -- the upstream killed, hung, cutting its answers ---------------------------------------


@pytest.mark.parametrize(
    ("fault", "seconds", "proxy_codes", "endings"),
    [
        pytest.param("kill", 1.5, {200, 502}, BROKEN, id="kill"),
        pytest.param("stop", 2.5, {200, 504}, SILENT, id="stop-2.5s"),
    ],
)
async def test_an_upstream_fault_under_traffic(
    faults: Rig,
    redis_standalone: RedisServer,
    caplog: pytest.LogCaptureFixture,
    fault: str,
    seconds: float,
    proxy_codes: set[int],
    endings: frozenset[str],
) -> None:
    """sim-vllm SIGKILLed (then started again on its port), or SIGSTOPped for longer
    than the proxy's 1 s read timeout. Killed: what it held breaks off (a whole answer
    is a 502, a stream ends with an OpenAI error event) and new requests are 502s
    (unreachable). Stopped: every request goes silent, and is answered at the read
    timeout (504, or a stream's error event). Either way requests are answered while
    the upstream is still down; leases end; once it is back, requests are served and
    sampled again."""
    upstream = await faults.vllm()
    stack = await faults.stack(shared_redis(redis_standalone), upstream.url,
                               proxy=UPSTREAM_TIMEOUTS)  # fmt: skip
    traffic = Traffic(stack, seed_of(fault, seconds)).start()
    assert await until(lambda: len(traffic.answers) >= 10, timeout_s=20)
    ongoing = [await stack.begin_stream(LONG * 3) for _ in range(3)]  # mid-answer
    began = time.monotonic()
    if fault == "kill":
        await asyncio.to_thread(upstream.kill)
    else:
        upstream.pause()
    try:
        await asyncio.sleep(seconds)  # the outage itself
    finally:
        if fault == "kill":
            await asyncio.to_thread(upstream.start)
        else:
            upstream.resume()
    ended = time.monotonic()

    def served_again() -> bool:
        served = [a for a in traffic.answers if a.door == "proxy" and a.status == 200]
        return sum(1 for a in served if a.sent_at >= ended) >= 5

    assert await until(served_again, timeout_s=20)
    answers = await traffic.stop()
    # The streams under way when the upstream broke ended with an OpenAI error event.
    broke_off = [await stream for stream in ongoing]
    cause = "error:upstream_cut" if fault == "kill" else "error:upstream_timeout"
    assert [(a.status, a.ending) for a in broke_off] == [(200, cause)] * 3, broke_off
    check_answers(answers + broke_off, proxy_codes, json_codes={200}, endings=endings)
    # Answered while the upstream was down (when stopped: by the read timeout).
    broken = [a for a in answers if a.door == "proxy" and a.during(began, ended)
              and a.ending in endings - WHOLE]  # fmt: skip
    assert broken, "no request was answered while the upstream was down"
    await leases_end(stack)
    await upstream_idle(stack, upstream)
    await samples_reach_the_window(stack)
    assert_no_errors(caplog)


CUT_AFTER = 6


async def test_an_upstream_that_cuts_its_answers(
    faults: Rig, redis_standalone: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """sim-vllm breaks the connection once an answer has 6 tokens: a whole answer that
    breaks off is a 502 in OpenAI's format (code upstream_cut), which the SDK raises;
    a stream relays what came, then an OpenAI error event, which the SDK raises too.
    Shorter answers are whole. Every lease ends (with its estimate: usage unknown)."""
    upstream = await faults.vllm("--cut-after-tokens", str(CUT_AFTER))
    stack = await faults.stack(shared_redis(redis_standalone), upstream.url,
                               proxy=UPSTREAM_TIMEOUTS)  # fmt: skip
    traffic = Traffic(stack, seed_of("cut"), max_tokens=(2, 2 * CUT_AFTER)).start()
    assert await until(lambda: len(traffic.answers) >= 40, timeout_s=30)
    answers = await traffic.stop()
    check_answers(answers, proxy_codes={200, 502}, json_codes={200}, endings=BROKEN)
    for a in (a for a in answers if a.door == "proxy"):
        if a.max_tokens < CUT_AFTER:
            assert (a.status, a.ending) == (200, "done" if a.stream else "answer"), a
        else:
            assert (a.status, a.ending) == (200 if a.stream else 502, "error:upstream_cut"), a

    client = openai.AsyncOpenAI(
        base_url=stack.proxy_url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    with pytest.raises(openai.APIStatusError) as whole:
        await client.chat.completions.create(**chat(CUT_AFTER + 2, stream=False))
    assert whole.value.status_code == 502 and whole.value.code == "upstream_cut"
    stream = await client.chat.completions.create(**chat(CUT_AFTER + 2, stream=True))
    tokens = 0
    with pytest.raises(openai.APIError) as cut:
        async for chunk in stream:
            tokens += sum(1 for c in chunk.choices if c.delta.content)
    assert cut.value.code == "upstream_cut" and tokens == CUT_AFTER
    await client.close()
    await leases_end(stack)
    await upstream_idle(stack, upstream)
    await samples_reach_the_window(stack, max_tokens=CUT_AFTER - 1)
    assert_no_errors(caplog)


# -- clients that leave -------------------------------------------------------------------


@dataclass
class Left:
    """What a client that meant to leave saw before it left."""

    behaviour: str
    status: int | None = None  # None: it left before any answer came
    mid_answer: bool = False  # it left with a 200 begun and not ended
    failure: str = ""


async def leave(stack: Stack, client: openai.AsyncOpenAI, behaviour: str,
                rng: random.Random) -> Left:  # fmt: skip
    """One client, leaving as ``behaviour`` says, at a point ``rng`` picks."""
    left = Left(behaviour)
    qos_class = rng.choice(CLASSES)
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            if behaviour == "stays":
                answer = await stack.ask(qos_class, rng.randint(4, 30), rng.random() < 0.5)
                left.status, left.failure = answer.status, answer.failure
            elif behaviour == "before-the-answer":
                await leave_before_the_answer(stack, qos_class, rng.uniform(0.0, 0.6), left)
            elif behaviour == "sdk-mid-stream":
                await leave_the_sdk_stream(client, qos_class, rng.randint(1, 8), left)
            elif behaviour == "curl-hangs-up":
                await hang_up_from_another_process(stack, qos_class, rng.uniform(0.2, 0.8), left)
            else:  # "mid-stream", "after-the-first-byte"
                lines = rng.randint(2, 12) if behaviour == "mid-stream" else 0
                await leave_mid_stream(stack, qos_class, lines, left)
    except TimeoutError:
        left.failure = f"no answer within {CALL_TIMEOUT_S} s"
    return left


async def leave_before_the_answer(stack: Stack, qos_class: str, after_s: float,
                                  left: Left) -> None:  # fmt: skip
    """Gives up after ``after_s`` (waiting in qosd's queue, or upstream): the request
    is cancelled, which closes its connection."""
    call = asyncio.create_task(stack.ask(qos_class, LONG, stream=False))
    done, _ = await asyncio.wait({call}, timeout=after_s)
    if done:  # answered first: it stayed, after all
        left.status = call.result().status
        return
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)


async def leave_mid_stream(stack: Stack, qos_class: str, lines: int, left: Left) -> None:
    """Reads the first byte of a stream, then ``lines`` more lines, then hangs up."""
    response = await stack.session.post(
        f"{stack.proxy_url}/chat/completions", json=chat(LONG, stream=True),
        headers={"x-qos-class": qos_class},
    )  # fmt: skip
    try:
        left.status = response.status
        if response.status == 200:
            await response.content.read(1)
            for _ in range(lines):
                await response.content.readline()
            left.mid_answer = True
    finally:
        response.close()  # the connection, not back to the pool: the client is gone


async def leave_the_sdk_stream(client: openai.AsyncOpenAI, qos_class: str, chunks: int,
                               left: Left) -> None:  # fmt: skip
    try:
        stream = await client.chat.completions.create(
            **chat(LONG, stream=True), extra_headers={"x-qos-class": qos_class}
        )
    except openai.APIStatusError as refused:
        left.status = refused.status_code
        return
    left.status = 200
    read = 0
    async for _ in stream:
        read += 1
        if read >= chunks:
            break
    await stream.close()
    left.mid_answer = True


async def hang_up_from_another_process(stack: Stack, qos_class: str, after_s: float,
                                       left: Left) -> None:  # fmt: skip
    """curl, a process of its own, hangs up a stream after ``after_s``: its disconnect
    reaches the proxy whenever the kernel delivers it, mid-write included (a client in
    the test's own event loop only ever leaves between two of the proxy's steps)."""
    process = await asyncio.create_subprocess_exec(
        "curl", "-sN", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", f"{after_s:.2f}",
        f"{stack.proxy_url}/chat/completions", "-H", "content-type: application/json",
        "-H", f"x-qos-class: {qos_class}", "-d", json.dumps(chat(LONG, stream=True)),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    out, _ = await process.communicate()
    code = int(out.decode() or 0)
    left.status = code or None  # 0: it left before the answer began
    left.mid_answer = code == 200 and process.returncode == CURL_TIMED_OUT


CURL_TIMED_OUT = 28
BEHAVIOURS = ("stays", "before-the-answer", "mid-stream", "after-the-first-byte",
              "sdk-mid-stream", "curl-hangs-up")  # fmt: skip


async def test_clients_that_leave_at_random_points(
    faults: Rig,
    healthy_vllm: VllmProcess,
    redis_standalone: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """48 clients at 20 a second, each (seeded) staying, or leaving before its answer
    (queued in qosd, or upstream), mid-stream, right after the first byte, mid-way
    through an SDK stream, or as curl hanging up at a random time. Six requests run at
    a time, so some wait in qosd's queue; then two that wait there for sure leave.
    What a client sees before it leaves is a 200 or a 429 (its wait ran out); the proxy
    counts each that left mid-answer as 499, never as a 500; the upstream drops what
    nobody reads; leases end, nobody is left waiting, and samples still come in."""
    stack = await faults.stack(
        shared_redis(redis_standalone),
        healthy_vllm.url,
        {"pools": {"default": {"max_in_flight": 6, "top_reserve": 0}},
         "classes": {"P1": {"max_wait_ms": 3_000}, "P2": {"max_wait_ms": 3_000}}},
    )  # fmt: skip
    rng = random.Random(1729)
    client = openai.AsyncOpenAI(
        base_url=stack.proxy_url, api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )
    clients = []
    for _ in range(48):
        behaviour = rng.choice(BEHAVIOURS)
        own = random.Random(rng.random())
        clients.append(asyncio.create_task(leave(stack, client, behaviour, own)))
        await asyncio.sleep(1 / RATE_PER_S)  # pacing: 20 arrivals a second
    results = await asyncio.gather(*clients)
    await client.close()
    print("\n" + str(Counter((r.behaviour, r.status, r.mid_answer) for r in results)))
    assert not [r for r in results if r.failure], [r for r in results if r.failure]
    assert {r.status for r in results} <= {200, 429, None}
    assert all(r.status is not None for r in results if r.behaviour == "stays")
    assert any(r.status is None for r in results), "nobody left before the answer"
    left = sum(r.mid_answer for r in results)
    assert left >= 5
    await leases_end(stack)  # the pool is empty again: six streams fill it
    left += await leave_while_queued(stack)

    def counted(code: str) -> float:
        return stack.metric("qosd_proxy_requests_total", code=code)

    assert await until(lambda: counted("499") >= left, timeout_s=SETTLE_WITHIN_S), (
        f"{counted('499')} requests counted 499, {left} clients left mid-answer"
    )
    assert counted("500") == 0
    await leases_end(stack)
    await upstream_idle(stack, healthy_vllm)
    await samples_reach_the_window(stack)
    assert_no_errors(caplog)


async def leave_while_queued(stack: Stack) -> int:
    """The pool full (six streams under way), two P1 requests wait in qosd's queue as
    the store shows; they leave, and the queue empties; then the six leave mid-stream.
    How many left mid-answer."""
    holders = [await stack.begin_stream(LONG * 3) for _ in range(6)]
    queued = [asyncio.create_task(stack.ask("P1", 8, stream=False)) for _ in range(2)]

    def waiting(pool: Any) -> int:
        return -1 if pool is None else int(pool.cls("P1").waiting)

    assert waiting(await eventually(stack.pool, lambda p: waiting(p) == 2)) == 2
    for task in (*queued, *holders):
        task.cancel()
    await asyncio.gather(*queued, *holders, return_exceptions=True)
    assert waiting(await eventually(stack.pool, lambda p: waiting(p) == 0)) == 0
    return len(queued) + len(holders)
