"""Every door holds: the probes a hostile or unlucky client tried on the proxy and the
JSON API, each kept as a regression test (issue 34).

Identity that a header cannot claim; a request id that names one lease; every byte
checked at the door (and ``/metrics`` unbroken by any of them); bodies read whole
and parsed safely; upstream faults that end cleanly; estimates that never refuse
real work; and the counting of what the proxy saw. Real sockets throughout: the
proxy in front of ``qosd sim-vllm`` or of a small upstream of the test's own that
misbehaves on purpose."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from qosd_client import DuplicateRequestId
from tests.conftest import DaemonFactory
from tests.proxy_stack import MODEL, Stack, StackFactory, chat, make_stack
from tests.waiting import eventually, until

__all__ = ["make_stack"]  # the fixture, used by name

HTTP = {"server": {"http_listen": "127.0.0.1:0"}}


def keyed(**keys: tuple[str, str]) -> dict[str, tuple[str, str]]:
    """API keys as ProxySettings keeps them: by SHA-256 digest."""
    from qosd.doors.proxy.handler import key_digest  # noqa: PLC0415 - as the command does

    return {key_digest(key): value for key, value in keys.items()}


async def raw_request(address: str, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte for byte (a header aiohttp's client would
    refuse to send), and the status and body of its answer."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head + b"content-length: " + str(len(body)).encode() + b"\r\n"
                 + b"connection: close\r\n\r\n" + body)  # fmt: skip
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def metrics_page(stack: Stack) -> str:
    return (await stack.proxies[0].daemon.metrics_page()).decode()


async def decisions(stack: Stack, qos_class: str) -> float:
    """Admissions of ``qos_class`` counted on /metrics."""
    prefix = (
        f'qosd_acquire_decisions_total{{class="{qos_class}",decision="admitted",'
        'pool="default",reason="NONE"} '
    )
    for line in (await metrics_page(stack)).splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0


# -- identity --------------------------------------------------------------------------


async def test_with_api_keys_a_missing_or_unknown_key_is_refused_and_headers_only_lower(
    make_stack: StackFactory,
) -> None:
    """The probe: with ``--api-key KEY=P2``, a wrong key, no key, or ``bearer KEY`` in
    lower case, each with ``x-qos-class: P0``, was admitted as P0. Now no key is a
    401, an unknown one a 403, the scheme matches in any case (and the key's P2
    holds against the header: 403), and a header may lower a key's class."""
    stack = await make_stack(api_keys=keyed(bulk=("P2", "batch"), gold=("P0", "")))
    url = f"{stack.url()}/chat/completions"
    async with aiohttp.ClientSession() as session:

        async def status(headers: dict[str, str]) -> int:
            async with session.post(url, json=chat(3, max_tokens=2), headers=headers) as answer:
                return answer.status

        assert await status({"x-qos-class": "P0"}) == 401
        assert await status({"x-qos-class": "P0", "authorization": "Bearer wrong"}) == 403
        assert await status({"x-qos-class": "P0", "authorization": "Basic bulk"}) == 401
        assert await status({"x-qos-class": "P0", "authorization": "bearer bulk"}) == 403
        assert await decisions(stack, "P0") == 0
        assert await status({"authorization": "BEARER bulk"}) == 200  # scheme in any case
        assert await decisions(stack, "P2") == 1
        assert await status({"authorization": "Bearer gold", "x-qos-class": "P2"}) == 200
        assert await decisions(stack, "P2") == 2  # lowered by the header
        assert await status({"authorization": "Bearer gold"}) == 200
        assert await decisions(stack, "P0") == 1
    refusals = [line for line in (await metrics_page(stack)).splitlines()
                if line.startswith('qosd_auth_refusals_total{code="PERMISSION_DENIED",'
                                   'method="proxy"}')]  # fmt: skip
    assert refusals and float(refusals[0].split()[-1]) == 2.0


@asynccontextmanager
async def upstream(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A one-route OpenAI-compatible upstream of the test's own, on a port of its own."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def completion(prompt_tokens: int = 3, completion_tokens: int = 2) -> dict[str, Any]:
    return {
        "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": "tok tok"}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }  # fmt: skip


