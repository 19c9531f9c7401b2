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
import contextlib
import dataclasses
import json
import logging
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import openai
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qosd.config import Config
from qosd.doors.grpc_api import judge_samples
from qosd.doors.proxy import tokenize as tokenize_module
from qosd.doors.proxy.estimate import (
    CALIBRATION_EVIDENCE,
    MIN_MEDIA_PART_TOKENS,
    PRIOR_MEDIA_PART_TOKENS,
    Estimator,
    PromptSize,
    Usage,
    prompt_size,
)
from qosd.doors.proxy.forwarded import FORWARDED_HEADERS
from qosd.doors.proxy.handler import CLIENT_CLOSED
from qosd.doors.proxy.telemetry import GenAiTelemetry
from qosd.doors.proxy.tokenize import IN_FLIGHT
from qosd.logs import MalformedHttpQuieted, quiet_malformed_http
from qosd.metrics import Metrics
from qosd.model import Outcome, Sample
from qosd.reload import plan_reload
from qosd.v1 import envoy_rls_pb2 as rls
from qosd_client import DuplicateRequestId, LatencySample, QosdClient, QosdError, Reason, Status
from qosd_client.v1 import qosd_pb2, qosd_pb2_grpc
from qosd_harness import RedisServer
from tests.conftest import BASE_CONFIG, DaemonFactory, merge
from tests.proxy_stack import MODEL, Stack, StackFactory, chat, make_stack
from tests.test_redis_store import busy, waits_unread
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


@dataclass(frozen=True)
class Answered:
    """A proxy's answer to one chat request, read whole."""

    status: int
    headers: dict[str, str]  # by lower-case name
    body: Any  # the JSON it carried


async def answer_to(stack: Stack, body: dict[str, Any] | None = None) -> Answered:
    """The proxy's answer to ``body`` (by default ``chat(3)``), over a raw HTTP client
    that neither retries nor raises."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url()}/chat/completions", json=body or chat(3)) as answer,
    ):
        headers = {name.lower(): value for name, value in answer.headers.items()}
        return Answered(answer.status, headers, await answer.json())


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


async def test_a_key_whose_class_is_not_configured_is_refused_as_unknown(
    make_stack: StackFactory,
) -> None:
    """The probe: a key whose class the config lacks (gone from it) met a header that
    named another class, and ``classes[key_class]`` raised KeyError: a 500. Now the
    key's class is refused as an unknown class, with or without the header."""
    stack = await make_stack(api_keys=keyed(old=("P9", "")))
    url = f"{stack.url()}/chat/completions"
    async with aiohttp.ClientSession() as session:
        for headers in ({"x-qos-class": "P2"}, {}):
            async with session.post(url, json=chat(3, max_tokens=2),
                                    headers={"authorization": "Bearer old", **headers}
                                    ) as answer:  # fmt: skip
                assert answer.status == 400, headers
                error = (await answer.json())["error"]
            assert error["param"] == "x-qos-class" and "P9" in error["message"]
    assert (await stack.status()).active_leases == 0


