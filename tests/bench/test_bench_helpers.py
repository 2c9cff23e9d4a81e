"""The benchmarks' own arithmetic (workload, ideal hit rate, decode window, percentiles,
paired ratios, FLOP and byte counts) and that each script starts: their figures are only as
good as these."""

import argparse
import asyncio
import json
import math
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.bench.script_help import Help, run_help

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_ab  # noqa: E402
import bench_hostile  # noqa: E402
import bench_llamacpp  # noqa: E402
import bench_perplexity  # noqa: E402
import bench_prefix_cache  # noqa: E402
import bench_serving  # noqa: E402
import bench_sizes  # noqa: E402
import bench_step_breakdown  # noqa: E402
import bench_structured  # noqa: E402
import bench_throughput  # noqa: E402
import common  # noqa: E402
import llamacpp  # noqa: E402

# SmolLM2-135M's shapes (the default model), no weights needed.
SMOLLM2_135M = SimpleNamespace(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, vocab_size=49152,
)


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


def test_process_overhead_pairs_interleaved_runs():
    # The committed make bench run: in-process and engine-process runs, in the order run.
    inproc, process = [88.041, 84.325, 79.119], [85.176, 93.71, 86.292]
    ratios = bench_throughput.paired_ratios(inproc, process)
    assert ratios == pytest.approx([0.96746, 1.11129, 1.09066], abs=1e-5)
    # The median pair says +9.1%; the ratio of the two medians said +2.3%.
    assert bench_throughput.median(ratios) - 1 == pytest.approx(0.0907, abs=1e-4)
    with pytest.raises(ValueError):
        bench_throughput.paired_ratios([1.0, 2.0], [1.0])


def test_decode_engine_kwargs_fit_every_prompt_in_the_first_step():
    kwargs = bench_throughput.decode_engine_kwargs({"max_num_seqs": 16}, 64, 128)
    assert kwargs == {"max_num_seqs": 64, "max_num_batched_tokens": 64 * 128}
    small = bench_throughput.decode_engine_kwargs(
        {"max_num_seqs": 256, "max_num_batched_tokens": 4096}, 8, 32)
    assert small == {"max_num_seqs": 256, "max_num_batched_tokens": 4096}


def test_structured_workload_is_half_structured_and_cannot_finish_early():
    kinds = bench_structured.workload_kinds(32)
    assert kinds[1::2] == [None] * 16
    assert [kinds.count(k) for k in ("json", "regex", "choice")] == [8, 4, 4]
    # Each grammar's shortest text is longer than min_len tokens.
    n = 10
    schema = bench_structured.structured_params("json", n, 0).json
    assert schema["minItems"] == n
    regex = bench_structured.structured_params("regex", n, 0).regex
    assert re.fullmatch(regex, "Go" + " a" * n + ".")
    assert not re.fullmatch(regex, "Go" + " a" * (n - 1) + ".")
    choices = bench_structured.structured_params("choice", n, 0).choice
    assert len(choices) == 4 and all(len(c.split()) == n + 1 for c in choices)


def test_structured_decode_figures_leave_out_the_prefill_step():
    outputs = [_output(10.0, 12.0, 5), _output(10.0, 12.0, 5)]
    rate, step_ms, full = bench_structured.decode_figures([3.0, 0.5, 0.5, 0.5, 0.5], outputs, 5)
    assert rate == pytest.approx(2 * 4 / 2.0) and step_ms == pytest.approx(500.0) and full
    assert not bench_structured.decode_figures([1.0, 1.0], outputs, 6)[2]


def test_step_breakdown_counts_gemm_flops_and_kv_bytes():
    # Per layer: qkv 576 x (576 + 2 * 192), o 576 x 576, gate/up 576 x 3072, down 1536 x 576;
    # then the (tied) LM head 576 x 49152.
    assert bench_step_breakdown.linear_weights(SMOLLM2_135M) == 30 * 3_538_944 + 28_311_552
    flops = 64 * bench_step_breakdown.gemm_flops_per_token(SMOLLM2_135M)
    assert flops == pytest.approx(17.21e9, rel=1e-3)  # per decode step of 64 tokens
    # K and V, 3 kv heads of 64 fp32 values, 30 layers: 46,080 bytes per context token.
    assert bench_step_breakdown.kv_bytes_per_token(SMOLLM2_135M, 4) == 46_080
    # Decode steps see contexts 129 .. 255 after a 128-token prompt and 128 output tokens.
    context = bench_step_breakdown.mean_decode_context(128, 128)
    assert context == sum(range(129, 256)) / 127 == 192
    assert 64 * context * 46_080 == pytest.approx(566.2e6, rel=1e-3)


