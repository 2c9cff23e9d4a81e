"""The kernel library's variants against each other, per batch size: one model's worth of
GGUF matmuls (the default model's 30 q4_1 layers; fp32 and int8 paths) through each library.

Libraries: every variant of the package this CPU runs (v1/kernels/variants.py), plus any given
as NAME=PATH (a -march=native build, another compiler's or tuning's, or a build of another
commit with the same kernel table and structs). All calls go through the same bindings
(`QuantKernels.linear`), with the same inputs; each round times every library once, in
an order that alternates between rounds (paired and interleaved, so all see the same
moments of a shared machine). A figure is the median over rounds of each library's time
relative to the first library's. --variants keeps only those of this package's variants.
With --repacked, each library runs the weights a second time in the interleaved layout its
table repacks q4_1 into (`NAME/q4_1x8`; none where it keeps GGUF's), in the same rounds, and a
second table gives each such time over its library's with GGUF's layout (paired per round).

    .venv/bin/python bench/bench_kernel_variants.py [--rows 1,4,16,64] [--rounds 9]
        [--variants x86_64_v3,x86_64_v4] [--lib NAME=PATH ...] [--repacked]
"""

import argparse
import ctypes
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import environment, print_table  # noqa: E402
from v1.kernels import library, variants  # noqa: E402
from v1.kernels.block_matmul import QuantBlocks, QuantKernels, kernels  # noqa: E402
from v1.models.layers.quantized import QuantizedWeight  # noqa: E402

# [out, in] of the default model's layer weights (q4_1 in its GGUF).
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def bind(path: str) -> QuantKernels:
    return kernels(ctypes.CDLL(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--variants", help="comma-separated: only these of this package's")
    ap.add_argument("--lib", action="append", default=[], help="NAME=PATH")
    ap.add_argument("--repacked", action="store_true",
                    help="each library in its repacked q4_1 layout too")
    args = ap.parse_args()

    plain = [QuantizedWeight.quantize(torch.randn(n, k) * 0.05, "q4_1") for n, k in SHAPES]
    # contender -> (its library, the weights in its layout)
    libs: dict[str, tuple[QuantKernels, list[QuantBlocks]]] = {}
    runnable = library.candidates("", platform.machine(), variants.cpu_flags())
    chosen = args.variants.split(",") if args.variants else runnable
    for name, path in [
        *((v, str(library.KERNELS_DIR / f"_v1_{v}.so")) for v in runnable if v in chosen),
        *((a.split("=", 1)[0], a.split("=", 1)[1]) for a in args.lib),
    ]:
        q = bind(path)
        libs[name] = (q, [w.kernel_blocks() for w in plain])
        kind = q.types["q4_1"].repack
        if args.repacked and kind is not None:
            moved = [QuantizedWeight("q4_1", w.blocks.clone(), w.out_features, w.in_features)
                     for w in plain]
            for w in moved:
                w.repack(kind)
            libs[f"{name}/{kind}"] = (q, [w.kernel_blocks() for w in moved])
    print(environment(kernels=False), "contenders:", list(libs))
    plain_of = {name: name.split("/")[0] for name in libs if "/" in name}  # repacked: plain
    rows, repacked = [], []
    for path in ("fp32", "int8"):
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, k) for _, k in SHAPES]

            def run(q: QuantKernels, weights: list[QuantBlocks], int8: bool = path == "int8",
                    xs=xs) -> None:
                for _ in range(LAYERS):
                    for w, x in zip(weights, xs):
                        q.linear(w, x, None, int8)

            times: dict[str, list[float]] = {name: [] for name in libs}
            for r in range(args.rounds):
                for name in (list(libs) if r % 2 == 0 else list(reversed(libs))):
                    start = time.perf_counter()
                    run(*libs[name])
                    times[name].append(time.perf_counter() - start)
            first = next(iter(libs))
            ratios = {name: statistics.median(a / b for a, b in zip(t, times[first]))
                      for name, t in times.items()}
            rows.append([path, m, statistics.median(times[first]) * 1e3,
                         *(ratios[name] for name in libs)])
            repacked.append([path, m, *(
                statistics.median(a / b for a, b in zip(times[name], times[base]))
                for name, base in plain_of.items())])
    print_table(["path", "rows", f"{next(iter(libs))} ms", *libs], rows)
    if plain_of:
        print("repacked over GGUF's layout, per library:")
        print_table(["path", "rows", *plain_of], repacked)


if __name__ == "__main__":
    main()
