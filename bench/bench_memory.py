"""Resident memory of `python -m v1 serve`'s frontend and engine core around large requests.

Issue 20 §3: nothing grows without bound, and memory returns to its baseline once large
requests are over. After a warm-up (a plain request, a small grammar, a small /tokenize) and a
second of idleness, the baseline; then three phases, one request at a time, each followed by
`--settle` seconds of idleness:

    grammars  20 distinct large grammars (JSON-schema string enums of `--enum-size` entries,
              ~20 MB each compiled at 8,000: the engine core keeps them in its grammar cache,
              bounded by VLLM_XGRAMMAR_CACHE_MB, `--grammar-cache-mb` here)
    prompts   10 distinct large prompts: completions of max_model_len - 8 tokens
    tokenize  10 distinct /tokenize calls of `--tokenize-mb` MB of text each (the frontend
              tokenizes them: ~115 MB of allocations per MB)

Per phase and process: resident anonymous memory (MB) at the phase's start, its peak (sampled
every 50 ms) and after the idle wait. The script starts the server (the branch's `v1`, on a
free loopback port) and stops it at the end. A few minutes on 2 cores.

    .venv/bin/python bench/bench_memory.py
"""

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
from bench_serving import server
from common import engine_core_pid, environment, print_table, process_parents, rss_mb


def anon_mb(pid: int) -> float:
    """Resident anonymous memory (the heap's; file-backed pages come and go with the
    machine's memory pressure)."""
    return rss_mb(pid, "RssAnon") or 0.0


def server_pids() -> tuple[int, int]:
    """The frontend (the server this script started: its only child) and the engine core (the
    frontend's largest descendant, as bench_hostile finds it)."""
    [frontend] = [p for p, parent in process_parents().items() if parent == os.getpid()]
    engine = engine_core_pid(frontend)
    assert engine is not None, "the server has no engine core process"
    return frontend, engine


class Peak:
    """The highest RSS of `pids` while the `with` block runs, sampled every 50 ms."""

    def __init__(self, pids: tuple[int, int]) -> None:
        self.pids, self.peak = pids, [anon_mb(p) for p in pids]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = [max(m, anon_mb(p)) for m, p in zip(self.peak, self.pids)]

    def __enter__(self) -> "Peak":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--enum-size", type=int, default=8000, help="entries per grammar")
    parser.add_argument("--tokenize-mb", type=float, default=1.0, help="MB of text per /tokenize")
    parser.add_argument("--grammar-cache-mb", type=int, default=None,
                        help="VLLM_XGRAMMAR_CACHE_MB for the server (default: its own, 512)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="idle seconds after each phase before RSS is read")
    args = parser.parse_args()
    if args.grammar_cache_mb is not None:
        os.environ["VLLM_XGRAMMAR_CACHE_MB"] = str(args.grammar_cache_mb)
    serve_args = argparse.Namespace(
        base_url=None, model=args.model, max_num_seqs=16, block_size=16,
        enable_prefix_caching=True, max_num_batched_tokens=None,
        server_args=f"--max-model-len {args.max_model_len}",
    )
    words = [f"w{i}" for i in range(100_000)]

    def text(n_chars: int, tag: int) -> str:  # distinct per tag, not cached as a prefix
        picked = (words[(tag * 7919 + i) % len(words)] for i in range(n_chars // 6))
        return f"{tag} {' '.join(picked)}"[:n_chars]

    def grammar(tag: int) -> dict[str, Any]:
        enum = [f"value {tag} {i}" for i in range(args.enum_size)]
        return {"prompt": "Pick one:", "max_tokens": 4,
                "structured_outputs": {"json": {"type": "string", "enum": enum}}}

    with server(serve_args) as base, httpx.Client(base_url=base, timeout=600) as client:
        pids = server_pids()
        prompt_ids = client.post("/tokenize", json={"prompt": text(50_000, 0)}).json()["tokens"]

        def long_prompt(tag: int) -> dict[str, Any]:
            ids = [prompt_ids[(tag * 131 + i) % len(prompt_ids)] for i in
                   range(args.max_model_len - 8)]
            return {"prompt": ids, "max_tokens": 4}

        def post(path: str, body: dict[str, Any]) -> None:
            response = client.post(path, json=body)
            response.raise_for_status()

        post("/v1/completions", {"prompt": "Hello", "max_tokens": 4})
        post("/v1/completions", {"prompt": "Yes or no?", "max_tokens": 4,
                                 "structured_outputs": {"choice": ["yes", "no"]}})
        post("/tokenize", {"prompt": text(10_000, 1)})
        time.sleep(args.settle)
        baseline = [anon_mb(p) for p in pids]
        phases: list[tuple[str, Callable[[int], None]]] = [
            ("grammars", lambda i: post("/v1/completions", grammar(i))),
            ("prompts", lambda i: post("/v1/completions", long_prompt(i))),
            ("tokenize", lambda i: post(
                "/tokenize", {"prompt": text(int(args.tokenize_mb * 2**20), 100 + i)})),
        ]
        counts = {"grammars": 20, "prompts": 10, "tokenize": 10}
        rows: list[list[Any]] = []
        result: dict[str, Any] = {"baseline_mb": [round(m) for m in baseline]}
        for name, send in phases:
            before = [anon_mb(p) for p in pids]
            start = time.perf_counter()
            with Peak(pids) as peak:
                for i in range(counts[name]):
                    send(i)
            seconds = time.perf_counter() - start
            time.sleep(args.settle)
            after = [anon_mb(p) for p in pids]
            figures = {process: [round(before[i]), round(peak.peak[i]), round(after[i])]
                       for i, process in enumerate(("frontend_mb", "engine_mb"))}
            rows.append([name, round(seconds, 1), *figures["frontend_mb"], *figures["engine_mb"]])
            result[name] = {"seconds": round(seconds, 1), **figures}
    print(f"baseline after warm-up (MB): frontend {baseline[0]:.0f}, engine core {baseline[1]:.0f}")
    print_table(["phase", "seconds", "frontend start", "peak", "after", "engine start", "peak",
                 "after"], rows)
    result["environment"] = environment()
    print(json.dumps(result), file=sys.stdout)


if __name__ == "__main__":
    main()
