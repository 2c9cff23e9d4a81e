"""GGUF block kernels (v1.models.layers.quantized) against fp32 matmuls, per batch size.

For each of the default model's weight shapes (SmolLM2-135M: fused qkv, o, gate_up, down and
the tied LM head) and each batch of M rows, times
- q4_1 and q8_0 blocks, each through its two C paths: "fp32" (blocks dequantized in registers,
  fp32 activations) and "int8" (activations quantized per block, integer dot products), and
  "dense" (the whole weight dequantized by C per call, then oneDNN: what prefill batches take);
- fp32 oneDNN against a prepacked weight (`PackedWeight`, what fp32 models run) and F.linear.
Every kernel runs once per round, in an order that rotates between rounds (paired and
interleaved, so all see the same moments of a shared machine); a figure is the median over
rounds, a ratio the median of the per-round ratios to oneDNN (below 1: faster than fp32).
"layer" sums qkv + o + gate_up + down; "layer+head" adds the LM head; "model" is 30 layers +
head (their ratios: of the summed medians); the default model itself runs q4_1 layers and a
q8_0 head ("model in the GGUF's kinds", `model_gguf` in the JSON), per path.

    .venv/bin/python bench/bench_quant_kernels.py [--rows 1,2,4,8,16,32,64] [--out DIR]

Prints a table and one JSON line; --out writes quant_kernels.json, .txt and .png.
"""

import argparse
import io
import json
import os
import statistics
import sys
from collections.abc import Callable
from contextlib import redirect_stdout
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/common.py: see why there

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import environment, print_table, time_call, write_outputs  # noqa: E402
from v1 import envs  # noqa: E402
from v1.kernels.block_matmul import kernels  # noqa: E402
from v1.models.layers import quantized as quant  # noqa: E402
from v1.models.layers.linear import PackedWeight  # noqa: E402

# [out, in] of the default model's weights, and the block kind its GGUF stores them in.
SHAPES = {
    "qkv": (960, 576, "q4_1"), "o": (576, 576, "q4_1"), "gate_up": (3072, 576, "q4_1"),
    "down": (576, 1536, "q4_1"), "lm_head": (49152, 576, "q8_0"),
}
LAYERS = 30
QUANT_PATHS = ("fp32", "int8", "dense")
QUANT_KERNELS = tuple(f"{k}/{p}" for k in ("q4_1", "q8_0") for p in QUANT_PATHS)
KERNELS = (*QUANT_KERNELS, "onednn", "F.linear")


