"""The OpenAI proxy stack the proxy tests share: a simulated vLLM server (or an app of
the test's own) and ``qosd proxy`` replicas in front of it, in the test's process on
real sockets."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest
from aiohttp import web

from qosd.config import Config
from qosd.doors.proxy.handler import ProxySettings
from qosd.doors.proxy.server import RunningProxy, start_proxy
from qosd.doors.proxy.upstreams import Route, Upstreams
from qosd_sim.vllm import SimulatedVllm, VllmSettings, vllm_runner
from tests.conftest import BASE_CONFIG, merge

MODEL = "llama-3-8b"  # the base config's pool serves it


@dataclass
class Stack:
    """A simulated vLLM server (or several of one model) and the proxies in front of it."""

    vllm: SimulatedVllm
    vllm_url: str
    proxies: list[RunningProxy]
    #: Every server of the model, the first one (``vllm``) first.
    vllms: list[SimulatedVllm] = field(default_factory=list)

    def url(self, replica: int = 0) -> str:
        return f"http://{self.proxies[replica].address}/v1"

    def client(self, replica: int = 0, **options: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url(replica), api_key="unused", **options)

    async def status(self, replica: int = 0, tenants: tuple[str, ...] = ()) -> Any:
        daemon = self.proxies[replica].daemon
        return (await daemon.status.status(["default"], 0, tenants)).pool("default")


StackFactory = Callable[..., Awaitable[Stack]]


@pytest.fixture
async def make_stack() -> AsyncIterator[StackFactory]:
    async with AsyncExitStack() as stack:

        async def make(
            extra: dict[str, Any] | None = None,
            *,
            replicas: int = 1,
            vllm: dict[str, Any] | None = None,
            servers: int = 1,
            **proxy: Any,
        ) -> Stack:
            vllms, urls = [], []
            for _ in range(servers):
                server = SimulatedVllm(VllmSettings(port=0, model_name=MODEL, **(vllm or {})))
                runner = vllm_runner(server)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                server.gpu.start()
                stack.push_async_callback(server.gpu.stop)
                stack.push_async_callback(runner.cleanup)
                vllms.append(server)
                urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
            url = urls[0]
            config = Config.model_validate(merge(BASE_CONFIG, extra or {}))
            telemetry = proxy.pop("telemetry", None)
            # upstreams: MODEL=URL items, for several models; upstream: MODEL's server;
            # by default, every simulated server.
            served = proxy.pop("upstreams", None) or (
                [f"{MODEL}={proxy.pop('upstream')}"] if "upstream" in proxy
                else [f"{MODEL}={u}" for u in urls]
            )  # fmt: skip
            route = proxy.pop("route", Route.PREDICTED)
            proxy_settings = ProxySettings(
                upstreams=Upstreams.parse(served, route),
                default_class=proxy.pop("default_class", "P1"),
                **proxy,
            )
            running = []
            for _ in range(replicas):
                started = await start_proxy(config, "127.0.0.1:0", proxy_settings, telemetry)
                stack.push_async_callback(started.stop)
                running.append(started)
            return Stack(vllms[0], url, running, vllms)

        yield make


def chat(words: int = 8, **body: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["word"] * words)}],
        **body,
    }


#: A pool that runs one request at a time, none of it reserved for the top class.
ONE_SLOT: dict[str, Any] = {"pools": {"default": {"max_in_flight": 1, "top_reserve": 0}}}


async def refused_beside_a_stream(
    client: openai.AsyncOpenAI,
) -> tuple[openai.RateLimitError, openai.AsyncStream[Any]]:
    """A stream holding a ONE_SLOT pool's slot, and the refusal of a P2 request made
    beside it; the caller closes the stream."""
    holder = await client.chat.completions.create(**chat(4, max_tokens=400, stream=True))
    assert await anext(aiter(holder)) is not None
    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(**chat(4), extra_headers={"x-qos-class": "P2"})
    return refused.value, holder