def test_step_breakdown_splits_nested_timers():
    timed = {"gemm": 0.140, "attention": 0.030, "sampling": 0.003, "fused": 0.0,
             "runner": 0.180, "core": 0.181, "step": 0.183}
    parts = bench_step_breakdown.split_step(timed)
    assert list(parts) == list(bench_step_breakdown.PARTS)
    assert parts["other model work"] == pytest.approx(0.007)
    assert parts["scheduler"] == pytest.approx(0.001)
    assert parts["output processing"] == pytest.approx(0.002)
    assert sum(parts.values()) == pytest.approx(timed["step"])
    # A fused step (GGUF blocks): the C call holds the layers; gemm timed the LM head alone.
    fused = {"gemm": 0.0025, "attention": 0.0, "sampling": 0.0001, "fused": 0.0068,
             "runner": 0.0118, "core": 0.0119, "step": 0.0120}
    parts = bench_step_breakdown.split_step(fused)
    assert parts["fused layers"] == 0.0068
    assert parts["other model work"] == pytest.approx(0.0024)
    assert sum(parts.values()) == pytest.approx(fused["step"])


def test_serving_summary_in_milliseconds():
    stats = bench_serving.summary("ttft", [0.1 * i for i in range(1, 101)])
    assert stats["ttft_ms_mean"] == pytest.approx(5050.0)
    assert stats["ttft_ms_p50"] == pytest.approx(5050.0)
    assert stats["ttft_ms_p99"] == pytest.approx(9901.0)
    assert bench_serving.summary("itl", []) == {
        "itl_ms_mean": None, "itl_ms_p50": None, "itl_ms_p99": None}


def test_hostile_stalls_are_the_gaps_and_polls_that_overlap_the_window():
    bystander = bench_hostile.Bystander("http://127.0.0.1:1", {})
    bystander.progress = [1.0, 1.1, 1.2, 5.0, 5.1]
    assert bystander.max_gap(1.25, 2.0) == pytest.approx(3.8)  # 1.2 -> 5.0 spans it
    assert bystander.max_gap(5.02, 5.08) == pytest.approx(0.1)
    bystander.polls = [[0.0, 0.01], [1.0, 4.0], [4.1, 4.2]]
    assert bystander.max_health(2.0, 3.0) == pytest.approx(3.0)
    assert bystander.max_health(4.05, 4.3) == pytest.approx(0.1)
    assert bystander.recovered(4.5) and not bystander.recovered(5.5)
    bystander.polls.append([4.3, 0.0])  # still pending: not recovered, and counted until now
    assert not bystander.recovered(4.5)


def test_hostile_finds_the_process_listening_on_a_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert bench_hostile.listening_pid(s.getsockname()[1]) == os.getpid()


HELP_SCRIPTS = ["bench_prefix_cache", "bench_throughput", "bench_serving", "bench_scheduler",
                "bench_async", "bench_step_breakdown", "bench_grammar", "bench_structured",
                "bench_dp", "bench_kv_cache_dtype", "bench_quant", "bench_quant_kernels",
                "bench_linear", "bench_hostile", "bench_suffix_index", "bench_llamacpp",
                "bench_spec", "bench_trees", "bench_kernel_variants", "bench_ab", "bench_sizes",
                "bench_perplexity", "bench_fused_step", "bench_spec_steps", "bench_start",
                "bench_isa_peak", "sizes_child"]


@pytest.fixture(scope="module")
def helps() -> dict[str, Help]:
    """Every HELP_SCRIPTS script's `--help`, from one helper process (see script_help)."""
    got = run_help([BENCH / f"{name}.py" for name in HELP_SCRIPTS], cwd=BENCH.parent)
    return {path.stem: help_ for path, help_ in got.items()}