@asynccontextmanager
async def upstream(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]] | None = None,
    routes: Iterable[web.RouteDef] = (),
) -> AsyncIterator[str]:
    """An OpenAI-compatible upstream of the test's own, on a port of its own: ``handler``
    answers /v1/chat/completions, ``routes`` whatever else the test needs."""
    app = web.Application()
    if handler is not None:
        app.router.add_post("/v1/chat/completions", handler)
    app.add_routes(routes)
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
    the header. When its client leaves, the id is freed for the retry (a new request,
    within the pool's limits); once a request under it is answered, the id admits
    nothing (409 again)."""
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
        first.close()  # its client leaves
        await eventually(stack.status, lambda p: p.active_leases == 0)
        async with session.post(url, json=chat(4, max_tokens=4), headers=headers) as retried:
            assert retried.status == 200  # the retry, answered
            await retried.read()
        await eventually(stack.status, lambda p: p.active_leases == 0)
        again, body = await another()
        assert again == 409 and body["error"]["code"] == "duplicate_request_id"
        async with session.post(url, json=chat(4, max_tokens=4), headers={"x-request-id": "new"}
                                ) as fresh:  # fmt: skip
            assert fresh.status == 200


async def test_a_naming_header_given_twice_is_refused_naming_it(
    make_stack: StackFactory, make_daemon: DaemonFactory
) -> None:
    """The third probe: two ``Authorization`` headers (key ``bulk`` then ``mid``), two
    ``x-qos-class`` headers, were each read as the first, silently: which copy counts
    was the door's choice, and a gateway appending its own after the client's could
    name another key or class. Each header that names the request, its key, class,
    tenant or objectives is now refused when given twice (400 naming it), at the proxy
    and in gRPC metadata."""
    stack = await make_stack(api_keys=keyed(bulk=("P2", "batch"), mid=("P1", "acme")))
    url = f"{stack.url()}/chat/completions"
    async with aiohttp.ClientSession() as session:

        async def refused(headers: list[tuple[str, str]]) -> tuple[int, str]:
            async with session.post(url, json=chat(3, max_tokens=2), headers=headers) as answer:
                return answer.status, (await answer.json())["error"]["param"]

        keys = [("authorization", "Bearer bulk"), ("authorization", "Bearer mid")]
        assert await refused(keys) == (400, "authorization")
        named = [("authorization", "Bearer mid"), ("x-qos-class", "P2"), ("x-qos-class", "P1")]
        assert await refused(named) == (400, "x-qos-class")
        hints = [("authorization", "Bearer mid"), ("x-dynamo-request-priority", "1"),
                 ("x-dynamo-request-priority", "9")]  # fmt: skip
        assert await refused(hints) == (400, "x-dynamo-request-priority")
    assert await decisions(stack, "P1") == 0 and await decisions(stack, "P2") == 0
    running = await make_daemon()
    metadata = (("x-llm-d-inference-objective", "critical"),
                ("x-llm-d-inference-objective", "sheddable"))  # fmt: skip
    async with grpc.aio.insecure_channel(running.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await qosd_pb2_grpc.QoSStub(channel).Acquire(
                qosd_pb2.AcquireRequest(model="llama-3-8b", input_tokens=5), metadata=metadata
            )
    assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "x-llm-d-inference-objective: given 2 times" in (failed.value.details() or "")


async def test_one_tenants_request_ids_are_not_anothers(make_stack: StackFactory) -> None:
    """The third probe: behind keys, key ``bulk`` answered under ``x-request-id:
    victim-0001`` left key ``mid`` (another tenant) refused with 409 under the same id
    for the lease's TTL: one tenant could hold another's predictable ids, and learn
    from the 409 which were in use. Ids are a tenant's own now; within a tenant, one id
    still names one request."""
    stack = await make_stack(api_keys=keyed(bulk=("P2", "batch"), mid=("P1", "acme")))
    url = f"{stack.url()}/chat/completions"
    async with aiohttp.ClientSession() as session:

        async def status(key: str) -> int:
            headers = {"authorization": f"Bearer {key}", "x-request-id": "victim-0001"}
            async with session.post(url, json=chat(3, max_tokens=2), headers=headers) as answer:
                return answer.status

        assert await status("bulk") == 200
        assert await status("mid") == 200
        assert await status("mid") == 409  # its own id, answered: taken for the TTL


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


@pytest.mark.parametrize(
    ("path", "body", "number"),
    [
        ("/v1/release", b'{"lease_id": "default:P1:x", "outcome": 1e400}', "1e400"),
        ("/v1/report", b'{"samples": [{"status": -1e999}]}', "-1e999"),
        ("/v1/acquire", b'{"qos_class": "P1", "input_tokens": 5, "max_wait_ms": 1E+999}', "1E+999"),
    ],
    ids=["release-outcome", "report-status", "acquire-wait"],
)
async def test_json_api_numbers_beyond_a_double_are_400s(
    make_daemon: DaemonFactory, path: str, body: bytes, number: str
) -> None:
    """The probe: ``1e400`` reads as infinity, which protobuf's converters met with
    OverflowError (not its ParseError), and the JSON API answered 500. Now it is a 400
    naming the number."""
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n".encode()
    code, answer = await raw_request(running.daemon.http.address, head, body)
    assert code == 400
    error = json.loads(answer)
    assert error["code"] == "INVALID_ARGUMENT"
    assert number in error["message"] and "out of range" in error["message"]


async def test_json_api_unknown_paths_and_methods_answer_in_its_format(
    make_daemon: DaemonFactory,
) -> None:
    """The probe: an unknown path or a wrong method on the daemon's HTTP listener got
    aiohttp's text pages, not the API's error format. Now each is ``{"code",
    "message"}`` (404, or 405 with ``Allow``), and every route answers as before."""
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    base = f"http://{running.daemon.http.address}"
    async with aiohttp.ClientSession() as session:
        for method, path, status, allow in [
            ("GET", "/v1/nope", 404, None),
            ("POST", "/v1/acquire/", 404, None),
            ("GET", "/v1/acquire", 405, "POST"),
            ("POST", "/v1/status", 405, "GET, HEAD"),
            ("DELETE", "/metrics", 405, "GET, HEAD"),
        ]:
            async with session.request(method, f"{base}{path}") as answer:
                assert answer.status == status, (method, path)
                assert answer.content_type == "application/json"
                error = await answer.json()
                assert error["code"] == ("NOT_FOUND" if status == 404 else "UNIMPLEMENTED")
                assert path in error["message"]
                assert answer.headers.get("Allow") == allow
        async with session.get(f"{base}/metrics") as page:
            assert page.status == 200 and page.content_type == "text/plain"
            assert "qosd_acquire_decisions_total" in await page.text()
        async with session.get(f"{base}/openapi.json") as document:
            assert document.status == 200
            assert "/v1/acquire" in (await document.json())["paths"]
        async with session.get(f"{base}/healthz") as healthz:
            assert healthz.status == 200 and await healthz.text() == "ok\n"
        async with session.get(f"{base}/readyz") as readyz:
            assert readyz.status == 200 and (await readyz.json())["ready"] is True
        async with session.get(f"{base}/v1/status") as shown:
            assert shown.status == 200


async def test_json_api_bounds_query_parameters(make_daemon: DaemonFactory) -> None:
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    base = f"http://{running.daemon.http.address}/v1/status"
    async with aiohttp.ClientSession() as session:
        for query in ("history=" + "9" * 20, "history=-1", "history=1e3", "tenant=a%00b",
                      "pool=default&pool=other", "history=1&history=2"):  # fmt: skip
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


async def test_a_prompt_beside_messages_counts_in_the_cost(make_stack: StackFactory) -> None:
    """The probe: ``{"messages": [], "prompt": "word " * 80000}`` to /v1/completions
    was admitted as 7 tokens, the prompt left out of the estimate because the body
    had a ``messages`` list, while an upstream that reads the prompt prefills it all.
    Now both count, whatever the route."""
    go_on = asyncio.Event()

    async def holding(request: web.Request) -> web.Response:
        await go_on.wait()
        return web.json_response(completion())

    prompt = "word " * 8_000
    async with upstream(routes=[web.post("/v1/completions", holding)]) as url:
        stack = await make_stack(upstream=url)
        body = {"model": MODEL, "messages": [], "prompt": prompt, "max_tokens": 1}
        async with aiohttp.ClientSession() as session:
            asking = asyncio.create_task(session.post(f"{stack.url()}/completions", json=body))
            pool = await eventually(stack.status, lambda p: p.cls("P1").in_flight == 1)
            assert pool.cls("P1").in_flight_tokens >= len(prompt) / 4  # the prior: 4 bytes each
            go_on.set()
            answered = await asking
            assert answered.status == 200, await answered.text()
            answered.release()
        assert (await eventually(stack.status, lambda p: p.active_leases == 0)).active_leases == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "llama-3-8b", "max_tokens": ' + b"9" * 5_000 + b', "messages": []}', "body"),
        (b'{"model": "llama-3-8b", "messages": ' + b"[" * 2_000 + b"]" * 2_000 + b"}", "body"),
        (b'{"model": "llama-3-8b", "messages": [{"content": "\xff"}]}', "body"),
        (json.dumps(chat(stream=True, stream_options=5)).encode(), "stream_options"),
        (json.dumps(chat(stream="yes")).encode(), "stream"),
        (b'{"model": "llama-3-8b", "temperature": 1e400, "messages": []}', "body"),
    ],
    ids=["5000-digits", "nested-2000", "invalid-utf8", "stream-options-5", "stream-yes", "1e400"],
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


# -- callers that leave, and reloads ---------------------------------------------------


def p1_waiting(status: Status) -> int:
    return status.pool("default").cls("P1").waiting


async def test_a_json_caller_that_leaves_while_queued_leaves_no_waiter_and_no_lease(
    make_daemon: DaemonFactory,
) -> None:
    """The probe: a JSON caller that disconnected while its Acquire waited in the queue
    was still admitted when its turn came, on a lease nobody released (held to the
    TTL). Now its handler is cancelled as a gRPC call is: it leaves the queue, nothing
    is admitted for it, and its request id is freed as a cancelled gRPC waiter's is
    (docs/api.md, Idempotency): the retry is decided anew."""
    running = await make_daemon(
        {**HTTP, "pools": {"default": {"max_in_flight": 1, "top_reserve": 0}},
         "classes": {"P1": {"max_wait_ms": 30_000}}}
    )  # fmt: skip
    qos = running.client
    assert running.daemon.http is not None
    url = f"http://{running.daemon.http.address}/v1/acquire"
    held = await qos.acquire("P1", 10, request_id="holder")
    assert held.admitted
    async with aiohttp.ClientSession() as session:
        asking = asyncio.create_task(
            session.post(url, json={"qos_class": "P1", "input_tokens": 10, "request_id": "json"})
        )
        assert p1_waiting(await eventually(qos.status, lambda s: p1_waiting(s) == 1)) == 1
        asking.cancel()  # closes the connection
        with pytest.raises(asyncio.CancelledError):
            await asking
        assert p1_waiting(await eventually(qos.status, lambda s: p1_waiting(s) == 0)) == 0
        # The same over gRPC, to compare the ids.
        over_grpc = asyncio.create_task(qos.acquire("P1", 10, request_id="grpc"))
        assert p1_waiting(await eventually(qos.status, lambda s: p1_waiting(s) == 1)) == 1
        over_grpc.cancel()
        with pytest.raises(asyncio.CancelledError):
            await over_grpc
        assert p1_waiting(await eventually(qos.status, lambda s: p1_waiting(s) == 0)) == 0
        # Both ids were freed as their callers left the queue: each retry is decided
        # anew (refused here, the one slot held), not refused as a reuse.
        retried = await qos.acquire("P1", 10, request_id="grpc", max_wait_ms=0)
        assert not retried.admitted and retried.reason is not Reason.NONE
        retry = {"qos_class": "P1", "input_tokens": 10, "request_id": "json", "max_wait_ms": 0}
        async with session.post(url, json=retry) as again:
            assert again.status == 200
            assert (await again.json())["decision"] == "DECISION_REJECTED"
        await qos.release(held.lease_id)
        # Nothing was admitted for the callers who left: the one slot is free at once.
        async with session.post(
            url, json={"qos_class": "P1", "input_tokens": 10, "max_wait_ms": 0}
        ) as fresh:
            assert fresh.status == 200
            admitted = await fresh.json()
        assert admitted["decision"] == "DECISION_ADMITTED"
    assert (await qos.status()).pool("default").active_leases == 1
    await qos.release(admitted["lease_id"])
    assert (await qos.status()).pool("default").active_leases == 0


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_a_json_release_whose_caller_leaves_runs_to_its_end(
    make_daemon: DaemonFactory, redis_standalone: RedisServer
) -> None:
    """A Release whose caller leaves while it is in the store (Redis busy) is not cut
    there: it settles the lease and is counted, as if the caller had stayed (its
    caller, gone, could not retry it). The daemon's own store traffic is stilled, so
    that what reaches the busy Redis is the Release."""
    running = await make_daemon(
        {"server": {"http_listen": "127.0.0.1:0", "health_check_interval_s": 60},
         "control": {"enabled": False}, "redis": {"timeout_ms": 10_000}}
    )  # fmt: skip
    assert running.daemon.http is not None
    held = await running.client.acquire("P1", 10)
    released = running.daemon.metrics.releases.labels("OK", "OK")
    async with aiohttp.ClientSession() as session:
        blocker = await busy(redis_standalone, 1_000)
        leaving = asyncio.create_task(
            session.post(f"http://{running.daemon.http.address}/v1/release",
                         json={"lease_id": held.lease_id})
        )  # fmt: skip
        await waits_unread(redis_standalone, 1.0)  # the Release waits in Redis
        leaving.cancel()  # the caller leaves
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await blocker
    assert await until(lambda: released._value.get() == 1)
    assert (await running.client.status()).pool("default").active_leases == 0


def test_a_sample_of_a_class_the_config_lacks_is_stored_not_judged() -> None:
    """The probe: ``judge_samples`` looked each sample's class up in the config of the
    moment, and a class missing there (samples validated under another config) raised
    KeyError after the samples were stored: a failed Report that had succeeded. Now
    such a sample is not judged; the others are."""
    slo = {"classes": {"P1": {"slo": {"ttft_ms": 100}}}}
    config = Config.model_validate(merge(BASE_CONFIG, slo))
    metrics = Metrics()

    def sample(qos_class: str) -> Sample:
        return Sample(pool="default", qos_class=qos_class, tenant="", ttft_ms=50.0,
                      tpot_ms=None, e2e_ms=None, input_tokens=10, output_tokens=1,
                      status=Outcome.OK)  # fmt: skip

    judge_samples(metrics, config, [sample("gone"), sample("P1")])
    judged = {(s.labels["class"], s.labels["result"]): s.value
              for family in metrics.registry.collect() if family.name == "qosd_slo_samples"
              for s in family.samples if s.name.endswith("_total")}  # fmt: skip
    assert judged == {("P1", "met"): 1.0, ("P1", "missed"): 0.0}


async def test_an_envoy_answer_states_the_limits_of_the_config_it_was_decided_under(
    make_daemon: DaemonFactory,
) -> None:
    """The probe: ShouldRateLimit read the config again after its wait, so a reload
    in between answered with the new mapping (and a class gone from it would have
    been an error status, which Envoy answers by letting the request through). Now
    one snapshot serves the whole call: a reload that halves ``tokens_per_hit``
    during the wait leaves the answer in the hits it was asked in."""
    running = await make_daemon(
        {"envoy_rls": {"tokens_per_hit": 100, "max_wait_ms": 30_000},
         "pools": {"default": {"max_in_flight": 1, "top_reserve": 0}},
         "classes": {"P1": {"max_wait_ms": 30_000}}}
    )  # fmt: skip
    qos = running.client
    held = await qos.acquire("P1", 10)
    request = rls.RateLimitRequest(domain="llm")
    descriptor = request.descriptors.add()
    descriptor.entries.add(key="qos_class", value="P1")
    descriptor.entries.add(key="tokens", value="10")
    async with grpc.aio.insecure_channel(running.address) as channel:
        should = channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            request_serializer=rls.RateLimitRequest.SerializeToString,
            response_deserializer=rls.RateLimitResponse.FromString,
        )
        asking = asyncio.ensure_future(should(request, timeout=30))
        assert p1_waiting(await eventually(qos.status, lambda s: p1_waiting(s) == 1)) == 1
        config = running.daemon.config
        halved = config.model_copy(
            update={"envoy_rls": config.envoy_rls.model_copy(update={"tokens_per_hit": 50})}
        )
        running.daemon.apply(plan_reload(config, halved, sample_ratio_live=False))
        await qos.release(held.lease_id)
        answer: rls.RateLimitResponse = await asking
    assert answer.overall_code == rls.RateLimitResponse.OK
    # P1's rate is 3,000 tokens/s: 30 hits of 100 tokens, as asked (60 of 50 after).
    assert answer.statuses[0].current_limit.requests_per_unit == 30


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
        answered = await answer_to(stack)
        assert answered.status == 502
        error = answered.body["error"]
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


async def test_a_200_that_is_no_answer_is_no_success(make_stack: StackFactory) -> None:
    """The probe: a stream that closed cleanly after half an event, with no ``[DONE]``,
    ended as a whole 200 (the SDK returned a short answer silently, settled as OK),
    and a 200 whose body was not JSON was relayed as ``application/json`` (the SDK
    raised a bare JSONDecodeError). Now the first ends with an error event and the
    second is a 502 ``upstream_invalid``; both settle as errors. A stream closed with
    no ``[DONE]`` after every choice's ``finish_reason`` is whole, as TGI before 2.2
    and llama.cpp's server before September 2024 end one. And a usage chunk
    the client did not ask for is dropped even when its usage cannot be read (a
    chunk with no choices broke ``chunk.choices[0]``)."""

    async def broken(request: web.Request) -> web.StreamResponse:
        asked = await request.json()
        if not asked.get("stream"):
            return web.Response(body=b"<html>oops</html>", content_type="application/json")
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(content_chunk("a")).encode() + b"\n\n")
        said = asked["messages"][0]["content"]
        if said.startswith("usage"):
            bad = {**usage_chunk(3, 1), "usage": "lots"}
            await response.write(b"data: " + json.dumps(bad).encode() + b"\n\ndata: [DONE]\n\n")
        elif said.startswith("finished"):  # as TGI before 2.2 ends a stream: no [DONE]
            last = content_chunk("b")
            last["choices"][0]["finish_reason"] = "stop"
            await response.write(b"data: " + json.dumps(last).encode() + b"\n\n")
        elif not said.startswith("whole"):  # "whole": whole events, and no [DONE]
            await response.write(b'data: {"id": "c", "choi')  # and a clean close
        return response

    async with upstream(broken) as url:
        stack = await make_stack(upstream=url)
        client = stack.client(max_retries=0)
        with pytest.raises(openai.InternalServerError) as whole:
            await client.chat.completions.create(**chat(3))
        assert whole.value.status_code == 502 and "upstream_invalid" in str(whole.value.body)
        stream = await client.chat.completions.create(**chat(3, stream=True))
        got: list[str] = []
        with pytest.raises(openai.APIError, match="middle of a line"):
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content or "")
        assert got == ["a"]  # and not half an event
        no_done = chat(3, stream=True)
        no_done["messages"][0]["content"] = "whole " + no_done["messages"][0]["content"]
        stream = await client.chat.completions.create(**no_done)
        with pytest.raises(openai.APIError, match="before its data: \\[DONE\\]"):
            async for _ in stream:
                pass
        finished = chat(3, stream=True)
        finished["messages"][0]["content"] = "finished " + finished["messages"][0]["content"]
        stream = await client.chat.completions.create(**finished)
        assert [chunk.choices[0].delta.content async for chunk in stream] == ["a", "b"]
        usage_asked = chat(3, stream=True)
        usage_asked["messages"][0]["content"] = "usage " + usage_asked["messages"][0]["content"]
        stream = await client.chat.completions.create(**usage_asked)
        assert [chunk.choices[0].delta.content async for chunk in stream] == ["a"]
        await client.close()
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
        assert pool.active_leases == 0
    page = await metrics_page(stack)
    assert 'qosd_releases_total{outcome="ERROR",result="OK"} 3.0' in page
    assert 'qosd_releases_total{outcome="OK",result="OK"} 2.0' in page


@pytest.mark.parametrize(
    ("sent", "passed"),
    [
        (
            {"retry-after": "7", "retry-after-ms": "7000"},
            {"retry-after": "7", "retry-after-ms": "7000"},
        ),
        ({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, {"retry-after": "0"}),  # past
        ({"retry-after": "1e9", "retry-after-ms": "-5"}, {}),
        ({"retry-after": "٧", "retry-after-ms": "99999999999"}, {}),  # Arabic-Indic 7; > a day
    ],
)
async def test_the_upstreams_own_pause_reaches_the_client(
    make_stack: StackFactory, sent: dict[str, str], passed: dict[str, str]
) -> None:
    """The probe: an upstream's 429 and 503 with ``retry-after: 7`` reached the client
    without it, so the SDK came back after half a second into a server that had asked
    for seven, and qosd admitted and charged each retry. The upstream's pause now goes
    on, when it is well formed and within a day."""

    async def overloaded(request: web.Request) -> web.Response:
        error = {"error": {"message": "busy", "type": "overloaded", "code": None}}
        return web.json_response(error, status=429, headers=sent)

    async with upstream(overloaded) as url:
        stack = await make_stack(upstream=url)
        answered = await answer_to(stack)
    assert answered.status == 429
    got = {name: answered.headers[name] for name in ("retry-after", "retry-after-ms")
           if name in answered.headers}  # fmt: skip
    assert got == passed


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
        answered = await answer_to(stack)
        assert answered.status == 504 and answered.body["error"]["code"] == "upstream_timeout"
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
    estimated = stack.proxies[0].proxy.estimator.prompt_tokens(MODEL, PromptSize(8_192))
    assert 1_500 <= estimated <= 3_000  # about 8 KB at ~4 bytes a token
    answer = await client.chat.completions.create(**chat(1_640, max_tokens=1))  # 8 KB
    assert answer.usage is not None and answer.usage.prompt_tokens == 1_640
    # Even a prompt whose estimate is past the class's burst is admitted (against a
    # full bucket), and settled from the real usage.
    answer = await client.chat.completions.create(**chat(20_000, max_tokens=1))  # ~100 KB
    assert answer.usage is not None and answer.usage.prompt_tokens == 20_000
    await client.close()
    assert await decisions(stack, "P1") == 3


async def test_an_image_is_no_free_prompt(make_stack: StackFactory) -> None:
    """The probe: an 800 KB base64 image, 50 image URLs or 800 KB of audio each took 8
    tokens of a 17,500-token bucket, and an upstream's 50,000 prompt tokens for them
    were settled one burst at a time: a vision model's long prefill passed the budget,
    ``max_in_flight_tokens`` and the long-prefill gate as nearly free. Each media part
    now costs the tokens learned for the model's parts, from a prior above what common
    vision encoders make of an image."""
    go_on = asyncio.Event()

    async def holding(request: web.Request) -> web.Response:
        await go_on.wait()
        return web.json_response(completion(prompt_tokens=2 * 3_000 + 10))

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 800_000}}
    audio = {"type": "input_audio", "input_audio": {"data": "A" * 1_000, "format": "wav"}}
    content = [{"type": "text", "text": "what is this?"}, image, audio]
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
    assert prompt_size(body) == PromptSize(len(b"what is this?"), 2)
    async with upstream(holding) as url:
        stack = await make_stack(upstream=url)
        async with aiohttp.ClientSession() as session:
            asking = asyncio.create_task(session.post(f"{stack.url()}/chat/completions", json=body))
            pool = await eventually(stack.status, lambda p: p.cls("P1").in_flight == 1)
            assert pool.cls("P1").in_flight_tokens >= 2 * PRIOR_MEDIA_PART_TOKENS
            go_on.set()
            answered = await asking
            assert answered.status == 200, await answered.text()
            answered.release()
        assert (await eventually(stack.status, lambda p: p.active_leases == 0)).active_leases == 0
    # The response's usage, less the text's estimate, is learned per part: about
    # 3,000 each here, one step of MEDIA_LEARNING_RATE from the prior.
    learned = stack.proxies[0].proxy.estimator.media_part_tokens[MODEL]
    assert learned == pytest.approx(PRIOR_MEDIA_PART_TOKENS + 0.05 * (3_000 - 1_600), abs=2)


async def test_the_first_prompts_are_counted_by_the_upstream_before_any_usage(
    make_stack: StackFactory,
) -> None:
    """Usage comes with an answer's last token, so the first seconds of traffic were
    admitted on the prior alone: 2-byte tokens at half their count. While the fit has
    little evidence the proxy asks the upstream's /tokenize (vLLM's) to count the
    prompts it sees, and learns from the counts; once it has enough, it stops asking.
    The upstream here reports no usage at all: what is learned is the counts'."""
    asked: list[dict[str, Any]] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        asked.append(body)
        words = sum(len(m["content"].split()) for m in body["messages"])
        return web.json_response({"count": words, "max_model_len": 8192, "tokens": []})

    async def no_usage(request: web.Request) -> web.Response:
        answer = completion()
        del answer["usage"]
        return web.json_response(answer)

    routes = [web.post("/tokenize", tokenize)]
    roomy = {"pools": {"default": {"capacity_tokens_s": 10_000_000}}}  # none of them waits
    async with upstream(no_usage, routes) as url:
        stack = await make_stack(roomy, upstream=url)
        proxy = stack.proxies[0].proxy
        prior = proxy.estimator.prompt_tokens(MODEL, PromptSize(2 * 3_000))
        assert prior < 2_000  # 3,000 two-byte tokens, taken for about 1,500
        client = stack.client(max_retries=0)
        for words in range(100, 100 + 150 * 20, 20):
            await client.chat.completions.create(**chat_of(" w" * words, max_tokens=1))
            await proxy.prompt_counter.idle()
        await client.close()
    # Asked while the evidence was short of CALIBRATION_EVIDENCE answers, then not.
    assert CALIBRATION_EVIDENCE <= len(asked) < 150
    assert asked[0]["model"] == MODEL and asked[0]["add_generation_prompt"] is True
    assert proxy.estimator.prompt_tokens(MODEL, PromptSize(2 * 3_000)) == pytest.approx(
        3_000, rel=0.03
    )
    assert counted(stack, "learned") == len(asked)


