"""CPU cost of the suffix-decoding index (v1/worker/spec_decode/suffix.py), no model.

Tokens: the words and punctuation of bench/data/perplexity.txt as ids (1,904 tokens, 727
distinct): a stand-in for BPE tokens with natural text's repetition, no tokenizer needed.
The shared tree is first filled with `--cached` finished requests (prompt + answer drawn
from the text), so lookups run against a full shared tree.

Per prompt length (400, 1000, 1500 tokens) it times, as the runner calls it (after each
sampled token, the request's tokens as a numpy view):
- index: the request's first `propose` call (indexes the whole prompt);
- step: one later `propose` call (one new token indexed + the lookup in both trees), median,
  mean and p99 over 128 decode steps, k = 4 and 8, for three outputs: "novel" (the text's
  words shuffled: nothing to draft), "quote" (the output copies a passage of its prompt: the
  request's own tree drafts) and "repeat" (the answer of an earlier request with the same
  prompt: the shared tree drafts), with how many drafted tokens per step were right;
- finish: `finish` (the answer enters the shared tree, the oldest request is evicted);
and, as the baseline that decided the structure, indexing the same prompt into a plain
(uncompressed) trie of depth 24. Then the shared tree's size: nodes and bytes (tracemalloc)
per cached token.

Prints a table, then one JSON line of the figures. Run:
`PYTHONPATH=. python bench/bench_suffix_index.py [--clock thread] [--cached N]`.
"""

import argparse
import json
import os
import re
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np

from v1.worker.spec_decode.suffix import SuffixProposer

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
STEPS = 128
CLOCK = time.perf_counter


def text_tokens() -> list[int]:
    ids: dict[str, int] = {}
    words = re.findall(r"\w+|[^\w\s]", TEXT.read_text())
    return [ids.setdefault(w, 1000 + len(ids)) for w in words]


def plain_trie_index(tokens: list[int], depth: int) -> None:
    """The structure not chosen: one dict node per (position, depth)."""
    root: dict = {}
    for i in range(len(tokens)):
        node = root
        for t in tokens[i : i + depth]:
            node = node.setdefault(t, {})


def dict_get_ns() -> float:
    """A yardstick for this machine's speed right now: one `dict.get` in a Python loop."""
    table = {i: i for i in range(1000)}
    t0 = CLOCK()
    for _ in range(20):
        for i in range(10000):
            table.get(i)
    return (CLOCK() - t0) / 200000 * 1e9


def fill(p: SuffixProposer, words: list[int], n: int, seed: int) -> None:
    """`n` finished requests: a 200-token prompt and a 128-token answer of the text's words
    shuffled (its vocabulary and word frequencies, not its passages)."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        tokens = [int(t) for t in rng.choice(words, size=200 + STEPS)]
        p.propose(f"fill{i}", tokens[:201], 8)
        p.propose(f"fill{i}", tokens, 8)
        p.finish(f"fill{i}")


def decode(p: SuffixProposer, req_id: str, prompt: list[int], output: list[int], k: int):
    """(index seconds, per-step seconds, finish seconds, drafted tokens that were right)."""
    buf = np.array(prompt + output)
    n = len(prompt) + 1
    t0 = CLOCK()
    draft = p.propose(req_id, buf[:n], k)
    index = CLOCK() - t0
    steps, right = [], 0
    for _ in range(1, STEPS):
        right += sum(1 for j, t in enumerate(draft) if n + j < len(buf) and buf[n + j] == t)
        n += 1
        t0 = CLOCK()
        draft = p.propose(req_id, buf[:n], k)
        steps.append(CLOCK() - t0)
    t0 = CLOCK()
    p.finish(req_id)
    return index, steps, CLOCK() - t0, right


def main() -> None:
    global CLOCK
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cached", type=int, default=1000,
                        help="finished requests in the shared tree before timing")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall",
                        help="thread: this thread's CPU time (on a busy machine, wall-clock "
                        "figures include the time the OS gives to other processes)")
    args = parser.parse_args()
    if args.clock == "thread":
        CLOCK = time.thread_time
    words = text_tokens()
    p = SuffixProposer(max_cached_requests=args.cached)
    fill(p, words, args.cached, seed=0)

    rows, result = [], {"cached": args.cached, "steps": STEPS, "clock": args.clock,
                        "loadavg_1m": round(os.getloadavg()[0], 2),
                        "dict_get_ns": round(dict_get_ns(), 1)}
    print(f"calibration: {result['dict_get_ns']} ns per dict.get in a Python loop "
          "(~30-40 on an idle core; scale the figures below by it)")
    # "repeat" answers from the text's end, which no prompt here reaches (prompts are its
    # first words); "novel" outputs are its words shuffled afresh for each run (each run's
    # output enters the shared tree when it finishes, so a later run would repeat it).
    answer = words[1700 : 1700 + STEPS]
    rng = np.random.default_rng(2)
    for plen in (400, 1000, 1500):
        prompt = words[:plen]
        t0 = CLOCK()
        plain_trie_index(prompt, p.max_tree_depth)
        plain_ms = (CLOCK() - t0) * 1e3
        for k in (4, 8):
            # "repeat": an earlier request with this prompt answered `answer`.
            decode(p, f"first{plen}.{k}", prompt, answer, k)
            novel = [int(t) for t in rng.choice(words, size=STEPS)]
            outputs = {"novel": novel, "quote": words[100 : 100 + STEPS], "repeat": answer}
            for name, output in outputs.items():
                index, steps, finish, right = decode(p, f"{name}{plen}.{k}", prompt, output, k)
                us = sorted(s * 1e6 for s in steps)
                rows.append({
                    "prompt": plen, "k": k, "output": name,
                    "index_ms": round(index * 1e3, 2), "plain_trie_index_ms": round(plain_ms, 1),
                    "step_us_median": round(statistics.median(us), 1),
                    "step_us_mean": round(statistics.fmean(us), 1),
                    "step_us_p99": round(us[int(0.99 * len(us))], 1),
                    "finish_ms": round(finish * 1e3, 2),
                    "right_drafts_per_step": round(right / (STEPS - 1), 2),
                })
    header = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in header]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(r[h]).rjust(w) for h, w in zip(header, widths)))
    result["rows"] = rows

    # Size of the shared tree: a fresh proposer filled under tracemalloc.
    tracemalloc.start()
    q = SuffixProposer(max_cached_requests=args.cached)
    fill(q, words, args.cached, seed=1)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    cached_tokens = sum(len(s) for _, s in q._cached)
    result["shared_tree"] = {
        "cached_tokens": cached_tokens,
        "nodes_per_token": round(q._trees[None].num_nodes() / cached_tokens, 2),
        "bytes_per_token": round(size / cached_tokens),
    }
    print(f"shared tree: {cached_tokens} cached tokens, "
          f"{result['shared_tree']['nodes_per_token']} nodes and "
          f"{result['shared_tree']['bytes_per_token']} bytes per token")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
