"""v1.envs: every variable parsed once, with its default, and bad values named."""

import ast
from pathlib import Path

import pytest

from v1 import envs


def test_defaults_when_nothing_is_set():
    env = envs.read({})
    assert env.cpu_kernels == ""
    assert env.fused_decode and env.quant_all_int8 and env.quant_prompt_int8
    assert env.quant_int8_min_rows is None
    assert env.matmul_calibration
    assert env.explicit == frozenset()
    assert env.cache_dir == Path.home() / ".cache" / "v1"
    assert env.enable_multiprocessing
    assert env.worker_multiproc_method == "fork"
    assert env.engine_core_hook is None
    assert env.xgrammar_cache_mb == 512
    assert not env.allow_runtime_lora_updating
    assert not env.server_dev_mode


def test_values_are_parsed():
    env = envs.read({
        "V1_CPU_KERNELS": " X86_64_V3 ", "V1_FUSED_DECODE": "off", "V1_QUANT_ALL_INT8": "0",
        "V1_QUANT_INT8_MIN_ROWS": "8", "V1_CACHE_DIR": "/tmp/x",
        "V1_WORKER_MULTIPROC_METHOD": "spawn", "V1_ENGINE_CORE_HOOK": "m:f",
        "VLLM_XGRAMMAR_CACHE_MB": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "V1_MATMUL_CALIBRATION": "0",
        "V1_QUANT_PROMPT_INT8": " ",  # empty: the default, not set
    })
    assert env.cpu_kernels == "x86_64_v3"
    assert not env.fused_decode and not env.quant_all_int8
    assert env.quant_int8_min_rows == 8
    assert env.cache_dir == Path("/tmp/x")
    assert env.worker_multiproc_method == "spawn"
    assert env.engine_core_hook == "m:f"
    assert env.xgrammar_cache_mb == 0
    assert env.allow_runtime_lora_updating
    # Set but empty stays off (vLLM's reading too: only 1 / true turn it on).
    assert not envs.read({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": ""}).allow_runtime_lora_updating
    assert not env.matmul_calibration
    # Which were set (to anything but empty): for settings that yield to an explicit one.
    assert env.explicit == {
        "V1_CPU_KERNELS", "V1_FUSED_DECODE", "V1_QUANT_ALL_INT8", "V1_QUANT_INT8_MIN_ROWS",
        "V1_CACHE_DIR", "V1_WORKER_MULTIPROC_METHOD", "V1_ENGINE_CORE_HOOK",
        "VLLM_XGRAMMAR_CACHE_MB", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "V1_MATMUL_CALIBRATION"}


@pytest.mark.parametrize("name, value", [
    ("V1_FUSED_DECODE", "maybe"), ("V1_QUANT_ALL_INT8", "2"), ("V1_MATMUL_CALIBRATION", "x"),
    ("V1_QUANT_INT8_MIN_ROWS", "0"),
    ("V1_QUANT_INT8_MIN_ROWS", "x"), ("V1_WORKER_MULTIPROC_METHOD", "forkserver"),
    ("V1_ENGINE_CORE_HOOK", "nocolon"), ("VLLM_XGRAMMAR_CACHE_MB", "-1"),
    ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "maybe"),
])
def test_bad_values_name_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        envs.read({name: value})


def test_every_field_has_one_variable():
    fields = [v.field for v in envs.VARIABLES]
    assert sorted([*fields, "explicit"]) == sorted(envs.Environment.__slots__)
    assert "| `V1_CPU_KERNELS` |" in envs.table()


def _environment_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each read of a V1_* variable: `os.environ.get(N)`, `os.getenv(N)`,
    `os.environ[N]`, `N in os.environ`, with N a string or a module constant holding one."""
    constants = {
        t.id: node.value.value
        for node in ast.walk(tree) if isinstance(node, ast.Assign)
        and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for t in node.targets if isinstance(t, ast.Name)
    }

    def name(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
        elif isinstance(node, ast.Name):
            value = constants.get(node.id)
        else:
            return None
        return value if value is not None and value.startswith("V1_") else None

    def is_environ(node: ast.AST) -> bool:
        return ast.unparse(node) in ("os.environ", "environ")

    reads = []
    for node in ast.walk(tree):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if ast.unparse(func) in ("os.getenv", "getenv") or (
                isinstance(func, ast.Attribute) and is_environ(func.value)
            ):
                keys = [node.args[0]]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            keys = [node.slice]
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            keys = [node.left]
        reads += [(node.lineno, n) for n in map(name, keys) if n is not None]
    return reads


def test_the_reader_sees_each_kind_of_read():
    source = (
        'import os\nK = "V1_B"\nos.environ.get("V1_A")\nos.getenv(K)\nos.environ["V1_C"]\n'
        '"V1_D" in os.environ\nos.environ.get("HF_HOME")\n'
    )
    assert [n for _, n in _environment_reads(ast.parse(source))] == [
        "V1_A", "V1_B", "V1_C", "V1_D"
    ]


def test_only_envs_reads_v1_variables():
    """Every V1_* variable is read by v1.envs, and by no other module under v1/."""
    package = Path(envs.__file__).parent
    found = [
        f"{path.relative_to(package.parent)}:{line}: {name}"
        for path in sorted(package.rglob("*.py")) if path != Path(envs.__file__)
        for line, name in _environment_reads(ast.parse(path.read_text()))
    ]
    assert not found, "\n".join(found)


def test_the_docs_list_every_variable():
    docs = Path(envs.__file__).parent.parent / "docs" / "architecture.md"
    assert envs.table() in docs.read_text()
