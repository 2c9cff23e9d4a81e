"""v1.config: each group checks its own values when made; EngineArgs maps vLLM's names onto
the groups; the package is plain data (no torch)."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from v1.config import (
    CacheConfig,
    EngineArgs,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from v1.worker.model_runner import ModelRunner


@pytest.mark.parametrize("make, match", [
    (lambda: ModelConfig(device="tpu"), "device must be one of .*got 'tpu'"),
    (lambda: ModelConfig(dtype="float64"), "dtype must be one of .*got 'float64'"),
    (lambda: ModelConfig(runner="draft"), "runner must be one of auto, generate, pooling"),
    (lambda: ModelConfig(pooler_config={"normalize": True}), "pooler_config needs runner"),
    (lambda: ModelConfig(quantization="fp4"), "quantization must be one of gguf, int8"),
    (lambda: ModelConfig(hf_overrides="max_position_embeddings=128"),
     "hf_overrides must be a dict or a function of the HF config"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5),
     r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (lambda: CacheConfig(kv_cache_memory=0), "kv_cache_memory must be an integer >= 1, got 0"),
    (lambda: CacheConfig(kv_cache_disk_bytes=1), "kv_cache_disk_bytes needs kv_cache_dir"),
    (lambda: SchedulerConfig(policy="lifo"), "scheduling_policy must be one of fcfs, priority"),
    (lambda: SchedulerConfig(long_prefill_token_threshold=-1),
     "long_prefill_token_threshold must be an integer >= 0, got -1"),
    (lambda: SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=64,
                             max_model_len=128), r"max_num_batched_tokens \(64\) must be >="),
    (lambda: ParallelConfig(data_parallel_size=0), "data_parallel_size must be an integer >= 1"),
    (lambda: ParallelConfig(data_parallel_routing="random"),
     "data_parallel_routing must be one of affinity, round_robin, least_loaded"),
    (lambda: ParallelConfig(data_parallel_backend="ray", data_parallel_size_local=1),
     "data_parallel_size_local is for the mp backend"),
    (lambda: ParallelConfig(data_parallel_kv_threshold=0), "data_parallel_kv_threshold must be"),
    (lambda: LoRAConfig(max_loras=2, max_cpu_loras=1), r"max_cpu_loras \(1\) must be >="),
])
def test_each_group_checks_its_values(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_engine_args_builds_the_groups(tmp_path):
    """A bad value fails when EngineArgs is made, with the group's message (on CPU too: a GPU
    option is checked where it would do nothing); vLLM's second spelling is named as given."""
    for bad, match in [
        ({"gpu_memory_utilization": 2.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"data_parallel_size": 2, "data_parallel_size_local": 1, "data_parallel_start_rank": 2},
         "exceeds data_parallel_size 2"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be an integer >= 1"),
        ({"max_num_batched_tokens": 32, "max_model_len": 64, "enable_chunked_prefill": False},
         r"max_num_batched_tokens \(32\) must be >= max_model_len \(64\)"),
    ]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(**bad)
    args = EngineArgs(kv_cache_dtype="bf16", kv_cache_memory_bytes=1 << 20,
                      gpu_memory_utilization=0.5, kv_cache_dir=str(tmp_path / "kv"))
    assert not (tmp_path / "kv").exists()  # made by the engine, not by the options
    scheduler, cache = args.create_configs(4096, on_gpu=True)
    assert scheduler.max_model_len == 4096 and scheduler.max_num_batched_tokens == 8192
    assert scheduler.long_prefill_token_threshold == 0 and not scheduler.cap_lone_prefill
    on_cpu, _ = args.create_configs(4096, on_gpu=False)  # a step is seconds: short chunks
    assert on_cpu.max_num_batched_tokens == 2048 and on_cpu.long_prefill_token_threshold == 512
    assert on_cpu.cap_lone_prefill
    for off in ({"long_prefill_token_threshold": 0}, {"enable_chunked_prefill": False}):
        assert EngineArgs(**off).create_configs(  # chunked prefill off: whole prompts
            4096, on_gpu=False)[0].long_prefill_token_threshold == 0
    assert cache.cache_dtype == "bfloat16" and cache.kv_cache_memory == 1 << 20
    assert cache.gpu_memory_utilization == 0.5 and cache.disk_bytes() == 8 << 30
    assert args.parallel_config() == ParallelConfig()
    assert args.model_config().dtype == "auto"


def test_hf_overrides_is_a_json_object_on_the_command_line():
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--hf-overrides", '{"max_position_embeddings": 128}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.model_config().hf_overrides == {"max_position_embeddings": 128}


def test_the_gpu_budget_is_the_runners(monkeypatch):
    """gpu_memory_utilization: the KV cache gets that fraction of the GPU's memory less what is
    in use (the weights); without it, 85% of what is free."""
    free, total = 80 << 20, 100 << 20
    runner = SimpleNamespace(device=torch.device("cuda"), kv_cache_block_bytes=lambda: 1 << 20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    blocks = ModelRunner.determine_num_blocks
    assert blocks(runner, CacheConfig(gpu_memory_utilization=0.5)) == 50 - 20
    assert blocks(runner, CacheConfig()) == int(80 * 0.85)
    assert blocks(runner, CacheConfig(kv_cache_memory=3 << 20)) == 3


def test_config_is_plain_data():
    """Importing v1.config imports no torch."""
    code = "import sys, v1.config; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
