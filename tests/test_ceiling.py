"""The class ceilings the QoS benchmark reports beside its goals (sim/qosd_sim/ceiling.py)."""

from __future__ import annotations

from qosd_sim.ceiling import class_ceiling
from qosd_sim.gpu import GpuModel
from qosd_sim.replay import Request
from qosd_sim.results import Objectives

GPU = GpuModel()
TTFT_ONLY = Objectives(ttft_ms=500.0, tpot_ms=None, e2e_ms=None, max_wait_ms=200.0)


def requests(times: list[float], input_tokens: int, output_tokens: int = 2) -> list[Request]:
    return [Request(i, at, input_tokens, output_tokens, "P0", "t") for i, at in enumerate(times)]


def test_a_class_the_gpu_keeps_up_with_is_all_on_time() -> None:
    # 1K prompts every 200 ms: each prefills in about 36 ms.
    ceiling = class_ceiling(GPU, requests([0.2 * i for i in range(20)], 1_000), TTFT_ONLY)
    assert (ceiling.offered, ceiling.alone_attained, ceiling.shed_attained) == (20, 20, 20)
    assert ceiling.as_dict()["ceiling"] == 1.0


def test_shedding_saves_what_a_growing_queue_loses() -> None:
    # 8K prompts (about 280 ms of prefill each, one per unchunked iteration) every
    # 150 ms: served in arrival order the queue grows and, after the first few, every
    # TTFT misses; refusing the ones that would miss keeps the rest on time.
    arrivals = requests([0.15 * i for i in range(40)], 8_000)
    ceiling = class_ceiling(GPU, arrivals, TTFT_ONLY)
    assert ceiling.alone_attained <= 3
    # Nearly as many as the GPU can prefill from the first arrival until the last
    # one's deadline (5.85 s + 0.5 s at one per ~275 ms: 23), never more.
    prefill_s = GPU.prefill_s([8_000])
    most = int((0.15 * 39 + 0.5) / prefill_s)
    assert most - 3 <= ceiling.shed_attained <= most
    figures = ceiling.as_dict()
    assert figures["ceiling"] == figures["shed_attainment"] == round(ceiling.shed_attained / 40, 4)


def test_tpot_objectives_count_and_stalls_miss_them() -> None:
    # A 32K prompt's ~2 s prefill stalls the decode of a stream already running; with a
    # 50 ms TPOT objective the stream misses, and no shedding of the later prompt can
    # be done without refusing it, so both references lose one of the two.
    objectives = Objectives(ttft_ms=5_000.0, tpot_ms=50.0, e2e_ms=None, max_wait_ms=200.0)
    stream = Request(0, 0.0, 200, 40, "P0", "t")
    long_prompt = Request(1, 0.1, 32_768, 2, "P0", "t")
    ceiling = class_ceiling(GPU, [stream, long_prompt], objectives)
    assert ceiling.alone_attained == 1  # the long prompt on time, the stream stalled
    assert ceiling.shed_attained == 1  # the stream kept, the long prompt refused
    assert class_ceiling(GPU, [], objectives).as_dict()["ceiling"] is None
