"""Check the engine on a CUDA machine: `make gpu-check` (or `python -m v1.tools.gpu_check`),
with random-weight models: kernels (Triton against `paged_attention_reference`), parity (fp32
tokens equal transformers', bf16 first tokens agree >= 90%) and timing, each reported on its
own. Exit code 1 when a check fails, 2 when CUDA was asked for and is missing; `--device cpu`
runs it tiny in Triton's interpreter. Details: docs/benchmarks.md, "On a GPU".
"""

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata, kv_cache_shape
from v1.attention.backends.torch_attn import paged_attention_reference, write_kv_cache

# SmolLM2-135M-Instruct's config.json (the default model's architecture), as
# transformers.LlamaConfig keywords. The weights are random, so the model file is not needed.
SMOLLM2_135M: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
BLOCK_SIZE = 16

# Relative error ||out - ref|| / ||ref|| allowed per cache dtype: the fp32 kernel uses 3xTF32
# dots (about fp32); 16-bit types round the inputs (in the reference too) and P before P @ V.
KERNEL_TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}
LOGPROB_TOL_FP32 = 1e-3
FIRST_TOKEN_AGREEMENT_BF16 = 0.9


@dataclass(frozen=True, slots=True)
class KernelCase:
    name: str
    reqs: tuple[tuple[int, int], ...]  # (q_len, seq_len) per request: the last q_len are new
    sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class Sizes:
    kernel_cases: tuple[KernelCase, ...]
    kernel_dtypes: tuple[torch.dtype, ...]
    parity_model: dict[str, Any]  # LlamaConfig keywords of the fp32 parity model
    parity_prompts: tuple[int, ...]  # prompt lengths
    parity_tokens: int  # greedy tokens per prompt
    full_model: dict[str, Any]  # the bf16 model (parity and timing)
    bf16_prompts: tuple[int, ...]
    prefill_prompts: tuple[int, int]  # (count, length)
    decode_batches: tuple[int, ...]
    # max(decode_batches) prompts of this length must fit one step's token budget
    # (max_num_batched_tokens: 8192 on GPU, 2048 on CPU), see measure_timing.
    decode_prompt_len: int
    decode_tokens: int
    repeats: int  # timed runs per figure (the median is kept)


def _decode_ctx(n: int, lo: int, hi: int, seed: int) -> tuple[tuple[int, int], ...]:
    lens = np.random.default_rng(seed).integers(lo, hi, n)
    return tuple((1, int(s)) for s in lens)


def full_sizes() -> Sizes:
    decodes = _decode_ctx(64, 1, 2049, seed=1)
    return Sizes(
        kernel_cases=(
            KernelCase("decode_b64", decodes),
            KernelCase("decode_b128_ctx4k", _decode_ctx(128, 2048, 4097, seed=2)),
            KernelCase("prefill", ((1024, 1024), (517, 517), (2000, 2000))),
            KernelCase("prefill_with_context", ((512, 1536), (300, 817), (129, 4000))),
            KernelCase("mixed", decodes[:32] + ((700, 700), (256, 1000), (33, 2080))),
            KernelCase("decode_window", decodes, sliding_window=512),
            KernelCase("mixed_window", decodes[:16] + ((600, 2100), (300, 300)),
                       sliding_window=257),
        ),
        kernel_dtypes=(torch.float32, torch.bfloat16, torch.float16),
        parity_model={**SMOLLM2_135M, "num_hidden_layers": 4, "vocab_size": 8192},
        parity_prompts=(1, 7, 16, 33, 100, 250, 511, 1030),
        parity_tokens=32,
        full_model=SMOLLM2_135M,
        bf16_prompts=(5, 17, 64, 200, 333, 1000, 1500, 2048),
        prefill_prompts=(64, 1024),
        decode_batches=(1, 16, 64, 256),
        decode_prompt_len=32,
        decode_tokens=128,
        repeats=3,
    )


def tiny_sizes() -> Sizes:
    """For `--device cpu`: every path, small enough for Triton's interpreter and CI."""
    small = {**SMOLLM2_135M, "num_hidden_layers": 2, "vocab_size": 1024,
             "intermediate_size": 256, "max_position_embeddings": 256}
    return Sizes(
        kernel_cases=(
            KernelCase("decode", ((1, 17), (1, 1), (1, 40))),
            KernelCase("prefill_with_context", ((9, 29), (5, 5))),
            KernelCase("mixed_window", ((1, 40), (6, 22)), sliding_window=7),
        ),
        # Triton's interpreter cannot multiply bf16 (it keeps it as uint16: triton#11584).
        kernel_dtypes=(torch.float32, torch.float16),
        parity_model=small,
        parity_prompts=(1, 9, 20),
        parity_tokens=8,
        full_model=small,
        bf16_prompts=(4, 18),
        prefill_prompts=(2, 24),
        decode_batches=(1, 4),
        decode_prompt_len=8,
        decode_tokens=4,
        repeats=1,
    )


