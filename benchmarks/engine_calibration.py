"""The simulated GPU beside a published table of measurements, and the fit behind it.

    python benchmarks/engine_calibration.py --json docs/results/engine_calibration.json

The cost model's constants (``qosd_sim.gpu.GpuModel``) are fitted to NVIDIA's
TensorRT-LLM figures for LLaMA 7B in FP16 on one A100 (``qosd_sim.calibration``): two
first-token latencies at batch 1 and three static-batch throughputs. Four constants
are fitted by least squares on the log of model / published (SciPy): the iteration's
floor, the time per token, decode attention per token of context and the time per
sequence. Prefill attention per token pair is not visible at 2,048 tokens, so it
comes from arithmetic: causal attention over a prompt of n tokens costs 2 x layers x
d_model x n^2 FLOPs (32 x 4096 for LLaMA 7B), against 2 x 6.7e9 FLOPs per token for
the weights, at the rate the fit found for the weights.

It prints the published figures beside those of the fit and of the model's
defaults, and writes them as JSON. Four constants on five cells leave one degree of
freedom, so a good fit says little by itself: each cell is also held out in turn
(``held_out``), the four constants fitted to the other four cells, and the held-out
cell predicted; its error is what the fit's agreement is worth on a cell it never saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from qosd_sim.calibration import (
    GQA_KV_RATIO,
    PUBLISHED,
    SOURCE,
    FirstTokenCell,
    ThroughputCell,
    model_figure,
    published_shape,
    table,
)
from qosd_sim.gpu import GpuModel

#: Causal attention FLOPs per prompt-token pair over weight FLOPs per token, LLaMA 7B.
ATTENTION_PER_PAIR = 2 * 32 * 4096 / (2 * 6.7e9)


def model_for(x: np.ndarray) -> GpuModel:
    floor_ms, us_per_token, context_us, sequence_us = (float(v) for v in x)
    return GpuModel(
        iteration_floor_ms=floor_ms,
        us_per_token=us_per_token,
        attention_us_per_token2=us_per_token * ATTENTION_PER_PAIR,
        decode_us_per_context_token=context_us / GQA_KV_RATIO,
        us_per_sequence=sequence_us,
    )


def _target(cell: FirstTokenCell | ThroughputCell) -> float:
    return cell.first_token_ms if isinstance(cell, FirstTokenCell) else cell.output_tokens_s


def fit(cells: Sequence[FirstTokenCell | ThroughputCell] = PUBLISHED) -> GpuModel:
    """The four constants fitted to ``cells`` (all the published ones by default)."""

    def residuals(x: np.ndarray) -> np.ndarray:
        shaped = published_shape(model_for(x))
        return np.array([np.log(model_figure(shaped, cell) / _target(cell)) for cell in cells])

    start = np.array([16.0, 60.0, 0.2, 20.0])
    found = least_squares(residuals, start, bounds=([1, 1, 0, 0], [100, 500, 5, 500]))
    return model_for(found.x)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="write the tables here")
    args = parser.parse_args()
    fitted = fit()
    defaults = GpuModel()
    names = ("iteration_floor_ms", "us_per_token", "attention_us_per_token2",
             "decode_us_per_context_token", "us_per_sequence")  # fmt: skip
    constants = {
        name: {"fitted": round(getattr(fitted, name), 6), "default": getattr(defaults, name)}
        for name in names
    }
    rows_fit, rows_default = table(fitted), table(defaults)
    print(f"Published: {SOURCE}\n")
    print("| cell | published | model (fit) | model (defaults) | error (defaults) |")
    print("|---|---:|---:|---:|---:|")
    for fit_row, row in zip(rows_fit, rows_default, strict=True):
        print(
            f"| {row['cell']} | {row['published']:,.0f} | {fit_row['model']:,.1f} | "
            f"{row['model']:,.1f} | {float(row['error']):+.1%} |"
        )
    print("\n| constant | fitted | default |\n|---|---:|---:|")
    for name, values in constants.items():
        print(f"| {name} | {values['fitted']:g} | {values['default']:g} |")
    seed_story = {
        "unchunked_32k_prefill_s": round(
            GpuModel(prefill_chunk_tokens=None).prefill_s([32_768]), 3
        ),
        "decode_step_ms_batch_128_context_1400": round(
            defaults.decode_s(128, 128 * 1400) * 1000, 1
        ),
        "chunked_iteration_ms_full_budget": round(
            defaults.iteration_s(defaults.prefill_chunk_tokens or 0) * 1000, 1
        ),
    }
    print(f"\nThe seed's story on the defaults: {seed_story}")
    held_out = []
    print("\nEach cell held out: fitted to the other four, then predicted")
    print("| held-out cell | published | predicted | error |\n|---|---:|---:|---:|")
    for cell in PUBLISHED:
        model = fit([other for other in PUBLISHED if other is not cell])
        predicted = model_figure(published_shape(model), cell)
        error = predicted / _target(cell) - 1
        held_out.append({"cell": cell.name, "published": _target(cell),
                         "predicted": round(predicted, 1), "error": round(error, 4)})  # fmt: skip
        print(f"| {cell.name} | {_target(cell):,.0f} | {predicted:,.1f} | {error:+.1%} |")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "source": SOURCE,
                    "cells": rows_default,
                    "cells_fitted": rows_fit,
                    "constants": constants,
                    "gpu_defaults": dataclasses.asdict(defaults),
                    "seed_story": seed_story,
                    "held_out": held_out,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
