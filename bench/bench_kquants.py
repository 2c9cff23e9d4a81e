"""The K-quant rows of the kernel table against q4_1 and q8_0, at decode's batch sizes.

For each weight shape (a 1B Llama's: 2048 x 2048 attention, 8192 x 2048 gate/up, 2048 x 8192
down, and an LM head) and each kernel library variant this CPU runs (--variants), times the
int8 path (`linear_i8`, what decode runs) at M activation rows on random blocks: q4_k, q5_k,
q6_k (and q4_k in the layout the library repacks it to, q4_kx8) beside q4_1 (in the layout
the library repacks it to) and q8_0 (--kinds: some of them). Every (variant, kind) runs once
per round, in an order that rotates between rounds (paired and interleaved on a shared
machine); a figure is the median over rounds: ms per call and GB/s of weight bytes read, and
per round the ratio of each kind's GB/s to q4_1's (median; with q4_1 among the kinds).
--against DIR times the same variants' libraries in DIR too (another build of the kernels,
e.g. an earlier commit's: its variants named "<variant>@"), and gives each kind's time in
this build over its time in DIR's (median of the rounds' ratios).

    .venv/bin/python bench/bench_kquants.py [--rows 1,4,16] [--variants x86_64_v4,x86_64_v3]
        [--kinds q4_kx8] [--against /path/to/other/v1/kernels]

Prints a table.
"""

import argparse
import ctypes
import math
import os
import statistics
import sys
import time
from operator import truediv
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench/common.py: see why there

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from v1.kernels import library, variants  # noqa: E402
from v1.kernels.block_matmul import QuantBlocks, QuantKernels  # noqa: E402
from v1.models.layers.quantized import QuantizedWeight  # noqa: E402

SHAPES = {"attn 2048x2048": (2048, 2048), "gate/up 8192x2048": (8192, 2048),
          "down 2048x8192": (2048, 8192), "head 49152x2048": (49152, 2048),
          "k/v 512x2048": (512, 2048), "gate+up 16384x2048": (16384, 2048)}
K_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # per 256 values
HALF_AT = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}  # the fp16 scales' offsets


def k_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random superblocks with small finite fp16 scales (speed does not depend on values)."""
    b = rng.integers(0, 256, size=(n, k // 256, K_BYTES[kind]), dtype=np.uint8)
    for at in HALF_AT[kind]:
        b[:, :, at:at + 2] = (rng.standard_normal((n, k // 256, 1)) * 1e-2).astype(
            np.float16).view(np.uint8)
    return torch.from_numpy(b.reshape(n, -1))


def interleaved(blocks: torch.Tensor, rows: int, block_bytes: int) -> torch.Tensor:
    """Each group of `rows` rows' blocks b together, dword f of row i at dword rows f + i."""
    n = blocks.shape[0]
    grouped = blocks.view(n // rows, rows, -1, block_bytes // 4, 4)
    return grouped.permute(0, 2, 3, 1, 4).contiguous().view(n, -1)


def weights(q: QuantKernels, n: int, k: int, rng: np.random.Generator,
            kinds: set[str] | None) -> dict[str, QuantBlocks]:
    """Random weights of each kind (those in `kinds`, or all)."""
    out = {kind: QuantBlocks(kind, k_blocks(kind, n, k, rng)) for kind in K_BYTES}
    repack = q.types["q4_k"].repack
    if repack:
        out[repack] = QuantBlocks(repack, interleaved(out["q4_k"].tensor, 8, K_BYTES["q4_k"]))
    dense = torch.randn(n, k)
    for kind in ("q4_1", "q8_0"):
        if kinds is None or kind in kinds:
            w = QuantizedWeight.quantize(dense, kind)
            w.repack_for(q)
            out[kind] = w.kernel_blocks()
    return {kind: w for kind, w in out.items() if kinds is None or kind in kinds}


def seconds(q: QuantKernels, w: QuantBlocks, x: torch.Tensor, min_s: float) -> float:
    """Seconds per call: the mean over calls for at least min_s."""
    q.linear(w, x, None, int8=True)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or calls < 3:
        q.linear(w, x, None, int8=True)
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--variants", default="x86_64_v4,x86_64_v3")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sample-s", type=float, default=0.05)
    parser.add_argument("--kinds", default="")
    parser.add_argument("--against", type=Path)
    args = parser.parse_args()
    runnable = library.candidates("", os.uname().machine, library.cpu_flags())
    libs = {v: QuantKernels(library.load_variant(v))
            for v in args.variants.split(",") if v in runnable}
    if args.against:  # its sources differ from this tree's: loaded without load_variant's check
        libs |= {f"{v}@": QuantKernels(ctypes.CDLL(str(args.against / variants.library_name(v))))
                 for v in list(libs)}
    kinds = set(args.kinds.split(",")) if args.kinds else None
    rng = np.random.default_rng(0)
    print(f"threads {torch.get_num_threads()}, {library.cpu_model()}; medians of "
          f"{args.rounds} interleaved rounds")
    print(f"{'shape':20} {'variant':16} {'M':>3} {'kind':6} {'ms':>8} {'GB/s':>7} "
          f"{'vs q4_1':>8}" + (f" {'vs @':>6}" if args.against else ""))
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        ws = {v: weights(q, n, k, rng, kinds) for v, q in libs.items()}
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            cases = [(v, kind) for v in libs for kind in ws[v]]
            times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
            for r in range(args.rounds):
                for v, kind in cases[r % len(cases):] + cases[:r % len(cases)]:
                    times[v, kind].append(seconds(libs[v], ws[v][kind], x, args.sample_s))
            for v, kind in cases:
                nbytes = ws[v][kind].tensor.numel()
                ratio = statistics.median(
                    times[v, "q4_1"][i] / t * nbytes / ws[v]["q4_1"].tensor.numel()
                    for i, t in enumerate(times[v, kind])) if "q4_1" in ws[v] else math.nan
                t = statistics.median(times[v, kind])
                line = (f"{shape:20} {v:16} {m:3} {kind:6} {t * 1e3:8.3f} "
                        f"{nbytes / t / 1e9:7.2f} {ratio:8.2f}")
                if (v + "@", kind) in times:
                    vs = statistics.median(map(truediv, times[v, kind], times[v + "@", kind]))
                    line += f" {vs:6.3f}"
                print(line)


if __name__ == "__main__":
    main()
