"""``qosd proxy`` in front of ``qosd sim-vllm``, called by the official ``openai`` SDK,
by curl and by raw HTTP: admission, settlement from the usage the server reports,
disconnects, refusals the SDK retries, bad input, and two replicas on one Redis.

Proxies and simulated servers run in the test's process on real sockets (the command
lines are started as written in tests/test_proxy_commands.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path

import aiohttp
import openai
import pytest

from qosd_harness import RedisServer, closed_port
from tests.conftest import merge
from tests.proxy_stack import (
    MODEL,
    ONE_SLOT,
    Stack,
    StackFactory,
    chat,
    make_stack,
    refused_beside_a_stream,
)
from tests.waiting import eventually, until

__all__ = ["make_stack"]  # the fixture, used by name


async def test_a_stream_settles_with_the_usage_vllm_reported(make_stack: StackFactory) -> None:
    """Through the openai SDK, streaming without asking for usage: the client sees no
    usage chunk, and the lease is settled with what the server counted (12 prompt
    words, 20 tokens out), not with the proxy's estimate (60 bytes / 4)."""
    stack = await make_stack({"classes": {"P1": {"fairness": "vtc"}}})
    client = stack.client()
    stream = await client.chat.completions.create(
        **chat(12, max_tokens=20, stream=True), extra_headers={"x-qos-tenant": "acme"}
    )
    chunks = [chunk async for chunk in stream]
    assert all(chunk.usage is None for chunk in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).count("tok") == 20
    pool = await eventually(lambda: stack.status(tenants=("acme",)), lambda p: p.active_leases == 0)
    assert pool.active_leases == 0
    assert pool.cls("P1").tenant("acme").served_tokens == 12 + 20
    # Asked for, the usage chunk comes through.
    stream = await client.chat.completions.create(
        **chat(5, max_tokens=3, stream=True, stream_options={"include_usage": True})
    )
    usages = [chunk.usage async for chunk in stream if chunk.usage is not None]
    assert [(u.prompt_tokens, u.completion_tokens) for u in usages] == [(5, 3)]
    await client.close()


async def test_sync_sdk_completions_and_curl_go_through(make_stack: StackFactory) -> None:
    """The sync SDK (in a thread: the servers share this loop) and curl, streaming."""
    stack = await make_stack()

    def sync_calls() -> tuple[int, int, str]:
        with openai.OpenAI(base_url=stack.url(), api_key="unused") as client:
            answer = client.completions.create(model=MODEL, prompt="a b c", max_tokens=4)
            assert answer.usage is not None
            streamed = subprocess.run(
                ["curl", "-sN", f"{stack.url()}/chat/completions",
                 "-H", "content-type: application/json", "-H", "x-qos-class: P0",
                 "-d", json.dumps(chat(3, max_tokens=2, stream=True))],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
            return answer.usage.prompt_tokens, answer.usage.completion_tokens, streamed.stdout

    prompt, completion, sse = await asyncio.to_thread(sync_calls)
    assert (prompt, completion) == (3, 4)
    events = [line for line in sse.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"usage"' not in sse
    assert sum(json.loads(e[6:])["choices"][0]["delta"].get("content", "").count("tok")
               for e in events[:-1]) == 2  # fmt: skip


async def test_a_client_that_leaves_mid_stream_ends_its_request_and_lease(
    make_stack: StackFactory,
) -> None:
    """A client reads two chunks of a 5,000-token answer and disconnects: the
    upstream request is dropped from the GPU, and the lease ends."""
    stack = await make_stack()
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url()}/chat/completions", json=chat(50, max_tokens=5_000,
                                                                  stream=True)) as answer,
    ):  # fmt: skip
        assert answer.status == 200
        await answer.content.readline()
        await answer.content.readline()
        assert (await stack.status()).active_leases == 1
        assert stack.vllm.gpu.engine.pending == 1
    assert await until(lambda: stack.vllm.gpu.engine.pending == 0)
    pool = await eventually(stack.status, lambda p: p.active_leases == 0)
    assert pool.active_leases == 0


@pytest.mark.parametrize(
    ("upstream", "status"),
    [("refusing", 503), ("unreachable", 502)],
)
async def test_an_upstream_that_refuses_or_is_gone_ends_the_lease(
    make_stack: StackFactory, upstream: str, status: int
) -> None:
    """vLLM at its queue cap answers 503, which the client gets as it came; a server
    that is not there is a 502. Either way the lease ends, with nothing used."""
    with closed_port() as port:  # held closed: no other worker's server can take it
        if upstream == "refusing":
            stack = await make_stack({"classes": {"P1": {"fairness": "vtc"}}},
                                     vllm={"max_waiting": 0})  # fmt: skip
        else:
            stack = await make_stack({"classes": {"P1": {"fairness": "vtc"}}},
                                     upstream=f"http://127.0.0.1:{port}")  # fmt: skip
        await _ask_once(stack, status)


