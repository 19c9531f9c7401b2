"""The proxy routes, so it predicts per server (qosd/doors/proxy/upstreams.py): each
request goes to the server of its model predicted to give it its first token soonest,
by a model of each server learned from the first tokens the proxy saw. Two simulated
vLLM servers behind one proxy, on real sockets, through the official client; and the
model itself, from known samples."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest

from qosd.config import Config
from qosd.doors.proxy.server import with_upstream_servers
from qosd.doors.proxy.upstreams import (
    MIN_SAMPLES,
    FirstTokenModel,
    Route,
    Upstream,
    Upstreams,
)
from qosd.policy import resolve_pools
from qosd_sim.gpu import GpuModel
from qosd_sim.vllm import SimulatedVllm
from tests.conftest import BASE_CONFIG, merge
from tests.proxy_stack import MODEL, StackFactory, chat, make_stack
from tests.waiting import eventually

__all__ = ["make_stack"]  # the fixture, used by name

#: Room for every request in these tests: the budget is not what they are about.
ROOMY: dict[str, Any] = {"pools": {"default": {"capacity_tokens_s": 10_000_000}}}
#: A GPU a tenth as fast as the A100 model: a 4,000-token prompt prefills for about
#: 2.5 s (two passes of its 2,048-token chunks), a short one in about 0.2 s.
SLOW_GPU = {"gpu": GpuModel(speed=0.1)}


def served(server: SimulatedVllm) -> float:
    """Requests the server finished (by their length: max_tokens)."""
    value = server.metrics.registry.get_sample_value(
        "vllm:request_success_total",
        {"model_name": MODEL, "engine": "0", "finished_reason": "length"},
    )
    return value or 0.0


async def streamed(client: openai.AsyncOpenAI, words: int, max_tokens: int) -> int:
    """Streams one answer to its end; its content chunks."""
    stream = await client.chat.completions.create(**chat(words, max_tokens=max_tokens, stream=True))
    return len([chunk async for chunk in stream if chunk.choices])


@pytest.mark.parametrize("route", [Route.PREDICTED, Route.IN_FLIGHT])
async def test_a_prompt_in_prefill_sends_the_requests_after_it_to_the_other_server(
    make_stack: StackFactory, route: Route
) -> None:
    """A 4,000-token prompt goes to the first of two idle servers; while it prefills,
    four short requests come at once. By prediction all four go to the other server:
    on the first, each would start behind the long prompt's prefill. By requests in
    flight (the rule before), every other one went behind it."""
    stack = await make_stack(ROOMY, servers=2, vllm=SLOW_GPU, route=route)
    first, second = stack.vllms
    upstreams = stack.proxies[0].proxy.settings.upstreams.by_model[MODEL]
    client = stack.client()
    long_prompt = await client.chat.completions.create(
        **chat(4_000, max_tokens=400, stream=True)  # still streaming when the test ends
    )
    try:
        sent = await eventually(lambda: _in_flight(upstreams), lambda n: n == [1, 0])
        assert sent == [1, 0]  # the long prompt went to the first server
        chunks = await asyncio.gather(*(streamed(client, 4, 2) for _ in range(4)))
        assert all(n >= 2 for n in chunks)  # each answered whole
        if route is Route.PREDICTED:
            assert (served(first), served(second)) == (0, 4)
        else:
            assert served(first) >= 1 and served(first) + served(second) == 4
    finally:
        await long_prompt.close()
    ended = await eventually(lambda: _in_flight(upstreams), lambda n: n == [0, 0])
    assert ended == [0, 0]
    assert [u.prefilling_tokens for u in upstreams] == [0, 0]


async def _in_flight(upstreams: list[Upstream]) -> list[int]:
    return [u.in_flight for u in upstreams]


def _taught(url: str, base_ms: float, per_token_ms: float) -> Upstream:
    server = Upstream(url)
    for k in range(MIN_SAMPLES):
        tokens = 100.0 * (k + 1)
        server.learn(tokens, float(k % 3), base_ms + per_token_ms * tokens)
    return server


def test_each_server_learns_its_own_time_to_a_first_token() -> None:
    """From its first tokens: 20 ms + 0.1 ms per prompt token in prefill there, for
    one server; 20 ms + 0.05 ms, for a server twice as fast."""
    slow, fast = _taught("http://a", 20.0, 0.1), _taught("http://b", 20.0, 0.05)
    assert slow.model is not None and fast.model is not None
    assert slow.model.per_token_ms == pytest.approx(0.1)
    assert fast.model.per_token_ms == pytest.approx(0.05)
    assert slow.model.base_ms == pytest.approx(20.0)
    assert slow.model.per_stream_ms == pytest.approx(0.0, abs=1e-9)


def test_the_soonest_predicted_first_token_wins() -> None:
    """Two idle servers: the faster one. The faster one 3,000 tokens deep in prefill
    (20 + 0.05 x 3,100 = 175 ms for a 100-token prompt) against the slower one idle
    (20 + 0.1 x 100 = 30 ms): the slower one. Routing by requests in flight looks at
    neither."""
    slow, fast = _taught("http://a", 20.0, 0.1), _taught("http://b", 20.0, 0.05)
    upstreams = Upstreams({MODEL: [slow, fast]})
    assert upstreams.pick(MODEL, tokens=100) is fast
    fast.send(3_000)
    assert upstreams.pick(MODEL, tokens=100) is slow
    assert Upstreams({MODEL: [fast, slow]}, Route.IN_FLIGHT).pick(MODEL, tokens=100) is slow
    assert upstreams.predicted_first_token_ms(MODEL, fast, 100) == pytest.approx(175.0)


def test_a_server_not_yet_learned_is_predicted_with_its_fleet() -> None:
    """A new server (or one restarted) has no model of its own: it is predicted with
    the mean of its model's learned servers' coefficients, and while none has one, by
    the prompt tokens in prefill alone."""
    learned, new = _taught("http://a", 20.0, 0.1), Upstream("http://b")
    upstreams = Upstreams({MODEL: [learned, new]})
    assert upstreams.predicted_first_token_ms(MODEL, new, 1_000) == pytest.approx(120.0)
    blank = Upstreams({MODEL: [Upstream("http://c"), Upstream("http://d")]})
    busy, idle = blank.by_model[MODEL]
    busy.send(500)
    assert blank.pick(MODEL, tokens=10) is idle


def test_a_request_leaves_the_counts_once_whatever_ends_it() -> None:
    """In flight and in prefill from its sending: its first token takes it out of
    prefill (teaching the model), its end out of flight; an end without a first token
    takes it out of both, teaching nothing; a second call of either changes nothing."""
    server = Upstream("http://a")
    streamed_one, failed_one = server.send(300), server.send(200)
    assert (server.in_flight, server.prefilling_tokens) == (2, 500)
    streamed_one.first_token(streamed_one.at + 0.05)
    streamed_one.first_token(streamed_one.at + 0.09)
    assert (server.in_flight, server.prefilling_tokens) == (2, 200)
    ((tokens, streams, ms),) = server.samples
    assert (tokens, streams) == (300.0, 0.0) and ms == pytest.approx(50.0)
    failed_one.ended()
    failed_one.ended()
    streamed_one.ended()
    assert (server.in_flight, server.prefilling_tokens, len(server.samples)) == (0, 0, 1)


def test_samples_that_cannot_tell_the_tokens_apart_learn_nothing() -> None:
    """Every sample at the same tokens, or within 1,000 ± 3 (where a fit found 7.4 ms a
    token against a true 0.08): no per-token cost can be told, so no model (the
    fleet's, or tokens alone, predicts instead)."""
    assert FirstTokenModel.fitted([(500.0, 0.0, 40.0)] * MIN_SAMPLES) is None
    narrow = [(1_000.0 + k % 7 - 3, 0.0, 80.0 + (k % 5)) for k in range(MIN_SAMPLES)]
    assert FirstTokenModel.fitted(narrow) is None


def test_no_cost_is_ever_negative() -> None:
    """First tokens that fall below a line through the origin would fit a negative
    base: the model is fitted through the origin instead, never clamped after a fit
    that counted on it."""
    samples = [(t, 0.0, 0.1 * t - 30.0) for t in (400.0, 800.0, 1_600.0, 3_200.0)] * 4
    model = FirstTokenModel.fitted(samples)
    assert model is not None and model.base_ms == 0 and model.per_stream_ms == 0
    assert 0.08 < model.per_token_ms < 0.1


def test_a_model_no_first_token_has_refreshed_gives_way_to_its_fleets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server predicted slow gets no traffic, so no first token would correct it:
    30 s after its last one, it is predicted with its fleet's fresh models again."""
    slow, fast = _taught("http://a", 20.0, 1.0), _taught("http://b", 20.0, 0.05)
    upstreams = Upstreams({MODEL: [slow, fast]})
    fast.send(3_000)  # 270 ms for 2,000 tokens there; 2,020 on the slow one, by its own
    assert upstreams.pick(MODEL, tokens=2_000) is fast
    monkeypatch.setattr(slow, "learned_at", time.monotonic() - 31)
    assert upstreams.predicted_first_token_ms(MODEL, slow, 2_000) == pytest.approx(120.0)
    assert upstreams.pick(MODEL, tokens=2_000) is slow


def test_the_proxy_counts_each_pools_servers() -> None:
    """Behind the proxy a pool's server count, where not configured, is the number of
    upstreams serving its models (the default pool: the models no pool names); the
    stores then keep that many prefill clocks. A configured count stands."""
    config = Config.model_validate(merge(BASE_CONFIG, {"pools": {
        "long": {"capacity_tokens_s": 1_000, "models": ["qwen"], "servers": 5},
        "pair": {"capacity_tokens_s": 1_000, "models": ["a", "b"]},
    }}))  # fmt: skip
    upstreams = Upstreams.parse([f"{MODEL}=http://a:8000", f"{MODEL}=http://b:8000",
                                 f"{MODEL}=http://c:8000", f"{MODEL}=http://c:8000/v1",
                                 "qwen=http://d:8000", "a=http://e:8000",
                                 "a=http://f:8000", "b=http://g:8000"])  # fmt: skip
    counted = resolve_pools(with_upstream_servers(config, upstreams))
    assert counted["default"].servers == 3  # c named twice is one server
    assert counted["long"].servers == 5
    # A prompt of b never goes to a's servers: the pool counts the smaller fleet.
    assert counted["pair"].servers == 1
    assert resolve_pools(config)["default"].servers == 1