async def test_callers_credentials_never_go_upstream_the_upstream_key_does(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    """The probe: the proxy forwarded ``Authorization: Bearer <qosd's own token>``
    upstream. Now the upstream sees the key of ``--upstream-key-file`` (re-read when
    the file changes), or none, never the caller's."""
    seen: list[str | None] = []

    async def recording(request: web.Request) -> web.Response:
        seen.append(request.headers.get("authorization"))
        return web.json_response(completion())

    key_file = tmp_path / "upstream-key"
    key_file.write_text("up-1\n")
    async with upstream(recording) as url:
        stack = await make_stack(api_keys=keyed(caller=("P1", "")), upstream=url,
                                 upstream_key_file=str(key_file))  # fmt: skip
        client = openai.AsyncOpenAI(base_url=stack.url(), api_key="caller")
        await client.chat.completions.create(**chat(3))
        key_file.write_text("up-2\n")  # rotated
        await client.chat.completions.create(**chat(3))
        await client.close()
        plain = await make_stack(api_keys=keyed(caller=("P1", "")), upstream=url)
        client = openai.AsyncOpenAI(base_url=plain.url(), api_key="caller")
        await client.chat.completions.create(**chat(3))
        await client.close()
    assert seen == ["Bearer up-1", "Bearer up-2", None]


# -- request ids -----------------------------------------------------------------------


async def test_one_request_id_names_one_lease_through_the_proxy(make_stack: StackFactory) -> None:
    """The probe: with ``max_in_flight: 3``, 10 concurrent streams sharing one
    ``x-request-id`` all ran on one lease, and a request reusing a released id was
    admitted at once into a full pool. Now one runs, the other nine get 409 naming
    the header; once it is released the id admits nothing (409 again)."""
    stack = await make_stack({"pools": {"default": {"max_in_flight": 3, "top_reserve": 0}}})
    url = f"{stack.url()}/chat/completions"
    headers = {"x-request-id": "same-id"}
    async with aiohttp.ClientSession() as session:
        first = await session.post(url, json=chat(4, max_tokens=400, stream=True),
                                   headers=headers)  # fmt: skip
        assert first.status == 200
        await first.content.readline()  # streaming: its lease is live

        async def another() -> tuple[int, Any]:
            async with session.post(url, json=chat(4, max_tokens=4, stream=True),
                                    headers=headers) as answer:  # fmt: skip
                return answer.status, await answer.json()

        answers = await asyncio.gather(*(another() for _ in range(9)))
        assert {code for code, _ in answers} == {409}
        assert all(body["error"]["param"] == "x-request-id" for _, body in answers)
        assert stack.vllm.gpu.engine.pending == 1
        first.close()
        await eventually(stack.status, lambda p: p.active_leases == 0)
        again, body = await another()
        assert again == 409 and body["error"]["code"] == "duplicate_request_id"
        async with session.post(url, json=chat(4, max_tokens=4), headers={"x-request-id": "new"}
                                ) as fresh:  # fmt: skip
            assert fresh.status == 200


async def test_one_request_id_names_one_lease_over_grpc_and_json(
    make_daemon: DaemonFactory,
) -> None:
    """On every store: a second Acquire under an id that names a live lease, a
    waiting request or a released lease gets ALREADY_EXISTS (409 over JSON), never
    a lease; the first one's lease is the only one in flight."""
    running = await make_daemon(
        {**HTTP, "pools": {"default": {"max_in_flight": 1, "top_reserve": 0}},
         "classes": {"P1": {"max_wait_ms": 30_000}}}
    )  # fmt: skip
    qos = running.client
    held = await qos.acquire("P1", 10, request_id="a")
    assert held.admitted
    outcomes = await asyncio.gather(
        *(qos.acquire("P1", 10, request_id="a") for _ in range(5)), return_exceptions=True
    )
    assert all(isinstance(o, DuplicateRequestId) for o in outcomes)
    waiting = asyncio.create_task(qos.acquire("P1", 10, request_id="b"))
    await eventually(qos.status, lambda s: s.pool("default").cls("P1").waiting == 1)
    with pytest.raises(DuplicateRequestId):
        await qos.acquire("P1", 10, request_id="b")
    await qos.release(held.lease_id)
    admitted_later = await waiting
    assert admitted_later.admitted
    assert (await qos.status()).pool("default").active_leases == 1
    await qos.release(admitted_later.lease_id)
    assert running.daemon.http is not None
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{running.daemon.http.address}/v1/acquire",
                     json={"qos_class": "P1", "input_tokens": 10, "request_id": "a"}) as answer,
    ):  # fmt: skip
        assert answer.status == 409
        body = await answer.json()
    assert body["code"] == "ALREADY_EXISTS" and "request_id" in body["message"]
    assert (await qos.status()).pool("default").active_leases == 0


