"""Every block type of the kernel table, at decode's and prompts' row counts.

For each weight shape (a 1B Llama's: 2048 x 2048 attention, 512 x 2048 k/v, 8192 x 2048
gate/up, 16384 x 2048 the two joined, 2048 x 8192 down, an LM head; --shapes takes any "<name>
<N>x<K>") and each kernel library variant this CPU runs (--variants), times each block type's
matmul at M activation rows on random blocks: its int8 path (`linear_i8`, what the engine runs
by default) or, for a type without one (f16, bf16), its fp32 path; a type the library can
interleave (q4_1, q8_0, q4_k, q6_k) also in that layout (q4_1x8, q8_0x8, q4_kx8, q6_kx8),
whether or not this library repacks it. --kinds: some of them. Every (variant, kind) runs once
per round, in an order that rotates between rounds (paired and interleaved on a shared
machine); a figure is the median over rounds: ms per call, GB/s of weight bytes read, and per
round the ratio of each kind's GB/s to that of q4_1 in the layout the library runs it in
(median; with q4_1 among the kinds), and of a repacked layout's time to its GGUF kind's ("vs
plain": q8_0x8's over q8_0's, paired per round; median). --against DIR times the same variants'
libraries in DIR too (another build of the kernels, e.g. an earlier commit's: its variants
named "<variant>@"), and gives each kind's time in this build over its time in DIR's (median of
the rounds' ratios).

    .venv/bin/python bench/bench_block_types.py [--rows 1,4,16] [--variants x86_64_v4,x86_64_v3]
        [--kinds q4_k,q6_k] [--against /path/to/other/v1/kernels]

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
from bench.common import cpu_info, cpu_line  # noqa: E402
from v1.kernels import library, variants  # noqa: E402
from v1.kernels.block_matmul import (  # noqa: E402
    BLOCK_SIZES,
    GGUF_KINDS,
    INTERLEAVED,
    QuantBlocks,
    QuantKernels,
)
from v1.kernels.tensors import weight_empty  # noqa: E402
from v1.models.layers.quantized import QuantizedWeight  # noqa: E402

SHAPES = ("attn 2048x2048", "k/v 512x2048", "gate/up 8192x2048", "gate+up 16384x2048",
          "down 2048x8192", "head 49152x2048")
# Where a block stores fp16 scales (byte offsets): kept small and finite.
HALF_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
           "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
FLOATS = {"f16": torch.float16, "bf16": torch.bfloat16}  # rows of halves


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """n rows of k values of `kind` in GGUF's layout, random (speed does not depend on
    values, but a scale's NaN or inf would send a row down the non-finite rerun), on the
    memory a repacked weight gets (`weight_empty`: huge pages from 2 MiB), so that the two
    layouts are timed on the same pages (numpy's own arrays get huge pages, torch's 4 KiB
    ones: either way one layout was favoured, docs/kernels.md). In the engine a plain weight
    is read from the file's mapping, on huge pages where the page cache has large folios."""
    if kind in FLOATS:
        return torch.from_numpy(rng.standard_normal((n, k), np.float32)).to(
            FLOATS[kind]).view(torch.uint8)
    elems, size = BLOCK_SIZES[kind]
    b = rng.integers(0, 256, size=(n, k // elems, size), dtype=np.uint8)
    for at in HALF_AT[kind]:
        b[:, :, at:at + 2] = (rng.standard_normal((n, k // elems, 1)) * 1e-2).astype(
            np.float16).view(np.uint8)
    blocks = weight_empty(n, b.shape[1] * size)
    blocks.numpy()[:] = b.reshape(n, -1)
    return blocks


def weights(q: QuantKernels, n: int, k: int, rng: np.random.Generator,
            kinds: set[str] | None) -> dict[str, QuantBlocks]:
    """Random weights of each GGUF kind this library runs (those in `kinds`, or all), and of
    each interleaved layout of it the library runs, whether or not it repacks the kind to it
    (so that the choice can be measured again)."""
    out = {}
    for kind in sorted(GGUF_KINDS):
        if not q.runs(kind) or (kinds is not None and kind not in kinds):
            continue
        blocks = random_blocks(kind, n, k, rng)
        out[kind] = QuantizedWeight(kind, blocks, n, k).kernel_blocks()
        for layout, (base, _) in INTERLEAVED.items():
            if base == kind and q.runs(layout):
                w = QuantizedWeight(kind, blocks, n, k)
                w.repack(layout)
                out[layout] = w.kernel_blocks()
    return out


def seconds(q: QuantKernels, w: QuantBlocks, x: torch.Tensor, min_s: float) -> float:
    """Seconds per call of the int8 path (the fp32 one for a kind without it): the mean over
    calls for at least min_s."""
    int8 = q.has(w.kind, "linear_i8")
    q.linear(w, x, None, int8=int8)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_s or calls < 3:
        q.linear(w, x, None, int8=int8)
        calls += 1
    return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--variants", default="x86_64_v4,x86_64_v3")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sample-s", type=float, default=0.05)
    parser.add_argument("--kinds", default="", help="GGUF kinds, comma-separated (all)")
    parser.add_argument("--against", type=Path)
    args = parser.parse_args()
    runnable = library.candidates("", os.uname().machine, variants.cpu_flags())
    libs = {v: QuantKernels(library.load_variant(v))
            for v in args.variants.split(",") if v in runnable}
    if args.against:  # its sources differ from this tree's: loaded without load_variant's check
        libs |= {f"{v}@": QuantKernels(ctypes.CDLL(str(args.against / variants.library_name(v))))
                 for v in list(libs)}
    kinds = set(args.kinds.split(",")) if args.kinds else None
    rng = np.random.default_rng(0)
    print(cpu_line(cpu_info(Path("/proc/cpuinfo").read_text())))
    print(f"threads {torch.get_num_threads()}; medians of "
          f"{args.rounds} interleaved rounds; f16/bf16: the fp32 path, the others int8")
    print(f"{'shape':20} {'variant':16} {'M':>3} {'kind':6} {'ms':>8} {'GB/s':>7} "
          f"{'vs q4_1':>8} {'vs plain':>8}" + (f" {'vs @':>6}" if args.against else ""))
    for shape in args.shapes.split(","):
        n, k = map(int, shape.rsplit(" ", 1)[1].split("x"))
        ws = {v: weights(q, n, k, rng, kinds) for v, q in libs.items()}
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k)
            cases = [(v, kind) for v in libs for kind in ws[v]]
            times: dict[tuple[str, str], list[float]] = {c: [] for c in cases}
            for r in range(args.rounds):
                for v, kind in cases[r % len(cases):] + cases[:r % len(cases)]:
                    times[v, kind].append(seconds(libs[v], ws[v][kind], x, args.sample_s))
            for v, kind in cases:
                ref = libs[v].types["q4_1"].repack or "q4_1"
                nbytes = ws[v][kind].tensor.numel()
                ratio = statistics.median(
                    times[v, ref][i] / t * nbytes / ws[v][ref].tensor.numel()
                    for i, t in enumerate(times[v, kind])) if ref in ws[v] else math.nan
                plain = INTERLEAVED.get(kind, (kind,))[0]
                vs_plain = statistics.median(map(truediv, times[v, kind], times[v, plain])) \
                    if plain != kind and (v, plain) in times else math.nan
                t = statistics.median(times[v, kind])
                line = (f"{shape:20} {v:16} {m:3} {kind:6} {t * 1e3:8.3f} "
                        f"{nbytes / t / 1e9:7.2f} {ratio:8.2f} {vs_plain:8.3f}")
                if (v + "@", kind) in times:
                    vs = statistics.median(map(truediv, times[v, kind], times[v + "@", kind]))
                    line += f" {vs:6.3f}"
                print(line)


if __name__ == "__main__":
    main()
