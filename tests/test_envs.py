"""v1.envs: every variable parsed once, with its default, and bad values named."""

from pathlib import Path

import pytest

from v1 import envs


def test_defaults_when_nothing_is_set():
    env = envs.read({})
    assert env.cpu_kernels == ""
    assert env.fused_decode and env.quant_all_int8 and env.quant_prompt_int8
    assert env.quant_int8_min_rows is None
    assert env.cache_dir == Path.home() / ".cache" / "v1"
    assert env.enable_multiprocessing
    assert env.worker_multiproc_method == "fork"
    assert env.engine_core_hook is None
    assert env.xgrammar_cache_mb == 512


def test_values_are_parsed():
    env = envs.read({
        "V1_CPU_KERNELS": " X86_64_V3 ", "V1_FUSED_DECODE": "off", "V1_QUANT_ALL_INT8": "0",
        "V1_QUANT_INT8_MIN_ROWS": "8", "V1_CACHE_DIR": "/tmp/x",
        "V1_WORKER_MULTIPROC_METHOD": "spawn", "V1_ENGINE_CORE_HOOK": "m:f",
        "VLLM_XGRAMMAR_CACHE_MB": "0",
    })
    assert env.cpu_kernels == "x86_64_v3"
    assert not env.fused_decode and not env.quant_all_int8
    assert env.quant_int8_min_rows == 8
    assert env.cache_dir == Path("/tmp/x")
    assert env.worker_multiproc_method == "spawn"
    assert env.engine_core_hook == "m:f"
    assert env.xgrammar_cache_mb == 0


@pytest.mark.parametrize("name, value", [
    ("V1_FUSED_DECODE", "maybe"), ("V1_QUANT_ALL_INT8", "2"), ("V1_QUANT_INT8_MIN_ROWS", "0"),
    ("V1_QUANT_INT8_MIN_ROWS", "x"), ("V1_WORKER_MULTIPROC_METHOD", "forkserver"),
    ("V1_ENGINE_CORE_HOOK", "nocolon"), ("VLLM_XGRAMMAR_CACHE_MB", "-1"),
])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        envs.read({name: value})


def test_every_field_has_one_variable():
    fields = [v.field for v in envs.VARIABLES]
    assert sorted(fields) == sorted(envs.Environment.__slots__)
    assert "| `V1_CPU_KERNELS` |" in envs.table()
