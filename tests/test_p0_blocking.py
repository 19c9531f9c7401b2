"""benchmarks/p0_blocking.py: which P0 requests arrived behind lower-class prefill that
an oldest-first server makes them wait for, on records built here."""

from __future__ import annotations

import pytest

from benchmarks.p0_blocking import blocking
from qosd_sim.experiment import Policy, PolicyRun
from qosd_sim.gateway import RequestRecord
from qosd_sim.gpu import GpuModel
from qosd_sim.replay import Request

pytestmark = pytest.mark.fast


def served(index: int, at_s: float, prompt: int, qos_class: str, ttft_s: float) -> RequestRecord:
    record = RequestRecord(Request(index, at_s, prompt, 10, qos_class, "t"))
    record.admitted = record.completed = True
    record.ttft_ms = ttft_s * 1000
    record.e2e_ms = (ttft_s + 0.3) * 1000  # 10 tokens at 33 ms: within P0's TPOT
    return record


def test_a_p0_request_behind_a_long_lower_class_prefill_is_counted() -> None:
    """A 32K P1 prompt admitted at 0 s starts its first token at 3 s. A short P0
    request arriving at 1 s (due 1.5 s) is behind it, and late; one arriving at 2.8 s
    (due 3.3 s) is not: the long prompt's first token leaves it time. The span behind
    long prefill is [0, 3 - 0.5] s of the 10 s span, and the long prompt's tokens are
    almost all of the on-time ones."""
    gpu = GpuModel()
    records = [
        served(0, 0.0, 32_768, "P1", 3.0),
        served(1, 1.0, 100, "P0", 2.05),  # late: behind the 32K prefill
        served(2, 2.8, 100, "P0", 0.25),
    ]
    result = blocking(PolicyRun(Policy.QOSD, records), 11, gpu, window_s=10.0)
    assert (result.p0_offered, result.p0_on_time) == (2, 1)
    assert (result.p0_behind_prefill, result.p0_behind_and_missed) == (1, 1)
    assert result.time_behind_long_prefill == pytest.approx(2.5 / 10.0)
    on_time_tokens = (32_768 + 10) + (100 + 10)
    assert result.long_prompt_goodput_share == pytest.approx((32_768 + 10) / on_time_tokens)