# ---- kernels ----------------------------------------------------------------------------------


@dataclass(slots=True)
class KernelBatch:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D], this step's new tokens
    value: torch.Tensor
    kv_cache: torch.Tensor  # context written; every other slot NaN
    metadata: AttentionMetadata
    kv_bytes: int  # K/V bytes the step must read at least (for the bandwidth figure)


def make_kernel_batch(case: KernelCase, dtype: torch.dtype, device: torch.device,
                      seed: int) -> KernelBatch:
    """Random q/k/v for `case` at the default model's head shapes, each request's blocks
    scattered over a shuffled pool, its context already in the cache."""
    heads, kv_heads, head = SMOLLM2_135M["num_attention_heads"], \
        SMOLLM2_135M["num_key_value_heads"], SMOLLM2_135M["head_dim"]
    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-s // BLOCK_SIZE) for _, s in case.reqs]
    pool = torch.randperm(sum(nblocks) + 1, generator=gen).to(torch.int32)
    # Table padding points at the spare block, which stays NaN.
    table = torch.full((len(case.reqs), max(nblocks) + 1), int(pool[-1]), dtype=torch.int32)
    cache = torch.full(kv_cache_shape(len(pool), BLOCK_SIZE, kv_heads, head), float("nan"))
    q_lens = np.array([q for q, _ in case.reqs], dtype=np.int32)
    seq_lens = np.array([s for _, s in case.reqs], dtype=np.int32)
    slots, used = [], 0
    for r, (q_len, seq_len) in enumerate(case.reqs):
        table[r, : nblocks[r]] = pool[used : used + nblocks[r]]
        used += nblocks[r]
        pos = torch.arange(seq_len)
        req_slots = table[r, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
        ctx = seq_len - q_len
        k, v = (torch.randn(ctx, kv_heads, head, generator=gen) for _ in range(2))
        write_kv_cache(k.to(dtype).float(), v.to(dtype).float(), cache, req_slots[:ctx])
        slots.append(req_slots[ctx:])
    metadata = AttentionMetadata.build(q_lens, seq_lens, table, torch.cat(slots), device)
    tokens = metadata.num_actual_tokens
    # Keys some query of the request can see: all of them, or the window's reach.
    visible = seq_lens if case.sliding_window is None else \
        np.minimum(seq_lens, q_lens + case.sliding_window - 1)
    elem = torch.tensor([], dtype=dtype).element_size()
    return KernelBatch(
        query=torch.randn(tokens, heads, head, generator=gen).to(device, dtype),
        key=torch.randn(tokens, kv_heads, head, generator=gen).to(device, dtype),
        value=torch.randn(tokens, kv_heads, head, generator=gen).to(device, dtype),
        kv_cache=cache.to(device, dtype),
        metadata=metadata,
        kv_bytes=int(visible.sum()) * 2 * kv_heads * head * elem,
    )


def reference_attention(batch: KernelBatch, scale: float,
                        sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch backend's cache write and attention, fp32 on the CPU: (cache, output)."""
    md = batch.metadata
    cpu_md = AttentionMetadata(
        md.num_actual_tokens, md.max_query_len, md.max_seq_len, md.query_start_loc.cpu(),
        md.seq_lens.cpu(), md.block_table.cpu(), md.slot_mapping.cpu(),
        md.query_start_loc_cpu, md.seq_lens_cpu,
    )
    cache = batch.kv_cache.float().cpu()
    write_kv_cache(batch.key.float().cpu(), batch.value.float().cpu(), cache, cpu_md.slot_mapping)
    out = paged_attention_reference(batch.query.float().cpu(), cache, cpu_md, scale,
                                    sliding_window)
    return cache, out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere in `out` gives NaN."""
    out, ref = out.double().cpu(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def check_kernels(sizes: Sizes, device: torch.device) -> dict[str, Any]:
    cases = []
    for i, case in enumerate(sizes.kernel_cases):
        for dtype in sizes.kernel_dtypes:
            name = {"case": case.name, "dtype": str(dtype).removeprefix("torch.")}
            try:  # one case failing to compile or run leaves the others their say
                cases.append({**name, **check_kernel_case(case, dtype, device, seed=i)})
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                cases.append({**name, "ok": False, "error": f"{type(e).__name__}: {e}"})
    return {"ok": all(c["ok"] for c in cases), "cases": cases}


def check_kernel_case(case: KernelCase, dtype: torch.dtype, device: torch.device,
                      seed: int) -> dict[str, Any]:
    from v1.attention.ops.triton_reshape_and_cache import reshape_and_cache
    from v1.attention.ops.triton_unified_attention import unified_attention

    scale = SMOLLM2_135M["head_dim"] ** -0.5
    batch = make_kernel_batch(case, dtype, device, seed)
    ref_cache, ref_out = reference_attention(batch, scale, case.sliding_window)
    cache = batch.kv_cache.clone()
    out = torch.full_like(batch.query, float("nan"))
    reshape_and_cache(batch.key, batch.value, cache, batch.metadata.slot_mapping)
    unified_attention(batch.query, cache, out, batch.metadata, scale,
                      sliding_window=case.sliding_window)
    # Slots the step writes must hold exactly the (rounded) new K/V; NaN == NaN here.
    cache_ok = bool(torch.equal(cache.float().cpu().nan_to_num(),
                                ref_cache.to(dtype).float().nan_to_num()))
    err = rel_error(out, ref_out)
    result: dict[str, Any] = {
        "tokens": batch.metadata.num_actual_tokens, "reqs": len(case.reqs),
        "window": case.sliding_window, "rel_err": err, "tol": KERNEL_TOL[dtype],
        "cache_ok": cache_ok, "ok": cache_ok and err <= KERNEL_TOL[dtype],
    }
    if device.type == "cuda":
        us = time_cuda_us(lambda: unified_attention(batch.query, cache, out, batch.metadata,
                                                    scale, sliding_window=case.sliding_window))
        result["us"] = us
        result["kv_gb_s"] = batch.kv_bytes / us / 1e3
    return result


def time_cuda_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


# ---- random models through the engine --------------------------------------------------------


def save_random_model(config_kwargs: dict[str, Any], seed: int, out_dir: Path) -> Any:
    """A transformers LlamaForCausalLM with random weights, saved as an HF checkpoint (fp32
    safetensors, no tokenizer) in `out_dir`; returns the model, fp32 on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config_kwargs)).float().eval()
    model.save_pretrained(out_dir)
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompts: list[list[int]], n: int) -> list[list[tuple[int, float]]]:
    """transformers' greedy continuation of each prompt, with each token's logprob; EOS does
    not stop it (the engine runs with ignore_eos)."""
    device = next(model.parameters()).device
    results = []
    for prompt in prompts:
        ids, past, steps = torch.tensor([prompt], device=device), None, []
        for _ in range(n):
            out = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = out.logits[0, -1].float().log_softmax(-1)
            token = int(logp.argmax())
            steps.append((token, float(logp[token])))
            ids = torch.tensor([[token]], device=device)
        results.append(steps)
    return results


