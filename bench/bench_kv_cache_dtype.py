"""fp32 vs bf16 vs fp16 KV caches on CPU (fp32 activations): the decode attention alone, and
the engine's decode steps.

Default: the attention alone, one layer's step of `--seqs` decodes of `--context` tokens
each with the default model's shapes (9 query heads on 3 kv heads of 64, block size 16),
their blocks scattered over a pool. It times `paged_attention` for the planned step (the C
kernel `v1_paged_decode_*`; with V1_CPU_KERNELS=0, the SDPA path) on three caches holding
the same values (values every dtype holds exactly, so the outputs are checked equal).

`--engine`: the default model through the engine, `--seqs` concurrent requests of
`--input-len` random tokens generating `--output-len` each (greedy, as bench_throughput.py
--decode), one `LLM` per cache dtype on the same weights and the same `--kv-cache-memory`;
decode tok/s from the requests' timestamps (bench_throughput.py's decode_window), and the
greedy tokens' agreement with the fp32 cache's.

Both time the dtypes in turn within each round, so that a round's figures saw the same phase
of the (shared) machine; the ratios are medians of the per-round ratios:

    ratio[dtype] = median_round(t[dtype] / t[fp32])       (time per step; < 1 is faster)

Prints a table and one JSON line.

    .venv/bin/python bench/bench_kv_cache_dtype.py
    .venv/bin/python bench/bench_kv_cache_dtype.py --context 1024
    .venv/bin/python bench/bench_kv_cache_dtype.py --engine
"""

import argparse
import json
import random
import sys
import time
from typing import Any

import common  # before torch: it sets the OpenMP wait policy, read when torch loads
import numpy as np
import torch
from bench_throughput import (
    decode_engine_kwargs,
    decode_window,
    paired_ratios,
    random_prompts,
    timed_generate,
)

from v1.attention.backends.abstract import AttentionMetadata, kv_cache_shape
from v1.attention.backends.torch_attn import paged_attention
from v1.attention.backends.torch_plan import AttentionPlan

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def paired(times: dict[str, list[float]]) -> dict[str, float]:
    """Per dtype, the median over rounds of its time over fp32's in the same round."""
    return {name: common.median(paired_ratios(times["fp32"], t)) for name, t in times.items()}