async def test_an_upstream_that_counts_no_prompts_is_asked_once(make_stack: StackFactory) -> None:
    """A server without /tokenize (404) is not asked again, and the estimate goes on
    learning from usage alone; a count the fit cannot take teaches nothing."""

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(completion(prompt_tokens=400))

    async with upstream(answer) as url:
        stack = await make_stack(upstream=url)
        proxy = stack.proxies[0].proxy
        client = stack.client(max_retries=0)
        for _ in range(3):
            await client.chat.completions.create(**chat_of(" w" * 400, max_tokens=1))
            await proxy.prompt_counter.idle()
        await client.close()
    assert proxy.prompt_counter.without_route == {url}
    assert counted(stack, "unsupported") == 1 and counted(stack, "learned") == 0
    # Usage goes on teaching the fit: 400 tokens of 800 bytes, from the prior's 208.
    assert proxy.estimator.prompt_tokens(MODEL, PromptSize(800)) > 220


async def test_a_count_that_never_comes_is_not_in_the_requests_way(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An upstream whose /tokenize hangs: the requests are answered all the same, at
    most IN_FLIGHT counts wait on it, and stopping the proxy ends them. (The counts'
    own timeout is lifted, so that a slow machine cannot end them first.)"""
    monkeypatch.setattr(tokenize_module, "TIMEOUT_S", 600.0)
    never = asyncio.Event()
    hanging = 0

    async def tokenize(request: web.Request) -> web.Response:
        nonlocal hanging
        hanging += 1
        await never.wait()
        return web.json_response({"count": 1})

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(completion(prompt_tokens=400))

    async with upstream(answer, [web.post("/tokenize", tokenize)]) as url:
        stack = await make_stack(upstream=url)
        client = stack.client(max_retries=0)
        for _ in range(IN_FLIGHT + 3):
            answered = await client.chat.completions.create(**chat_of(" w" * 400, max_tokens=1))
            assert answered.usage is not None and answered.usage.prompt_tokens == 400
        await client.close()
        counter = stack.proxies[0].proxy.prompt_counter
        assert await until(lambda: hanging == IN_FLIGHT)
        assert counter.asking == IN_FLIGHT
        await stack.proxies[0].stop()  # cancels the counts still asked
        assert counter.asking == 0


def counted(stack: Stack, result: str) -> float:
    """The proxy's prompt counts with this result, from its /metrics page."""
    wanted = f'qosd_proxy_prompt_counts_total{{model="{MODEL}",result="{result}"}} '
    for line in stack.proxies[0].daemon.metrics.exposition().decode().splitlines():
        if line.startswith(wanted):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat_of(content: str, **body: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **body}


def test_the_prior_ages_out_of_the_estimate() -> None:
    """Held at its full weight, the prior kept a fit of 2-byte tokens 0.2 % short
    however many responses came: 4,077 tokens for 4,085, under a long-prefill
    threshold of 4,081 that the gateway loop's true counts passed. It ages as the
    responses do: after a thousand the fit is theirs."""
    estimator = Estimator()
    for i in range(1_000):
        words = 200 + (i * 37) % 4_000
        estimator.learn(MODEL, "P1", PromptSize(2 * words), Usage(words, 1))
    assert estimator.prompt_tokens(MODEL, PromptSize(2 * 4_085)) == 4_085
    assert estimator.prompt_tokens(MODEL, PromptSize(2 * 300)) == 300


def test_media_part_costs_are_learned_per_model_and_bounded() -> None:
    """A text-only response teaches the text fit, one with parts the part cost; usage
    past what the parts could cost teaches nothing."""
    estimator = Estimator()
    with_image = PromptSize(text_bytes=40, media_parts=1)
    before = estimator.prompt_tokens("vl", with_image)
    assert before >= PRIOR_MEDIA_PART_TOKENS
    for _ in range(200):
        estimator.learn("vl", "P1", with_image, Usage(600, 1))  # LLaVA's 576 and text
    assert 560 <= estimator.prompt_tokens("vl", with_image) <= 640
    assert estimator.prompt_tokens("other", with_image) == before  # per model
    assert estimator.prompt_tokens("vl", PromptSize(40)) < 30  # text unchanged by parts
    estimator.learn("vl", "P1", with_image, Usage(10**6, 1, credible=True))
    assert estimator.prompt_tokens("vl", with_image) <= 640  # beyond any part: not learned
    for _ in range(500):  # tiny images: a part is never learned below MIN_MEDIA_PART_TOKENS
        estimator.learn("vl", "P1", with_image, Usage(12, 1))
    assert estimator.prompt_tokens("vl", with_image) >= MIN_MEDIA_PART_TOKENS
    # A part whose type is not a string is a part, not a crash (it was a 500).
    odd = {"messages": [{"role": "user", "content": [{"type": ["x"]}, {"text": "hi"}]}]}
    assert prompt_size(odd) == PromptSize(len(b"hi"), 1)


# -- the proxy's own faults (issue: a static review of the proxy) ----------------------


def content_chunk(text: str = "tok") -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [choice]}  # fmt: skip


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip
    return {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [], "usage": usage}  # fmt: skip


