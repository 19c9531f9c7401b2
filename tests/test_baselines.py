"""The baselines a user would pick, run end to end over real sockets as the replay
runs them: clients that give up at their TTFT objective (``fifo-deadline``), and a
server's own queue cap with the openai SDK's retries (``vllm-native``)."""

from __future__ import annotations

from qosd_sim.experiment import Policy, run_policy
from qosd_sim.gateway import GAVE_UP, RetryPolicy
from qosd_sim.gpu import GpuModel
from qosd_sim.replay import Request


def _burst(count: int, tokens: int, output: int, qos_class: str = "P0") -> list[Request]:
    return [Request(i, 0.0, tokens, output, qos_class, "t") for i in range(count)]


def test_clients_that_give_up_at_their_objective_free_the_gpu() -> None:
    """Ten 2,000-token P0 prompts at once, about 130 ms of prefill each: the last
    ones cannot have a first token within 500 ms. Their clients give up and the
    server drops them, so the GPU does less than for clients that wait."""
    workload = _burst(10, 2_000, 20)
    common = {"gpu": GpuModel(), "capacity_cost_s": 1.0, "output_weight": 1.0,
              "redis_url": None, "drain_s": 30.0, "window_s": 0.5}  # fmt: skip
    patient = run_policy(Policy.FIFO, workload, **common)  # type: ignore[arg-type]
    deadline = run_policy(Policy.FIFO_DEADLINE, workload, **common)  # type: ignore[arg-type]
    assert all(r.completed for r in patient.records)
    gave_up = [r for r in deadline.records if r.error.startswith(GAVE_UP)]
    served = [r for r in deadline.records if r.completed]
    assert gave_up and served and len(gave_up) + len(served) == 10
    assert all(r.ttft_ms is None and r.admitted for r in gave_up)
    assert all(r.ttft_ms is not None and r.ttft_ms <= 500 + 100 for r in served)
    assert deadline.busy[-1][1] < patient.busy[-1][1]


def test_a_full_queue_refuses_and_the_client_retries_as_the_sdk_does() -> None:
    """A server that takes two requests in flight at most (vLLM's
    ``--max-num-queued-reqs``), eight long requests at once: the rest are refused at
    once and retried up to twice, with the SDK's backoff; what is still refused after
    that is a refusal (``QUEUE_FULL``), never an error."""
    workload = _burst(8, 4_000, 200, qos_class="P1")
    run = run_policy(
        Policy.VLLM_NATIVE, workload, gpu=GpuModel(), capacity_cost_s=1.0, output_weight=1.0,
        redis_url=None, drain_s=60.0, window_s=0.5, queue_cap=2,
    )  # fmt: skip
    retries = RetryPolicy().max_retries
    refused = [r for r in run.records if r.decision == "QUEUE_FULL"]
    served = [r for r in run.records if r.completed]
    assert len(refused) + len(served) == 8 and refused and len(served) >= 2
    assert all(not r.admitted and r.retries == retries and not r.error for r in refused)
    assert any(r.retries > 0 for r in served) or len(served) == 2
    assert max(r.retries for r in run.records) <= retries
