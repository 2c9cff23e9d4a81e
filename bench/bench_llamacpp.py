"""v1 against llama.cpp on the same GGUF file, alternating in one run.

llama.cpp comes from `make bench-llamacpp` (bench/llamacpp.py: llama-cpp-python in its own
venv, `llama-server` and `llama-bench`, one -march=native build of the llama.cpp source
llama-cpp-python vendors) or, with `--llamacpp-build avx2`, from `make bench-llamacpp-avx2`
(the same source built for AVX2 without AVX-512: the other CPU class, measured on an AVX-512
machine beside `--v1-env V1_CPU_KERNELS=x86_64_v3`). Without it a part says so and is
skipped (exit 0). llama.cpp processes start with a clean environment: without
the OMP_WAIT_POLICY=PASSIVE that `import v1` and bench/common.py put in os.environ (under it
llama.cpp ran ~3x slower here); both sides use all cores.

Each part runs `--rounds` rounds; in a round every contender runs once, right after one
another (the order reversed every other round), so a round's runs saw the same machine. A
ratio is the median over rounds of that round's ratio. `--v1-env VAR=VALUE` settings are in
os.environ before anything of v1 is imported, so every engine (and `v1 serve`) this script
starts reads them. The output names the CPU (model, family/model numbers, the flags that
decide which kernels run), the llama.cpp build and its instruction-set options, and the v1
kernel library the engine process really mapped.

- bench: v1 (defaults, one engine) against llama.cpp's own `llama-bench`, same GGUF, same
  threads. A round runs `llama-bench -p 512 -n 128 -r 1` once (its pp512 and tg128 tests,
  each after its own untimed warm-up) and v1 once for each test (the order of the two sides
  reversed every other round). What is timed:
  - tg128: llama-bench times 128 one-token decodes into an empty context (llama_decode and
    synchronize; random tokens, no sampling). v1 times `LLM.generate` of one request whose
    prompt is one token, 128 greedy tokens (EOS ignored), from an empty prefix cache: 128
    forward passes of one token (the first one the prompt's), with sampling and the
    frontend/engine-process round trips.
  - pp512: llama-bench times one 512-token batch (random tokens) into an empty context. v1
    times `LLM.generate` of one 512-token prompt (seeded random token ids) with max_tokens=1
    from an empty prefix cache: the prefill (chunked as the engine's defaults chunk it), the
    one sampled token and the round trips, as a time to first token.
  tok/s is tokens over those seconds (llama-bench's own figure for its side); a ratio is
  v1's tok/s over llama-bench's in the same round, its median over rounds reported.

- decode: one request, a short chat prompt, `--decode-tokens` greedy tokens (EOS ignored):
  tok/s of v1 with `LLM()`'s defaults (a .gguf file's blocks), v1 with float weights
  (quantization="none", for reference), and llama-cpp-python; and each one's fraction of the
  physical limit: the weights' bytes read per token at this machine's streaming read rate.
  Prefix caches are emptied before each run.
- helpdesk: one user at a time (batch 1): a shared system prompt (bench/data/helpdesk.json,
  ~470 tokens) and `--helpdesk-requests` questions in a seeded order where about
  `--repeat-fraction` of them repeat an earlier question verbatim; `--helpdesk-tokens` greedy
  tokens each (EOS ignored). Contenders: v1 (defaults) without speculation, v1 with each
  `--speculative-config` (vLLM's JSON, passed through to `LLM(speculative_config=...)`; an
  engine without the option, or refusing the value, is reported unavailable), llama.cpp plain
  and llama.cpp with its prompt-lookup drafting (LlamaPromptLookupDecoding: it drafts from
  the request's own tokens only). Each v1 run is a fresh engine (a suffix index must not
  remember the previous round); llama.cpp starts each run from an empty context. Reports
  tok/s and, per speculative configuration, whether its tokens equal those without it.
- serving: bench_serving.py's shared-prompt workload (`--serving-prompts` requests, one
  system prompt of `--serving-system-len` tokens, all at once unless `--serving-args` says
  otherwise) against `python -m v1 serve` (defaults; bench_serving starts it)
  and against `llama-server -np --parallel` (continuous batching; bench_serving's
  `--base-url`), each started fresh per round.

Prints each part's table, then one JSON line; `--out DIR` writes llamacpp.json/.png (`--name`).

    make bench-llamacpp
    .venv/bin/python bench/bench_llamacpp.py --out bench/results | tee bench/results/llamacpp.txt
    .venv/bin/python bench/bench_llamacpp.py --parts decode --rounds 5
    make bench-llamacpp-avx2
    .venv/bin/python bench/bench_llamacpp.py --parts bench --rounds 5 --llamacpp-build avx2 \
        --v1-env V1_CPU_KERNELS=x86_64_v3
"""

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import llamacpp
from common import (
    agreement,
    cpu_line,
    engine_core_pid,
    environment,
    median,
    print_table,
    write_outputs,
)