async def sse(
    request: web.Request, *chunks: dict[str, Any], done: bool = True
) -> web.StreamResponse:
    """``chunks`` as server-sent events, then ``[DONE]``."""
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    if done:
        await response.write(b"data: [DONE]\n\n")
    return response


def in_memory_spans() -> tuple[InMemorySpanExporter, GenAiTelemetry]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return spans, GenAiTelemetry(provider.get_tracer("test"))


def proxy_answers(stack: Stack, code: int) -> float:
    """The proxy's count of its answers to P1 requests with ``code``."""
    counter = stack.proxies[0].daemon.metrics.proxy_requests.labels(MODEL, "P1", str(code))
    return float(counter._value.get())


def test_a_negative_usage_is_no_usage() -> None:
    """The second probe: ``prompt_tokens: -7`` was clamped to 0 and the request settled
    as free. A count below 0 is no count: the usage is unread and the estimate stands."""
    assert Usage.parse({"prompt_tokens": -7, "completion_tokens": 3}, 1_000) is None
    assert Usage.parse({"prompt_tokens": 7, "completion_tokens": -1}, 1_000) is None
    assert Usage.parse({"prompt_tokens": 0, "completion_tokens": 3}, 1_000) == Usage(0, 3)


async def test_an_upstream_that_had_the_request_and_broke_off_is_charged(
    make_stack: StackFactory,
) -> None:
    """The second probe: an upstream that read the request, worked, then dropped the
    connection was answered as unreachable and the whole charge refunded, so a
    crashing upstream made its load free. Only a connection never made uses nothing;
    this one is a 502 ``upstream_cut``, settled at the estimate."""

    async def dropping(request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        request.transport.abort()  # no answer at all
        raise ConnectionResetError

    async with upstream(dropping) as url:
        stack = await make_stack(upstream=url)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{stack.url()}/chat/completions", json=chat(300, max_tokens=5)) as answer,
        ):
            assert answer.status == 502
            assert (await answer.json())["error"]["code"] == "upstream_cut"
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
    assert pool.active_leases == 0  # settled (upstream_cut: at the estimate, _used)


