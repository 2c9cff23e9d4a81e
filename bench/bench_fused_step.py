"""The fused decode step alone, through kernel libraries and thread counts, paired and
interleaved in one process: a kernel change's effect on a real batch-1 step, which the noise
of a shared 2-core machine (10-30% between runs) hides in whole-engine figures.

The fused step is every decoder layer of a decode step in one C call (v1.models.fused_decode):
the layers' matmuls, attention, norms and RoPE, and where the engine's step ran them there
(GGUF embedding and head, every row sampled) the embedding lookup, final norm and LM head;
no Python. The model
(the default one: its GGUF blocks in the C kernels) decodes `--context` tokens of one request
in this process; that request's last decode step is then run again and again from the same
inputs. Each round runs every contender once, in an order that alternates between rounds:
a pause (an idle library's pool workers then sleep, as between an engine's steps), `--warmup`
calls, then `--calls` timed ones. A figure is the median over rounds of a contender's time per
call, and of its ratio to the first contender's in the same round. GB/s: the weight bytes the
call reads (the layers', and the LM head's where it runs) over that time.

Contenders: each kernel library (`--lib NAME=PATH`, e.g. a build of another commit or of
edited C; default: every variant of this package this CPU runs, which must all have the same
kernel table and structs) at each `--threads` count.

    .venv/bin/python bench/bench_fused_step.py [--threads 1,2] [--lib NAME=PATH ...]
        [--context 64] [--rounds 30]
"""

import argparse
import ctypes
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import environment, load, make_llm, print_table  # noqa: E402
from v1.kernels import library, variants  # noqa: E402
from v1.kernels.fused_step import FusedDecoder  # noqa: E402
from v1.models.layers.quantized import block_weights  # noqa: E402
from v1.sampling_params import SamplingParams  # noqa: E402


def last_fused_call(args: argparse.Namespace) -> tuple[tuple, dict, int]:
    """The arguments (positional, keyword) of the last fused decode step of one request
    decoding `--context` tokens, and the bytes of block weights it reads: the layers', and the
    LM head's where it ran (the embedding's one row not counted)."""
    loaded = load(args.model)
    llm = make_llm(loaded, max_model_len=args.context + 64)
    calls: list[tuple[tuple, dict]] = []
    real = FusedDecoder.__call__

    def record(self: FusedDecoder, *call_args: object, **kwargs: object) -> object:
        calls.append((call_args, kwargs))
        return real(self, *call_args, **kwargs)

    with mock.patch.object(FusedDecoder, "__call__", record):
        llm.generate(["Tell me a story about a lighthouse."],
                     SamplingParams(temperature=0, max_tokens=args.context, ignore_eos=True),
                     use_tqdm=False)
    if not calls:
        raise SystemExit("no fused decode step ran: the model's layers do not qualify "
                         "(the INFO log says why)")
    model = llm.llm_engine.client.engine_core.model_runner.model
    ends = [getattr(model, "lm_head", None), model.model.embed_tokens]
    head = ends[0] or ends[1]
    weight_bytes = sum(w.blocks.nbytes for m in model.modules()
                       if all(m is not end for end in ends)
                       for w in block_weights(getattr(m, "kernel", None)))
    call_args, kwargs = calls[-1]
    if kwargs.get("logits") is not None:
        weight_bytes += sum(w.blocks.nbytes for w in block_weights(head.kernel))
    return call_args, kwargs, weight_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    ap.add_argument("--lib", action="append", default=[], help="NAME=PATH (repeatable)")
    ap.add_argument("--threads", default=str(torch.get_num_threads()),
                    help="comma-separated thread counts (default: torch's)")
    ap.add_argument("--context", type=int, default=64, help="tokens decoded before the replay")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per contender and round")
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    libs = dict(a.split("=", 1) for a in args.lib) or {
        v: str(library.KERNELS_DIR / f"_v1_{v}.so")
        for v in library.candidates("", platform.machine(), variants.cpu_flags())}
    call, kwargs, weight_bytes = last_fused_call(args)
    layers, hidden, *rest = call
    # The embeddings it updates in place (None: it looks the ids up into its own scratch).
    start = None if hidden is None else hidden.clone()
    contenders = {f"{name} x{t}": (FusedDecoder(ctypes.CDLL(path)), t)
                  for name, path in libs.items() for t in map(int, args.threads.split(","))}
    print(environment(kernels=False), "contenders:", list(contenders), "context:", args.context)

    def run(fused: FusedDecoder, calls: int) -> None:
        for _ in range(calls):
            if start is not None:
                hidden.copy_(start)
            fused(layers, hidden, *rest, **kwargs)

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(args.rounds):
        for name in (list(contenders) if r % 2 == 0 else list(reversed(contenders))):
            fused, threads = contenders[name]
            torch.set_num_threads(threads)
            time.sleep(0.002)
            run(fused, args.warmup)
            t0 = time.perf_counter()
            run(fused, args.calls)
            times[name].append((time.perf_counter() - t0) / args.calls)
    first = times[next(iter(contenders))]
    print_table(["contender", "ms per step", "GB/s of weights", "x first"], [
        [name, statistics.median(t) * 1e3, weight_bytes / statistics.median(t) / 1e9,
         statistics.median(a / b for a, b in zip(t, first))] for name, t in times.items()])


if __name__ == "__main__":
    main()
