"""Where a decode step's time goes: GEMMs, attention and the rest.

The workload of `bench_throughput.py --decode`: `--seqs` concurrent requests of `--input-len`
random tokens, each generating `--output-len` tokens, all prefilled in the first step; the
steps after it decode every request at once, with contexts of input_len + 1 to
input_len + output_len - 1 tokens (mean input_len + output_len / 2).

How it measures: the real in-process engine runs the workload with perf_counter timers around
its own calls (on CPU every op is synchronous, so a call's wall time is its work):
- step: `LLMEngine.step`: the engine core's step (`EngineCore.step`: schedule, model runner,
  update_from_output), then output processing (detokenization, stop checks);
- GEMMs: every `Linear.forward` (q/k/v, o, gate/up, down of each layer) and the LM head
  (`compute_logits`);
- fused layers: with `--weights gguf` (the engine's default for a .gguf file: its blocks in
  the C kernels), a decode step runs every layer as one C call (`FusedDecoder`: the layers'
  GEMMs, attention, norms and RoPE inside it), and where the step samples every row, the
  embedding lookup, final norm and LM head too; then "gemm" is empty (else the LM head alone);
- attention: `paged_attention`, reading the K/V cache (the C decode kernel on CPU); the KV
  write and the attention plan count under "other";
- sampling: the `Sampler`;
- other model work: the runner minus the above (input preparation and the step's plan,
  embedding, norms, RoPE, SiLU-and-mul, KV write, outside the fused call): Python and the
  small ops; scheduler: the core's step minus the runner; output processing: the step minus
  the core's step.
Figures are means over the pure-decode steps (every request decoding) of `--repeat` runs.
GFLOP/s counts 2 FLOPs per weight of every linear layer and the LM head per token (from the
model config); GB/s counts the K and V bytes of every context token in every layer.

`--floors` also measures what this machine gives without the engine around it: fp32 matmul
on a big square shape, the model's own GEMMs at `--seqs` rows called back to back, and a
streaming read of one step's K/V bytes; the floor step is the GEMM floor plus the K/V bytes at
that read rate.

Prints a table, then one JSON line. `--out DIR` writes step_breakdown.json and a PNG.

    .venv/bin/python bench/bench_step_breakdown.py --floors
    .venv/bin/python bench/bench_step_breakdown.py --seqs 8 --input-len 32 --output-len 16
    .venv/bin/python bench/bench_step_breakdown.py --seqs 1 --input-len 8 --weights gguf
"""

import argparse
import functools
import json
import random
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

# common (through bench_throughput) must be imported before torch: it sets OMP_WAIT_POLICY,
# which libgomp reads once, when torch is imported (v1 imports torch); the sorted order keeps
# it first only while torch is not imported by name at the top.
from bench_throughput import decode_engine_kwargs, random_prompts, timed_generate
from common import (
    CallClock,
    add_model_args,
    bar,
    environment,
    load,
    make_llm,
    print_table,
    seconds_per_call,
    setup_threads,
    write_outputs,
)

from v1.attention.backends import torch_attn
from v1.engine.core import EngineCore
from v1.engine.llm_engine import LLMEngine
from v1.kernels.fused_step import FusedDecoder
from v1.models.decoder import DecoderForCausalLM, head_dim_of
from v1.models.layers.linear import Linear
from v1.sampling_params import SamplingParams
from v1.worker.model_runner import ModelRunner
from v1.worker.sampler import Sampler

# The timed calls, each nested in the next ones: gemm, attention, sampling, fused < runner <
# core < step.
TIMED = ("gemm", "attention", "sampling", "fused", "runner", "core", "step")
# What a step is split into, as printed.
PARTS = ("fused layers", "gemm", "attention", "sampling", "other model work", "scheduler",
         "output processing")


def linear_weights(config: Any) -> int:
    """Weights multiplied per token: every layer's q/k/v, o, gate/up and down, and the LM
    head (biases are negligible)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * head_dim_of(config)
    kv = config.num_key_value_heads * head_dim_of(config)
    per_layer = hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden
    return config.num_hidden_layers * per_layer + hidden * config.vocab_size


def gemm_flops_per_token(config: Any) -> int:
    return 2 * linear_weights(config)


def kv_bytes_per_token(config: Any, element_size: int) -> int:
    """K and V of one context token in every layer."""
    return (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim_of(config)
            * element_size)


def mean_decode_context(input_len: int, output_len: int) -> float:
    """Mean context per request over the decode steps: input_len + 1 .. input_len +
    output_len - 1 tokens (the first output token comes from the prefill step)."""
    return input_len + output_len / 2


def split_step(timed: dict[str, float]) -> dict[str, float]:
    """One step's timed calls (seconds) as the printed parts."""
    return {
        "fused layers": timed["fused"],
        "gemm": timed["gemm"],
        "attention": timed["attention"],
        "sampling": timed["sampling"],
        "other model work": timed["runner"] - timed["fused"] - timed["gemm"]
        - timed["attention"] - timed["sampling"],
        "scheduler": timed["core"] - timed["runner"],
        "output processing": timed["step"] - timed["core"],
    }


