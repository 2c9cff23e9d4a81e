"""The kernel library's variants against each other, per batch size: one model's worth of
GGUF matmuls (the default model's 30 q4_1 layers; fp32 and int8 paths) through each library,
and of its attention: one request's query rows (a decode and its drafts, as in a verify step;
`--attention-rows`) over `--context` keys of an fp32 cache, through each library's paged
decode kernel once per layer. Its outputs are checked close to the first library's, and the
table says whether they are the same bits (builds of one variant's flags should be; variants
with and without FMA round differently).

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
        [--attention-rows 1,13] [--context 600]
"""

import argparse
import ctypes
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import environment, print_table  # noqa: E402
from v1.kernels import library, variants  # noqa: E402
from v1.kernels.attention import paged_decode_kernel  # noqa: E402
from v1.kernels.block_matmul import QuantBlocks, QuantKernels, kernels  # noqa: E402
from v1.models.layers.quantized import QuantizedWeight  # noqa: E402

# [out, in] of the default model's layer weights (q4_1 in its GGUF).
SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30
# The default model's attention: query heads, kv heads, head size; the cache's block size.
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def paired_times(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Each run's seconds per round, every run once a round, the order reversed every other
    round."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in (list(runs) if r % 2 == 0 else list(reversed(runs))):
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def ratios_to_first(times: dict[str, list[float]]) -> dict[str, float]:
    """Per run, the median over rounds of its time over the first run's that round."""
    first = times[next(iter(times))]
    return {name: statistics.median(a / b for a, b in zip(t, first)) for name, t in times.items()}


def attention_layers(lib: ctypes.CDLL, rows: int, context: int) -> Callable[[], torch.Tensor]:
    """`rows` query rows of one request, the last one at key `context` (a verify step's: each
    row sees the keys up to its own), attending through `lib`'s fp32 paged decode kernel, once
    per layer (`LAYERS` calls on one layer's cache: its blocks in a random order); returns
    the call, which gives the output. The inputs are the same for every library."""
    gen = torch.Generator().manual_seed(rows)
    blocks = -(-context // BLOCK)
    cache = torch.randn(2, blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)[None].contiguous()
    zeros = torch.zeros(rows, dtype=torch.int64)
    ends = torch.arange(context - rows + 1, context + 1)
    kernel = paged_decode_kernel(cache, HEADS, lib=lib)
    assert kernel is not None, "the library has no fp32 paged decode kernel"
    step = kernel.bind(table, zeros, torch.arange(rows), zeros, ends,
                       torch.zeros(0, dtype=torch.int64), cache)
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=gen)
    out = torch.empty_like(query)

    def run() -> torch.Tensor:
        for _ in range(LAYERS):
            kernel(step, query, cache, out, None, HEAD_DIM**-0.5)
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--variants", help="comma-separated: only these of this package's")
    ap.add_argument("--lib", action="append", default=[], help="NAME=PATH")
    ap.add_argument("--attention-rows", default="1,13",
                    help="one request's query rows per attention step ('': none)")
    ap.add_argument("--context", type=int, default=600, help="the attention's keys")
    ap.add_argument("--repacked", action="store_true",
                    help="each library in its repacked q4_1 layout too")
    args = ap.parse_args()

    plain = [QuantizedWeight.quantize(torch.randn(n, k) * 0.05, "q4_1") for n, k in SHAPES]
    # contender -> (its library, the weights in its layout)
    libs: dict[str, tuple[QuantKernels, list[QuantBlocks]]] = {}
    cdlls: dict[str, ctypes.CDLL] = {}  # the libraries by contender name (repacked: none)
    runnable = library.candidates("", platform.machine(), variants.cpu_flags())
    chosen = args.variants.split(",") if args.variants else runnable
    for name, path in [
        *((v, str(library.KERNELS_DIR / f"_v1_{v}.so")) for v in runnable if v in chosen),
        *((a.split("=", 1)[0], a.split("=", 1)[1]) for a in args.lib),
    ]:
        cdlls[name] = ctypes.CDLL(path)
        q = kernels(cdlls[name])
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

            times = paired_times({name: (lambda lib=lib: run(*lib)) for name, lib in libs.items()},
                                 args.rounds)
            ratios = ratios_to_first(times)
            first = next(iter(libs))
            rows.append([path, m, statistics.median(times[first]) * 1e3,
                         *(ratios[name] for name in libs)])
            repacked.append([path, m, *(
                statistics.median(a / b for a, b in zip(times[name], times[base]))
                for name, base in plain_of.items())])
    print_table(["path", "rows", f"{next(iter(libs))} ms", *libs], rows)
    if plain_of:
        print("repacked over GGUF's layout, per library:")
        print_table(["path", "rows", *plain_of], repacked)
    attention = []
    for m in (int(r) for r in args.attention_rows.split(",") if r):
        runs = {name: attention_layers(lib, m, args.context) for name, lib in cdlls.items()}
        outs = [run().clone() for run in runs.values()]
        for name, o in zip(runs, outs):
            if not torch.allclose(o, outs[0], rtol=1e-4, atol=1e-5):
                sys.exit(f"{name}'s attention output differs from {next(iter(runs))}'s by up "
                         f"to {(o - outs[0]).abs().max().item():.3g} at {m} rows")
        times = paired_times(runs, args.rounds)
        ratios = ratios_to_first(times)
        attention.append([m, statistics.median(times[next(iter(runs))]) * 1e3, *ratios.values(),
                          " ".join(name for name, o in zip(runs, outs) if torch.equal(o, outs[0]))])
    if attention:
        print(f"attention: one request's query rows over {args.context} keys, {LAYERS} layers:")
        print_table(["rows", f"{next(iter(cdlls))} ms", *cdlls, "same bits"], attention)


if __name__ == "__main__":
    main()