async def _ask_once(stack: Stack, status: int) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url()}/chat/completions", json=chat(8, max_tokens=4),
                     headers={"x-qos-tenant": "acme"}) as answer,
    ):  # fmt: skip
        assert answer.status == status
        assert "error" in await answer.json()
    pool = await eventually(lambda: stack.status(tenants=("acme",)), lambda p: p.active_leases == 0)
    assert pool.active_leases == 0
    assert pool.cls("P1").tenant("acme").served_tokens == 0  # settled as nothing used


async def test_refusals_are_429s_the_sdk_retries(make_stack: StackFactory) -> None:
    """One request runs at a time and P2 may not wait: a second request is refused
    with 429, Retry-After and x-qos-reason, and the SDK retries it as it would
    OpenAI's (twice, then raises)."""
    stack = await make_stack(merge(ONE_SLOT, {"classes": {"P2": {"max_wait_ms": 0}}}))
    client = stack.client(max_retries=2)
    refused, holder = await refused_beside_a_stream(client)
    headers = refused.response.headers
    assert headers["x-qos-reason"] == "rate_limited" and int(headers["retry-after"]) >= 1
    assert refused.body is not None
    assert refused.code == "rate_limited"
    page = (await stack.proxies[0].daemon.metrics_page()).decode()
    assert 'qosd_proxy_requests_total{class="P2",code="429",model="llama-3-8b"} 3.0' in page
    await holder.close()
    await client.close()


async def test_a_queue_timeout_says_when_to_come_back(make_stack: StackFactory) -> None:
    """The probe: a request that waited out its max wait in the queue was refused with
    no Retry-After (and gRPC's and JSON's refusals with ``retry_after_ms: 0``). It is
    now told to come back after as long as it waited: the queue did not clear in it."""
    stack = await make_stack(merge(ONE_SLOT, {"classes": {"P2": {"max_wait_ms": 300}}}))
    client = stack.client(max_retries=0)
    refused, holder = await refused_beside_a_stream(client)
    headers = refused.response.headers
    assert headers["x-qos-reason"] == "queue_timeout" and headers["retry-after"] == "1"
    assert 250 <= int(headers["retry-after-ms"]) <= 60_000
    await holder.close()
    await client.close()


@pytest.mark.parametrize(
    ("body", "headers", "status", "param"),
    [
        (b"{not json", {}, 400, "body"),
        (json.dumps({"messages": []}).encode(), {}, 400, "model"),
        (json.dumps(chat(model="gpt-9")).encode(), {}, 404, "model"),
        (json.dumps(chat()).encode(), {"x-qos-class": "P7"}, 400, "x-qos-class"),
        (json.dumps(chat()).encode(), {"x-slo-ttft-ms": "-5"}, 400, "x-slo-ttft-ms"),
        (json.dumps(chat()).encode(), {"x-llm-d-slo-tpot-ms": "nan"}, 400, "x-llm-d-slo-tpot-ms"),
        (json.dumps(chat()).encode(), {"x-slo-ttft-ms": "1e12"}, 400, "x-slo-ttft-ms"),
        # float() takes these; no client means them as milliseconds (the probe).
        (json.dumps(chat()).encode(), {"x-slo-ttft-ms": "1_000"}, 400, "x-slo-ttft-ms"),
        (json.dumps(chat()).encode(), {"x-slo-ttft-ms": "1e3"}, 400, "x-slo-ttft-ms"),
        (json.dumps(chat()).encode(), {"x-slo-tpot-ms": "+50"}, 400, "x-slo-tpot-ms"),
        (json.dumps(chat(max_tokens=-1)).encode(), {}, 400, "max_tokens"),
        (json.dumps(chat(20_000)).encode(), {}, 413, "body"),
    ],
)
async def test_bad_input_is_answered_in_openai_s_format_naming_the_field(
    make_stack: StackFactory, body: bytes, headers: dict[str, str], status: int, param: str
) -> None:
    stack = await make_stack(max_body_bytes=50_000)
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url()}/chat/completions", data=body, headers=headers) as answer,
    ):
        assert answer.status == status
        error = (await answer.json())["error"]
    assert error["param"] == param and param in error["message"]
    assert (await stack.status()).active_leases == 0