def make_llm(model_dir: Path, device: torch.device, dtype: torch.dtype,
             attn_impl_cls: type[AttentionImpl], max_tokens_in_flight: int, max_model_len: int,
             max_num_seqs: int = 256) -> Any:
    """The engine in this process (nothing here needs an engine process), on weights loaded
    with the given attention backend (on CUDA the engine's own choice is Triton's; on CPU
    naming it runs the GPU backend in the interpreter), with a KV cache just large enough for
    the workload (each request may leave one block part-filled) and for one request of
    `max_model_len`, which the engine insists on."""
    from v1 import LLM
    from v1.models.loader import load_model

    loaded = load_model(str(model_dir), dtype, device, attn_impl_cls)
    blocks = max(max_tokens_in_flight // BLOCK_SIZE + max_num_seqs, max_model_len // BLOCK_SIZE)
    return LLM(
        loaded_model=loaded, device=str(device), dtype=str(dtype).removeprefix("torch."),
        generation_config="vllm", max_num_seqs=max_num_seqs, num_gpu_blocks=blocks + 1,
    )


def engine_greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[tuple[int, float]]]:
    from v1 import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outs:
        completion = out.outputs[0]
        results.append([(t, lp[t].logprob) for t, lp in zip(completion.token_ids,
                                                           completion.logprobs)])
    return results