@pytest.mark.parametrize("name", HELP_SCRIPTS)
def test_help(helps: dict[str, Help], name: str) -> None:
    out = helps[name]
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 patterns")
def test_isa_peaks_measure_the_patterns_this_cpu_runs():
    """isa_peak.c compiles with the kernels' compiler and rates each pattern the CPU has:
    the bounds bench_isa_peak.py sets the kernels against."""
    from bench.bench_isa_peak import BOUND_BY, peaks
    from v1.kernels import variants

    got = peaks()
    flags = set(variants.cpu_flags())
    want = {"i8_avx2": "avx2", "i8_avxvnni": "avx_vnni", "i8_avx512vnni": "avx512_vnni",
            "f32_fma256": "fma", "f32_fma512": "avx512f"}
    assert set(got) == {name for name, flag in want.items() if flag in flags}
    assert all(rate > 1e9 for rate in got.values()), got
    assert {p for pair in BOUND_BY.values() for p in pair} == set(want)


def test_spec_steps_price_the_drafts_rows_against_one_row_steps():
    from bench.bench_spec_steps import Step, summarize

    steps = [Step(40, 0, 1, 0.5, False),  # a prompt chunk
             Step(1, 0, 1, 0.2, False),  # a one-token prompt tail: not a decode step
             Step(1, 0, 1, 0.010, True), Step(1, 0, 1, 0.012, True), Step(1, 0, 1, 0.011, True),
             Step(3, 2, 3, 0.015, True), Step(3, 2, 1, 0.017, True)]
    got = summarize(steps)
    assert got["decode_steps"] == 5 and got["prompt_s"] == 0.7
    assert got["by_rows"] == {1: {"steps": 3, "median_ms": 11.0, "tokens_per_step": 1.0},
                              3: {"steps": 2, "median_ms": 16.0, "tokens_per_step": 2.0}}
    # The 3-row steps cost 4 and 6 ms beyond a 1-row step's 11: the drafts' rows.
    assert got["rows_cost_s"] == 0.01 and got["rows_free_decode_s"] == 0.055
    # Two runs pooled: per-run figures.
    assert summarize(steps + steps, runs=2)["rows_cost_s"] == 0.01
    assert "rows_cost_s" not in summarize([Step(3, 2, 3, 0.015, True)])


def test_ab_contenders_name_a_tree_and_its_settings(tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "__init__.py").touch()
    name, tree, env = bench_ab.parse_contender(f"v3={tmp_path},V1_CPU_KERNELS=x86_64_v3,A=")
    assert (name, tree, env) == ("v3", tmp_path.resolve(), {"V1_CPU_KERNELS": "x86_64_v3",
                                                              "A": ""})
    for bad in ("noequals", "=tree", "a=", f"a={tmp_path},novalue", f"a={tmp_path / 'v1'}"):
        with pytest.raises(ValueError, match="contender"):
            bench_ab.parse_contender(bad)


def test_kernel_variants_times_every_library_on_matmuls_and_attention():
    """bench_kernel_variants.py through this package's libraries, tiny: both parts' tables
    (its attention outputs checked close across libraries whose roundings differ)."""
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_kernel_variants.py"), "--rows", "2", "--rounds", "1",
         "--attention-rows", "1,3", "--context", "40"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert re.search(r"^int8\s+2\s", out, re.M)
    assert re.search(r"^3\s+\d+\.\d+\s", out.split("attention:")[1], re.M)


def test_helpdesk_questions_repeat_earlier_ones_verbatim():
    pool = [f"question {i}?" for i in range(5)]
    asked = bench_llamacpp.helpdesk_questions(pool, 20, 0.4, seed=0)
    assert asked == bench_llamacpp.helpdesk_questions(pool, 20, 0.4, seed=0)  # fixed seed
    assert len(asked) == 20 and asked[0] == pool[0]
    firsts = list(dict.fromkeys(asked))
    assert firsts == pool[: len(firsts)]  # new questions come in the pool's order
    assert 3 <= len(asked) - len(firsts) <= 17  # some repeats, not only repeats
    assert bench_llamacpp.helpdesk_questions(pool, 7, 0.0, seed=0) == pool + pool[:2]
    with pytest.raises(ValueError, match="repeat_fraction"):
        bench_llamacpp.helpdesk_questions(pool, 5, 1.0, seed=0)