async def test_two_replicas_on_one_redis_give_p0_its_turn_fleet_wide(
    make_stack: StackFactory, redis_standalone: RedisServer
) -> None:
    """One request runs at a time, fleet-wide. A P2 request waits at replica A; a P0
    request arrives later at replica B, and goes first."""
    redis = {"url": redis_standalone.url, "key_prefix": f"t{uuid.uuid4().hex[:12]}",
             "timeout_ms": 1_000}  # fmt: skip
    stack = await make_stack(
        {"redis": redis, "pools": {"default": {"max_in_flight": 1, "top_reserve": 0}},
         "classes": {"P2": {"max_wait_ms": 30_000}, "P0": {"max_wait_ms": 30_000}},
         "control": {"enabled": False}},
        replicas=2,
    )  # fmt: skip
    first, second = stack.client(0), stack.client(1)
    holder = await first.chat.completions.create(**chat(4, max_tokens=200, stream=True))
    await anext(aiter(holder))
    finished: list[str] = []

    async def ask(client: openai.AsyncOpenAI, qos_class: str) -> None:
        await client.chat.completions.create(
            **chat(4, max_tokens=5), extra_headers={"x-qos-class": qos_class}
        )
        finished.append(qos_class)

    low = asyncio.create_task(ask(first, "P2"))
    await eventually(stack.status, lambda p: p.cls("P2").waiting == 1)
    high = asyncio.create_task(ask(second, "P0"))
    await eventually(stack.status, lambda p: p.cls("P0").waiting == 1)
    await holder.close()  # the slot frees
    await asyncio.gather(low, high)
    assert finished == ["P0", "P2"]
    await first.close()
    await second.close()


async def test_auth_qos_guards_the_openai_listener(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    """With ``auth.qos`` set, as on the daemon: no key is a 401, a wrong one a 403
    (in OpenAI's format, which the SDK raises as its own errors), the token passes."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    stack = await make_stack({"auth": {"qos": {"token_file": str(token)}}})
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{stack.url()}/chat/completions", json=chat()) as answer,
    ):
        assert answer.status == 401
        assert (await answer.json())["error"]["param"] == "authorization"
    with pytest.raises(openai.PermissionDeniedError):
        await stack.client().chat.completions.create(**chat())
    client = openai.AsyncOpenAI(base_url=stack.url(), api_key="s3cret")
    answer = await client.chat.completions.create(**chat(3, max_tokens=2))
    assert answer.usage is not None and answer.usage.completion_tokens == 2
    await client.close()


async def test_models_lists_the_upstreams_models(make_stack: StackFactory) -> None:
    stack = await make_stack()
    client = stack.client()
    assert [m.id async for m in client.models.list()] == [MODEL]
    await client.close()


async def test_the_proxy_has_the_simulated_vllm_count_its_first_prompts(
    make_stack: StackFactory,
) -> None:
    """The simulated vLLM answers vLLM's /tokenize (a chat's or a prompt's count, as
    a completion of it counts it), and the proxy asks it about the prompts it sees
    while its estimate calibrates (qosd.doors.proxy.tokenize)."""
    stack = await make_stack()
    url = f"{stack.vllm_url}/tokenize"
    async with aiohttp.ClientSession() as session:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]
        async with session.post(url, json={"model": MODEL, "messages": messages}) as answer:
            assert answer.status == 200
            counted = await answer.json()
            assert counted["count"] == 5 and len(counted["tokens"]) == 5
            assert counted["max_model_len"] == stack.vllm.settings.max_model_len
        async with session.post(url, json={"model": MODEL, "prompt": "one two"}) as answer:
            assert (await answer.json())["count"] == 2
        async with session.post(url, json={"model": "other", "prompt": "x"}) as answer:
            assert answer.status == 404 and (await answer.json())["error"]["param"] == "model"
        async with session.post(url, data=b"{not json") as answer:
            assert answer.status == 400
    client = stack.client(max_retries=0)
    answer = await client.chat.completions.create(**chat(12, max_tokens=1))
    await client.close()
    assert answer.usage is not None and answer.usage.prompt_tokens == 12
    await stack.proxies[0].proxy.prompt_counter.idle()
    page = stack.proxies[0].daemon.metrics.exposition().decode()
    assert f'qosd_proxy_prompt_counts_total{{model="{MODEL}",result="learned"}} 1.0' in page