@pytest.mark.parametrize("count", [10**400, 10**18], ids=["400-digits", "1e18"])
async def test_absurd_usage_is_settled_at_the_limit_and_teaches_the_estimates_nothing(
    make_stack: StackFactory, count: int
) -> None:
    """The probe: ``"prompt_tokens"`` of 1 and 400 zeros raised OverflowError in the
    settlement, before its Release (the lease waited for its TTL), and in the
    telemetry; 10**18 skewed the estimates of the next thousands of requests. Now
    both are settled at once, at the limit, the span's counts are the limit's, and
    nothing is learned from them."""

    async def boasting(request: web.Request) -> web.StreamResponse:
        if (await request.json()).get("stream"):
            return await sse(request, content_chunk(), content_chunk(), usage_chunk(count, count))
        return web.json_response(completion(prompt_tokens=count, completion_tokens=count))

    spans, telemetry = in_memory_spans()
    async with upstream(boasting) as url:
        stack = await make_stack({"limits": {"max_request_tokens": 100_000}}, upstream=url,
                                 telemetry=telemetry)  # fmt: skip
        async with aiohttp.ClientSession() as session:
            for body in (chat(3), chat(3, stream=True, stream_options={"include_usage": True})):
                async with session.post(f"{stack.url()}/chat/completions", json=body) as answer:
                    assert answer.status == 200
                    text = await answer.text()
                assert str(count) in text  # passed on as it came
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
        assert pool.active_leases == 0
    proxy = stack.proxies[0].proxy
    await proxy.settled()
    assert proxy.estimator.fits == {} and proxy.estimator.output_tokens == {}
    assert 'qosd_releases_total{outcome="OK",result="OK"} 2.0' in await metrics_page(stack)
    assert proxy_answers(stack, 200) == 2 and proxy_answers(stack, 500) == 0
    counted = [(span.attributes or {}).get("gen_ai.usage.input_tokens")
               for span in spans.get_finished_spans()]  # fmt: skip
    assert counted == [100_000, 100_000]


async def test_tools_and_n_count_in_the_cost(make_stack: StackFactory) -> None:
    """The probe: a request with a ``tools`` array of 32K tokens was admitted as about
    8 tokens (past the too-large check, the long-prefill handling and the in-flight
    token bound), and ``n`` was never read. Now the tools' JSON counts in the prompt's
    estimate, the expected output is ``max_tokens`` times ``n``, and a request whose
    tools alone are past the limit is refused as too large."""
    go_on = asyncio.Event()

    async def holding(request: web.Request) -> web.Response:
        await go_on.wait()
        return web.json_response(completion())

    tools = [{"type": "function", "function": {"name": f"f{i}", "description": "word " * 100,
              "parameters": {"type": "object"}}} for i in range(80)]  # fmt: skip
    tools_bytes = len(json.dumps(tools))
    async with upstream(holding) as url:
        stack = await make_stack({"limits": {"max_request_tokens": 20_000}}, upstream=url)
        post = f"{stack.url()}/chat/completions"
        async with aiohttp.ClientSession() as session:
            asking = asyncio.create_task(
                session.post(post, json=chat(3, max_tokens=100, n=4, tools=tools))
            )
            pool = await eventually(stack.status, lambda p: p.cls("P1").in_flight == 1)
            # At 4 bytes a token (the prior), plus 4 answers of 100 tokens; it was ~111.
            assert pool.cls("P1").in_flight_tokens >= tools_bytes / 4 + 400
            go_on.set()
            answer = await asking
            assert answer.status == 200
            answer.release()
            async with session.post(post, json=chat(3, max_tokens=1, tools=tools * 20)) as big:
                assert big.status == 400  # 900 KB of tools: past 20,000 tokens at 32 bytes each
                error = (await big.json())["error"]
            assert error["param"] == "messages" and "limits.max_request_tokens" in error["message"]
        assert (await eventually(stack.status, lambda p: p.active_leases == 0)).active_leases == 0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (chat(max_tokens=10**23), "max_tokens"),
        (chat(max_completion_tokens=200_000), "max_completion_tokens"),
        (chat(n=0), "n"),
        (chat(n=129), "n"),
        (chat(n="2"), "n"),
        (chat(best_of=True), "best_of"),
        (chat(max_completion_tokens=None, max_tokens=-5), "max_tokens"),
    ],
    ids=[
        "max-tokens-1e23",
        "max-completion-tokens-past-limit",
        "n-0",
        "n-129",
        "n-string",
        "best-of-true",
        "max-tokens-negative-beside-a-null",
    ],
)
async def test_max_tokens_n_and_best_of_are_bounded_at_the_door(
    make_stack: StackFactory, body: dict[str, Any], param: str
) -> None:
    """The probe: a ``max_tokens`` of 10**23 went into a span attribute no int64 holds,
    and ``n`` was never read. Now ``max_tokens`` past ``limits.max_request_tokens``,
    and ``n`` or ``best_of`` that is not a whole number from 1 to 128, is a 400
    naming the field; no lease is taken."""
    stack = await make_stack({"limits": {"max_request_tokens": 100_000}})
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url()}/chat/completions", json=body) as answer,
    ):
        assert answer.status == 400
        error = (await answer.json())["error"]
    assert error["param"] == param and param in error["message"]
    assert (await stack.status()).active_leases == 0


