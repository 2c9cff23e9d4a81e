"""fp32 linear layers on CPU, per batch size: oneDNN against a copy packed once, oneDNN against
the plain weight, and F.linear (MKL) — the forms an fp32 weight can be held in with one copy.

Why it exists: `v1.models.layers.linear.PackedWeight` keeps one packed copy of each weight and
no plain one, which is right only if the packed matmul is no slower than F.linear at the batch
sizes the engine runs (decode batches of 1-256 rows, prefill chunks up to 2048); the tied LM
head, whose matrix must stay plain for embedding lookups, multiplies through oneDNN against the
plain weight. Shapes are the default model's (SmolLM2-135M: qkv, o, gate_up, down, the LM
head); the forms run interleaved, so ratios are taken over the same moments of a shared
machine. (bench_quant_kernels.py puts the Q4_1 / Q8_0 block kernels beside the packed one.)

    .venv/bin/python bench/bench_linear.py [--rows 1,16,64,256,2048]

Prints one line per (shape, rows): the median ms of each form and the medians of the paired
ratios to the packed one (above 1: slower than packed), then one JSON line.
"""

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/common.py: see why there

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import time_call  # noqa: E402
from v1.models.layers.linear import PackedWeight  # noqa: E402

# [out, in] of the default model's weights.
SHAPES = {
    "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
    "lm_head": (49152, 576),
}


def kernels(weight: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    packed = PackedWeight(weight)
    return {
        "packed": lambda: packed.linear(x),
        "f_linear": lambda: F.linear(x, weight),
        "onednn_plain": lambda: torch.ops.mkldnn._linear_pointwise(
            x, weight, None, "none", [], ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,256,2048")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per point")
    parser.add_argument("--max-head-rows", type=int, default=256,
                        help="the LM head only sees sampled rows: skip it above this")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for name, (out_f, in_f) in SHAPES.items():
                if name == "lm_head" and rows > args.max_head_rows:
                    continue
                fns = kernels(torch.randn(out_f, in_f) * 0.05, torch.randn(rows, in_f))
                # Enough repetitions for ~20 ms per sample.
                reps = max(1, min(500, int(4e9 / (rows * out_f * in_f) / 50)))
                for fn in fns.values():
                    time_call(fn, 2)
                runs = [{k: time_call(fn, reps) for k, fn in fns.items()}
                        for _ in range(args.rounds)]
                ms = {k: statistics.median(r[k] for r in runs) * 1e3 for k in fns}
                ratio = {k: statistics.median(r[k] / r["packed"] for r in runs) for k in fns}
                print(f"rows {rows:5d} {name:8s} " + "  ".join(
                    f"{k} {ms[k]:7.3f} ms" + ("" if k == "packed" else f" ({ratio[k]:.2f}x)")
                    for k in fns))
                results.append({"rows": rows, "shape": name, "ms": ms,
                                "over_packed": {k: v for k, v in ratio.items() if k != "packed"}})
    print(json.dumps({"bench": "linear", "threads": torch.get_num_threads(),
                      "results": results}))


if __name__ == "__main__":
    main()
