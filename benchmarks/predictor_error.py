"""How far qosd's predictions are from the simulated server's truth, per engine.

    python benchmarks/predictor_error.py --json docs/results/predictor_error.json

qosd admits by two predictions (``docs/design.md``, "Admission by predicted
latency"), made from what it knows: the leases in flight and the models its SLO loop
learns from reports. This serves a trace's requests on the simulated GPU
(``qosd_sim.gpu``, in virtual time, first come first served, admitted as qosd's
gate would: while the prefill admitted is done within 300 ms, within the batch slots
and the KV cache),
gives qosd's learning code the reports and the in-flight counts a leader would read
once a second, and compares, request by request:

- **TTFT**: the prefill clock the stores keep (``deadline.lua``): a prompt's first
  token comes when the prefill admitted before it and its own, by the learned prefill
  model, are done; on a server that caps one prompt's tokens per pass
  (``chunked-shared``, vLLM's ``--long-prefill-token-threshold``, 512 tokens as the
  QoS benchmark's ``chunked-priority`` engine), the prompts in prefill share the
  passes, and the stores count of the clock's lead at most ``SHARED_PASS_STRETCH``
  times the prompt's own prefill per request in flight (``budget.lua``:
  ``predict.top_wait_until``; ``ttft_serial``: the lead counted whole);
- **TPOT**: ``step(B) / (1 - ρ)``, the learned decode step at the mean batch ``B`` in
  flight over the request's decode, stretched by ``ρ``, the share of that time the
  prompts admitted meanwhile add to the streams' decode, by the same prefill model:
  all of each prefill unchunked, the prefill less the step its pass decodes chunked
  (what the stores' share clock counts, ``formulas.lua``: ``prefill_stretch_us``);
- **the decode step itself**: the learned ``step(B)`` against the simulator's passes
  that carried no prefill: as the leader learns it, the reported TPOTs less the
  prefill that shared each decode (``qosd/control/leader.py``; on unchunked pools
  the stores use it only for the pass a new prompt waits out, ADR 17),
  and from the steps as reported (``_as_reported``: the learner until ``a32b8aa``).

It reports the median and 90th percentile of the absolute relative error, and the
median signed error (positive: qosd predicts slower than the truth, the safe side),
per engine and load. The models are learned from the first half of the run and judged
on the second, as a leader would have them.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

from qosd.control.decode import BatchHistory, DecodeModel, decode_points, learn_decode
from qosd.control.leader import USUAL_PROMPT_QUANTILE
from qosd.control.passes import learn_from_passes
from qosd.control.prefill import learn_prefill
from qosd.control.prefill import prefill_ms as prefill_model_ms
from qosd.model import Outcome, PassRead, StoredSample
from qosd.policy import SHARED_PASS_STRETCH
from qosd_sim.gateway import EXPECTED_OUTPUT_TOKENS
from qosd_sim.gpu import VLLM_A100_BATCHED_TOKENS, Engine, GpuModel, Sequence
from qosd_sim.replay import read_trace
from qosd_sim.server import EnginePassCounters
from qosd_sim.workload import WorkloadSpec, seeded_workload

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "azure2023_conv.csv"
ENGINES = {
    "chunked": GpuModel(),
    "unchunked": GpuModel(prefill_chunk_tokens=None),
    "chunked-shared": GpuModel(long_prefill_token_threshold=VLLM_A100_BATCHED_TOKENS // 4),
}
LOADS = (0.5, 0.9)
BACKLOG_S = 0.3  # the default backlog bound: P0's 500 ms objective less its 200 ms wait
SEEDS = (11, 12, 13)
READ_EVERY_S = 5.0  # qosd scrape's default interval


@dataclass(slots=True)
class Pass:
    start_s: float
    duration_s: float
    decodes: int
    prefill_tokens: int


def serve(
    model: GpuModel, arrivals: list[tuple[float, int, int]], backlog_s: float
) -> tuple[list[Sequence], list[Pass], list[PassRead]]:
    """``run_virtual``'s loop, keeping every pass, behind a gate as qosd's: a request
    goes to the server (its ``submitted_at``) once the prefill admitted before it is
    done within ``backlog_s`` (by the server's own prefill work: the gate only makes
    the regime qosd runs the servers in; the predictions below know none of it), and
    until then waits outside, first come first served. Also what ``qosd scrape
    --engine vllm`` would report of the server's pass counters every
    :data:`READ_EVERY_S` (the simulated servers' own ``EnginePassCounters``)."""
    engine = Engine(model)
    pending = sorted(arrivals)
    sequences: list[Sequence] = []
    passes: list[Pass] = []
    counters, reads, next_read = EnginePassCounters(), list[PassRead](), READ_EVERY_S
    now, index, clock = 0.0, 0, 0.0

    def has_room() -> bool:
        """qosd's gate: the backlog bound, the batch slots, the KV cache (prompt plus
        the gateway's output estimate a lease holds)."""
        running = [s for s in sequences if s.finished_at is None]
        held = sum(s.input_tokens + EXPECTED_OUTPUT_TOKENS for s in running)
        n_in = pending[index][1]
        return (not running) or (
            clock - now <= backlog_s
            and len(running) < model.max_batch
            and held + n_in + EXPECTED_OUTPUT_TOKENS <= model.kv_capacity_tokens
        )

    while index < len(pending) or engine.pending:
        while index < len(pending) and pending[index][0] <= now and has_room():
            _, n_in, n_out = pending[index]
            sequence = Sequence(f"r{index}", n_in, n_out, submitted_at=now)
            clock = max(now, clock) + model.prefill_work_s(n_in)
            engine.submit(sequence)
            sequences.append(sequence)
            index += 1
        iteration = engine.plan(now)
        if iteration is None:  # idle: the next arrival, or the backlog's drain
            now = max(now, pending[index][0], clock - backlog_s)
            continue
        passes.append(Pass(now, iteration.duration_s, len(iteration.decode),
                           sum(n for _, n in iteration.prefill)))  # fmt: skip
        if now >= next_read:  # the read falls between passes, as a scrape does
            stats = counters.take()
            if stats is not None:
                reads.append(PassRead(int(next_read * 1000), "s", stats.passes,
                                      stats.prefill_tokens, stats.decode_tokens,
                                      stats.step_ms))  # fmt: skip
            next_read = (math.floor(now / READ_EVERY_S) + 1) * READ_EVERY_S
        now += iteration.duration_s
        counters.record(engine.complete(now), iteration.duration_s)
    return sequences, passes, reads


def errors(predicted: Seq[float], true: Seq[float]) -> dict[str, float | int]:
    relative = [(p - t) / t for p, t in zip(predicted, true, strict=True) if t > 0]
    absolute = sorted(abs(r) for r in relative)
    return {
        "requests": len(relative),
        "abs_rel_error_p50": round(statistics.median(absolute), 3),
        "abs_rel_error_p90": round(absolute[int(0.9 * (len(absolute) - 1))], 3),
        "signed_rel_error_p50": round(statistics.median(relative), 3),
    }


def reports(sequences: list[Sequence]) -> list[StoredSample]:
    """What the servers would report of each finished request, stamped at its end."""
    samples = []
    for s in sequences:
        if s.first_token_at is None or s.finished_at is None:
            continue
        ttft = (s.first_token_at - s.submitted_at) * 1000
        e2e = (s.finished_at - s.submitted_at) * 1000
        tpot = (e2e - ttft) / (s.output_tokens - 1) if s.output_tokens > 1 else None
        samples.append(StoredSample(int(s.finished_at * 1000), ttft, tpot, e2e,
                                    s.input_tokens, s.output_tokens, Outcome.OK, "t"))  # fmt: skip
    return samples


def leader_reads(sequences: list[Sequence]) -> BatchHistory:
    """The requests in flight (qosd's leases), read once a second, as a leader reads them."""
    history = BatchHistory(horizon_ms=10**9)
    end = max(s.finished_at or 0.0 for s in sequences)
    for second in range(int(end) + 2):
        in_flight = [s for s in sequences if s.submitted_at <= second < (s.finished_at or 1e18)]
        history.record(second * 1000, len(in_flight))
    return history


def ttft_errors(sequences: list[Sequence], judged: list[Sequence],
                prefill_ms: Callable[[int], float],
                shared_stretch: float = 0.0) -> dict[str, float | int]:  # fmt: skip
    """The real prefill clock, as the stores keep it, from each request's admission:
    its lead and the prompt's own prefill; with ``shared_stretch``, of the lead at most
    that many times its own prefill per request in flight (prompts share passes)."""
    clock_s, predicted = 0.0, {}
    for s in sorted(sequences, key=lambda s: s.submitted_at):
        own_s = prefill_ms(s.input_tokens) / 1000
        lead_s = max(0.0, clock_s - s.submitted_at)
        if shared_stretch > 0:
            in_flight = sum(
                1 for o in sequences
                if o.submitted_at < s.submitted_at < (o.finished_at or math.inf)
            )  # fmt: skip
            lead_s = min(lead_s, max(1, in_flight) * shared_stretch * own_s)
        predicted[s.request_id] = (lead_s + own_s) * 1000
        clock_s = max(s.submitted_at, clock_s) + own_s
    true = [((s.first_token_at or 0.0) - s.submitted_at) * 1000 for s in judged]
    return errors([predicted[s.request_id] for s in judged], true)


def tpot_errors(sequences: list[Sequence], judged: list[Sequence], history: BatchHistory,
                prefill_ms: Callable[[int], float], decode: DecodeModel,
                chunked: bool) -> dict[str, float | int]:  # fmt: skip
    """step(B) / (1 - ρ) over each request's decode, against its TPOT."""
    starts = sorted((s.submitted_at, prefill_ms(s.input_tokens)) for s in sequences)
    predicted, true = [], []
    for s in judged:
        first, last = s.first_token_at or 0.0, s.finished_at or 0.0
        batch = history.mean_over(first * 1000, last * 1000)
        if s.output_tokens < 2 or batch is None or last <= first:
            continue
        step = decode.step_ms(batch)
        added = [max(0.0, ms - step) if chunked else ms
                 for at, ms in starts if first <= at < last]  # fmt: skip
        share = sum(added) / 1000 / (last - first)
        predicted.append(step / (1 - share) if share < 0.95 else step * 20)
        true.append((last - first) * 1000 / (s.output_tokens - 1))
    return errors(predicted, true)


def step_errors(passes: list[Pass], decode: DecodeModel) -> dict[str, float | int]:
    """The learned step against the passes that carried no prefill."""
    pure = [p for p in passes if p.prefill_tokens == 0 and p.decodes > 0]
    return errors([decode.step_ms(p.decodes) for p in pure], [p.duration_s * 1000 for p in pure])


def measure(model: GpuModel, arrivals: list[tuple[float, int, int]]) -> dict[str, object]:
    """Learns from the first half of the run (by finish) and judges the second."""
    shared = model.long_prefill_token_threshold is not None
    shared_stretch = SHARED_PASS_STRETCH if shared else 0.0
    sequences, passes, pass_reads = serve(model, arrivals, BACKLOG_S)
    samples = reports(sequences)
    history = leader_reads(sequences)
    half = sorted(s.at_ms for s in samples)[len(samples) // 2]
    prefill = learn_prefill([s for s in samples if s.at_ms <= half])
    if prefill is None:
        return {"learned": False}

    prefill_ms = functools.partial(prefill_model_ms, prefill.coefficients())
    learning = [s for s in samples if s.at_ms <= half]
    # As the leader learns it (less the prefill that shared each decode), and from
    # the steps as reported (the learner until a32b8aa: ADR 13).
    decode = learn_decode(decode_points(learning, history, prefill_ms, chunked=model.chunked))
    as_reported = learn_decode(decode_points(learning, history))
    if decode is None or as_reported is None:
        return {"learned": False}
    # From the servers' own counters, as a scraper reads them (qosd/control/passes.py).
    prompts = sorted(s.input_tokens for s in learning)
    usual_prefill = prefill_ms(prompts[int(USUAL_PROMPT_QUANTILE * (len(prompts) - 1))])
    reads = [r for r in pass_reads if r.at_ms <= half]
    from_passes = learn_from_passes(reads, half, usual_prefill)
    judged = [s for s in sequences if s.finished_at is not None and s.finished_at * 1000 > half]
    return {
        "learned": True,
        "prefill_model_ms": [prefill.base_ms, prefill.per_token_ms, prefill.per_token2_ms],
        "decode_model_ms": [decode.base_ms, decode.per_sequence_ms],
        "ttft": ttft_errors(sequences, judged, prefill_ms, shared_stretch),
        "ttft_serial": ttft_errors(sequences, judged, prefill_ms),
        "tpot": tpot_errors(sequences, judged, history, prefill_ms, decode, model.chunked),
        "decode_step": step_errors(passes, decode),
        "decode_as_reported_model_ms": [as_reported.base_ms, as_reported.per_sequence_ms],
        "tpot_as_reported": tpot_errors(
            sequences, judged, history, prefill_ms, as_reported, model.chunked
        ),
        "decode_step_as_reported": step_errors(passes, as_reported),
        **(
            {}
            if from_passes is None
            else {
                "decode_from_passes_model_ms": [
                    from_passes.base_ms,
                    from_passes.per_sequence_ms,
                    from_passes.per_prefill_token_ms,
                ],
                "tpot_from_passes": tpot_errors(
                    sequences, judged, history, prefill_ms, from_passes.decode(), model.chunked
                ),
                "decode_step_from_passes": step_errors(passes, from_passes.decode()),
            }
        ),
    }


def line(name: str, error: object) -> str:
    assert isinstance(error, dict)
    p50, p90 = error["abs_rel_error_p50"], error["abs_rel_error_p90"]
    return f"{name} |err| p50 {p50:.0%} p90 {p90:.0%} bias {error['signed_rel_error_p50']:+.0%}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    rows = read_trace(args.trace)
    results: list[dict[str, object]] = []
    for engine, model in ENGINES.items():
        for load in LOADS:
            for seed in SEEDS:
                spec = WorkloadSpec(load=load, inject_every_s=None)
                workload = seeded_workload(rows, model, spec, seed)
                arrivals = [(r.at_s, r.input_tokens, r.output_tokens) for r in workload.requests]
                measured = measure(model, arrivals)
                results.append({"engine": engine, "load": load, "seed": seed, **measured})
                if not measured["learned"]:
                    print(f"{engine:14} load {load:g} seed {seed}: too little evidence to learn")
                    continue
                print(f"{engine:14} load {load:g} seed {seed}: "
                      + "; ".join(line(name, measured[key]) for name, key in
                                  (("TTFT", "ttft"), ("TTFT serial", "ttft_serial"),
                                   ("TPOT", "tpot"), ("step", "decode_step"),
                                   ("step as reported", "decode_step_as_reported"),
                                   ("step from passes", "decode_step_from_passes"),
                                   ("TPOT from passes", "tpot_from_passes"))
                                  if key in measured),
                      flush=True)  # fmt: skip
    Path(args.json).write_text(json.dumps({"trace": Path(args.trace).name, "runs": results},
                                          indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