async def test_a_large_body_is_parsed_off_the_loop_and_only_for_a_known_key(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe: an 8 MB ``{"messages": [[], [], ...]}`` held the event loop for
    seconds while it was parsed, and with ``--api-key`` a caller with no key could
    send it (the body was parsed before the key was checked). Now the key is checked
    first, and an unknown caller's body is never parsed; a large body is parsed in a
    thread while the loop goes on serving: a small request is answered here while
    the large one's parsing is held."""
    from qosd.doors.proxy import handler  # noqa: PLC0415 - patched where it is used

    parsed_in: list[int] = []
    released: list[bool] = []
    hold = threading.Event()
    from qosd.doors.bodies import (  # noqa: PLC0415 - the one patched over
        PARSE_OFF_LOOP_BYTES,
        parse_json,
    )

    def held_parse(raw: bytes) -> Any:
        parsed_in.append(threading.get_ident())
        if len(raw) > PARSE_OFF_LOOP_BYTES:
            released.append(hold.wait(10))  # on the loop, nothing would set it
        return parse_json(raw)

    monkeypatch.setattr(handler, "parse_json", held_parse)

    async def answering(request: web.Request) -> web.Response:
        return web.json_response(completion())

    big = b'{"model": "llama-3-8b", "max_tokens": 2, "messages": [' + b"[], " * 500_000 + b"[]]}"
    async with upstream(answering) as url:
        stack = await make_stack(api_keys=keyed(key=("P1", "")), upstream=url)
        post = f"{stack.url()}/chat/completions"
        as_json = {"content-type": "application/json"}
        keyed_json = {**as_json, "authorization": "Bearer key"}
        async with aiohttp.ClientSession() as session:
            async with session.post(post, data=big, headers=as_json) as refused:
                assert refused.status == 401
            assert parsed_in == []  # refused before its body was read
            large = asyncio.create_task(session.post(post, data=big, headers=keyed_json))
            assert await until(lambda: len(parsed_in) == 1)
            async with session.post(post, json=chat(3, max_tokens=2),
                                    headers={"authorization": "Bearer key"}) as small:  # fmt: skip
                assert small.status == 200
            hold.set()
            answer = await large
            assert answer.status == 200
            answer.release()
    assert released == [True]
    assert parsed_in[0] != threading.get_ident()  # not the event loop's thread


async def test_a_stream_that_breaks_after_its_200_ends_with_an_error_event(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probes: an event over 128 KiB (aiohttp's LineTooLong), an event with
    ``"choices": 5`` (a TypeError in the proxy), or any failure of the proxy's own
    once a stream's 200 had gone out, answered a 500 inside that stream: a second
    status line. Now an event up to ``--max-body-bytes`` is relayed whole, and
    ``choices: 5`` as it came; a longer event, or a failure of the proxy's own, ends
    the stream with an OpenAI error event. Every lease ends (ERROR where the stream
    broke), and each stream counts as a 200."""
    from qosd.doors.proxy import handler  # noqa: PLC0415 - patched where it is used

    async def odd(request: web.Request) -> web.StreamResponse:
        case = (await request.json())["messages"][0]["content"]
        first = {"long": content_chunk("x" * 300_000),
                 "too long": content_chunk("x" * 600_000),
                 "five": {**content_chunk(), "choices": 5},
                 "word": content_chunk()}[case]  # fmt: skip
        return await sse(request, first, content_chunk(), usage_chunk(3, 2))

    async with upstream(odd) as url:
        stack = await make_stack(upstream=url, max_body_bytes=500_000)

        async def streamed(case: str) -> str:
            body = {**chat(stream=True), "messages": [{"role": "user", "content": case}]}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{stack.url()}/chat/completions", json=body) as answer,
            ):
                assert answer.status == 200
                return await answer.text()

        long = await streamed("long")
        assert "x" * 300_000 in long and long.endswith("data: [DONE]\n\n")
        five = await streamed("five")
        assert '"choices": 5' in five and five.endswith("data: [DONE]\n\n")
        too_long = await streamed("too long")
        last = json.loads(too_long.rstrip("\n").rpartition("data: ")[2])
        assert last["error"]["code"] == "upstream_too_large" and "HTTP/1.1" not in too_long

        def failing(chunk: dict[str, Any]) -> bool:
            raise TypeError("a bug of the proxy's own")

        monkeypatch.setattr(handler, "has_content", failing)
        broken = await streamed("word")
        last = json.loads(broken.rstrip("\n").rpartition("data: ")[2])
        assert last["error"]["code"] == "internal_error" and "HTTP/1.1" not in broken
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
        assert pool.active_leases == 0
    await stack.proxies[0].proxy.settled()
    page = await metrics_page(stack)
    assert 'qosd_releases_total{outcome="OK",result="OK"} 2.0' in page
    assert 'qosd_releases_total{outcome="ERROR",result="OK"} 2.0' in page
    assert proxy_answers(stack, 200) == 4 and proxy_answers(stack, 500) == 0


async def test_a_client_that_stops_reading_is_taken_to_have_left(make_stack: StackFactory) -> None:
    """The probe: a client that stopped reading a stream, its connection left open,
    held its lease and the upstream's request for as long as it kept the connection.
    Now a write that waits past the client write timeout counts it as gone: a 499,
    its lease settled as cancelled, its upstream request closed."""
    ended = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        line = b"data: " + json.dumps(content_chunk("x" * 16_000)).encode() + b"\n\n"
        try:
            while True:
                await response.write(line)
        finally:
            ended.set()

    async with upstream(endless) as url:
        stack = await make_stack(upstream=url, client_write_timeout_s=0.5)
        host, _, port = stack.proxies[0].address.rpartition(":")
        body = json.dumps(chat(3, stream=True)).encode()
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
        reader.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(reader, (host, int(port)))
        await loop.sock_sendall(reader, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                                b"content-type: application/json\r\ncontent-length: "
                                + str(len(body)).encode() + b"\r\n\r\n" + body)  # fmt: skip
        try:  # and never reads
            assert await until(ended.is_set)
            pool = await eventually(stack.status, lambda p: p.active_leases == 0)
            assert pool.active_leases == 0
            assert await until(lambda: proxy_answers(stack, CLIENT_CLOSED) == 1)
        finally:
            reader.close()
    await stack.proxies[0].proxy.settled()
    assert 'qosd_releases_total{outcome="CANCELLED",result="OK"} 1.0' in await metrics_page(stack)


async def test_an_answer_past_the_limit_is_a_502_and_its_lease_ends(
    make_stack: StackFactory,
) -> None:
    """The probe: a whole answer was read into memory however large. Now one past
    ``--max-answer-bytes``, its length said or not, is a 502 in OpenAI's format
    (``upstream_too_large``), and its lease ends."""

    async def huge(request: web.Request) -> web.StreamResponse:
        body = json.dumps({**completion(), "padding": "x" * 200_000}).encode()
        if (await request.json())["max_tokens"] == 1:
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"content-type": "application/json"})
        response.enable_chunked_encoding()  # no length said
        await response.prepare(request)
        for start in range(0, len(body), 16_384):
            await response.write(body[start : start + 16_384])
        return response

    async with upstream(huge) as url:
        stack = await make_stack(upstream=url, max_answer_bytes=100_000)
        async with aiohttp.ClientSession() as session:
            for max_tokens in (1, 2):
                async with session.post(f"{stack.url()}/chat/completions",
                                        json=chat(3, max_tokens=max_tokens)) as answer:  # fmt: skip
                    assert answer.status == 502
                    error = (await answer.json())["error"]
                assert error["code"] == "upstream_too_large" and error["type"] == "upstream_error"
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
        assert pool.active_leases == 0
    await stack.proxies[0].proxy.settled()
    assert 'qosd_releases_total{outcome="ERROR",result="OK"} 2.0' in await metrics_page(stack)


async def test_models_are_listed_whatever_the_upstreams_answer(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probes: an upstream's ``{"data": null}`` or ``{"data": 5}`` made
    ``/v1/models`` aiohttp's text 500, and upstreams were asked one after another,
    each for up to the 300 s read timeout. Now they are asked at once, each for a few
    seconds; a model whose server answers nonsense or nothing is listed as a stub."""
    from qosd.doors.proxy import handler  # noqa: PLC0415 - patched where it is used

    monkeypatch.setattr(handler, "MODELS_TIMEOUT_S", 3.0)
    silent_now = 0
    never = asyncio.Event()

    async def listing(request: web.Request) -> web.Response:
        nonlocal silent_now
        kind = request.match_info["kind"]
        if kind == "silent":
            silent_now += 1
            await never.wait()
        good = {"object": "list", "data": [7, {"id": "m-good", "object": "model",
                                               "owned_by": "vllm"}]}  # fmt: skip
        return web.json_response({"null": {"data": None}, "five": {"data": 5}, "list": [1],
                                  "good": good}[kind])  # fmt: skip

    names = ["m-null", "m-five", "m-list", "m-silent-a", "m-silent-b", "m-good"]
    async with upstream(routes=[web.get("/{kind}/v1/models", listing)]) as url:
        kinds = [name.removeprefix("m-").partition("-")[0] for name in names]
        stack = await make_stack(
            upstreams=[f"{n}={url}/{k}" for n, k in zip(names, kinds, strict=True)]
        )
        async with aiohttp.ClientSession() as session:
            asking = asyncio.create_task(session.get(f"{stack.url()}/models"))
            assert await until(lambda: silent_now == 2, timeout_s=2.5)  # both at once
            answer = await asking
            assert answer.status == 200
            listed = (await answer.json())["data"]
            answer.release()
        never.set()
    assert [(m["id"], m["owned_by"]) for m in listed] == [
        *((name, "qosd-proxy") for name in names[:-1]),
        ("m-good", "vllm"),
    ]


async def test_a_clients_own_priority_never_goes_upstream(make_stack: StackFactory) -> None:
    """The probe: a client's ``priority`` field went upstream as it came, so that a
    client could jump vLLM's queue (``--scheduling-policy priority``). Now it is
    taken out; with ``--priority-upstreams`` the field is qosd's, from the class."""
    seen: list[Any] = []

    async def recording(request: web.Request) -> web.Response:
        seen.append((await request.json()).get("priority", "none"))
        return web.json_response(completion())

    async with upstream(recording) as url:
        for priority_upstreams in (False, True):
            stack = await make_stack(upstream=url, priority_upstreams=priority_upstreams)
            client = stack.client()
            await client.chat.completions.create(**chat(3), extra_body={"priority": -100})
            await client.close()
    assert seen == ["none", 1]  # P1: the second class


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_a_slow_client_holds_no_connection_past_its_deadlines(
    make_daemon: DaemonFactory, make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe (slowloris): on both HTTP listeners, a connection that sent nothing,
    half a head, or a head whose body never came was still open after 200 s, and
    1,100 of them took the daemon's descriptors (gRPC and /metrics failed with them).
    Now a connection that has not sent a whole head within the idle timeout
    (``server.http_idle_timeout_s``, 1 s here) is closed, and a body that has not
    come within the body timeout (0.5 s here, 30 s as shipped) is a 408."""
    from qosd.doors import bodies  # noqa: PLC0415 - patched where it is used

    monkeypatch.setattr(bodies, "BODY_TIMEOUT_S", 0.5)
    idle = {"server": {"http_listen": "127.0.0.1:0", "http_idle_timeout_s": 1}}
    running = await make_daemon(idle)
    stack = await make_stack(idle)
    assert running.daemon.http is not None
    for address, path in ((running.daemon.http.address, "/v1/acquire"),
                          (stack.proxies[0].address, "/v1/chat/completions")):  # fmt: skip
        host, _, port = address.rpartition(":")
        for sent in (b"", b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n"):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(sent)
            # The listener closes it: the read ends (no answer: no whole request came).
            assert await asyncio.wait_for(reader.read(), 10) == b"", (address, sent)
            writer.close()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{")  # fmt: skip
        status_line = await asyncio.wait_for(reader.readline(), 10)  # then it lingers
        writer.close()
        assert status_line.split()[1] == b"408", (address, status_line)
        # A body whose Content-Encoding does not decode (the second probe: a 500 and
        # two tracebacks a request): a 400 naming the body.
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\n"
                     b"content-encoding: deflate\r\ncontent-length: 4\r\n"
                     b"connection: close\r\n\r\nxxxx")  # fmt: skip
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert answer.split(b"\r\n", 1)[0].split()[1] == b"400", (address, answer[:300])
        assert b"body" in answer.partition(b"\r\n\r\n")[2]
    assert (await running.client.status()).pool("default").active_leases == 0


@pytest.mark.parametrize("backend", ["embedded"], indirect=True)
async def test_malformed_http_fills_no_log(
    make_daemon: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe: every malformed request (here a bad chunk size) was logged at ERROR
    with a traceback and the sender's bytes, unthrottled. Now twenty of them at once
    leave one WARNING line, with no traceback, and the listener answers on."""
    quiet_malformed_http()  # as `qosd serve` and `qosd proxy` configure their logging
    # A filter of this test's own: the process's one remembers when it last let a line
    # through, and a malformed request of an earlier test in the same second left
    # this one nothing to log.
    server_log = logging.getLogger("aiohttp.server")
    for installed in [f for f in server_log.filters if isinstance(f, MalformedHttpQuieted)]:
        server_log.removeFilter(installed)
    server_log.addFilter(MalformedHttpQuieted())
    running = await make_daemon(HTTP)
    assert running.daemon.http is not None
    host, _, port = running.daemon.http.address.rpartition(":")
    began = time.monotonic()
    for _ in range(20):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/acquire HTTP/1.1\r\nhost: x\r\n"
                     b"transfer-encoding: chunked\r\n\r\nzz\r\n")  # fmt: skip
        status_line = await asyncio.wait_for(reader.readline(), 10)
        assert status_line.split()[1] == b"400"
        writer.close()
    elapsed = time.monotonic() - began
    logged = [r for r in caplog.records if r.name == "aiohttp.server"]
    # One line a second at most: one, unless this machine took seconds for the twenty.
    assert 1 <= len(logged) <= 1 + math.ceil(elapsed), [r.getMessage() for r in logged]
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in logged)
    assert "Error handling request" in logged[0].getMessage()
    assert (await running.client.status()).pool("default").active_leases == 0


async def test_trace_context_goes_upstream_only_when_well_formed(
    make_stack: StackFactory,
) -> None:
    """The third probe: ``traceparent``, ``tracestate`` and
    ``endpoint-load-metrics-format`` went upstream as they came, malformed or not, and
    bytes that were not UTF-8 arrived as an empty value. Each goes on now only when
    well formed; trace context that does not parse is dropped whole, as W3C Trace
    Context asks, and the request is served."""
    seen: list[dict[str, str]] = []

    async def recording(request: web.Request) -> web.Response:
        seen.append({k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k))})
        return web.json_response(completion())

    parent = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    sent = [
        {"traceparent": parent, "tracestate": "vendor=x1", "endpoint-load-metrics-format": "TEXT"},
        {"traceparent": "00-zz-zz-01", "tracestate": "vendor=x1"},
        {"traceparent": "00-" + "0" * 32 + "-" + "b" * 16 + "-01"},  # an all-zero trace id
        {"traceparent": parent + "-more", "endpoint-load-metrics-format": "TEXT; rm -rf"},
        {"traceparent": parent, "tracestate": "x" * 513},
    ]
    async with upstream(recording) as url:
        stack = await make_stack(upstream=url)
        async with aiohttp.ClientSession() as session:
            for headers in sent:
                async with session.post(f"{stack.url()}/chat/completions", json=chat(3),
                                        headers=headers) as answer:  # fmt: skip
                    assert answer.status == 200
    assert seen == [
        {"traceparent": parent, "tracestate": "vendor=x1", "endpoint-load-metrics-format": "TEXT"},
        {},
        {},
        {},  # version 00 has four fields exactly
        {"traceparent": parent},
    ]


