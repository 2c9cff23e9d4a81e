"""One benchmark, two checkouts: is a change a regression? Runs a bench script of this folder
in each source tree in turn (a `git worktree` of the old commit, say, and this one), --rounds
times, alternating which goes first (paired and interleaved: both see the same moments of a
shared machine), and reads the JSON line each run prints last. For every numeric field the
two have in common it prints each tree's median and the median over rounds of the round's
ratio B / A (each round's ratio in the JSON line).

Each tree's own `v1` is imported (PYTHONPATH=TREE, run from TREE/bench): its kernels are
whatever that tree builds (the library in place, or, in older trees, its first-use cache).

    git worktree add /tmp/old bdb476d
    .venv/bin/python bench/bench_trees.py --a /tmp/old --b . --rounds 3 -- \\
        bench_throughput.py --decode --no-hf --decode-seqs 16
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import cpu_info, cpu_line  # isort: skip


def run(tree: Path, argv: list[str]) -> dict[str, Any]:
    """The last JSON object line `argv` (a script of the tree's bench/ and its options)
    prints, run with the tree's `v1`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, *argv], cwd=tree / "bench", env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree}: {' '.join(argv)} failed ({proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"{tree}: {' '.join(argv)} printed no JSON line")


def numbers(result: Any, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a JSON value, by dotted path."""
    if isinstance(result, bool):
        return {}
    if isinstance(result, int | float):
        return {prefix: float(result)}
    items = (result.items() if isinstance(result, dict)
             else enumerate(result) if isinstance(result, list) else ())
    found: dict[str, float] = {}
    for key, value in items:
        found.update(numbers(value, f"{prefix}.{key}" if prefix else str(key)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", type=Path, required=True, help="the baseline tree")
    parser.add_argument("--b", type=Path, required=True, help="the tree compared with it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fields", nargs="*", default=None,
                        help="only these dotted fields (default: every numeric one)")
    parser.add_argument("bench", nargs=argparse.REMAINDER,
                        help="-- SCRIPT [ARGS]: a script of bench/ and its options")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench:
        parser.error("name the benchmark after --")
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        got = {name: numbers(run(trees[name], bench)) for name in order}
        rounds.append(got)
        print(f"round {r + 1}/{args.rounds} done ({' then '.join(order)})", file=sys.stderr)
    common = [k for k in rounds[0]["a"] if all(k in rd["a"] and k in rd["b"] for rd in rounds)]
    if args.fields:
        common = [k for k in common if k in args.fields]
    cpu = cpu_info(Path("/proc/cpuinfo").read_text())
    print(f"A = {trees['a']}\nB = {trees['b']}\nbench: {' '.join(bench)}; {args.rounds} rounds")
    print(cpu_line(cpu))
    print(f"{'field':48s} {'A median':>12s} {'B median':>12s} {'B/A (paired)':>13s}")
    summary = {}
    for key in common:
        a = statistics.median(rd["a"][key] for rd in rounds)
        b = statistics.median(rd["b"][key] for rd in rounds)
        pairs = [rd["b"][key] / rd["a"][key] for rd in rounds if rd["a"][key]]
        ratio = statistics.median(pairs) if pairs else float("nan")
        summary[key] = {"a": a, "b": b, "ratio": ratio, "pairs": pairs}
        print(f"{key:48s} {a:12.4g} {b:12.4g} {ratio:13.3f}")
    print(json.dumps({"bench": bench, "rounds": args.rounds, "cpu": cpu, "fields": summary}))


if __name__ == "__main__":
    main()