class StepClock(CallClock):
    """Seconds spent in each timed call, per engine step, with the step's token count
    (the tokens of all core steps in it: one per `LLMEngine.step` in these workloads)."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        super().__init__(TIMED)
        self._tokens = 0

    def _runner(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        timed = self._timed("runner", fn)

        def execute_model(runner: Any, scheduler_output: Any) -> Any:
            self._tokens += scheduler_output.total_num_scheduled_tokens
            return timed(runner, scheduler_output)
        return execute_model

    def _step(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        timed = self._timed("step", fn)

        def step(engine: Any) -> Any:
            self._reset()
            self._tokens = 0
            out = timed(engine)
            if self._tokens:
                self.steps.append((self._tokens, self._spent))
            return out
        return step

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The timers around the engine's classes (every engine in this process)."""
        with ExitStack() as stack:
            for owner, attr, wrap in [
                (Linear, "forward", functools.partial(self._timed, "gemm")),
                (DecoderForCausalLM, "compute_logits", functools.partial(self._timed, "gemm")),
                (torch_attn, "paged_attention", functools.partial(self._timed, "attention")),
                (Sampler, "__call__", functools.partial(self._timed, "sampling")),
                (FusedDecoder, "__call__", functools.partial(self._timed, "fused")),
                (ModelRunner, "execute_model", self._runner),
                (EngineCore, "step", functools.partial(self._timed, "core")),
                (LLMEngine, "step", self._step),
            ]:
                stack.enter_context(mock.patch.object(owner, attr, wrap(getattr(owner, attr))))
            yield


