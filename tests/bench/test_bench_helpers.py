"""The benchmarks' own arithmetic (workload, ideal hit rate, decode window, percentiles) and
that each script starts: their figures are only as good as these."""

import argparse
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_prefix_cache  # noqa: E402
import bench_serving  # noqa: E402
import bench_throughput  # noqa: E402


def test_ideal_hit_tokens_counts_shared_full_blocks_before_the_last_token():
    shared = list(range(32))
    prompts = [
        shared + [100] * 8,  # first: nothing cached yet
        shared + [200] * 8,  # shares two full blocks
        shared,  # shares both, but its last token must be computed: one block
        [7] + shared[1:] + [1] * 8,  # differs in the first block: nothing
        shared[:16] + [9] * 20,  # shares the first block only
    ]
    assert bench_prefix_cache.ideal_hit_tokens(prompts, 16) == [0, 32, 16, 0, 16]


@pytest.mark.model
def test_workload_shares_each_groups_system_prompt(hf_tokenizer):
    args = argparse.Namespace(seed=0, groups=2, prompts_per_group=3, system_len=100,
                              question_len=[10, 20], plain=False, interleave=True)
    prompts = bench_prefix_cache.make_workload(args, hf_tokenizer)
    assert len(prompts) == 6
    again = bench_prefix_cache.make_workload(args, hf_tokenizer)
    assert again == prompts  # fixed seed

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    # Round robin: 0, 2, 4 are group 0's; 1, 3, 5 group 1's.
    assert common(prompts[0], prompts[2]) > 100 and common(prompts[0], prompts[4]) > 100
    assert common(prompts[1], prompts[3]) > 100
    assert common(prompts[0], prompts[1]) < 20  # the groups differ early
    for p in prompts:
        assert 100 + 10 < len(p) < 100 + 20 + 60  # system + question + template tokens


def _output(first: float, finished: float, n: int):
    metrics = SimpleNamespace(first_token_time=first, finished_time=finished)
    return SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=[0] * n)])


def test_decode_window_starts_at_the_common_first_token():
    outputs = [_output(10.0, 12.0, 5), _output(10.0, 13.0, 9)]
    assert bench_throughput.decode_window(outputs) == (3.0, 4 + 8)
    # First tokens from different steps: no pure-decode window.
    assert bench_throughput.decode_window([_output(10.0, 12.0, 5), _output(10.5, 13.0, 9)]) \
        is None
    no_times = SimpleNamespace(metrics=None, outputs=[SimpleNamespace(token_ids=[0])])
    assert bench_throughput.decode_window([no_times]) is None


def test_serving_summary_in_milliseconds():
    stats = bench_serving.summary("ttft", [0.1 * i for i in range(1, 101)])
    assert stats["ttft_ms_mean"] == pytest.approx(5050.0)
    assert stats["ttft_ms_p50"] == pytest.approx(5050.0)
    assert stats["ttft_ms_p99"] == pytest.approx(9901.0)
    assert bench_serving.summary("itl", []) == {
        "itl_ms_mean": None, "itl_ms_p50": None, "itl_ms_p99": None}


@pytest.mark.parametrize("name", ["bench_prefix_cache", "bench_throughput", "bench_serving",
                                  "bench_scheduler", "bench_async"])
def test_help(name):
    out = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")