def compare_greedy(ours: list[list[tuple[int, float]]],
                   ref: list[list[tuple[int, float]]]) -> dict[str, Any]:
    """Share of equal positions, of equal first tokens, and the largest logprob difference
    over the positions before each prompt's first difference (the same context on both)."""
    equal = total = first = 0
    max_lp_err = 0.0
    for a, b in zip(ours, ref, strict=True):
        total += len(b)
        equal += sum(x[0] == y[0] for x, y in zip(a, b))
        first += bool(a) and a[0][0] == b[0][0]
        for x, y in zip(a, b):
            max_lp_err = max(max_lp_err, abs(x[1] - y[1]))
            if x[0] != y[0]:
                break
    return {
        "agreement": equal / total, "first_token_agreement": first / len(ref),
        "max_logprob_err": max_lp_err, "prompts": len(ref), "tokens_per_prompt": len(ref[0]),
    }


def random_prompts(lengths: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def check_parity_fp32(sizes: Sizes, device: torch.device, work: Path) -> dict[str, Any]:
    from v1.attention.backends.triton_attn import TritonAttentionImpl

    cfg = sizes.parity_model
    hf = save_random_model(cfg, seed=0, out_dir=work / "parity").to(device)
    prompts = random_prompts(sizes.parity_prompts, cfg["vocab_size"], seed=1)
    ref = hf_greedy(hf, prompts, sizes.parity_tokens)
    del hf
    in_flight = sum(sizes.parity_prompts) + len(prompts) * sizes.parity_tokens
    # The Triton backend, also on CPU: the GPU's attention path through the whole engine.
    llm = make_llm(work / "parity", device, torch.float32, TritonAttentionImpl, in_flight,
                   cfg["max_position_embeddings"])
    try:
        result = compare_greedy(engine_greedy(llm, prompts, sizes.parity_tokens), ref)
    finally:
        llm.shutdown()
    result["ok"] = result["agreement"] == 1.0 and result["max_logprob_err"] <= LOGPROB_TOL_FP32
    result["attention"] = TritonAttentionImpl.__name__
    return result


def check_bf16(sizes: Sizes, device: torch.device, work: Path) -> dict[str, Any]:
    """bf16 parity of the full-size model, then its prefill and decode timings."""
    from v1.worker.model_runner import attention_impl_for

    cfg = sizes.full_model
    hf = save_random_model(cfg, seed=2, out_dir=work / "full").to(device, torch.bfloat16)
    prompts = random_prompts(sizes.bf16_prompts, cfg["vocab_size"], seed=3)
    ref = hf_greedy(hf, prompts, sizes.parity_tokens)
    del hf
    count, length = sizes.prefill_prompts
    batch = max(sizes.decode_batches)
    in_flight = max(
        count * (length + 1),
        batch * (sizes.decode_prompt_len + sizes.decode_tokens + 1),
        sum(sizes.bf16_prompts) + len(prompts) * sizes.parity_tokens,
    )
    # The engine's own backend: on CPU, Triton's interpreter cannot multiply bf16.
    attn_impl_cls = attention_impl_for(device)
    llm = make_llm(work / "full", device, torch.bfloat16, attn_impl_cls, in_flight,
                   cfg["max_position_embeddings"], max_num_seqs=max(batch, count))
    try:
        parity = compare_greedy(engine_greedy(llm, prompts, sizes.parity_tokens), ref)
        parity["ok"] = parity["first_token_agreement"] >= FIRST_TOKEN_AGREEMENT_BF16
        parity["attention"] = attn_impl_cls.__name__
        timing = measure_timing(llm, sizes, cfg["vocab_size"])
    finally:
        llm.shutdown()
    return {"parity_bf16": parity, "timing": timing}


def measure_timing(llm: Any, sizes: Sizes, vocab: int) -> dict[str, Any]:
    """Engine throughput on fresh random prompts (no prefix-cache hits), after a warm-up run
    of each shape (Triton compiles per shape class); each figure is the median of
    `sizes.repeats` runs.

    Prefill: prompts over the wall time of a run that samples one token each. Decode: the
    tokens after each request's first over the time from the first tokens to the last ones,
    as the frontend stamped them (`RequestOutput.metrics`); the batch's prompts fit in one
    step's token budget, so those are the same step for all and the span holds decode steps
    alone."""
    from v1 import SamplingParams

    seeds = iter(range(100, 10_000))

    def run(count: int, length: int, max_tokens: int) -> tuple[float, float]:
        """(wall seconds, seconds from the first sampled tokens to the last)"""
        prompts = random_prompts((length,) * count, vocab, next(seeds))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        first = min(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.last_token_time for o in outs)
        return wall, last - first

    def median(count: int, length: int, max_tokens: int, index: int) -> float:
        run(count, length, max_tokens)  # warm-up
        return float(np.median([run(count, length, max_tokens)[index]
                                for _ in range(sizes.repeats)]))

    count, length = sizes.prefill_prompts
    prefill_s = median(count, length, 1, index=0)
    decode = {
        str(batch): batch * sizes.decode_tokens
        / median(batch, sizes.decode_prompt_len, sizes.decode_tokens + 1, index=1)
        for batch in sizes.decode_batches
    }
    return {
        "ok": True, "dtype": "bfloat16", "prefill_tok_s": count * length / prefill_s,
        "prefill_prompts": count, "prefill_len": length, "decode_tok_s": decode,
        "decode_prompt_len": sizes.decode_prompt_len, "decode_tokens": sizes.decode_tokens,
        "repeats": sizes.repeats, "cuda_graphs": False,
    }


# ---- running and reporting --------------------------------------------------------------------


@dataclass(slots=True)
class Report:
    device: torch.device
    results: dict[str, Any] = field(default_factory=dict)

    def run(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        """Run one check; an exception is that check's failure, not the tool's end."""
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # a broken check is reported like a failed one
            traceback.print_exc(file=sys.stderr)
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        # A check may return several results (the bf16 model's parity and timing).
        parts = result if "ok" not in result else {name: result}
        for part, value in parts.items():
            value["seconds"] = round(time.perf_counter() - start, 2)
            self.results[part] = value

    def summary(self) -> dict[str, Any]:
        import transformers
        import triton

        failed = [name for name, r in self.results.items() if not r["ok"]]
        return {
            "gpu_check": "v1", "ok": not failed, "failed": failed,
            "device": str(self.device),
            "device_name": torch.cuda.get_device_name(self.device)
            if self.device.type == "cuda" else platform.processor() or platform.machine(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "triton": triton.__version__,
                         "transformers": transformers.__version__},
            **self.results,
        }


def print_table(summary: dict[str, Any]) -> None:
    kernels = summary.get("kernels", {})
    for c in kernels.get("cases", []):
        if "error" in c:
            print(f"kernel {c['case']:<22} {c['dtype']:<9} ERROR {c['error']}")
            continue
        timing = f" {c['us']:9.1f} us {c['kv_gb_s']:7.1f} GB/s" if "us" in c else ""
        print(f"kernel {c['case']:<22} {c['dtype']:<9} rel_err {c['rel_err']:.2e} "
              f"(tol {c['tol']:.0e}) {'ok' if c['ok'] else 'FAIL'}{timing}")
    for name in ("parity_fp32", "parity_bf16"):
        p = summary.get(name, {})
        if "agreement" in p:
            print(f"{name:<12} agreement {p['agreement']:.3f}, first tokens "
                  f"{p['first_token_agreement']:.3f}, max logprob err "
                  f"{p['max_logprob_err']:.2e} {'ok' if p['ok'] else 'FAIL'}")
    t = summary.get("timing", {})
    if "prefill_tok_s" in t:
        decode = ", ".join(f"b{b}: {v:.0f}" for b, v in t["decode_tok_s"].items())
        print(f"timing bf16  prefill {t['prefill_tok_s']:.0f} tok/s; decode tok/s {decode}")
    for name, r in summary.items():
        if isinstance(r, dict) and "error" in r:
            print(f"{name}: ERROR {r['error']}")
    print(f"gpu_check: {'ok' if summary['ok'] else 'FAILED: ' + ', '.join(summary['failed'])}")


CHECKS = ("kernels", "parity", "bf16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m v1.tools.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=("full", "tiny"), default=None,
                        help="default: full on cuda, tiny on cpu")
    parser.add_argument("--only", choices=CHECKS, action="append",
                        help="run only these checks (repeatable; default: all)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available (use --device cpu to run the logic on CPU)",
              file=sys.stderr)
        return 2
    if args.device == "cpu":
        # Before the ops are imported (in check_kernels): Triton decides then.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    size = args.size or ("full" if device.type == "cuda" else "tiny")
    sizes = full_sizes() if size == "full" else tiny_sizes()
    checks = args.only or CHECKS
    report = Report(device)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="v1-gpu-check-") as tmp:
        work = Path(tmp)
        if "kernels" in checks:
            report.run("kernels", lambda: check_kernels(sizes, device))
        if "parity" in checks:
            report.run("parity_fp32", lambda: check_parity_fp32(sizes, device, work))
        if "bf16" in checks:
            report.run("bf16", lambda: check_bf16(sizes, device, work))
    summary = report.summary()
    summary["size"] = size
    summary["seconds"] = round(time.perf_counter() - start, 2)
    print_table(summary)
    # Last line of stdout, machine-readable; NaN (a broken kernel) becomes null.
    print(json.dumps(_finite(summary)), flush=True)
    return 0 if summary["ok"] else 1


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
