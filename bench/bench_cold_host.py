"""What the host code of a batch-1 decode step pays for running right after its weights streamed.

A step streams its weights (~100 MB for the default model, more than the L2 and L3 hold) through
the caches, then runs Python, torch's dispatcher and numpy until the next kernel: that code
and its data are no longer cached. This times a few of the ops a step's host code calls, each
alone, in three states: warm (called just before), after a streaming read of `--stream-mb`
of fp32 (the weights' stand-in, on torch's threads), and after sleeping `--sleep-ms` (the
core idle: on a VM another tenant may have run there). Medians over `--repeat` calls.

    .venv/bin/python bench/bench_cold_host.py [--stream-mb 100] [--repeat 200]
"""

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import environment, print_table  # noqa: E402
from v1.kernels.elementwise import native_ops  # noqa: E402


def timed(before: Callable[[], object], op: Callable[[], object], repeat: int) -> float:
    """Median microseconds of `op`, each call right after `before`."""
    times = []
    for _ in range(repeat):
        before()
        t0 = time.perf_counter()
        op()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream-mb", type=int, default=100)
    parser.add_argument("--sleep-ms", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()

    ops = native_ops()
    x, residual, weight = torch.randn(1, 576), torch.randn(1, 576), torch.randn(576)
    table = torch.randn(4096, 1, 64)
    positions = torch.tensor([7])
    small = np.arange(4)
    contenders: dict[str, Callable[[], object]] = {
        "torch empty": lambda: x.new_empty(1, 576),
        "torch index": lambda: table[positions],
        "numpy cumsum": lambda: np.cumsum(small),
        "python loop (200 adds)": lambda: sum(range(200)),
    }
    if ops is not None:
        contenders["C RMSNorm (ctypes)"] = lambda: ops.rms_norm(x, residual, weight, 1e-5)
    weights = torch.ones(args.stream_mb << 18)  # fp32: stream_mb MB
    states: dict[str, Callable[[], object]] = {
        "warm": lambda: None,
        f"after streaming {args.stream_mb} MB": weights.sum,
        f"after sleeping {args.sleep_ms:g} ms": lambda: time.sleep(args.sleep_ms / 1e3),
    }
    rows = {name: {state: round(timed(before, op, args.repeat), 1)
                   for state, before in states.items()} for name, op in contenders.items()}
    env = environment()
    print(f"{env}; medians of {args.repeat} calls each, microseconds")
    print_table(["op", *states], [[name, *row.values()] for name, row in rows.items()])
    print(json.dumps({"bench": "cold_host", "stream_mb": args.stream_mb,
                      "sleep_ms": args.sleep_ms, "repeat": args.repeat, "us": rows, **env}))


if __name__ == "__main__":
    main()