# -- every byte checked at the door ----------------------------------------------------


async def test_a_bad_byte_in_a_header_is_a_400_and_breaks_nothing_for_others(
    make_stack: StackFactory,
) -> None:
    """The probe: a non-UTF-8 byte in ``x-qos-tenant`` was admitted; ``/metrics`` then
    answered 500, the report task died, and with ``tenant_max_share`` other callers'
    concurrent requests got 500. Now it is a 400 naming the header, other callers
    are served, ``/metrics`` answers, and the SLO loop still gets samples."""
    stack = await make_stack({**HTTP, "classes": {"P1": {"tenant_max_share": 0.5}}})
    address = stack.proxies[0].address
    body = json.dumps(chat(3, max_tokens=2)).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
            b"\r\nx-qos-tenant: bad\xff\xfebyte\r\n")  # fmt: skip
    client = stack.client()
    bad, *good = await asyncio.gather(
        raw_request(address, head, body),
        *(client.chat.completions.create(**chat(3, max_tokens=2),
                                         extra_headers={"x-qos-tenant": f"t{i}"})
          for i in range(4)),
    )  # fmt: skip
    status, answer = bad
    assert status == 400
    error = json.loads(answer)["error"]
    assert error["param"] == "x-qos-tenant" and "UTF-8" in error["message"]
    assert len(good) == 4
    control = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
               b"\r\nx-request-id: a\x7fb\r\n")  # fmt: skip
    assert (await raw_request(address, control, body))[0] == 400
    daemon = stack.proxies[0].daemon
    assert daemon.http is not None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{daemon.http.address}/metrics") as page,
    ):
        assert page.status == 200
        text = await page.text()
    assert 'tenant="t0"' in text
    before = daemon.metrics.report_samples.labels("accepted")._value.get()
    await client.chat.completions.create(**chat(3, max_tokens=2))
    assert await until(
        lambda: daemon.metrics.report_samples.labels("accepted")._value.get() > before
    )
    await client.close()


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        (b'{"qos_class": "P1", "input_tokens": ' + b"9" * 5_000 + b"}", 400, "digits"),
        (b"[" * 2_000 + b"]" * 2_000, 400, "nests"),
        (b'{"qos_class": "P1", "tenant": "\xff", "input_tokens": 5}', 400, "UTF-8"),
        (b'{"qos_class": "P1", "tenant": "a\\u0000b", "input_tokens": 5}', 400, "tenant"),
        (b'{"qos_class": "P1", "input_tokens": NaN}', 400, "NaN"),
    ],
    ids=["5000-digits", "nested-2000", "invalid-utf8", "control-char", "nan"],
)
async def test_json_api_bad_bodies_are_400s(
    make_daemon: DaemonFactory, body: bytes, status: int, field: str
) -> None:
    """The probes that got a 500 from the JSON API; each is a 400 that says why."""
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    head = b"POST /v1/acquire HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    code, answer = await raw_request(running.daemon.http.address, head, body)
    assert code == status
    assert field in json.loads(answer)["message"]