async def test_a_samples_correlation_fields_are_bounded(make_daemon: DaemonFactory) -> None:
    """The third probe: a sample's ``lease_id`` and ``traceparent``, kept for
    correlation only, were taken at 100,000 characters each. Each is bounded now, and
    a sample past a bound is rejected naming the field; the others are stored."""
    qos = (await make_daemon()).client
    base = LatencySample("llama-3-8b", "P1", ttft_ms=100.0)
    result = await qos.report([
        dataclasses.replace(base, lease_id="default:P1:" + "a" * 100_000),
        dataclasses.replace(base, traceparent="00-" + "0" * 100_000),
        dataclasses.replace(base, lease_id="default:P1:abc",
                            traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"),
    ])  # fmt: skip
    assert result.accepted == 1
    assert [(index, reason.split(" ")[0]) for index, reason in result.rejected] == [
        (0, "lease_id"),
        (1, "traceparent"),
    ]


async def test_a_report_as_large_as_allowed_is_stored_and_read_back(
    make_daemon: DaemonFactory,
) -> None:
    """The probe: on the embedded store a Report of 4,000 samples (the limit is 10,000)
    failed with a 500, its samples lost, and with a window of 20,000 the status read
    failed too (GetStatus, /metrics, the SLO loop) until the samples aged out: the
    call's values crossed into Lua as a function's arguments, past its C stack. On
    every store now: three Reports of 4,000, the status and the page read them all."""
    running = await make_daemon({**HTTP, "report": {"window_size": 12_000}})
    assert running.daemon.http is not None
    url = f"http://{running.daemon.http.address}"
    samples = [{"qos_class": "P1", "ttft_ms": 100 + i % 50} for i in range(4_000)]
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(f"{url}/v1/report", json={"samples": samples}) as answer:
                assert answer.status == 200, await answer.text()
                assert (await answer.json())["accepted"] == 4_000
        async with session.get(f"{url}/v1/status") as answer:
            assert answer.status == 200, await answer.text()
        async with session.get(f"{url}/metrics") as answer:
            assert answer.status == 200
            page = await answer.text()
    assert 'qosd_latency_window_samples{class="P1",pool="default"} 12000.0' in page


async def test_the_proxys_http_listener_is_no_way_around_its_keys(
    make_stack: StackFactory,
) -> None:
    """The probe: the proxy's ``--http-listen`` served the daemon's whole JSON API, so
    that a caller with no key could Acquire as P0 there while the OpenAI listener
    held it to its key's P2; and the review: so did its gRPC listener. Now the HTTP
    listener serves health and metrics only, and the gRPC listener no QoS call
    without ``auth.qos`` (``qosctl status`` still works there)."""
    stack = await make_stack({**HTTP, "envoy_rls": {"enabled": True}},
                             api_keys=keyed(**{"bulk-key": ("P2", "bulk")}))  # fmt: skip
    daemon = stack.proxies[0].daemon
    http = daemon.http
    assert http is not None
    async with QosdClient(daemon.addresses[0]) as qos:
        with pytest.raises(QosdError) as refused:
            await qos.acquire("P0", 10)
        assert "UNIMPLEMENTED" in str(refused.value)  # no QoS service there
        assert (await qos.status()).pool("default").active_leases == 0
    # Nor Envoy's ShouldRateLimit, which admits as Acquire does (the second probe).
    request = rls.RateLimitRequest(domain="llm")
    request.descriptors.add().entries.add(key="qos_class", value="P0")
    async with grpc.aio.insecure_channel(daemon.addresses[0]) as channel:
        should = channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            request_serializer=rls.RateLimitRequest.SerializeToString,
            response_deserializer=rls.RateLimitResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as unserved:
            await should(request, timeout=10)
    assert unserved.value.code() is grpc.StatusCode.UNIMPLEMENTED
    async with aiohttp.ClientSession() as session:
        body = {"qos_class": "P0", "model": MODEL, "input_tokens": 10}
        for path in ("/v1/acquire", "/v1/release", "/v1/report"):
            async with session.post(f"http://{http.address}{path}", json=body) as answer:
                assert answer.status == 404, path
        async with session.get(f"http://{http.address}/v1/status") as answer:
            assert answer.status == 404
        async with session.get(f"http://{http.address}/metrics") as answer:
            assert answer.status == 200
    assert (await stack.status()).active_leases == 0


@pytest.mark.parametrize(
    ("upstream_status", "body", "status", "code", "should_retry"),
    [
        (500, b"boom", 502, "upstream_error", None),
        (401, b'{"error": {"message": "bad key"}}', 502, "upstream_refused_proxy", "false"),
        (204, b"", 502, "upstream_error", "false"),
        (307, b"elsewhere", 502, "upstream_error", "false"),
        (422, b"<html>no</html>", 422, "upstream_422", "false"),
        (400, b'{"error": {"message": "bad field", "code": "x"}}', 400, "x", "false"),
        (409, b'{"error": {"message": "taken", "code": "y"}}', 409, "y", "false"),
        (503, b"busy", 503, "upstream_503", None),
    ],
    ids=["500-text", "401", "204", "307", "422-html", "400-openai", "409-openai", "503-text"],
)
async def test_an_upstream_status_reaches_the_client_as_the_clients_to_see(
    make_stack: StackFactory,
    upstream_status: int,
    body: bytes,
    status: int,
    code: str,
    should_retry: str | None,
) -> None:
    """The probe: an upstream's 500 (body ``boom``, text/plain) reached the client as a
    500, which the docs call a bug of the proxy; its 401 looked like the client's own
    key refused; 204, 304 and 299 went through too. Now the client's own faults and
    the upstream's overload go on, in OpenAI's format; anything else is a 502 naming
    the upstream's status. Either way the lease ends; and where no retry can help,
    the answer says so (the review: a wrong upstream key had each call retried)."""

    async def answering(request: web.Request) -> web.Response:
        # A redirect's Location (aiohttp would follow a 307 with the POST) goes nowhere
        # the proxy should send a request of a client's.
        where = {"Location": "http://127.0.0.1:9/v1/chat/completions"}
        return web.Response(status=upstream_status, body=body, content_type="text/plain",
                            headers=where if upstream_status == 307 else None)  # fmt: skip

    async with upstream(answering) as url:
        stack = await make_stack(upstream=url)
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f"{stack.url()}/chat/completions", json=chat(3), allow_redirects=False
            ) as answer,  # fmt: skip
        ):
            assert answer.status == status
            error = (await answer.json())["error"]
            # The SDKs retry 409, 429 and 5xx unless told: told where no retry can help.
            assert answer.headers.get("x-should-retry") == should_retry
        assert error["code"] == code
        assert (await eventually(stack.status, lambda p: p.active_leases == 0)).active_leases == 0


def released(releases: Any) -> float:
    """Every Release counted, whatever its outcome and result."""
    return float(sum(sample.value for metric in releases.collect() for sample in metric.samples
                     if sample.name.endswith("_total")))  # fmt: skip


