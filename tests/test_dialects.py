"""The stack's dialects (issue 36): llm-d's and Dynamo's request headers, OpenAI's
rate-limit and retry headers, and OpenTelemetry's GenAI conventions, through the proxy
(with the official ``openai`` SDK) and the JSON API (with curl), on real sockets."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from typing import Any

import openai
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qosd.doors.dialects import SDK_RETRY_WINDOW_MS, duration
from qosd.doors.proxy.handler import key_digest
from qosd.doors.proxy.telemetry import GenAiTelemetry
from tests.conftest import DaemonFactory, merge
from tests.proxy_stack import (
    MODEL,
    ONE_SLOT,
    Stack,
    StackFactory,
    chat,
    make_stack,
    refused_beside_a_stream,
)
from tests.waiting import until

__all__ = ["make_stack"]  # the fixture, used by name

QOSCTL = [sys.executable, "-c", "from qosd.ctl import main; raise SystemExit(main())"]
FAIR = {"classes": {name: {"fairness": "vtc"} for name in ("P0", "P1", "P2")}}


def proxied(stack: Stack, metric: str, **labels: str) -> float:
    """A counter of the proxy's daemon, from its /metrics page."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in stack.proxies[0].daemon.metrics.exposition().decode().splitlines():
        if line.startswith(f"{metric}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def tenants(stack: Stack, *names: str) -> dict[str, Any]:
    """``qosctl status --tenant ... --json`` against the proxy's daemon: what the
    operator sees (in a thread: the daemon answers on this event loop)."""
    address = stack.proxies[0].daemon.addresses[0]
    args = [arg for name in names for arg in ("--tenant", name)]
    done = await asyncio.to_thread(
        subprocess.run, [*QOSCTL, "status", "--address", address, "--json", *args],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    (pool,) = json.loads(done.stdout)["pools"]
    return {cls["name"]: {t["name"]: t for t in cls["tenants"]} for cls in pool["classes"]}


# -- the peers' request headers ----------------------------------------------------------


async def test_llm_d_and_dynamo_headers_land_in_their_class_and_tenant(
    make_stack: StackFactory,
) -> None:
    """llm-d's objective and fairness id (and their deprecated x-gateway-* names), and
    Dynamo's priority (its header, or its body hint where no header names a class),
    each land in the configured class and tenant: qosctl shows the tenants' tokens,
    the decision counters the classes."""
    stack = await make_stack({**FAIR, "peer_headers": {
        "objectives": {"premium-traffic": "P0", "batch": "P2"},
        "dynamo_priority": [{"min": 5, "class": "P0"}, {"min": 1, "max": 4, "class": "P1"},
                            {"max": 0, "class": "P2"}]}})  # fmt: skip
    client = stack.client()
    sent = [
        ({"x-llm-d-inference-objective": "premium-traffic",
          "x-llm-d-inference-fairness-id": "tenant-a"}, "P0", "tenant-a"),
        ({"x-gateway-inference-objective": "batch",
          "x-gateway-inference-fairness-id": "tenant-b"}, "P2", "tenant-b"),
        ({"x-dynamo-request-priority": "7", "x-llm-d-inference-fairness-id": "tenant-c"},
         "P0", "tenant-c"),
        ({"x-dynamo-request-priority": "2", "x-qos-tenant": "tenant-d"}, "P1", "tenant-d"),
        ({"x-dynamo-request-priority": "-3", "x-qos-tenant": "tenant-e"}, "P2", "tenant-e"),
        # Dynamo's body hint (nvext.agent_hints.priority below), where no header names one.
        ({"x-qos-tenant": "tenant-g"}, "P0", "tenant-g"),
        # Dynamo's header overrides its body hint, as Dynamo has it, whatever the
        # header's priority (0 is P2 here).
        ({"x-dynamo-request-priority": "+2", "x-qos-tenant": "tenant-h"}, "P1", "tenant-h"),
        ({"x-dynamo-request-priority": "0", "x-qos-tenant": "tenant-i"}, "P2", "tenant-i"),
        # qosd's own headers first: x-qos-class wins over the peers'.
        ({"x-qos-class": "P1", "x-llm-d-inference-objective": "premium-traffic",
          "x-qos-tenant": "tenant-f", "x-llm-d-inference-fairness-id": "nobody"},
         "P1", "tenant-f"),
    ]  # fmt: skip
    hint = {"nvext": {"agent_hints": {"priority": 6}}}
    for headers, _, tenant in sent:
        body = hint if tenant in ("tenant-g", "tenant-h", "tenant-i") else None
        await client.chat.completions.create(
            **chat(5, max_tokens=3), extra_headers=headers, extra_body=body
        )
    for wrong in ("6", 2**31, True):  # Dynamo reads an i32: refused, naming the field
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(
                **chat(5), extra_body={"nvext": {"agent_hints": {"priority": wrong}}}
            )
        assert refused.value.body["param"] == "nvext.agent_hints.priority"  # type: ignore[index]
    await client.close()
    shown = await tenants(stack, *(tenant for _, _, tenant in sent), "nobody")
    for _, qos_class, tenant in sent:
        assert shown[qos_class][tenant]["served_tokens"] == 5 + 3, (qos_class, tenant)
    assert all(shown[c]["nobody"]["served_tokens"] == 0 for c in ("P0", "P1", "P2"))
    admitted = {
        c: proxied(stack, "qosd_acquire_decisions_total", pool="default", reason="NONE",
                   decision="admitted", **{"class": c})
        for c in ("P0", "P1", "P2")
    }  # fmt: skip
    assert admitted == {"P0": 3, "P1": 3, "P2": 3}


async def test_no_header_raises_a_keys_class(make_stack: StackFactory) -> None:
    """A key's class holds against every header: an llm-d objective or a Dynamo
    priority above it is refused (403, naming the header); one below lowers it."""
    stack = await make_stack(api_keys={key_digest("bulk-key"): ("P2", "bulk")})
    client = openai.AsyncOpenAI(base_url=stack.url(), api_key="bulk-key", max_retries=0)
    for headers in ({"x-llm-d-inference-objective": "critical"},
                    {"x-dynamo-request-priority": "9"}):  # fmt: skip
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await client.chat.completions.create(**chat(3), extra_headers=headers)
        assert refused.value.body["param"] in headers  # type: ignore[index]
    # Nor does Dynamo's body hint, which Dynamo-aware clients send as a matter of
    # course: held to the key's class (P2), not refused.
    await client.chat.completions.create(
        **chat(3), extra_body={"nvext": {"agent_hints": {"priority": 9}}}
    )
    # The key is checked first: a caller without one (or with a wrong one) learns
    # nothing of its other headers, a malformed one included (the probe saw a 400).
    stranger = openai.AsyncOpenAI(base_url=stack.url(), api_key="wrong-key", max_retries=0)
    for authorization, status in (("Basic d3Jvbmc=", 401), ("Bearer wrong-key", 403)):
        with pytest.raises(openai.APIStatusError) as refused_key:
            await stranger.chat.completions.create(
                **chat(3),
                extra_headers={"x-dynamo-request-priority": "zz", "authorization": authorization},
            )
        assert refused_key.value.status_code == status
        assert refused_key.value.body["param"] == "authorization"  # type: ignore[index]
    await stranger.close()
    await client.chat.completions.create(
        **chat(3), extra_headers={"x-llm-d-inference-objective": "sheddable"}
    )
    await client.close()
    assert proxied(stack, "qosd_acquire_decisions_total", pool="default", reason="NONE",
                   decision="admitted", **{"class": "P2"}) == 2  # fmt: skip
    assert proxied(stack, "qosd_acquire_decisions_total", pool="default", reason="NONE",
                   decision="admitted", **{"class": "P0"}) == 0  # fmt: skip


async def test_the_json_api_reads_the_peers_headers(make_daemon: DaemonFactory) -> None:
    """A body that names no class or tenant takes them from llm-d's headers (curl)."""
    running = await make_daemon({"server": {"http_listen": "127.0.0.1:0"}, **FAIR})
    assert running.daemon.http is not None
    url = f"http://{running.daemon.http.address}/v1/acquire"

    def curl() -> Any:
        done = subprocess.run(
            ["curl", "-s", url, "-H", "x-llm-d-inference-objective: critical",
             "-H", "x-llm-d-inference-fairness-id: tenant-j",
             "-d", json.dumps({"model": MODEL, "input_tokens": 40})],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return json.loads(done.stdout)

    answer = await asyncio.to_thread(curl)
    assert answer["decision"] == "DECISION_ADMITTED" and answer["lease_id"].startswith(
        "default:P0:"
    )
    status = await running.client.status(tenants=["tenant-j"])
    assert status.pool("default").cls("P0").tenant("tenant-j").served_tokens == 40


# -- answers clients understand ------------------------------------------------------------


async def test_the_sdk_reads_rate_limit_headers_that_fall_as_the_bucket_drains(
    make_stack: StackFactory,
) -> None:
    """``with_raw_response``: every answer carries the class's bucket, in cost units
    (prompt tokens here); its remaining tokens fall by each request's cost, and its
    reset is how long the class's rate takes to fill it."""
    # P1 refills at 30 tokens/s here (3,000 with the stack's pool): a busy machine's
    # gap between two requests refilled more than one request's cost, and the
    # remaining tokens rose.
    slow = {"pools": {"default": {"capacity_tokens_s": 100}},
            "classes": {"P1": {"burst_tokens": 5_000}}}  # fmt: skip
    stack = await make_stack(slow)
    client = stack.client()
    remaining: list[int] = []
    for _ in range(3):
        raw = await client.chat.completions.with_raw_response.create(**chat(500, max_tokens=1))
        headers = raw.headers
        assert headers["x-ratelimit-limit-tokens"] == "5000"
        remaining.append(int(headers["x-ratelimit-remaining-tokens"]))
        assert headers["x-ratelimit-reset-tokens"].endswith("s")
        raw.parse()
    await client.close()
    assert remaining[0] > remaining[1] > remaining[2]
    # Each request charged its estimate (about 500 words' worth): the bucket falls by
    # roughly that each time, refilled a little in between at P1's 30 tokens/s.
    assert all(100 < a - b < 2_000 for a, b in itertools.pairwise(remaining))


async def test_the_sdk_retries_a_refusal_that_says_so_and_not_one_that_does_not(
    make_stack: StackFactory,
) -> None:
    """A refusal whose wait fits the SDK's retry window says ``x-should-retry: true``
    and the SDK retries it (3 attempts with ``max_retries=2``); one past the window (a
    tenant ceiling that refills in minutes) says ``false``, and the SDK stops at the
    first. Both carry llm-d's dropped reason beside qosd's."""
    stack = await make_stack(
        merge(ONE_SLOT, {"classes": {"P2": {"max_wait_ms": 0},
                                     "P1": {"tenant_max_share": 0.0001, "max_wait_ms": 0}}})
    )  # fmt: skip
    client = stack.client(max_retries=2)
    retried, holder = await refused_beside_a_stream(client)
    headers = retried.response.headers
    assert headers["x-should-retry"] == "true"
    assert headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
    assert proxied(stack, "qosd_proxy_requests_total", model=MODEL, code="429",
                   **{"class": "P2"}) == 3  # fmt: skip
    await holder.close()
    assert await until(lambda: proxied(stack, "qosd_proxy_requests_total", model=MODEL,
                                       code="499", **{"class": "P1"}) == 1)  # fmt: skip
    await stack.proxies[0].proxy.settled()  # the holder's slot is free
    with pytest.raises(openai.RateLimitError) as final:
        for _ in range(3):  # the tenant's 1 token/s ceiling: empty after the first
            await client.chat.completions.create(
                **chat(200, max_tokens=1), extra_headers={"x-qos-tenant": "tiny"}
            )
            await stack.proxies[0].proxy.settled()  # its lease ended: the slot is free
    headers = final.value.response.headers
    assert headers["x-should-retry"] == "false"
    assert int(headers["retry-after-ms"]) > SDK_RETRY_WINDOW_MS == 120_000
    refused = proxied(stack, "qosd_proxy_requests_total", model=MODEL, code="429",
                      **{"class": "P1"})  # fmt: skip
    assert refused == 1  # no retry
    await client.close()


def test_reset_durations_read_as_openais() -> None:
    assert [duration(s) for s in (0.02, 1.5, 90.0, 360.0)] == ["20ms", "1.5s", "1m30s", "6m0s"]


# -- OpenTelemetry's GenAI conventions ----------------------------------------------------


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Every data point the reader holds, by metric name."""
    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def check_client_metrics(points: dict[str, list[Any]]) -> None:
    """The proxy is the client of its calls upstream: the three that went there (not
    the refused one), and the tokens of the two whose usage came back, by token type."""
    calls = points["gen_ai.client.operation.duration"]
    assert sum(p.count for p in calls) == 3
    assert all(p.attributes["server.address"] == "127.0.0.1" for p in calls)
    usage = sorted((p.attributes["gen_ai.token.type"], p.sum)
                   for p in points["gen_ai.client.token.usage"])  # fmt: skip
    assert usage == [("input", 12), ("output", 9)]


async def test_genai_spans_and_metrics_for_streamed_unstreamed_and_refused_requests(
    make_stack: StackFactory,
) -> None:
    """An in-memory exporter and metric reader see, per request, a span ``chat
    llama-3-8b`` with the GenAI attributes, and the three gen_ai.server histograms with
    qosd's class and decision; a refused request's span has error.type."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meters = MeterProvider(metric_readers=[reader])
    telemetry = GenAiTelemetry(tracer_provider.get_tracer("test"), meters.get_meter("test"))
    stack = await make_stack(
        {"pools": {"default": {"max_in_flight": 1, "top_reserve": 0}},
         "classes": {"P2": {"max_wait_ms": 0}}},
        telemetry=telemetry,
    )  # fmt: skip
    client = stack.client(max_retries=0)
    await client.chat.completions.create(**chat(6, max_tokens=4))
    asked = chat(6, max_tokens=5, stream=True, stream_options={"include_usage": True})
    stream = await client.chat.completions.create(**asked)
    async for _ in stream:
        pass
    holder = await client.chat.completions.create(**chat(4, max_tokens=400, stream=True))
    async for chunk in holder:  # to its first token: the slot is held, a token timed
        if chunk.choices and chunk.choices[0].delta.content:
            break
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(**chat(4), extra_headers={"x-qos-class": "P2"})
    await holder.close()
    await client.close()
    assert await until(lambda: proxied(stack, "qosd_proxy_requests_total", model=MODEL,
                                       code="499", **{"class": "P1"}) == 1)  # fmt: skip
    await stack.proxies[0].proxy.settled()
    finished = {span.attributes["gen_ai.request.max_tokens"]: span
                for span in spans.get_finished_spans()
                if span.attributes and "gen_ai.request.max_tokens" in span.attributes}  # fmt: skip
    whole, streamed = finished[4], finished[5]
    for span, output in ((whole, 4), (streamed, 5)):
        attributes = dict(span.attributes or {})
        assert span.name == f"chat {MODEL}"
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.request.model"] == MODEL
        assert attributes["gen_ai.response.model"] == MODEL
        assert attributes["gen_ai.usage.input_tokens"] == 6
        assert attributes["gen_ai.usage.output_tokens"] == output
        assert attributes["qosd.decision"] == "admitted" and "error.type" not in attributes
    refused = [span for span in spans.get_finished_spans()
               if (span.attributes or {}).get("qosd.class") == "P2"]  # fmt: skip
    assert len(refused) == 1
    assert refused[0].attributes["error.type"] == "rate_limited"  # type: ignore[index]
    assert refused[0].attributes["qosd.decision"] == "rejected"  # type: ignore[index]
    points = metric_points(reader)
    durations = points["gen_ai.server.request.duration"]
    counted = {(p.attributes["qosd.class"], p.attributes["qosd.decision"],
                p.attributes.get("error.type")): p.count for p in durations}  # fmt: skip
    assert counted == {("P1", "admitted", None): 2, ("P1", "admitted", "client_closed"): 1,
                       ("P2", "rejected", "rate_limited"): 1}  # fmt: skip
    assert all(p.attributes["gen_ai.request.model"] == MODEL for p in durations)
    # Tokens are timed where they stream, of successful responses only (as the
    # conventions define both): the stream that ended well, not the holder the client
    # left after its first token; with the buckets the conventions advise for each.
    ttft, tpot = (
        points["gen_ai.server.time_to_first_token"],
        points["gen_ai.server.time_per_output_token"],
    )
    assert sum(p.count for p in ttft) == 1 and sum(p.count for p in tpot) == 1
    assert list(ttft[0].explicit_bounds) == [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                                             0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]  # fmt: skip
    assert list(tpot[0].explicit_bounds)[:3] == [0.01, 0.025, 0.05]
    check_client_metrics(points)
    assert streamed.attributes["gen_ai.request.stream"] is True  # type: ignore[index]
    assert "gen_ai.request.stream" not in (whole.attributes or {})