async def test_json_api_bounds_query_parameters(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    base = f"http://{running.daemon.http.address}/v1/status"
    async with aiohttp.ClientSession() as session:
        for query in ("history=" + "9" * 20, "history=-1", "history=1e3", "tenant=a%00b"):
            async with session.get(f"{base}?{query}") as answer:
                assert answer.status == 400, query
                assert (await answer.json())["code"] == "INVALID_ARGUMENT"
        async with session.get(f"{base}?history=3") as answer:
            assert answer.status == 200


async def test_json_api_reads_a_body_that_comes_in_pieces(make_daemon: DaemonFactory) -> None:
    """The probe: a valid body that arrived in two TCP segments was refused with 400
    (``content.read(n)`` returns what is buffered), and large Reports failed so
    under load. The body here comes in 40 pieces, the client pausing between them."""
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    samples = [{"model": MODEL, "qos_class": "P1", "ttft_ms": 100 + i, "input_tokens": 10}
               for i in range(1_000)]  # fmt: skip
    raw = json.dumps({"samples": samples}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        size = len(raw) // 40 + 1
        for start in range(0, len(raw), size):
            yield raw[start : start + size]
            await asyncio.sleep(0.005)  # the fault itself: a slow sender, not a wait

    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://{running.daemon.http.address}/v1/report", data=pieces(),
                     headers={"content-type": "application/json"}) as answer,
    ):  # fmt: skip
        assert answer.status == 200
        assert (await answer.json())["accepted"] == 1_000


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "llama-3-8b", "max_tokens": ' + b"9" * 5_000 + b', "messages": []}', "body"),
        (b'{"model": "llama-3-8b", "messages": ' + b"[" * 2_000 + b"]" * 2_000 + b"}", "body"),
        (b'{"model": "llama-3-8b", "messages": [{"content": "\xff"}]}', "body"),
        (json.dumps(chat(stream=True, stream_options=5)).encode(), "stream_options"),
        (json.dumps(chat(stream="yes")).encode(), "stream"),
    ],
    ids=["5000-digits", "nested-2000", "invalid-utf8", "stream-options-5", "stream-yes"],
)
async def test_proxy_bad_bodies_are_400s_and_hold_no_lease(
    make_stack: StackFactory, body: bytes, param: str
) -> None:
    """The probes that got a 500 from the proxy (``stream_options: 5`` also leaked
    its lease until the TTL): each is a 400 in OpenAI's format naming the field, and
    no lease is left."""
    stack = await make_stack()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url()}/chat/completions", data=body,
                     headers={"content-type": "application/json"}) as answer,
    ):  # fmt: skip
        assert answer.status == 400
        assert (await answer.json())["error"]["param"] == param
    assert (await stack.status()).active_leases == 0


# -- upstream faults -------------------------------------------------------------------


async def test_a_cut_answer_is_a_502_a_cut_stream_ends_with_an_error_event(
    make_stack: StackFactory,
) -> None:
    """The probe: a non-streaming body cut mid-way got a 500 text answer with a
    traceback, and a cut stream ended with no error event. Now the first is a 502 in
    OpenAI's format, the second an error event the SDK raises; both leases end."""

    async def cutting(request: web.Request) -> web.StreamResponse:
        streamed = (await request.json()).get("stream")
        response = web.StreamResponse()
        response.content_type = "text/event-stream" if streamed else "application/json"
        if not streamed:
            response.content_length = 4096  # promised, never delivered
        await response.prepare(request)
        chunk = {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": None}],
        }
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n" if streamed
                             else b'{"id": "cmpl-1", "choi')  # fmt: skip
        assert request.transport is not None
        request.transport.abort()  # the connection breaks mid-body
        return response

    async with upstream(cutting) as url:
        stack = await make_stack(upstream=url)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{stack.url()}/chat/completions", json=chat(3)) as answer,
        ):
            assert answer.status == 502
            error = (await answer.json())["error"]
        assert error["code"] == "upstream_cut" and error["type"] == "upstream_error"
        client = stack.client(max_retries=0)
        stream = await client.chat.completions.create(**chat(3, stream=True))
        with pytest.raises(openai.APIError, match="broke off"):
            async for _ in stream:
                pass
        await client.close()
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
        assert pool.active_leases == 0
    page = await metrics_page(stack)
    assert 'qosd_releases_total{outcome="ERROR",result="OK"} 2.0' in page


async def test_a_hung_upstream_ends_its_request_and_lease_at_the_read_timeout(
    make_stack: StackFactory,
) -> None:
    """The probe: a hung upstream held its lease for as long as the client waited.
    Now the read timeout ends it: a 504, and the lease ends."""
    release = asyncio.Event()

    async def hanging(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response(completion())

    async with upstream(hanging) as url:
        stack = await make_stack(upstream=url, upstream_read_timeout_s=0.5)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{stack.url()}/chat/completions", json=chat(3)) as answer,
        ):
            assert answer.status == 504
            assert (await answer.json())["error"]["code"] == "upstream_timeout"
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
        assert pool.active_leases == 0
        release.set()


