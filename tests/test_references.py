"""The achievable P0 references (sim/qosd_sim/references.py): schedules the engine
really runs, so never above the proven bound, and what each admits."""

from __future__ import annotations

import random

import pytest

from qosd_sim.bound import on_time_bound
from qosd_sim.gpu import GpuModel
from qosd_sim.objectives import SCALED, Objectives
from qosd_sim.references import p0_clairvoyant, p0_online
from qosd_sim.replay import Request

pytestmark = pytest.mark.fast

P0 = SCALED["P0"]


def _requests(rows: list[tuple[float, int, int]]) -> list[Request]:
    return [Request(i, at, tokens, out, "P0", "t") for i, (at, tokens, out) in enumerate(rows)]


def _bound_and_references(
    gpu: GpuModel, requests: list[Request], objectives: Objectives
) -> tuple[int, int, int]:
    bound = on_time_bound(gpu, [(r.at_s, r.input_tokens) for r in requests], objectives)
    online = p0_online(gpu, requests, objectives)
    clairvoyant = p0_clairvoyant(gpu, requests, objectives, bound.chosen)
    return bound.on_time, online.on_time, clairvoyant.on_time


def test_a_light_load_is_all_on_time_in_both() -> None:
    requests = _requests([(i * 1.0, 512, 16) for i in range(20)])
    online = p0_online(GpuModel(), requests, P0)
    assert (online.offered, online.admitted, online.on_time) == (20, 20, 20)
    bound, _, clairvoyant = _bound_and_references(GpuModel(), requests, P0)
    assert bound == clairvoyant == 20


def test_online_refuses_what_its_forward_run_sees_late() -> None:
    # Ten 2,048-token prompts at once: one chunked iteration (~130 ms) each, so the
    # fourth's first token would come after 500 ms.
    requests = _requests([(0.0, 2048, 1) for _ in range(10)])
    online = p0_online(GpuModel(), requests, P0)
    assert 0 < online.admitted < 10
    assert online.on_time == online.admitted  # one token each: nothing slows them later
    # A prompt whose prefill alone outlasts its objective is refused, and not chosen.
    tight = Objectives(ttft_ms=100.0)
    alone = _requests([(0.0, 2048, 1)])
    assert p0_online(GpuModel(), alone, tight).admitted == 0
    assert on_time_bound(GpuModel(), [(0.0, 2048)], tight).chosen == ()


@pytest.mark.parametrize("chunk_tokens", [2048, 512, None])
def test_neither_reference_beats_the_bound(chunk_tokens: int | None) -> None:
    gpu = GpuModel(prefill_chunk_tokens=chunk_tokens)
    rng = random.Random(chunk_tokens or 0)
    for _ in range(8):
        at, rows = 0.0, []
        for _ in range(rng.randint(5, 25)):
            at += rng.expovariate(6.0)
            rows.append((at, rng.choice([128, 700, 2_000, 6_000]), rng.randint(1, 40)))
        requests = _requests(rows)
        bound, online, clairvoyant = _bound_and_references(gpu, requests, P0)
        assert online <= bound and clairvoyant <= bound
