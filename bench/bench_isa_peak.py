"""The kernels against the instruction throughputs they are bound by, on this CPU, one thread.

bench/isa_peak.c measures each kernel family's innermost pattern alone (registers and L1
only): the int8 dot products of the block matmuls per instruction set, the fp32 FMAs of the
attention. This compiles and runs it, then runs, per library variant this CPU runs, the
default model's 30 layers of q4_1 matmuls (int8 path, the layout the engine repacks them
into) and its attention (one request's query rows over `--context` keys) at each row count,
and gives the multiply-adds per second each attains and its share of its pattern's peak.

What it answers: how far a library could still gain by tuning (its share) and how close two
libraries can come at all (the ratio of their peaks). The AVX2 library's int8 peak is about
half AVX-512 VNNI's on one core (vpmaddubsw + vpaddw per 32 multiply-adds where vpdpbusd
does 64), so the AVX2 library within 1.5x of the AVX-512 one needs a larger share of its
peak than the AVX-512 library attains of its own.

    .venv/bin/python bench/bench_isa_peak.py [--rows 1,2,4,8,13,16,64] [--rounds 7]
        [--context 600]
"""

import argparse
import ctypes
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.bench_kernel_variants import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    LAYERS,
    SHAPES,
    attention_layers,
)
from bench.common import environment, print_table, seconds_per_call  # noqa: E402
from v1.kernels import library, variants  # noqa: E402
from v1.kernels.block_matmul import kernels  # noqa: E402
from v1.models.layers.quantized import QuantizedWeight  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "isa_peak.c"
# Per library, the patterns of isa_peak.c its int8 matmuls and its attention are bound by.
BOUND_BY = {
    "x86_64_v4": ("i8_avx512vnni", "f32_fma512"),
    "x86_64_v3_vnni": ("i8_avxvnni", "f32_fma256"),
    "x86_64_v3": ("i8_avx2", "f32_fma256"),
}
MATMUL_MACS = sum(n * k for n, k in SHAPES) * LAYERS  # per row


def peaks() -> dict[str, float]:
    """isa_peak.c's patterns on this CPU: multiply-adds per second."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "isa_peak"
        subprocess.run([*variants.compiler(), "-O2", str(SOURCE), "-o", str(exe)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {name: float(rate) for name, rate in (line.split() for line in out.splitlines())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,13,16,64")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--context", type=int, default=600, help="the attention's keys")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the peaks are one core's
    peak = peaks()
    print(environment(kernels=False))
    print("peaks, one thread (GMAC/s):", ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peak.items()))
    runnable = library.candidates("", platform.machine(), variants.cpu_flags())
    libs = [v for v in BOUND_BY if v in runnable]
    plain = [QuantizedWeight.quantize(torch.randn(n, k) * 0.05, "q4_1") for n, k in SHAPES]
    table = []
    for name in libs:
        cdll = ctypes.CDLL(str(library.KERNELS_DIR / f"_v1_{name}.so"))
        q = kernels(cdll)
        moved = [QuantizedWeight("q4_1", w.blocks.clone(), w.out_features, w.in_features)
                 for w in plain]
        kind = q.types["q4_1"].repack
        for w in moved:
            if kind is not None:
                w.repack(kind)
        weights = [w.kernel_blocks() for w in moved]
        int8_peak, f32_peak = (peak[p] for p in BOUND_BY[name])
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, k) for _, k in SHAPES]

            def matmuls(q=q, weights=weights, xs=xs) -> None:
                for _ in range(LAYERS):
                    for w, x in zip(weights, xs):
                        q.linear(w, x, None, True)
            rate = m * MATMUL_MACS / seconds_per_call(matmuls, args.rounds)
            # scores and p.v: 2 D multiply-adds per query head and key (the keys a row sees)
            keys = sum(args.context - i for i in range(m))
            attend = attention_layers(cdll, m, args.context)
            att = 2 * HEAD_DIM * HEADS * LAYERS * keys / seconds_per_call(attend, args.rounds)
            table.append([name, m, rate / 1e9, rate / int8_peak, att / 1e9, att / f32_peak])
    print_table(["library", "rows", "int8 GMAC/s", "of peak", "attention GMAC/s", "of peak"],
                [[n, m, f"{r:.1f}", f"{s:.2f}", f"{a:.1f}", f"{t:.2f}"]
                 for n, m, r, s, a, t in table])
    if "i8_avx512vnni" in peak and "i8_avx2" in peak:
        ratio = peak["i8_avx512vnni"] / peak["i8_avx2"]
        print(f"int8 peak ratio, AVX-512 VNNI / AVX2: {ratio:.2f}x")


if __name__ == "__main__":
    main()