BENCH = Path(__file__).resolve().parent
HELPDESK = BENCH / "data" / "helpdesk.json"
DECODE_QUESTION = "Explain in two sentences why the sky is blue."
DEFAULT_SPEC_CONFIGS = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
    '"prompt_lookup_max": 4}',
    '{"method": "suffix"}',
)
PARTS = ("decode", "helpdesk", "serving", "bench")
# What each part needs of llama.cpp (llamacpp.missing): None is the llama-cpp-python worker.
PART_TOOLS = {"decode": None, "helpdesk": None, "serving": "llama-server", "bench": "llama-bench"}


def chat_prompt(tokenizer: Any, question: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat through the model's template (which holds the special
    tokens: no BOS added again, as LLM.chat does)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def helpdesk_questions(questions: list[str], num_requests: int, repeat_fraction: float,
                       seed: int) -> list[str]:
    """`num_requests` questions: each, with probability `repeat_fraction` (and once one was
    asked), a verbatim repeat of an earlier one, else the next new one of `questions` (which
    then start over, as repeats). Deterministic for a seed."""
    if not 0.0 <= repeat_fraction < 1.0:
        raise ValueError(f"repeat_fraction must be in [0, 1), got {repeat_fraction}")
    rng = random.Random(seed)
    asked: list[str] = []
    fresh = iter(questions * (num_requests // max(1, len(questions)) + 1))
    for _ in range(num_requests):
        asked.append(rng.choice(asked) if asked and rng.random() < repeat_fraction
                     else next(fresh))
    return asked


def parse_env_setting(text: str) -> tuple[str, str]:
    """--v1-env's VAR=VALUE (VALUE may be empty) -> (VAR, VALUE); ValueError if malformed."""
    var, sep, value = text.partition("=")
    if not sep or not var.isidentifier():
        raise ValueError(f"--v1-env {text!r}: expected VAR=VALUE")
    return var, value


def kernel_libraries(maps: str) -> list[str]:
    """The v1 kernel libraries (v1/kernels/_v1_<variant>.so) a /proc/PID/maps text maps."""
    names = {Path(line.split()[-1]).name for line in maps.splitlines()
             if len(line.split()) >= 6 and "/v1/kernels/_v1_" in line}
    return sorted(n for n in names if n.endswith(".so"))


def engine_kernels() -> list[str]:
    """The kernel libraries the engine process started by this one has mapped."""
    pid = engine_core_pid(os.getpid())
    if pid is None:
        return []
    try:
        return kernel_libraries(Path(f"/proc/{pid}/maps").read_text())
    except OSError:
        return []


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """`length` token ids drawn from the vocabulary, the same for a seed: a prompt whose
    content does not matter, only its length, as llama-bench's."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def make_engine(path: Path, **kwargs: Any) -> Any:
    """A default (engine process) `LLM` on `path`, warmed up by a tiny untimed request;
    imported as users do (`from v1 import LLM`: v1/startup_gc.py)."""
    from v1 import LLM, SamplingParams

    llm = LLM(model=str(path), **kwargs)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                 SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    return llm


def engine_run(llm: Any, prompts: list[list[int]], max_tokens: int
               ) -> tuple[float, list[list[int]]]:
    """Seconds and outputs of `prompts` one after another (batch 1), from an empty prefix
    cache, greedy, exactly `max_tokens` tokens each."""
    from v1.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    assert llm.reset_prefix_cache(), "the prefix cache could not be reset (blocks in use)"
    outputs = []
    t0 = time.perf_counter()
    for prompt in prompts:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        outputs.append(list(out[0].outputs[0].token_ids))
    return time.perf_counter() - t0, outputs


def rounds_order(names: list[str], r: int) -> list[str]:
    return names if r % 2 == 0 else names[::-1]


def summarize(seconds: dict[str, list[float]], tokens: int, baselines: list[str]
              ) -> dict[str, dict[str, Any]]:
    """Per contender that ran: its runs' tok/s, their median, and per baseline
    (`vs_<baseline>`) the median over rounds of its tok/s over the baseline's that round."""
    rows: dict[str, dict[str, Any]] = {}
    for name, runs in seconds.items():
        if not runs:
            continue
        rows[name] = {"tok_s": [round(tokens / s, 1) for s in runs],
                      "tok_s_median": round(tokens / median(runs), 1)}
        for base in baselines:
            ratios = [b / s for s, b in zip(runs, seconds.get(base, []))]
            rows[name][f"vs_{base.replace(' ', '_')}"] = (
                round(median(ratios), 3) if ratios else None)
    return rows


def weights_read_per_token(path: Path) -> int:
    """Bytes a batch-1 decode step reads from the GGUF's weights: every tensor but the token
    embedding (one row of it is read), whose bytes count once more when the LM head is tied to
    it (no `output.weight`), as in the default model."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    embedding = tensors.pop("token_embd.weight", 0)
    return sum(tensors.values()) + (0 if "output.weight" in tensors else embedding)


def read_bandwidth(nbytes: int, repeat: int = 21, best: bool = False) -> float:
    """This machine's rate of reading `nbytes` again and again (as decode reads the weights
    each token: from the caches where they fit, as a 300 MiB L3 holds 97 MB), bytes/s: the
    median of `repeat` sums of an fp32 buffer that size on torch's threads, all cores; `best`:
    the fastest sum instead (a bound: other processes on the cores only slow a sum down)."""
    import torch

    buf = torch.ones(nbytes // 4)
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        buf.sum()
        times.append(time.perf_counter() - t)
    return buf.nbytes / (min(times) if best else median(times))


def part_decode(args: argparse.Namespace, path: Path, tokenizer: Any,
                worker: llamacpp.Worker) -> dict[str, Any]:
    prompt = chat_prompt(tokenizer, DECODE_QUESTION)
    engines = {"v1 defaults": make_engine(path), "v1 fp32": make_engine(path, quantization="none")}
    worker.run([prompt[:4]], 2)  # warm-up, untimed
    names = [*engines, "llama.cpp"]
    seconds: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for r in range(args.rounds):
            for name in rounds_order(names, r):
                if name == "llama.cpp":
                    t, outputs[name] = worker.run([prompt], args.decode_tokens)
                else:
                    t, outputs[name] = engine_run(engines[name], [prompt], args.decode_tokens)
                seconds[name].append(t)
                print(f"decode round {r}: {name} {args.decode_tokens / t:.1f} tok/s",
                      file=sys.stderr)
    finally:
        for llm in engines.values():
            llm.shutdown()
    rows = summarize(seconds, args.decode_tokens, ["llama.cpp"])
    for name in engines:
        rows[name]["llamacpp_agreement"] = agreement(outputs[name], outputs["llama.cpp"])
    # The physical limit: the quantized weights' bytes per token at the read rate.
    per_token = weights_read_per_token(path)
    bandwidth = read_bandwidth(per_token)
    limit = bandwidth / per_token
    for name in ("v1 defaults", "llama.cpp"):
        rows[name]["fraction_of_limit"] = round(rows[name]["tok_s_median"] / limit, 3)
    return {"prompt_tokens": len(prompt), "tokens": args.decode_tokens, "rows": rows,
            "weights_mb_per_token": round(per_token / 1e6, 1),
            "read_gb_s": round(bandwidth / 1e9, 1), "limit_tok_s": round(limit, 1)}


def part_helpdesk(args: argparse.Namespace, path: Path, tokenizer: Any,
                  worker: llamacpp.Worker | None) -> dict[str, Any]:
    """v1 with and without drafts on the help-desk questions, beside llama.cpp plain and with
    prompt lookup (none with no `worker`: `--helpdesk-v1-only`)."""
    data = json.loads(HELPDESK.read_text())
    questions = helpdesk_questions(data["questions"], args.helpdesk_requests,
                                   args.repeat_fraction, args.seed)
    prompts = [chat_prompt(tokenizer, q, data["system"]) for q in questions]
    lookup = {"max_ngram_size": args.lookup_ngram, "num_pred_tokens": args.lookup_tokens}
    specs = {f"v1 spec {json.loads(c).get('method', '?')}": json.loads(c)
             for c in args.speculative_config}
    llama_runs = {} if worker is None else {"llama.cpp": None, "llama.cpp lookup": lookup}
    names = ["v1", *specs, *llama_runs]
    for config in llama_runs.values():
        assert worker is not None
        worker.run([prompts[0][:4]], 2, config)  # warm-up, untimed
    seconds: dict[str, list[float]] = {n: [] for n in names}
    outputs: dict[str, list[list[int]]] = {}
    unavailable: dict[str, str] = {}
    for r in range(args.rounds):
        for name in rounds_order(names, r):
            if name in unavailable:
                continue
            if worker is not None and name in llama_runs:
                t, outputs[name] = worker.run(prompts, args.helpdesk_tokens, llama_runs[name])
            else:
                kwargs = {"speculative_config": specs[name]} if name in specs else {}
                try:
                    llm = make_engine(path, **kwargs)
                except ValueError as e:  # no such option yet, or a value it refuses
                    unavailable[name] = str(e)
                    print(f"{name}: unavailable ({e})", file=sys.stderr)
                    continue
                try:
                    t, outputs[name] = engine_run(llm, prompts, args.helpdesk_tokens)
                finally:
                    llm.shutdown()
            seconds[name].append(t)
            print(f"helpdesk round {r}: {name} {len(prompts) * args.helpdesk_tokens / t:.1f} "
                  "tok/s", file=sys.stderr)
    tokens = len(prompts) * args.helpdesk_tokens
    rows = summarize(seconds, tokens, ["llama.cpp", "llama.cpp lookup", "v1"])
    for name in specs:
        if name in outputs:
            rows[name]["tokens_equal_spec_off"] = outputs[name] == outputs["v1"]
            rows[name]["agreement_spec_off"] = agreement(outputs[name], outputs["v1"])
    # llama.cpp verifies drafts in batched evaluations whose rounding differs from one-token
    # steps: its greedy tokens with lookup may differ from its plain ones.
    if llama_runs:
        rows["llama.cpp lookup"]["tokens_equal_plain"] = (
            outputs["llama.cpp lookup"] == outputs["llama.cpp"])
        rows["llama.cpp lookup"]["agreement_plain"] = agreement(outputs["llama.cpp lookup"],
                                                                outputs["llama.cpp"])
    return {"requests": len(prompts), "repeats": len(questions) - len(set(questions)),
            "system_tokens": len(tokenizer.encode(data["system"], add_special_tokens=False)),
            "tokens_per_request": args.helpdesk_tokens, "lookup": lookup,
            "speculative_configs": specs, "unavailable": unavailable, "rows": rows}


def serving_run(args: argparse.Namespace, path: Path, extra: list[str]) -> dict[str, Any]:
    """One bench_serving.py run (its JSON line) with the serving part's workload."""
    cmd = [sys.executable, str(BENCH / "bench_serving.py"), "--model", str(path),
           "--num-prompts", str(args.serving_prompts), "--groups", "1",
           "--system-len", str(args.serving_system_len),
           "--output-len", str(args.serving_tokens), "--request-rate", "inf",
           *shlex.split(args.serving_args), *extra]
    print("running:", shlex.join(cmd), file=sys.stderr)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def part_serving(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    names = ["v1 serve", "llama-server"]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in rounds_order(names, r):
            if name == "llama-server":
                with llamacpp.server(path, args.parallel, args.ctx_per_slot,
                                     extra_args=shlex.split(args.llama_server_args),
                                     build=args.llamacpp_build) as base:
                    runs[name].append(serving_run(args, path, ["--base-url", base]))
            else:
                runs[name].append(serving_run(
                    args, path, ["--server-args=" + args.v1_server_args]))
            res = runs[name][-1]
            print(f"serving round {r}: {name} {res['duration_s']} s, {res['out_tok_s']} out "
                  f"tok/s, TTFT p50 {res['ttft_ms_p50']} ms", file=sys.stderr)
    keys = ("duration_s", "out_tok_s", "ttft_ms_p50", "tpot_ms_p50", "hit_rate", "failed")
    rows = {n: {k: median([run[k] for run in runs[n]]) for k in keys} for n in names}
    rows["v1 serve"]["speedup_vs_llama_server"] = round(median(
        [b["duration_s"] / a["duration_s"] for a, b in zip(runs[names[0]], runs[names[1]])]), 3)
    return {"parallel": args.parallel, "requests": args.serving_prompts,
            "system_len": args.serving_system_len, "tokens_per_request": args.serving_tokens,
            "rows": rows, "runs": runs}


def part_bench(args: argparse.Namespace, path: Path, tokenizer: Any) -> dict[str, Any]:
    gen, prefill = args.decode_tokens, args.prefill_tokens
    gen_prompt = random_prompt(1, len(tokenizer), args.seed)
    prefill_prompt = random_prompt(prefill, len(tokenizer), args.seed + 1)
    llm = make_engine(path)
    kernels = engine_kernels()
    names = ["llama.cpp", "v1"]
    seconds: dict[str, dict[str, list[float]]] = {test: {n: [] for n in names}
                                                  for test in ("tg", "pp")}
    commit = None
    try:
        for r in range(args.rounds):
            for name in rounds_order(names, r):
                if name == "llama.cpp":
                    tests = llamacpp.llama_bench(path, args.threads, args.llamacpp_build,
                                                 prefill, gen, repetitions=1)
                    seconds["tg"][name].append(tests[f"tg{gen}"]["seconds"])
                    seconds["pp"][name].append(tests[f"pp{prefill}"]["seconds"])
                    commit = tests[f"tg{gen}"]["build_commit"]
                else:
                    seconds["tg"][name].append(engine_run(llm, [gen_prompt], gen)[0])
                    seconds["pp"][name].append(engine_run(llm, [prefill_prompt], 1)[0])
                print(f"bench round {r}: {name} tg{gen} {gen / seconds['tg'][name][-1]:.1f} "
                      f"tok/s, pp{prefill} {prefill / seconds['pp'][name][-1]:.1f} tok/s",
                      file=sys.stderr)
    finally:
        llm.shutdown()
    return {"tg_tokens": gen, "pp_tokens": prefill, "v1_kernels": kernels,
            "llamacpp_build_commit": commit,
            f"tg{gen}": summarize(seconds["tg"], gen, ["llama.cpp"]),
            f"pp{prefill}": summarize(seconds["pp"], prefill, ["llama.cpp"])}


def print_part(title: str, rows: dict[str, dict[str, Any]], columns: list[str]) -> None:
    print(f"\n== {title}")
    print_table(["", *columns], [[n, *(row.get(c, "") for c in columns)]
                                 for n, row in rows.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="a .gguf file (default: SmolLM2-135M-Instruct's)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="the help-desk question order")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads of llama.cpp and of the v1 engines this script makes "
                             "(they fork with its torch threads; the serving part's `v1 serve` "
                             "keeps its default); default: all cores, both")
    parser.add_argument("--llamacpp-build", choices=list(llamacpp.BUILDS), default="native",
                        help="the llama.cpp build every part runs (see bench/llamacpp.py)")
    parser.add_argument("--v1-env", action="append", default=[], metavar="VAR=VALUE",
                        type=parse_env_setting,
                        help="an environment variable for v1's engines, repeatable "
                             "(V1_CPU_KERNELS=x86_64_v3: the AVX2 kernels)")
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="greedy tokens per request of decode, and bench's tg test")
    parser.add_argument("--prefill-tokens", type=int, default=512,
                        help="bench's pp test: the prompt's length")
    parser.add_argument("--helpdesk-requests", type=int, default=24)
    parser.add_argument("--helpdesk-v1-only", action="store_true",
                        help="the help desk through v1 alone, with and without drafts (no "
                             "llama-cpp-python needed)")
    parser.add_argument("--repeat-fraction", type=float, default=0.35)
    parser.add_argument("--helpdesk-tokens", type=int, default=128)
    parser.add_argument("--speculative-config", action="append", default=None,
                        help="v1's speculative_config as vLLM's JSON, repeatable "
                             f"(default: {' and '.join(DEFAULT_SPEC_CONFIGS)})")
    # llama-cpp-python documents num_pred_tokens=2 as the better choice on CPU (10 on GPU).
    parser.add_argument("--lookup-ngram", type=int, default=2,
                        help="LlamaPromptLookupDecoding max_ngram_size")
    parser.add_argument("--lookup-tokens", type=int, default=2,
                        help="LlamaPromptLookupDecoding num_pred_tokens")
    parser.add_argument("--serving-prompts", type=int, default=32)
    parser.add_argument("--serving-system-len", type=int, default=400)
    parser.add_argument("--serving-tokens", type=int, default=32)
    parser.add_argument("--serving-args", default="",
                        help="other bench_serving.py options for both servers, one string")
    parser.add_argument("--parallel", type=int, default=8, help="llama-server slots (-np)")
    parser.add_argument("--ctx-per-slot", type=int, default=1024,
                        help="llama-server context per slot (its -c is parallel times this)")
    parser.add_argument("--llama-server-args", default="",
                        help='other llama-server options, one string: "--spec-type ngram-mod"')
    parser.add_argument("--v1-server-args", default="",
                        help="other `python -m v1 serve` options, one string")
    parser.add_argument("--out", default=None, help="directory for NAME.json and NAME.png")
    parser.add_argument("--name", default="llamacpp", help="the output files' name")
    args = parser.parse_args()
    v1_env = dict(args.v1_env)
    os.environ.update(v1_env)  # before v1 is imported: its engines read them (v1/envs.py)
    # SIGTERM as an exception too, so the worker, engines and servers are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    args.speculative_config = args.speculative_config or list(DEFAULT_SPEC_CONFIGS)
    for config in args.speculative_config:
        if not isinstance(json.loads(config), dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {config!r}")

    from v1 import envs
    from v1.models.model_files import hf_dir_of, load_tokenizer, resolve_model

    envs.read()  # a V1_* value it refuses fails here, not in an engine process
    path = resolve_model(args.model)
    if path.suffix != ".gguf":
        raise ValueError(f"bench_llamacpp needs a .gguf model, got {path}")
    for part in list(args.parts):
        if part == "helpdesk" and args.helpdesk_v1_only:
            continue
        if reason := llamacpp.missing(PART_TOOLS[part], args.llamacpp_build):
            print(f"{part}: skipped: {reason}")
            args.parts.remove(part)
    if not args.parts:
        return
    tokenizer = load_tokenizer(hf_dir_of(path))
    result: dict[str, Any] = {
        "bench": "llamacpp", "command": shlex.join([sys.executable, *sys.argv]),
        "model": path.name, "rounds": args.rounds,
        "v1_env": v1_env,
        "llamacpp_build": args.llamacpp_build,
        "llamacpp_build_options": llamacpp.build_options(args.llamacpp_build),
        "llamacpp_threads": llamacpp.default_threads(args.threads),
        "llamacpp_version": llamacpp.version(), **environment()}
    needs_worker = {"decode", *(() if args.helpdesk_v1_only else ("helpdesk",))} & set(args.parts)
    worker = (llamacpp.Worker(path, 2048, args.threads, args.llamacpp_build)
              if needs_worker else None)
    try:
        if "decode" in args.parts:
            assert worker is not None
            result["decode"] = part_decode(args, path, tokenizer, worker)
        if "helpdesk" in args.parts:
            result["helpdesk"] = part_helpdesk(args, path, tokenizer, worker)
    finally:
        if worker is not None:
            worker.close()
    if "serving" in args.parts:
        result["serving"] = part_serving(args, path)
    if "bench" in args.parts:
        result["bench_llamacpp"] = part_bench(args, path, tokenizer)
        result["v1_kernels"] = result["bench_llamacpp"]["v1_kernels"]

    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    print(cpu_line(result["cpu"]))
    options = result["llamacpp_build_options"]
    print(f"llama.cpp {result['llamacpp_version']}, build {args.llamacpp_build}: "
          f"{' '.join(f'{k}={v}' for k, v in options.items())}; {result['llamacpp_threads']} "
          f"threads; v1 env: {' '.join(f'{k}={v}' for k, v in v1_env.items()) or '(defaults)'}"
          + (f"; v1 kernels loaded: {' '.join(result['v1_kernels']) or 'none'}"
             if "v1_kernels" in result else ""))
    print(f"load average (1 min): {result['loadavg_1m']} at the start, "
          f"{result['loadavg_1m_end']} at the end")

    if "decode" in result:
        print_part(f"decode: one request, {result['decode']['prompt_tokens']}-token prompt, "
                   f"{args.decode_tokens} greedy tokens (tok/s)", result["decode"]["rows"],
                   ["tok_s_median", "vs_llama.cpp", "fraction_of_limit"])
        d = result["decode"]
        print(f"limit: {d['weights_mb_per_token']} MB of weights per token at {d['read_gb_s']} "
              f"GB/s (reading that many bytes again and again) = {d['limit_tok_s']} tok/s")
    if "helpdesk" in result:
        h = result["helpdesk"]
        print_part(f"helpdesk: batch 1, {h['requests']} requests ({h['repeats']} repeats), "
                   f"{h['system_tokens']}-token system prompt, {args.helpdesk_tokens} tokens "
                   "each (tok/s)", h["rows"],
                   ["tok_s_median", "vs_llama.cpp", "vs_llama.cpp_lookup", "vs_v1",
                    "tokens_equal_spec_off"])
        for name, why in h["unavailable"].items():
            print(f"{name}: unavailable ({why})")
    if "serving" in result:
        s = result["serving"]
        print_part(f"serving: {s['requests']} requests at once, {s['system_len']}-token shared "
                   f"system prompt, {s['tokens_per_request']} tokens each, llama-server "
                   f"-np {s['parallel']}", s["rows"],
                   ["duration_s", "out_tok_s", "ttft_ms_p50", "tpot_ms_p50", "hit_rate",
                    "speedup_vs_llama_server"])

    if "bench_llamacpp" in result:
        b = result["bench_llamacpp"]
        for test in (f"tg{b['tg_tokens']}", f"pp{b['pp_tokens']}"):
            print_part(f"bench {test}: v1 against llama-bench (tok/s; ratio: median of rounds)",
                       b[test], ["tok_s_median", "vs_llama.cpp", "tok_s"])

    panels = [(part, result[part]["rows"]) for part in ("decode", "helpdesk") if part in result]
    if "bench_llamacpp" in result:
        b = result["bench_llamacpp"]
        panels += [(f"bench {test}", b[test])
                   for test in (f"tg{b['tg_tokens']}", f"pp{b['pp_tokens']}")]

    def plot(fig: Any) -> None:
        for i, (title, rows) in enumerate(panels):
            ax = fig.add_subplot(1, len(panels), i + 1)
            ax.barh(list(rows), [row["tok_s_median"] for row in rows.values()])
            ax.set_xlabel("tok/s (median of rounds)")
            ax.set_title(title)

    write_outputs(args.out, args.name, result, plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
