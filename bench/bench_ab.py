"""v1 against v1: the same workloads through two or more source trees or settings, paired and
interleaved, to tell whether a change made anything slower (or faster).

A contender is `NAME=TREE[,VAR=VALUE...]`: the v1 package of checkout TREE (its C kernels
built there), with environment variables set for it (`V1_CPU_KERNELS=x86_64_v3`, ...). Each
contender is one long-lived child process (this script, `--child`, with TREE first on
PYTHONPATH) that loads the default model once and then runs workloads when asked; between
its runs it sleeps on its standard input, so only one contender computes at a time. Each round
runs every workload once per contender, the contenders' order reversed every other round; a
ratio is the median over rounds of that round's tok/s over the first contender's.

Workloads (the default model, `LLM()`'s defaults, greedy, EOS ignored, exact token counts):
- decode: one request, a short chat prompt, `--decode-tokens` tokens (the prefix cache
  emptied first);
- prefix: `--prefix-requests` chats sharing the help-desk system prompt (~470 tokens),
  `--prefix-tokens` tokens each, submitted at once (the prefix cache emptied first);
- spec: the help-desk questions one at a time with suffix drafts (vLLM's defaults),
  `--spec-tokens` each, on an engine made fresh for the run (no drafts remembered).

Prints a table, then one JSON line. Example, main's head against a worktree:

    .venv/bin/python bench/bench_ab.py base=/tmp/base head=. --rounds 5
    .venv/bin/python bench/bench_ab.py v4=. v3=.,V1_CPU_KERNELS=x86_64_v3 --workloads decode
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# common first: it sets the OpenMP wait policy torch reads as it loads.
from common import cpu_info, cpu_line, median  # isort: skip
from bench_llamacpp import DECODE_QUESTION, HELPDESK, chat_prompt

BENCH = Path(__file__).resolve().parent
WORKLOADS = ("decode", "prefix", "spec")


def parse_contender(text: str) -> tuple[str, Path, dict[str, str]]:
    """NAME=TREE[,VAR=VALUE...] -> (name, tree, env); ValueError naming what is wrong."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"contender {text!r}: expected NAME=TREE[,VAR=VALUE...]")
    tree, *settings = rest.split(",")
    env = {}
    for setting in settings:
        var, sep, value = setting.partition("=")
        if not sep or not var:
            raise ValueError(f"contender {text!r}: {setting!r} is not VAR=VALUE")
        env[var] = value
    path = Path(tree).resolve()
    if not (path / "v1" / "__init__.py").is_file():
        raise ValueError(f"contender {text!r}: {path} holds no v1 package")
    return name, path, env


