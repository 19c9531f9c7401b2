"""benchmarks/fairness.py's own arithmetic: the workload's shape and Jain's index."""

from __future__ import annotations

import pytest

from benchmarks.fairness import HEAVY, jain, workload

pytestmark = pytest.mark.fast


def test_jain_s_index_is_one_when_even_and_one_over_n_when_one_has_all() -> None:
    assert jain([5.0, 5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain([8.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert 0.25 < jain([4.0, 2.0, 1.0, 1.0]) < 1.0


def test_the_heavy_tenant_offers_ten_times_each_light_one() -> None:
    rows = [(1_000, 200), (300, 50)]
    requests = workload(rows, rate_s=40.0, duration_s=300.0, heavy_x=10.0, count=10, seed=1)
    counts: dict[str, int] = {}
    for request in requests:
        counts[request.tenant] = counts.get(request.tenant, 0) + 1
        assert request.qos_class == "P1" and (request.input_tokens, request.output_tokens) in rows
    assert len(counts) == 10
    light = [n for name, n in counts.items() if name != HEAVY]
    assert len(requests) == pytest.approx(40 * 300, rel=0.05)
    assert counts[HEAVY] / (sum(light) / len(light)) == pytest.approx(10, rel=0.1)
    assert [r.at_s for r in requests] == sorted(r.at_s for r in requests)
