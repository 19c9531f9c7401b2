"""The published measurements the cost model is fitted to, and the model's figures for
the same experiments.

The table is NVIDIA's, for LLaMA 7B in FP16 on one A100 with TensorRT-LLM (its
``docs/source/performance.md``, at commit 138f96d45f90b9667426f7c47297d8c06bafac73 of
github.com/NVIDIA/TensorRT-LLM: the "A100 GPUs (FP16)" rows of "Peak Throughput" and
"Low Latency", TP 1). Two kinds of cell:

- first-token latency at batch 1: one prefill of the prompt;
- peak output throughput of a static batch: ``batch`` requests that all arrive at
  once, whose prompts are prefilled together and which then decode in lockstep.

The model reproduces each experiment in its own engine (``qosd_sim.gpu``, unchunked,
with room for the whole batch), with LLaMA 7B's full multi-head attention: 32 KV heads,
where the grouped-query shape the benchmarks run (8 KV heads, Llama-3-8B's) reads a
quarter of the KV cache per decoded token (``GQA_KV_RATIO``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from qosd_sim.gpu import GpuModel, run_virtual

SOURCE = (
    "NVIDIA TensorRT-LLM, docs/source/performance.md at 138f96d45f90b9667426f7c47297d8c06bafac73: "
    "LLaMA 7B, A100, FP16, TP 1"
)
#: KV heads of LLaMA 7B (multi-head) over those of the shape the benchmarks run.
GQA_KV_RATIO = 4


@dataclass(frozen=True, slots=True)
class FirstTokenCell:
    prompt_tokens: int
    first_token_ms: float  # published

    @property
    def name(self) -> str:
        return f"first token, batch 1, {self.prompt_tokens:,}-token prompt (ms)"


@dataclass(frozen=True, slots=True)
class ThroughputCell:
    batch: int
    prompt_tokens: int
    output_tokens: int
    output_tokens_s: float  # published

    @property
    def name(self) -> str:
        return (
            f"output tokens/s, batch {self.batch}, {self.prompt_tokens:,} in / "
            f"{self.output_tokens:,} out"
        )


PUBLISHED: tuple[FirstTokenCell | ThroughputCell, ...] = (
    FirstTokenCell(128, 16.0),
    FirstTokenCell(2048, 133.0),
    ThroughputCell(384, 128, 128, 5_586.0),
    ThroughputCell(60, 128, 2048, 1_928.0),
    ThroughputCell(52, 2048, 128, 591.0),
)


def published_shape(gpu: GpuModel) -> GpuModel:
    """``gpu`` as the published experiments ran: LLaMA 7B's multi-head attention,
    whole prompts in one prefill, and room for any batch."""
    return dataclasses.replace(
        gpu,
        decode_us_per_context_token=gpu.decode_us_per_context_token * GQA_KV_RATIO,
        prefill_chunk_tokens=None,
        max_batch=1024,
        kv_capacity_tokens=10**8,
        max_prefill_tokens=10**8,
    )


def model_figure(gpu: GpuModel, cell: FirstTokenCell | ThroughputCell) -> float:
    """The model's figure for one published cell, in the cell's unit; ``gpu`` is
    used as given (see ``published_shape``)."""
    if isinstance(cell, FirstTokenCell):
        return gpu.prefill_s([cell.prompt_tokens]) * 1000
    batch = [(0.0, cell.prompt_tokens, cell.output_tokens)] * cell.batch
    finished = run_virtual(gpu, batch)
    elapsed = max(s.finished_at or 0.0 for s in finished)
    return cell.batch * cell.output_tokens / elapsed


def table(gpu: GpuModel) -> list[dict[str, float | str]]:
    """Every published cell beside the model's figure (``gpu`` in its published shape)."""
    shaped = published_shape(gpu)
    rows: list[dict[str, float | str]] = []
    for cell in PUBLISHED:
        published = (
            cell.first_token_ms if isinstance(cell, FirstTokenCell) else cell.output_tokens_s
        )
        model = model_figure(shaped, cell)
        rows.append(
            {
                "cell": cell.name,
                "published": published,
                "model": round(model, 1),
                "error": round(model / published - 1, 4),
            }
        )
    return rows