class Child:
    """One contender's process: asked a workload on stdin, answers one JSON line."""

    def __init__(self, name: str, tree: Path, env: dict[str, str], args: argparse.Namespace):
        self.name = name
        child_env = {**os.environ, **env,
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), str(BENCH),
                                                                os.environ.get("PYTHONPATH")]))}
        knobs = ["--decode-tokens", str(args.decode_tokens), "--prefix-requests",
                 str(args.prefix_requests), "--prefix-tokens", str(args.prefix_tokens),
                 "--spec-requests", str(args.spec_requests), "--spec-tokens",
                 str(args.spec_tokens)]
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", *knobs],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=child_env, cwd=tree, text=True)
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"contender {self.name}: its process exited "
                               f"(code {self.proc.wait()})")
        return json.loads(line)

    def run(self, workload: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


# -- the child side -----------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:

    import v1
    from v1 import LLM, SamplingParams

    def params(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def timed(llm: Any, prompts: list[list[int]], n: int, one_by_one: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        batches = [[p] for p in prompts] if one_by_one else [prompts]
        outs = [o for batch in batches for o in llm.generate(
            [{"prompt_token_ids": p} for p in batch], params(n), use_tqdm=False)]
        seconds = time.perf_counter() - t0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return {"seconds": seconds, "tok_s": sum(map(len, tokens)) / seconds,
                "tokens": tokens}

    llm = LLM()
    tokenizer = llm.get_tokenizer()
    helpdesk = json.loads(HELPDESK.read_text())
    decode_prompt = chat_prompt(tokenizer, DECODE_QUESTION)
    questions = (helpdesk["questions"] * args.spec_requests)[: args.spec_requests]
    spec_prompts = [chat_prompt(tokenizer, q, helpdesk["system"]) for q in questions]
    shared = (helpdesk["questions"] * args.prefix_requests)[: args.prefix_requests]
    prefix_prompts = [chat_prompt(tokenizer, f"{q} (ticket {i})", helpdesk["system"])
                      for i, q in enumerate(shared)]
    llm.generate([{"prompt_token_ids": decode_prompt[:8]}], params(4), use_tqdm=False)
    print(json.dumps({"v1": v1.__file__}), flush=True)
    for line in sys.stdin:
        workload = line.strip()
        if workload == "decode":
            assert llm.reset_prefix_cache()
            result = timed(llm, [decode_prompt], args.decode_tokens, one_by_one=True)
        elif workload == "prefix":
            assert llm.reset_prefix_cache()
            result = timed(llm, prefix_prompts, args.prefix_tokens, one_by_one=False)
        elif workload == "spec":
            spec = LLM(speculative_config={"method": "suffix"})
            try:
                result = timed(spec, spec_prompts, args.spec_tokens, one_by_one=True)
            finally:
                spec.shutdown()
        else:
            raise SystemExit(f"unknown workload {workload!r}")
        print(json.dumps(result), flush=True)
    llm.shutdown()


# -- the parent side ----------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("contenders", nargs="*", help="NAME=TREE[,VAR=VALUE...], two or more")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefix-requests", type=int, default=32)
    parser.add_argument("--prefix-tokens", type=int, default=32)
    parser.add_argument("--spec-requests", type=int, default=12)
    parser.add_argument("--spec-tokens", type=int, default=64)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if len(args.contenders) < 2:
        parser.error("give two or more contenders")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    try:
        specs = [parse_contender(c) for c in args.contenders]
    except ValueError as e:
        parser.error(str(e))
    children = [Child(name, tree, env, args) for name, tree, env in specs]
    tok_s: dict[str, dict[str, list[float]]] = {
        w: {c.name: [] for c in children} for w in args.workloads}
    equal: dict[str, bool] = dict.fromkeys(args.workloads, True)
    try:
        for r in range(args.rounds):
            order = children if r % 2 == 0 else children[::-1]
            for workload in args.workloads:
                tokens = []
                for c in order:
                    result = c.run(workload)
                    tok_s[workload][c.name].append(result["tok_s"])
                    tokens.append(result["tokens"])
                    print(f"round {r} {workload} {c.name}: {result['tok_s']:.1f} tok/s",
                          file=sys.stderr)
                equal[workload] &= all(t == tokens[0] for t in tokens)
    finally:
        for c in children:
            c.close()
    base = children[0].name
    rows = {}
    print(f"{'workload':10} {'contender':14} {'tok/s (median)':>15} {'vs ' + base:>10}")
    for workload, runs in tok_s.items():
        for name, values in runs.items():
            ratio = median([v / b for v, b in zip(values, runs[base])])
            rows[f"{workload}/{name}"] = {"tok_s": [round(v, 1) for v in values],
                                          "median": round(median(values), 1),
                                          f"vs_{base}": round(ratio, 3)}
            print(f"{workload:10} {name:14} {median(values):15.1f} {ratio:10.3f}")
        print(f"{workload:10} greedy tokens equal across contenders: {equal[workload]}")
    cpu = cpu_info(Path("/proc/cpuinfo").read_text())
    print(cpu_line(cpu))
    print(json.dumps({"contenders": [c.name for c in children],
                      "v1": {c.name: c.ready["v1"] for c in children},
                      "rounds": args.rounds, "rows": rows, "tokens_equal": equal, "cpu": cpu,
                      "loadavg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