async def test_usage_beyond_the_limit_is_settled_at_the_limit(make_stack: StackFactory) -> None:
    """The probe: usage above ``max_request_tokens`` left the lease to its TTL. Now
    it is settled at the limit, at once."""

    async def boasting(request: web.Request) -> web.Response:
        return web.json_response(completion(prompt_tokens=10**12, completion_tokens=10**12))

    async with upstream(boasting) as url:
        stack = await make_stack({"limits": {"max_request_tokens": 100_000},
                                  "classes": {"P1": {"fairness": "vtc"}}},
                                 upstream=url)  # fmt: skip
        client = stack.client()
        await client.chat.completions.create(**chat(3), extra_headers={"x-qos-tenant": "big"})
        await client.close()
        pool = await eventually(lambda: stack.status(tenants=("big",)),
                                lambda p: p.active_leases == 0)  # fmt: skip
    assert pool.cls("P1").tenant("big").served_tokens == 200_000  # both at the limit
    assert 'qosd_releases_total{outcome="OK",result="OK"} 1.0' in await metrics_page(stack)


async def test_a_client_that_leaves_is_a_499_and_the_server_aborts_its_request(
    make_stack: StackFactory,
) -> None:
    """The probes: a client that disconnected was counted as code 500, and ``qosd
    sim-vllm`` kept generating for it (vLLM aborts). Now it is a 499, the simulated
    server aborts the request (off the GPU, counted as vLLM counts aborts), and the
    lease ends, settled as cancelled."""
    stack = await make_stack()
    async with aiohttp.ClientSession() as session:
        # Not streamed: no byte comes before the whole answer; the client leaves first.
        asking = asyncio.create_task(
            session.post(f"{stack.url()}/chat/completions", json=chat(8, max_tokens=50_000))
        )
        assert await until(lambda: stack.vllm.gpu.engine.pending == 1)
        asking.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await asking
    assert await until(lambda: stack.vllm.gpu.engine.pending == 0)
    pool = await eventually(stack.status, lambda p: p.active_leases == 0)
    assert pool.active_leases == 0
    page = await metrics_page(stack)
    assert 'code="499"' in page and 'code="500"' not in page
    assert 'qosd_releases_total{outcome="CANCELLED",result="OK"} 1.0' in page
    vllm_page = stack.vllm.metrics
    aborted = vllm_page.success.labels(*vllm_page.labels, "abort")._value.get()
    assert aborted == 1


# -- estimates -------------------------------------------------------------------------


async def test_one_short_answer_does_not_make_a_long_prompt_look_oversized(
    make_stack: StackFactory,
) -> None:
    """The probe: after one "hi" (5 prompt tokens, most of them template), an 8 KB
    prompt was estimated at 20,000 tokens and refused with cost_exceeds_burst against
    a 17,500-token burst. The estimate now separates the template's overhead from
    bytes per token and learns over many responses; and an estimate alone never
    refuses a request as oversized."""
    stack = await make_stack({"classes": {"P1": {"burst_tokens": 17_500}}})
    client = stack.client(max_retries=0)
    await client.chat.completions.create(model=MODEL, max_tokens=1,
                                         messages=[{"role": "user", "content": "hi"}])  # fmt: skip
    estimated = stack.proxies[0].proxy.estimator.prompt_tokens(MODEL, 8_192)
    assert 1_500 <= estimated <= 3_000  # about 8 KB at ~4 bytes a token
    answer = await client.chat.completions.create(**chat(1_640, max_tokens=1))  # 8 KB
    assert answer.usage is not None and answer.usage.prompt_tokens == 1_640
    # Even a prompt whose estimate is past the class's burst is admitted (against a
    # full bucket), and settled from the real usage.
    answer = await client.chat.completions.create(**chat(20_000, max_tokens=1))  # ~100 KB
    assert answer.usage is not None and answer.usage.prompt_tokens == 20_000
    await client.close()
    assert await decisions(stack, "P1") == 3
