"""The kernel library's variants against each other, per batch size: one model's worth of
GGUF matmuls (the default model's 30 q4_1 layers; fp32 and int8 paths) through each library.

Libraries: every variant of the package this CPU runs (v1/kernels/variants.py), plus any given
as NAME=PATH (a -march=native build, another compiler's or tuning's, or a build of an older
commit: `--legacy NAME=PATH` for one whose entry points lack the trailing thread count, as
before the shared pool). All calls go straight through ctypes, with the same inputs; each
round times every library once, in an order that alternates between rounds (paired and
interleaved, so all see the same moments of a shared machine). A figure is the median over
rounds of each library's time relative to the first library's.

    .venv/bin/python bench/bench_kernel_variants.py [--rows 1,4,16,64] [--rounds 9]
        [--lib NAME=PATH ...] [--legacy NAME=PATH ...]
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
from v1.kernels import library  # noqa: E402
from v1.kernels.quant import KIND_CODE  # noqa: E402
from v1.models.layers.quantized import QuantizedWeight  # noqa: E402

# [out, in] of the default model's layer weights (q4_1 in its GGUF).
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def bind(path: str, legacy: bool) -> dict[str, ctypes._CFuncPtr]:
    lib = ctypes.CDLL(path)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    fns = {}
    for path_name, symbol in (("fp32", "v1_q_linear_f32"), ("int8", "v1_q_linear_i8")):
        fn = getattr(lib, symbol)
        fn.argtypes = [i32, p, i64, i64, p, i64, i64, p, p, i64] + ([] if legacy else [i32])
        fn.restype = i32
        fns[path_name] = fn
    return fns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--lib", action="append", default=[], help="NAME=PATH")
    ap.add_argument("--legacy", action="append", default=[], help="NAME=PATH, no thread count")
    args = ap.parse_args()

    libs: dict[str, tuple[dict, bool]] = {}
    for name, (path, legacy) in [
        *((v, (str(library.KERNELS_DIR / f"_v1_{v}.so"), False))
          for v in library.candidates("", platform.machine(), library.cpu_flags())),
        *((a.split("=", 1)[0], (a.split("=", 1)[1], False)) for a in args.lib),
        *((a.split("=", 1)[0], (a.split("=", 1)[1], True)) for a in args.legacy),
    ]:
        libs[name] = (bind(path, legacy), legacy)
    threads = torch.get_num_threads()
    weights = [QuantizedWeight.quantize(torch.randn(n, k) * 0.05, "q4_1").blocks
               for n, k in SHAPES]
    print(environment(), "libraries:", list(libs))
    rows = []
    for path in ("fp32", "int8"):
        for m in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(m, k) for _, k in SHAPES]
            ys = [torch.empty(m, n) for n, _ in SHAPES]

            def run(fn: ctypes._CFuncPtr, legacy: bool, m: int = m, xs=xs, ys=ys) -> None:
                extra = () if legacy else (threads,)
                for _ in range(LAYERS):
                    for (n, k), b, x, y in zip(SHAPES, weights, xs, ys):
                        fn(KIND_CODE["q4_1"], b.data_ptr(), n, k, x.data_ptr(), k, m, None,
                           y.data_ptr(), n, *extra)

            times: dict[str, list[float]] = {name: [] for name in libs}
            for r in range(args.rounds):
                for name in (list(libs) if r % 2 == 0 else list(reversed(libs))):
                    fns, legacy = libs[name]
                    start = time.perf_counter()
                    run(fns[path], legacy)
                    times[name].append(time.perf_counter() - start)
            first = next(iter(libs))
            ratios = {name: statistics.median(a / b for a, b in zip(t, times[first]))
                      for name, t in times.items()}
            rows.append([path, m, statistics.median(times[first]) * 1e3,
                         *(ratios[name] for name in libs)])
    print_table(["path", "rows", f"{next(iter(libs))} ms", *libs], rows)


if __name__ == "__main__":
    main()
