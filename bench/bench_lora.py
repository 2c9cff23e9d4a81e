"""Decode throughput with LoRA adapters in the batch: 16 concurrent requests (random prompts,
greedy, fixed length) on the default model, with 0, 1 and 4 distinct adapters among them
(rank 16, on every projection: q, k, v, o, gate, up, down; random PEFT folders written at
start, so nothing is downloaded), against the same engine without LoRA at all. Each
configuration is its own in-process engine; rounds run every configuration once, in an order
that rotates per round, and each round's decode tok/s (the pure-decode window, from per-request
timestamps) is divided by the no-LoRA engine's of the same round; the figure is the median
ratio. "0 adapters" is an engine with enable_lora whose requests all run the base model.

    .venv/bin/python bench/bench_lora.py
    .venv/bin/python bench/bench_lora.py --rounds 5 --out bench/results
"""

import argparse
import json
import math
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import common  # before torch: it sets the OpenMP wait policy, read when torch loads
import torch
from bench_throughput import decode_window, random_prompts

from v1.lora.peft import TARGET_MODULES
from v1.lora.request import LoRARequest
from v1.models.decoder import head_dim_of
from v1.sampling_params import SamplingParams

CONFIGS = {"no LoRA": None, "0 adapters": 0, "1 adapter": 1, "4 adapters": 4}


def write_adapter(folder: Path, config: Any, rank: int, seed: int) -> None:
    """A random PEFT LoRA folder for `config`'s model (every projection, B non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * head_dim_of(config)
    kv = config.num_key_value_heads * head_dim_of(config)
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for proj in TARGET_MODULES:
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            n_in, n_out = shapes[proj]
            a = torch.randn(rank, n_in, generator=gen) / math.sqrt(n_in)
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGET_MODULES), "bias": "none",
    }))


def run(args: argparse.Namespace, adapter_root: Path) -> dict[str, Any]:
    common.setup_threads(args)
    n = args.concurrency
    engine = {"max_num_seqs": n, "num_gpu_blocks": args.num_gpu_blocks, "max_model_len": 512,
              "max_num_batched_tokens": max(2048, n * args.input_len)}
    llms = {}
    loras = []
    for name, num_adapters in CONFIGS.items():
        # Its own copy of the weights: an engine with LoRA wraps its model's layers.
        loaded = common.load(args.model)
        if num_adapters is None:
            llms[name] = common.make_llm(loaded, **engine)
            continue
        llms[name] = common.make_llm(loaded, enable_lora=True, max_loras=4,
                                     max_lora_rank=args.rank, **engine)
        if not loras:
            for i in range(4):
                folder = adapter_root / f"adapter{i}"
                write_adapter(folder, loaded.hf_config, args.rank, args.seed + i)
                loras.append(LoRARequest(f"adapter{i}", i + 1, str(folder)))
    vocab = int(loaded.hf_config.vocab_size)
    prompts = random_prompts(random.Random(args.seed), n, (args.input_len, args.input_len), vocab)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def generate(name: str) -> list:
        llm, k = llms[name], CONFIGS[name]
        llm.reset_prefix_cache()  # every run computes its prompts
        per_request = [loras[i % k] for i in range(n)] if k else None
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False, lora_request=per_request)

    for name in llms:  # warm-up: fault in the KV cache, load the adapters
        generate(name)
    rates: dict[str, list[float]] = {name: [] for name in llms}
    names = list(llms)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            outputs = generate(name)
            window = decode_window(outputs)
            if window is None:
                raise RuntimeError("the prefills did not all finish in one step")
            rates[name].append(window[1] / window[0])
            print(f"round {r} {name}: {rates[name][-1]:.1f} decode tok/s", file=sys.stderr)
    for llm in llms.values():
        llm.shutdown()
    base = rates["no LoRA"]
    results = [
        {"config": name, "decode_tok_s": common.median(rates[name]),
         "ratio_to_no_lora": common.median([x / b for x, b in zip(rates[name], base)]),
         "rounds": rates[name]}
        for name in names
    ]
    return {"concurrency": n, "input_len": args.input_len, "max_tokens": args.max_tokens,
            "rank": args.rank, "results": results, "env": common.environment()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_model_args(parser)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every configuration")
    parser.add_argument("--num-gpu-blocks", type=int, default=512)
    parser.add_argument("--out", default=None, help="directory for lora.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(args, Path(tmp))
    common.print_table(
        ["config", "decode tok/s", "ratio to no LoRA"],
        [[r["config"], r["decode_tok_s"], r["ratio_to_no_lora"]] for r in result["results"]],
    )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "lora.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "env"}))


if __name__ == "__main__":
    main()
