"""CPU cost of the suffix-decoding index (v1/worker/spec_decode/suffix.py), no model.

Tokens: the words and punctuation of bench/data/perplexity.txt as ids (1,904 tokens, 727
distinct): a stand-in for BPE tokens with natural text's repetition, no tokenizer needed.
The global index is first filled with `--cached` finished requests (prompt + answer drawn
from the text), so lookups run against a realistically full shared trie.

Per prompt length (400, 1000, 1500 tokens) it times, as the runner calls it (after each
sampled token, the request's tokens as a numpy view):
- index: the request's first `propose` call (indexes the whole prompt);
- step: one later `propose` call (one new token indexed + the lookup in both tries), mean and
  p99 over 128 decode steps, k = 4 and 8, for three outputs: "novel" (text not in the prompt),
  "quote" (the output copies a passage of its prompt: the request's own trie drafts) and
  "repeat" (the answer of an earlier request with the same prompt: the shared trie drafts);
- finish: `finish` (the answer enters the shared trie, the oldest request is evicted);
and, as the baseline that decided the structure, indexing the same prompt into a plain
(uncompressed) trie of depth 24. Then the shared trie's size: nodes and bytes (tracemalloc)
per cached token.

Prints a table, then one JSON line of the figures.
"""

import argparse
import json
import re
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np

from v1.worker.spec_decode.suffix import SuffixProposer

TEXT = Path(__file__).resolve().parent / "data" / "perplexity.txt"
STEPS = 128


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


def fill(p: SuffixProposer, words: list[int], n: int, answer_len: int, seed: int) -> None:
    """`n` finished requests: a prompt ending in a random 30-token "question", a random
    128-token answer, both from the text."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        q, a = rng.integers(0, len(words) - 200, size=2)
        tokens = words[:200] + words[q : q + 30] + words[a : a + answer_len]
        p.propose(f"fill{i}", np.array(tokens[:231]), 8)
        p.propose(f"fill{i}", np.array(tokens), 8)
        p.finish(f"fill{i}")


def decode(p: SuffixProposer, req_id: str, prompt: list[int], output: list[int], k: int):
    """(index seconds, per-step seconds, finish seconds, drafted tokens that were right)."""
    buf = np.array(prompt + output)
    n = len(prompt) + 1
    t0 = time.perf_counter()
    draft = p.propose(req_id, buf[:n], k)
    index = time.perf_counter() - t0
    steps, right = [], 0
    for i in range(1, STEPS):
        right += sum(1 for j, t in enumerate(draft) if n + j < len(buf) and buf[n + j] == t)
        n += 1
        t0 = time.perf_counter()
        draft = p.propose(req_id, buf[:n], k)
        steps.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    p.finish(req_id)
    return index, steps, time.perf_counter() - t0, right


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cached", type=int, default=1000,
                        help="finished requests in the shared trie before timing")
    args = parser.parse_args()
    words = text_tokens()
    p = SuffixProposer(max_cached_requests=args.cached)
    fill(p, words, args.cached, STEPS, seed=0)

    rows, result = [], {"cached": args.cached, "steps": STEPS}
    for plen in (400, 1000, 1500):
        prompt = words[:plen]
        t0 = time.perf_counter()
        plain_trie_index(prompt, p.max_tree_depth)
        plain_ms = (time.perf_counter() - t0) * 1e3
        novel = words[len(words) - STEPS :] if plen < len(words) - STEPS else words[plen:]
        outputs = {"novel": novel, "quote": words[100 : 100 + STEPS]}
        for k in (4, 8):
            # "repeat": an earlier request with this prompt answered `answer`.
            answer = words[1200 : 1200 + STEPS]
            decode(p, f"first{plen}.{k}", prompt, answer, k)
            outputs["repeat"] = answer
            for name, output in outputs.items():
                index, steps, finish, right = decode(p, f"{name}{plen}.{k}", prompt, output, k)
                us = [s * 1e6 for s in steps]
                row = {
                    "prompt": plen, "k": k, "output": name,
                    "index_ms": round(index * 1e3, 2), "plain_trie_index_ms": round(plain_ms, 1),
                    "step_us_mean": round(statistics.fmean(us), 1),
                    "step_us_p99": round(sorted(us)[int(0.99 * len(us))], 1),
                    "finish_ms": round(finish * 1e3, 2),
                    "right_drafts_per_step": round(right / (STEPS - 1), 2),
                }
                rows.append(row)
    header = list(rows[0])
    widths = [max(len(h), *(len(str(r[h])) for r in rows)) for h in header]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(r[h]).rjust(w) for h, w in zip(header, widths)))
    result["rows"] = rows

    # Size of the shared trie: a fresh proposer filled under tracemalloc.
    tracemalloc.start()
    q = SuffixProposer(max_cached_requests=args.cached)
    fill(q, words, args.cached, STEPS, seed=1)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    cached_tokens = sum(len(s) for s in q._cached)
    result["shared_trie"] = {
        "cached_tokens": cached_tokens,
        "nodes_per_token": round(q._global.num_nodes() / cached_tokens, 2),
        "bytes_per_token": round(size / cached_tokens),
    }
    print(f"shared trie: {cached_tokens} cached tokens, "
          f"{result['shared_trie']['nodes_per_token']} nodes and "
          f"{result['shared_trie']['bytes_per_token']} bytes per token")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