def measure(shape: tuple[int, int, str], rows: int, rounds: int, sample_s: float,
            weights: dict[str, object]) -> dict[str, dict[str, float]]:
    out_f, in_f, _ = shape
    x = torch.randn(rows, in_f)
    packed, q4, q8 = weights["onednn"], weights["q4_1"], weights["q8_0"]
    fns: dict[str, Callable[[], object]] = {
        f"{kind}/{path}": (lambda w=w, path=path: w.linear(x, path=path))
        for kind, w in (("q4_1", q4), ("q8_0", q8)) for path in QUANT_PATHS
    }
    fns["onednn"] = lambda: packed.linear(x)
    fns["F.linear"] = lambda: F.linear(x, weights["fp32"])
    reps = {}
    for name, fn in fns.items():  # warm up (builds the kernels once) and size the samples
        fn()
        once = time_call(fn, 1)
        reps[name] = max(1, min(1000, int(sample_s / max(once, 1e-6))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            samples[name].append(time_call(fns[name], reps[name]))
    result = {name: {"ms": statistics.median(s) * 1e3} for name, s in samples.items()}
    for name in fns:
        ratios = [a / b for a, b in zip(samples[name], samples["onednn"])]
        result[name]["vs_onednn"] = statistics.median(ratios)
    return result


def combine(parts: list[dict[str, dict[str, float]]], weights: list[float]
            ) -> dict[str, dict[str, float]]:
    """Weighted sums of the parts' medians; the ratio is the ratio of the sums."""
    out = {}
    for name in KERNELS:
        ms = sum(w * p[name]["ms"] for p, w in zip(parts, weights))
        out[name] = {"ms": ms}
    for name in KERNELS:
        out[name]["vs_onednn"] = out[name]["ms"] / out["onednn"]["ms"]
    return out


def gguf_column(parts: dict[str, dict[str, dict[str, float]]], path: str,
                layers: int) -> float:
    """ms of the default model's own kinds: q4_1 layers, q8_0 head, through `path`."""
    layer = sum(parts[s][f"q4_1/{path}"]["ms"] for s in ("qkv", "o", "gate_up", "down"))
    return layers * layer + parts["lm_head"][f"q8_0/{path}"]["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--rounds", type=int, default=7, help="paired rounds per point")
    parser.add_argument("--sample-ms", type=float, default=15.0, help="time per sample")
    parser.add_argument("--out", default=None, help="directory for quant_kernels.json/.txt/.png")
    args = parser.parse_args()
    if kernels() is None:
        raise SystemExit("the C kernels are unavailable (not built, or V1_CPU_KERNELS=0)")
    torch.manual_seed(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    table = []
    with torch.inference_mode():
        weights = {}
        for name, (out_f, in_f, _) in SHAPES.items():
            w = torch.randn(out_f, in_f) * 0.05
            weights[name] = {"fp32": w, "onednn": PackedWeight(w),
                             "q4_1": quant.QuantizedWeight.quantize(w, "q4_1"),
                             "q8_0": quant.QuantizedWeight.quantize(w, "q8_0")}
        for rows in rows_list:
            parts = {name: measure(shape, rows, args.rounds, args.sample_ms / 1e3, weights[name])
                     for name, shape in SHAPES.items()}
            layer = combine([parts[s] for s in ("qkv", "o", "gate_up", "down")], [1] * 4)
            parts["layer"] = layer
            parts["layer+head"] = combine([layer, parts["lm_head"]], [1, 1])
            parts["model"] = combine([layer, parts["lm_head"]], [LAYERS, 1])
            for shape, r in parts.items():
                results.append({"rows": rows, "shape": shape, **{
                    k: {"ms": round(v["ms"], 4), "vs_onednn": round(v["vs_onednn"], 3)}
                    for k, v in r.items()}})
                table.append([shape, rows, *(r[k]["ms"] for k in KERNELS),
                              *(r[k]["vs_onednn"] for k in QUANT_KERNELS)])
            for path in QUANT_PATHS:
                ms = gguf_column(parts, path, LAYERS)
                results.append({"rows": rows, "shape": "model_gguf", "path": path,
                                "ms": round(ms, 3),
                                "vs_onednn": round(ms / parts["model"]["onednn"]["ms"], 3)})
    text = io.StringIO()
    with redirect_stdout(text):
        print("ms per call (median of paired rounds) and ratio to fp32 oneDNN prepacked; "
              f"threads {torch.get_num_threads()}, int8 dot products: "
              f"{kernels().int8_isa}")
        print_table(["shape", "M", *(f"{k} ms" for k in KERNELS),
                     *(f"{k}/onednn" for k in QUANT_KERNELS)], table)
        print("\nmodel in the GGUF's kinds (q4_1 layers, q8_0 head), ms per step / vs oneDNN:")
        for r in results:
            if r["shape"] == "model_gguf":
                print(f"  M={r['rows']:3d} {r['path']:5s} {r['ms']:9.3f} ms  {r['vs_onednn']:.3f}")
    print(text.getvalue(), end="")
    summary = {"bench": "quant_kernels", "int8_isa": kernels().int8_isa,
               "int8_min_rows": envs.read().quant_int8_min_rows, **environment(),
               "results": results}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "quant_kernels.txt").write_text(text.getvalue())

        def plot(fig) -> None:
            ax = fig.add_subplot(1, 1, 1)
            for path in QUANT_PATHS:
                pts = [r for r in results if r["shape"] == "model_gguf" and r["path"] == path]
                ax.plot([p["rows"] for p in pts], [p["vs_onednn"] for p in pts], marker="o",
                        label=f"gguf blocks, {path} path")
            ax.axhline(1.0, color="gray", linestyle="--", label="fp32 oneDNN prepacked")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("rows per matmul (M)")
            ax.set_ylabel("time / fp32 oneDNN (model: 30 layers + head)")
            ax.legend()

        write_outputs(args.out, "quant_kernels", summary, plot)


if __name__ == "__main__":
    main()