def floors(model: Any, rows: int, kv_bytes: float, repeat: int) -> dict[str, float]:
    """The machine's rates without the engine: big fp32 matmul, the model's GEMMs at `rows`
    rows back to back, and a streaming read of `kv_bytes`."""
    import torch  # here, not above: see the imports

    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    peak = 2 * n**3 / seconds_per_call(lambda: torch.mm(a, b), repeat)

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = [torch.randn(rows, m.in_features) for m in linears]
    head_input = torch.randn(rows, model.config.hidden_size)

    def all_gemms() -> None:
        for m, x in zip(linears, inputs):
            m(x)
        model.compute_logits(head_input)

    with torch.inference_mode():
        gemm_s = seconds_per_call(all_gemms, repeat)
    buf = torch.ones(int(kv_bytes) // 4)
    read = buf.nbytes / seconds_per_call(buf.sum, repeat)
    del buf
    floor_s = gemm_s + kv_bytes / read
    return {
        "matmul_2048_gflop_s": round(peak / 1e9, 1),
        "gemm_floor_ms": round(gemm_s * 1e3, 2),
        "gemm_floor_gflop_s": round(rows * gemm_flops_per_token(model.config) / gemm_s / 1e9, 1),
        "read_gb_s": round(read / 1e9, 2),
        "floor_step_ms": round(floor_s * 1e3, 2),
        "floor_tok_s": round(rows / floor_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=64, help="concurrent requests")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=1, help="timed runs of the workload")
    parser.add_argument("--floors", action="store_true",
                        help="also measure the matmul, GEMM and read floors of this machine")
    parser.add_argument("--floor-repeat", type=int, default=10, help="calls per floor (median)")
    parser.add_argument("--weights", choices=("fp32", "gguf"), default="fp32",
                        help="fp32 (oneDNN GEMMs) or a .gguf file's blocks in the C kernels, "
                             "as the engine's default (fused layers at decode)")
    parser.add_argument("--out", default=None, help="directory for the JSON result and a PNG plot")
    add_model_args(parser)
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error("--output-len must be at least 2: the first token comes from the prefill")
    setup_threads(args)
    # The floors are fp32's (oneDNN GEMMs): measured on float weights only.
    if args.floors and args.weights != "fp32":
        parser.error("--floors measures fp32 GEMMs: use it with --weights fp32")
    loaded = load(args.model, "none" if args.weights == "fp32" else None)
    config = loaded.hf_config
    n = args.seqs
    element_size = 4  # load() computes in fp32: an fp32 K/V cache (whatever the weights)
    context = mean_decode_context(args.input_len, args.output_len)
    kv_bytes = n * context * kv_bytes_per_token(config, element_size)
    flops = n * gemm_flops_per_token(config)
    floor = floors(loaded.model, n, kv_bytes, args.floor_repeat) if args.floors else {}

    prompts = random_prompts(random.Random(args.seed), n, (args.input_len, args.input_len),
                             int(config.vocab_size))
    # A context as long as the workload's, not the model's (a 1B Llama's 131072 tokens
    # would not fit the default KV cache).
    llm = make_llm(loaded, async_scheduling=False,
                   max_model_len=max(args.input_len, 32) + args.output_len + 16,
                   **decode_engine_kwargs({"max_num_seqs": n}, n, args.input_len))
    timed_generate(llm, [prompts[0][:32]], SamplingParams(max_tokens=2, ignore_eos=True))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    clock = StepClock()
    run_step_ms = []
    with clock.installed():
        for r in range(args.repeat):
            first = len(clock.steps)
            t, _ = timed_generate(llm, prompts, params)
            run = [s["step"] for tokens, s in clock.steps[first:] if tokens == n]
            run_step_ms.append(1e3 * statistics.fmean(run))
            print(f"run {r}: {t:.2f} s, {len(run)} decode steps of {run_step_ms[-1]:.1f} ms",
                  file=sys.stderr)
    llm.shutdown()
    decode_steps = [split_step(s) for tokens, s in clock.steps if tokens == n]
    # The K/V byte count assumes exactly these steps (contexts input_len + 1 ...).
    assert len(decode_steps) == args.repeat * (args.output_len - 1), len(decode_steps)
    ms = {p: 1e3 * statistics.fmean(s[p] for s in decode_steps) for p in PARTS}
    step_ms = sum(ms.values())
    # Fused layers: "gemm" timed the LM head alone or nothing (the head in the C call too),
    # "attention" nothing (in the C call).
    head_flops = n * 2 * config.hidden_size * config.vocab_size
    head_fused = bool(ms["fused layers"]) and not ms["gemm"]
    gemm_flops = 0 if head_fused else head_flops if ms["fused layers"] else flops
    fused_flops = flops if head_fused else flops - head_flops

    result: dict[str, Any] = {
        "bench": "step_breakdown",
        "concurrent": n,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "mean_context": context,
        "decode_steps": len(decode_steps),
        "step_ms": round(step_ms, 2),
        "decode_tok_s": round(n / step_ms * 1e3, 1),
        **{f"{p.replace(' ', '_')}_ms": round(v, 2) for p, v in ms.items()},
        "weights": args.weights,
        "gemm_gflop_per_step": round(gemm_flops / 1e9, 3),
        "gemm_gflop_s": round(gemm_flops / ms["gemm"] / 1e6, 1) if ms["gemm"] else None,
        "kv_mb_per_step": round(kv_bytes / 1e6, 1),
        "attention_gb_s": (round(kv_bytes / ms["attention"] / 1e6, 2) if ms["attention"]
                           else None),
        "run_step_ms": [round(x, 2) for x in run_step_ms],
        **floor,
        **environment(),
    }
    rates = {}
    if ms["gemm"]:
        rates["gemm"] = (f"{result['gemm_gflop_s']} GFLOP/s ({result['gemm_gflop_per_step']} "
                         f"GFLOP{': the LM head' if ms['fused layers'] else ''})")
    if ms["attention"]:
        rates["attention"] = f"{result['attention_gb_s']} GB/s ({result['kv_mb_per_step']} MB K/V)"
    if ms["fused layers"]:
        rates["fused layers"] = (f"{fused_flops / ms['fused layers'] / 1e6:.1f} GFLOP/s of the "
                                 f"layers' GEMMs{' and the LM head' if head_fused else ''}, "
                                 f"with their attention")
    print_table(["part", "ms/step", "share", "rate"],
                [[p, ms[p], f"{ms[p] / step_ms:.1%}", rates.get(p, "")] for p in PARTS]
                + [["step", step_ms, "100%", f"{result['decode_tok_s']} tok/s"]])
    print(f"{n} decoding requests, mean context {context:g}, {len(decode_steps)} steps")
    if floor:
        print(f"floors: fp32 matmul 2048^3 {floor['matmul_2048_gflop_s']} GFLOP/s; the model's "
              f"GEMMs at {n} rows {floor['gemm_floor_ms']} ms ({floor['gemm_floor_gflop_s']} "
              f"GFLOP/s); streaming read {floor['read_gb_s']} GB/s; floor step "
              f"{floor['floor_step_ms']} ms = {floor['floor_tok_s']} tok/s")

    def plot(fig: Any) -> None:
        bar(fig.add_subplot(1, 1, 1), list(PARTS), [ms[p] for p in PARTS], "ms per step",
            f"decode step, {n} requests, context ~{context:g}: {step_ms:.1f} ms")

    write_outputs(args.out, "step_breakdown", result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