def test_llamacpp_starts_without_this_process_openmp_settings(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # what bench/common.py sets
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    env = llamacpp.clean_env()
    assert not [k for k in env if k.startswith(("OMP_", "GOMP_"))]
    assert env["PATH"] == os.environ["PATH"]
    assert env["LLAMA_CPP_LIB_PATH"] == str(llamacpp.ROOT / ".llamacpp" / "build" / "bin")
    avx2 = llamacpp.clean_env("avx2")
    assert avx2["LLAMA_CPP_LIB_PATH"] == str(llamacpp.ROOT / ".llamacpp" / "build-avx2" / "bin")


# Two tests of `llama-bench -p 512 -n 128 -r 2 -o json` as it prints them (some fields cut).
LLAMA_BENCH_JSON = """[
  {
    "build_commit": "1a2b3c4",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "/m/SmolLM2-135M-Instruct-Q4_1.gguf",
    "model_type": "llama ?B Q4_1",
    "model_size": 96805760,
    "model_n_params": 134515008,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 2,
    "type_k": "f16",
    "type_v": "f16",
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-11-29T03:00:00Z",
    "avg_ns": 2700000000,
    "stddev_ns": 100000000,
    "avg_ts": 189.7,
    "stddev_ts": 7.1,
    "samples_ns": [ 2600000000, 2800000000 ],
    "samples_ts": [ 196.9, 182.8 ]
  },
  {
    "build_commit": "1a2b3c4",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "avg_ns": 1536000000,
    "stddev_ns": 20000000,
    "avg_ts": 83.34,
    "stddev_ts": 1.08,
    "samples_ns": [ 1516000000, 1556000000 ],
    "samples_ts": [ 84.43, 82.26 ]
  },
  {
    "build_commit": "1a2b3c4",
    "n_threads": 2,
    "n_prompt": 0,
    "n_gen": 32,
    "n_depth": 4096,
    "avg_ns": 500000000,
    "stddev_ns": 0,
    "avg_ts": 64.0,
    "stddev_ts": 0.0,
    "samples_ns": [ 500000000 ],
    "samples_ts": [ 64.0 ]
  }
]
"""


def test_llama_bench_json_reads_as_its_tests_mean_and_stddev():
    tests = llamacpp.parse_llama_bench(LLAMA_BENCH_JSON)
    assert list(tests) == ["pp512", "tg128", "tg32@d4096"]
    assert tests["pp512"] == {"tok_s": 189.7, "tok_s_stddev": 7.1, "seconds": 2.7,
                              "samples_tok_s": [196.9, 182.8], "threads": 2,
                              "build_commit": "1a2b3c4"}
    assert tests["tg128"]["tok_s"] == 83.34 and tests["tg128"]["tok_s_stddev"] == 1.08
    assert tests["tg128"]["seconds"] == pytest.approx(1.536)
    both = json.loads(LLAMA_BENCH_JSON)[1] | {"n_prompt": 512}
    assert list(llamacpp.parse_llama_bench(json.dumps([both]))) == ["pp512+tg128"]


def test_llama_bench_runs_its_build_in_the_clean_environment(monkeypatch, tmp_path):
    monkeypatch.setitem(llamacpp.BUILDS, "avx2", (tmp_path, "bench-llamacpp-avx2"))
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    calls = []

    def run(cmd, env, **kwargs):
        calls.append((cmd, env))
        return SimpleNamespace(stdout=LLAMA_BENCH_JSON)

    monkeypatch.setattr(llamacpp.subprocess, "run", run)
    tests = llamacpp.llama_bench(Path("/m/x.gguf"), threads=3, build="avx2", repetitions=2)
    assert tests["tg128"]["tok_s"] == 83.34
    [(cmd, env)] = calls
    assert cmd == [str(tmp_path / "bin" / "llama-bench"), "-m", "/m/x.gguf", "-t", "3",
                   "-p", "512", "-n", "128", "-r", "2", "-o", "json"]
    assert "OMP_WAIT_POLICY" not in env


def test_llamacpp_missing_names_the_build_and_its_make_target(monkeypatch, tmp_path):
    for build in ("native", "avx2"):
        monkeypatch.setitem(llamacpp.BUILDS, build, (tmp_path / build, f"target-{build}"))
    monkeypatch.setattr(llamacpp, "ROOT", tmp_path)
    monkeypatch.setattr(llamacpp, "PYTHON", tmp_path / "venv" / "python")
    assert llamacpp.missing("llama-bench", "avx2") == (
        "llama.cpp is not built (avx2/bin/llama-bench missing): run `make target-avx2`")
    # The worker needs llama-cpp-python's venv (the native target) and the build's library.
    assert "run `make bench-llamacpp target-avx2`" in llamacpp.missing(None, "avx2")
    (tmp_path / "avx2" / "bin").mkdir(parents=True)
    (tmp_path / "avx2" / "bin" / "llama-bench").touch()
    assert llamacpp.missing("llama-bench", "avx2") is None
    assert llamacpp.missing("llama-bench", "native") is not None


def test_cmake_cache_gives_a_builds_instruction_set_options():
    cache = ("// comment\nGGML_NATIVE:BOOL=OFF\nGGML_AVX2:BOOL=ON\nGGML_AVX512:BOOL=OFF\n"
             "GGML_FMA:BOOL=ON\nCMAKE_C_FLAGS:STRING=\nGGML_AVX2-ADVANCED:INTERNAL=1\n"
             "LLAMA_CURL:BOOL=ON\n")
    assert llamacpp.parse_cmake_cache(cache, llamacpp.ISA_OPTIONS + ("CMAKE_C_FLAGS",)) == {
        "GGML_AVX2": "ON", "GGML_FMA": "ON"}
    assert llamacpp.parse_cmake_cache("CMAKE_C_FLAGS:STRING=-mno-amx-tile\n",
                                      ["CMAKE_C_FLAGS"]) == {"CMAKE_C_FLAGS": "-mno-amx-tile"}


def test_v1_env_settings_parse_as_var_and_value():
    assert bench_llamacpp.parse_env_setting("V1_CPU_KERNELS=x86_64_v3") == (
        "V1_CPU_KERNELS", "x86_64_v3")
    assert bench_llamacpp.parse_env_setting("V1_QUANT_INT8_MIN_ROWS=") == (
        "V1_QUANT_INT8_MIN_ROWS", "")
    assert bench_llamacpp.parse_env_setting("A=b=c") == ("A", "b=c")
    for bad in ("V1_CPU_KERNELS", "=x", "1A=x", "A B=x"):
        with pytest.raises(ValueError, match="VAR=VALUE"):
            bench_llamacpp.parse_env_setting(bad)


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Processor
stepping\t: 8
flags\t\t: fpu sse2 avx fma f16c avx2 avx512f avx512bw avx_vnni avx512_vnni amx_tile amx_int8

processor\t: 1
vendor_id\t: OtherVendor
model name\t: Other
flags\t\t: fpu
"""


def test_cpu_info_names_the_first_cpu_and_its_kernel_flags():
    assert common.cpu_info(CPUINFO) == {
        "model": "Intel(R) Xeon(R) Processor", "vendor": "GenuineIntel",
        "family_model_stepping": "6/143/8",
        "flags": ["avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
                  "amx_tile", "amx_int8"]}
    zen3 = CPUINFO.replace(" avx512f avx512bw avx_vnni avx512_vnni amx_tile amx_int8", "")
    assert common.cpu_info(zen3)["flags"] == ["avx2", "fma", "f16c"]
    arm = "processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU part\t: 0xd0c\n"
    assert common.cpu_info(arm)["flags"] == ["asimd", "asimddp"]


def test_cpu_line_names_the_cpu_a_result_ran_on():
    """The line bench_llamacpp and bench_ab print: model, vendor and family/model/stepping,
    the kernel flags (or that it has none of them)."""
    assert common.cpu_line(common.cpu_info(CPUINFO)) == (
        "CPU: Intel(R) Xeon(R) Processor (GenuineIntel 6/143/8), flags: avx2 fma f16c avx_vnni "
        "avx512f avx512bw avx512_vnni amx_tile amx_int8")
    bare = dict(common.cpu_info(CPUINFO), flags=[])
    assert common.cpu_line(bare).endswith("flags: none of " + " ".join(common.CPU_FLAGS))


def test_kernel_libraries_are_read_from_a_process_maps():
    maps = (
        "7f0000000000-7f0000001000 r--p 00000000 08:01 42 /usr/lib/libc.so.6\n"
        "7f0000002000-7f0000003000 r--p 00000000 08:01 43 /w/v1/kernels/_v1_x86_64_v3.so\n"
        "7f0000003000-7f0000009000 r-xp 00001000 08:01 43 /w/v1/kernels/_v1_x86_64_v3.so\n"
        "7f000000a000-7f000000b000 rw-p 00000000 00:00 0 \n"
        "7f000000c000-7f000000d000 r--p 00000000 08:01 44 /w/v1/kernels/_v1_x86_64_v3.so.partial\n"
    )
    assert bench_llamacpp.kernel_libraries(maps) == ["_v1_x86_64_v3.so"]
    assert bench_llamacpp.kernel_libraries("") == []


def test_random_prompt_is_seeded_and_in_the_vocabulary():
    prompt = bench_llamacpp.random_prompt(512, 100, seed=3)
    assert len(prompt) == 512 and all(0 <= t < 100 for t in prompt)
    assert prompt == bench_llamacpp.random_prompt(512, 100, seed=3)
    assert prompt != bench_llamacpp.random_prompt(512, 100, seed=4)


def test_serving_client_reads_a_server_without_cached_counts_or_metrics():
    """--base-url at another OpenAI-compatible server (llama-server): a usage block without
    prompt_tokens_details and a /metrics that answers 501 read as none, not as a failure."""
    chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
              {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(501, json={"error": {"message": "start it with --metrics"}})
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            req = bench_serving.Request()
            await bench_serving.send(client, "http://x/v1/completions", [1, 2], 2, req)
            return req, await bench_serving.get_metrics(client, "http://x")

    req, metrics = asyncio.run(go())
    assert req.error is None and len(req.chunks) == 2
    assert (req.prompt_tokens, req.output_tokens, req.cached_tokens) == (7, 2, 0)
    assert metrics == {}


@pytest.mark.model
def test_llamacpp_bench_without_llamacpp_says_so_and_exits_0(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(llamacpp, "ROOT", tmp_path)
    monkeypatch.setattr(llamacpp, "PYTHON", tmp_path / "absent")
    monkeypatch.setitem(llamacpp.BUILDS, "native", (tmp_path / "absent", "bench-llamacpp"))
    monkeypatch.setattr(sys, "argv", ["bench_llamacpp.py"])
    bench_llamacpp.main()  # returns: exit status 0
    out = capsys.readouterr().out
    for part in bench_llamacpp.PARTS:
        assert f"{part}: skipped: llama.cpp is not built" in out


@pytest.mark.parametrize("name, vocab, params", [
    ("qwen2.5-0.5b", 151936, 494_032_768),
    ("llama-3.2-1b", 128256, 1_235_814_400),
    ("llama-3.2-3b", 128256, 3_212_749_824),
])
def test_size_sweep_bodies_have_their_published_parameter_counts(name, vocab, params):
    config = bench_sizes.hf_config(bench_sizes.SHAPES[name], vocab, 1, 2)
    shapes = bench_sizes.tensor_shapes(config)
    total = sum(math.prod(shape) for _, shape in shapes)
    assert total == params  # with their own vocabularies: the shapes are the real ones
    assert "model_type" not in config and "rope_scaling" not in config
    shards = {bench_sizes.shard_of(n) for n, _ in shapes}
    assert len(shards) == config["num_hidden_layers"] + 1  # one per layer, one for the rest


def test_size_sweep_bandwidth_limit_and_stream_buffer():
    assert bench_sizes.limit_tok_s(10e9, 500_000_000) == 20.0
    assert bench_sizes.stream_buffer_bytes(300 << 20) == 1200 << 20  # 4 caches past the L3
    assert bench_sizes.stream_buffer_bytes(8 << 20) == 1 << 30  # at least 1 GiB
    assert bench_sizes.cpu_class(False, ["avx2", "avx512f"]) == "avx512"
    assert bench_sizes.cpu_class(True, ["avx2", "avx512f"]) == "avx2"
    assert bench_sizes.cpu_class(False, ["avx2"]) == "avx2"


def test_size_sweep_avx2_runs_the_avx2_build_with_v1_held_to_avx2():
    args = bench_sizes.parse_args(["--avx2", "--v1-env", "V1_CPU_KERNELS=portable"])
    assert args.build == "avx2"
    assert args.v1_env == {**bench_sizes.AVX2_ENV, "V1_CPU_KERNELS": "portable"}
    assert bench_sizes.parse_args([]).build == "native"
    assert bench_sizes.parse_args([]).v1_env == {}


def test_size_sweep_child_loads_a_file_and_answers_each_test():
    """bench_sizes' v1 side on the default model's GGUF: ready (a load timed, no torch loaded
    in the child before: as a user's script, it starts the engine first), its kernels and
    the sweep's threads and context, a time per test asked, its engine's peak RSS at the
    end. The file converted first: a first load's conversion loads torch in the frontend."""
    from v1.models.gguf_cache import convert_gguf
    from v1.models.model_files import default_model_path

    convert_gguf(default_model_path())
    args = bench_sizes.parse_args(["--threads", "1", "--decode-tokens", "2",
                                   "--prefill-tokens", "8", "--ctx", "64"])
    child = bench_sizes.V1Child(default_model_path(), args, time.monotonic() + 240)
    try:
        assert child.ask()["load_s"] > 0
        info = child.ask()
        assert any(name.startswith("_v1_") for name in info["kernels"])
        assert (info["threads"], info["max_model_len"]) == (1, 64)
        assert info["torch_before_ready"] is False
        assert child.ask("tg")["seconds"] > 0 and child.ask("pp")["seconds"] > 0
        assert child.finish()["peak_rss_mb"] > 0
    finally:
        child.kill()


def test_perplexity_text_is_named_relative_to_the_repository_when_inside_it(tmp_path):
    assert bench_perplexity.TEXT_PATH.is_file()
    assert bench_perplexity.shown_path(bench_perplexity.TEXT_PATH) == (
        "bench/data/perplexity_long.txt")
    assert bench_perplexity.shown_path(tmp_path / "t.txt") == str(tmp_path / "t.txt")


def test_perplexity_chunks_as_llama_perplexity_cuts_them():
    tokens = list(range(10, 21))  # 11 tokens, chunks of 4: the 3-token tail dropped
    assert bench_perplexity.chunks(tokens, 4, None) == [[10, 11, 12, 13], [14, 15, 16, 17]]
    assert bench_perplexity.chunks(tokens, 4, 1) == [[1, 11, 12, 13], [1, 15, 16, 17]]
    log = "...\n[1]12.5,[2]13.1,\nFinal estimate: PPL = 13.0712 +/- 0.42117\n"
    assert bench_perplexity.parse_final_estimate(log) == (13.0712, 0.42117)
    with pytest.raises(ValueError):
        bench_perplexity.parse_final_estimate("no estimate")
    # Greedy pairs end before v1's first end of turn (llama.cpp's ignore_eos masks it).
    ours, ref = bench_perplexity.until_special([[5, 6, 2, 7], [5, 6]], [[5, 6, 9, 7], [5, 8]], {2})
    assert (ours, ref) == ([[5, 6], [5, 6]], [[5, 6], [5, 8]])


def test_environment_names_the_cpu_and_the_kernel_library(monkeypatch):
    """Every result names what it ran on: the CPU's kernel flags and the library a
    V1_CPU_KERNELS setting loads (here the portable one, which every machine can load)."""
    monkeypatch.setenv("V1_CPU_KERNELS", "portable")
    env = common.environment()
    assert env["v1_kernel_library"] == "_v1_portable.so"
    assert env["cpu"] == common.cpu_info(Path("/proc/cpuinfo").read_text())
    # a run against another server (or of several libraries) names none
    assert "v1_kernel_library" not in common.environment(kernels=False)