def decode_step(seqs: int, context: int, seed: int) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of `seqs` decodes at position `context` and an fp32 cache filled with
    values every dtype holds exactly (so the three caches store the same keys)."""
    rng = np.random.default_rng(seed)
    per_req = -(-context // BLOCK)
    num_blocks = seqs * per_req
    table = rng.permutation(num_blocks).astype(np.int32).reshape(seqs, per_req)
    seq_lens = np.full(seqs, context, dtype=np.int32)
    qsl = np.arange(seqs + 1, dtype=np.int32)
    slots = table[:, -1].astype(np.int64) * BLOCK + (context - 1) % BLOCK
    metadata = AttentionMetadata(
        num_actual_tokens=seqs, max_query_len=1, max_seq_len=context,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens),
        block_table=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
    )
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen)
    return metadata, cache.to(torch.bfloat16).to(torch.float16).float()


def kernel(args: argparse.Namespace) -> None:
    metadata, cache32 = decode_step(args.seqs, args.context, args.seed)
    caches = {name: cache32.to(dtype) for name, dtype in DTYPES.items()}
    gen = torch.Generator().manual_seed(args.seed + 1)
    query = torch.randn(args.seqs, HEADS, HEAD_DIM, generator=gen)
    key = value = torch.zeros(args.seqs, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    plans = {name: AttentionPlan.for_step(metadata, cache, HEADS)
             for name, cache in caches.items()}
    outs = {name: paged_attention(query, key, value, caches[name], plans[name], scale)
            for name in DTYPES}
    for name in DTYPES:  # the same values in every cache: the same output
        assert torch.equal(outs[name], outs["fp32"]), name

    times: dict[str, list[float]] = {name: [] for name in DTYPES}
    for _ in range(args.rounds):
        for name in DTYPES:
            t0 = time.perf_counter()
            for _ in range(args.calls):
                paged_attention(query, key, value, caches[name], plans[name], scale)
            times[name].append((time.perf_counter() - t0) / args.calls)
    ms = {name: 1e3 * common.median(t) for name, t in times.items()}
    ratios = paired(times)
    kv_bytes = {name: args.seqs * args.context * 2 * KV_HEADS * HEAD_DIM * dtype.itemsize
                for name, dtype in DTYPES.items()}
    path = {name: "C kernel" if plans[name].native is not None else "SDPA" for name in DTYPES}
    common.print_table(
        ["kv dtype", "path", "ms / layer-step", "time vs fp32", "K/V MB read"],
        [[name, path[name], ms[name], ratios[name], kv_bytes[name] / 1e6] for name in DTYPES],
    )
    print(json.dumps({
        "bench": "kv_cache_dtype_kernel", "seqs": args.seqs, "context": args.context,
        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK,
        "path": path, "ms_per_layer_step": {k: round(v, 4) for k, v in ms.items()},
        "time_ratio_vs_fp32": {k: round(v, 3) for k, v in ratios.items()},
        "kv_bytes_read": kv_bytes, **common.environment(),
    }))


def engine(args: argparse.Namespace) -> None:
    from v1.sampling_params import SamplingParams

    loaded = common.load(args.model)
    vocab = int(loaded.hf_config.vocab_size)
    n, out_len = args.seqs, args.output_len
    prompts = random_prompts(random.Random(args.seed), n, (args.input_len, args.input_len), vocab)
    full = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    llms = {}
    for name in DTYPES:
        kwargs = dict(max_num_seqs=n, kv_cache_dtype=name, kv_cache_memory=args.kv_cache_memory)
        llms[name] = common.make_llm(loaded, **decode_engine_kwargs(kwargs, n, args.input_len))
        timed_generate(llms[name], [prompts[0][:32]], SamplingParams(max_tokens=2))  # warm-up
    step_s: dict[str, list[float]] = {name: [] for name in DTYPES}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name, llm in llms.items():
            _, outputs = timed_generate(llm, prompts, full)
            window = decode_window(outputs)
            assert window is not None, "the prompts were not prefilled in one step"
            step_s[name].append(window[0] / (window[1] / n))
            tokens[name] = [list(o.outputs[0].token_ids) for o in outputs]
            print(f"round {r} {name}: {1e3 * step_s[name][-1]:.1f} ms / step", file=sys.stderr)
    num_blocks = {name: llm.llm_engine.client.engine_core.num_blocks
                  for name, llm in llms.items()}
    for llm in llms.values():
        llm.shutdown()
    ms = {name: 1e3 * common.median(t) for name, t in step_s.items()}
    ratios = paired(step_s)
    agree = {name: common.agreement(tokens[name], tokens["fp32"]) for name in DTYPES}
    common.print_table(
        ["kv dtype", "step ms", "decode tok/s", "time vs fp32", "blocks", "same tokens"],
        [[name, ms[name], 1e3 * n / ms[name], ratios[name], num_blocks[name],
          agree[name]["mean_common_prefix"]] for name in DTYPES],
    )
    result: dict[str, Any] = {
        "bench": "kv_cache_dtype_engine", "concurrent": n, "input_len": args.input_len,
        "output_len": out_len, "kv_cache_memory": args.kv_cache_memory,
        "decode_step_ms": {k: round(v, 2) for k, v in ms.items()},
        "decode_tok_s": {k: round(1e3 * n / v, 1) for k, v in ms.items()},
        "step_time_ratio_vs_fp32": {k: round(v, 3) for k, v in ratios.items()},
        "num_blocks": num_blocks,
        "greedy_agreement_vs_fp32": {k: {m: round(x, 4) for m, x in a.items()}
                                     for k, a in agree.items()},
        **common.environment(),
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", action="store_true",
                        help="the engine's decode steps instead of the attention alone")
    parser.add_argument("--seqs", type=int, default=64, help="concurrent decodes")
    parser.add_argument("--context", type=int, default=256, help="tokens per request (kernel)")
    parser.add_argument("--calls", type=int, default=20, help="kernel calls per dtype and round")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (--engine)")
    parser.add_argument("--output-len", type=int, default=128, help="tokens out (--engine)")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30,
                        help="bytes of KV cache per engine (--engine)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of every dtype (default: 15 kernel, 3 engine)")
    common.add_model_args(parser)
    args = parser.parse_args()
    common.setup_threads(args)
    if args.engine:
        args.rounds = args.rounds or 3
        engine(args)
    else:
        args.rounds = args.rounds or 15
        kernel(args)


if __name__ == "__main__":
    main()