async def test_a_drain_ends_an_endless_stream_within_its_grace(
    make_stack: StackFactory,
) -> None:
    """The probe: under SIGTERM a stream that never ended kept streaming for 80 s, and
    the proxy exited after 122 s (aiohttp's own 60 s shutdown), past Kubernetes' 30 s
    grace and so SIGKILL, its lease never released; then twice the grace. Now the
    drain lasts ``server.drain_grace_s``: the stream is then cut, and its lease
    released."""
    started = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = await sse(request, content_chunk(), done=False)
        started.set()
        await asyncio.Event().wait()  # never more
        return response

    grace = 2.0
    async with upstream(endless) as url:
        stack = await make_stack({"server": {"drain_grace_s": grace}}, upstream=url)
        running = stack.proxies[0]
        releases = running.daemon.metrics.releases
        async with aiohttp.ClientSession() as session:
            streaming = await session.post(f"{stack.url()}/chat/completions",
                                           json=chat(3, stream=True))  # fmt: skip
            await started.wait()
            assert (await stack.status()).active_leases == 1
            before = released(releases)
            began = time.monotonic()
            await asyncio.wait_for(running.stop(), 20)  # 60 s and more before
            took = time.monotonic() - began
            after = released(releases)
            with contextlib.suppress(aiohttp.ClientError):
                await streaming.read()  # cut: it ends
            streaming.release()
    assert after == before + 1  # its lease was released before the daemon stopped
    # The grace, then the cut: not twice the grace (the second probe saw aiohttp's
    # shutdown wait it once for the handlers and once more after cancelling them).
    assert grace <= took < 2 * grace, took


async def test_the_sdks_retry_of_a_refused_request_is_no_reuse(
    make_stack: StackFactory,
) -> None:
    """The second probe: with an ``x-request-id`` of its own, a request the upstream
    refused (503) was retried by the SDK, as invited, and refused as a reuse of the id
    (409, not retried), for the lease's whole TTL. A request the upstream refused or
    never got used nothing: its admission is undone and its id freed, so the retry is
    admitted anew, and answered."""
    answered: list[int] = []

    async def busy_once(request: web.Request) -> web.Response:
        answered.append(len(answered))
        if len(answered) == 1:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return web.json_response(completion())

    async with upstream(busy_once) as url:
        stack = await make_stack(upstream=url)
        client = stack.client(max_retries=2)
        done = await client.chat.completions.create(
            **chat(3), extra_headers={"x-request-id": "gw-7-000001"}
        )
        await client.close()
    assert done.choices and answered == [0, 1]
    assert (await eventually(stack.status, lambda p: p.active_leases == 0)).active_leases == 0


async def test_the_retry_of_a_request_that_failed_on_its_way_is_no_reuse(
    make_stack: StackFactory,
) -> None:
    """The third probe: with an ``x-request-id`` of its own, a request whose upstream
    went silent got a 504, which the SDK retried as invited, and the retry was refused
    as a reuse of the id (409), hiding the 504; so after a cut (502) or a proxy fault
    (500). A request that failed on its way, or whose client left, is now settled and
    its id freed: the retry is admitted anew. An answered request keeps its id."""
    calls: list[int] = []

    async def silent_once(request: web.Request) -> web.Response:
        calls.append(len(calls))
        if len(calls) == 1:
            await asyncio.Event().wait()  # silent past the read timeout
        return web.json_response(completion())

    async with upstream(silent_once) as url:
        stack = await make_stack(upstream=url, upstream_read_timeout_s=0.5)
        client = stack.client(max_retries=2)
        named = {"x-request-id": "gw-7-000002"}
        done = await client.chat.completions.create(**chat(3), extra_headers=named)
        assert done.choices and calls == [0, 1]
        with pytest.raises(openai.ConflictError):  # answered: the id stays taken
            await client.chat.completions.create(**chat(3), extra_headers=named)
        await client.close()
        pool = await eventually(stack.status, lambda p: p.active_leases == 0)
        assert pool.active_leases == 0
    page = await metrics_page(stack)
    assert 'qosd_releases_total{outcome="ERROR",result="OK"} 1.0' in page  # at the estimate
    assert 'qosd_releases_total{outcome="OK",result="OK"} 1.0' in page


async def test_a_server_that_refuses_connections_is_passed_over(
    make_stack: StackFactory,
) -> None:
    """The second probe: with two servers for one model and one down, seven requests
    in eight failed (502): the down one refused at once, kept no request in flight,
    and so was the least busy. A refused connection got nothing: the request goes to
    the next server, and the one that refused is passed over for a while."""
    with socket.socket() as held:  # bound, never listening: every connection refused
        held.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{held.getsockname()[1]}"

        async def answering(request: web.Request) -> web.Response:
            return web.json_response(completion())

        async with upstream(answering) as url:
            stack = await make_stack(upstreams=[f"{MODEL}={down}", f"{MODEL}={url}"])
            async with aiohttp.ClientSession() as session:

                async def ask() -> int:
                    async with session.post(f"{stack.url()}/chat/completions",
                                            json=chat(3)) as answer:  # fmt: skip
                        return answer.status

                statuses = await asyncio.gather(*(ask() for _ in range(8)))
            assert statuses == [200] * 8
            pool = await eventually(stack.status, lambda p: p.active_leases == 0)
            assert pool.active_leases == 0


async def test_a_caller_without_a_key_is_not_invited_to_send_its_body(
    make_stack: StackFactory,
) -> None:
    """The second probe: ``Expect: 100-continue`` on a proxy with API keys got
    ``100 Continue`` before the key was checked, so a caller with none uploaded up to
    8 MiB for its 401. The key is judged first now; a caller with one is invited."""
    stack = await make_stack(api_keys=keyed(**{"bulk-key": ("P2", "bulk")}))
    host, _, port = stack.proxies[0].address.rpartition(":")
    keyed_head = b"authorization: Bearer bulk-key\r\n"
    for authorization, first_line in ((b"", b"401"), (keyed_head, b"100")):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + authorization
                     + b"content-type: application/json\r\ncontent-length: 1000000\r\n"
                     b"expect: 100-continue\r\n\r\n")  # fmt: skip
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        assert status_line.split()[1] == first_line, (authorization, status_line)


async def test_an_event_written_without_the_space_is_read(make_stack: StackFactory) -> None:
    """The second probe: an upstream that wrote ``data:{...}`` (the space after the
    colon is optional in server-sent events) had its usage left unread, so its usage
    chunk went to a client that had not asked for one. Both framings are read now."""

    async def unspaced(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in (content_chunk(), usage_chunk(3, 1)):
            await response.write(b"data:" + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data:[DONE]\n\n")
        return response

    async with upstream(unspaced) as url:
        stack = await make_stack(upstream=url)
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{stack.url()}/chat/completions", json=chat(3, stream=True)) as answer,
        ):
            text = await answer.text()
        assert answer.status == 200
        assert '"usage"' not in text and "tok" in text  # the usage chunk was the proxy's
        await stack.proxies[0].proxy.settled()
        assert (await stack.status()).active_leases == 0


async def test_a_clients_dynamo_rank_never_goes_upstream(make_stack: StackFactory) -> None:
    """The review: Dynamo's ``nvext.agent_hints.priority`` and ``strict_priority`` went
    upstream in the body as they came, so that a client could jump a Dynamo router's
    queue past its qosd class. Now both are taken out; the rest of ``nvext`` goes on."""
    seen: list[Any] = []

    async def recording(request: web.Request) -> web.Response:
        seen.append((await request.json()).get("nvext"))
        return web.json_response(completion())

    hints = {"priority": 9, "strict_priority": 3, "osl": 64}
    async with upstream(recording) as url:
        stack = await make_stack(upstream=url)
        client = stack.client()
        await client.chat.completions.create(
            **chat(3), extra_body={"nvext": {"cache_salt": "s", "agent_hints": hints}}
        )
        await client.chat.completions.create(**chat(3), extra_body={"nvext": {"cache_salt": "t"}})
        await client.close()
    assert seen == [{"cache_salt": "s", "agent_hints": {"osl": 64}}, {"cache_salt": "t"}]


async def test_a_failure_right_after_admission_still_ends_the_lease(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe: the rate-limit headers were made between admission and the ``try``
    whose ``finally`` ends the lease, so a failure there left the lease to its TTL.
    Now nothing stands between them: a 500 in OpenAI's format, and the lease ends."""
    from qosd.doors.proxy import handler  # noqa: PLC0415 - patched where it is used

    def failing(decision: Any) -> dict[str, str]:
        raise RuntimeError("a bug of the proxy's own")

    monkeypatch.setattr(handler, "rate_limit_headers", failing)
    stack = await make_stack()
    answered = await answer_to(stack)
    assert answered.status == 500 and answered.body["error"]["type"] == "server_error"
    assert await decisions(stack, "P1") == 1
    pool = await eventually(stack.status, lambda p: p.active_leases == 0)
    assert pool.active_leases == 0


async def test_unknown_paths_and_methods_are_answered_in_openai_s_format(
    make_stack: StackFactory,
) -> None:
    """The probe: a path the proxy does not serve, or a method a path does not take,
    got aiohttp's text 404 or 405. Now each is OpenAI's error, which the SDK raises
    as its own."""
    stack = await make_stack()
    base = f"http://{stack.proxies[0].address}"
    async with aiohttp.ClientSession() as session:
        for method, path, status in [("GET", "/v1/chat/completions", 405),
                                     ("DELETE", "/v1/models", 405),
                                     ("POST", "/v1/embeddings", 404),
                                     ("GET", "/nothing", 404)]:  # fmt: skip
            async with session.request(method, f"{base}{path}") as answer:
                assert answer.status == status, path
                error = (await answer.json())["error"]
            assert error["type"] == "invalid_request_error" and path in error["message"]
    client = stack.client(max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await client.embeddings.create(model=MODEL, input="word")
    await client.close()
