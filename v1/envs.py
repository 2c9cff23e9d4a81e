"""The environment variables v1 reads, all of them, and the only module that reads them.

Each is declared once in `VARIABLES` (name, default, meaning, parser raising ValueError).
`read()` gives one frozen `Environment`; callers take it where they are built and pass the
values down, so nothing on a step's path reads the environment. The table:
docs/architecture.md (`python -m v1.envs` prints it).
"""

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_ON = ("", "1", "true", "yes", "on")  # "" (set but empty) means the default: on
_OFF = ("0", "false", "no", "off")


def _flag(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{name}={value!r}: expected 0 or 1 (or on/off)")


def _opt_in(name: str, value: str) -> bool:
    # Off unless set to an "on" value: set but empty stays off (what it guards is risky).
    return bool(value.strip()) and _flag(name, value)


def _min_rows(name: str, value: str) -> int | None:
    v = value.strip()
    if not v:
        return None
    if not v.isdigit() or int(v) < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1 or empty")
    return int(v)


def _cpu_kernels(name: str, value: str) -> str:
    # Which names are valid depends on the machine: v1.kernels.library checks them.
    return value.strip().lower()


def _start_method(name: str, value: str) -> str:
    v = value.strip() or "fork"
    if v not in ("fork", "spawn"):
        raise ValueError(
            f"{name}={value!r} is not a start method for the engine process: use 'fork' or "
            "'spawn'"
        )
    return v


def _cache_dir(name: str, value: str) -> Path:
    return Path(value.strip() or Path.home() / ".cache" / "v1").expanduser()


def _hook(name: str, value: str) -> str | None:
    v = value.strip()
    if v and ":" not in v:
        raise ValueError(f"{name}={value!r}: expected 'module:function'")
    return v or None


def _mebibytes(name: str, value: str) -> int:
    v = value.strip()
    if not v.isdigit():
        raise ValueError(f"{name} must be a whole number of MiB (>= 0), got {value!r}")
    return int(v)


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    field: str  # the Environment attribute it fills
    default: str  # as it would be written in the environment
    parse: Callable[[str, str], Any]
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("V1_CPU_KERNELS", "cpu_kernels", "", _cpu_kernels,
             "C kernel library: unset/1 the best variant for this CPU, 0 none (torch paths), "
             "native, asan, or a variant name (x86_64_v4, x86_64_v3, portable, ...)"),
    Variable("V1_FUSED_DECODE", "fused_decode", "1", _flag,
             "1: decode steps that qualify run the decoder layers as one C call; 0: per-op"),
    Variable("V1_QUANT_ALL_INT8", "quant_all_int8", "1", _flag,
             "1: every row of a GGUF-block matmul takes the int8-activation path (unset: "
             "but big prompt chunks where V1_MATMUL_CALIBRATION says); 0: rows by kind and "
             "count (see V1_QUANT_PROMPT_INT8, V1_QUANT_INT8_MIN_ROWS)"),
    Variable("V1_QUANT_PROMPT_INT8", "quant_prompt_int8", "1", _flag,
             "with V1_QUANT_ALL_INT8=0: prompt tokens' rows take int8 (1) or go by count (0)"),
    Variable("V1_QUANT_INT8_MIN_ROWS", "quant_int8_min_rows", "", _min_rows,
             "with V1_QUANT_ALL_INT8=0: calls of at least this many rows take int8"),
    Variable("V1_MATMUL_CALIBRATION", "matmul_calibration", "1", _flag,
             "1: a GGUF-block model on the C kernels times the int8 path against dense at "
             "first start on this machine (cached in V1_CACHE_DIR) and sends prompt chunks "
             "dense from the row count where dense is clearly faster; 0: no timing, int8 "
             "everywhere. Ignored where V1_QUANT_ALL_INT8 or V1_QUANT_INT8_MIN_ROWS is set"),
    Variable("V1_CACHE_DIR", "cache_dir", "~/.cache/v1", _cache_dir,
             "where converted weights and calibration results are kept"),
    Variable("V1_ENABLE_MULTIPROCESSING", "enable_multiprocessing", "1", _flag,
             "0: LLM and LLMEngine run the engine core in the calling process"),
    Variable("V1_WORKER_MULTIPROC_METHOD", "worker_multiproc_method", "fork", _start_method,
             "how engine-core processes start: fork or spawn (vLLM's "
             "VLLM_WORKER_MULTIPROC_METHOD)"),
    Variable("V1_ENGINE_CORE_HOOK", "engine_core_hook", "", _hook,
             "tests only: 'module:function' called with the EngineCore in its process"),
    Variable("VLLM_XGRAMMAR_CACHE_MB", "xgrammar_cache_mb", "512", _mebibytes,
             "compiled-grammar cache size in MiB (vLLM's variable; 0 keeps nothing)"),
    Variable("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "allow_runtime_lora_updating", "0", _opt_in,
             "1: the server serves /v1/load_lora_adapter and /v1/unload_lora_adapter "
             "(vLLM's variable), loading only from --lora-root and --lora-modules folders; "
             "0: those routes answer 404"),
    Variable("VLLM_SERVER_DEV_MODE", "server_dev_mode", "0", _opt_in,
             "1: the server serves vLLM's development routes /reset_prefix_cache, /pause, "
             "/resume and /is_paused (vLLM's variable); 0: those routes answer 404"),
)

_BY_FIELD = {var.field: var for var in VARIABLES}


@dataclass(frozen=True, slots=True)
class Environment:
    """The parsed values of `VARIABLES`, one attribute each, and `explicit`: the names of
    those set to a value (not unset, not empty), for settings that yield to an explicit
    one."""

    cpu_kernels: str
    fused_decode: bool
    quant_all_int8: bool
    quant_prompt_int8: bool
    quant_int8_min_rows: int | None
    matmul_calibration: bool
    cache_dir: Path
    enable_multiprocessing: bool
    worker_multiproc_method: str
    engine_core_hook: str | None
    xgrammar_cache_mb: int
    allow_runtime_lora_updating: bool
    server_dev_mode: bool
    explicit: frozenset[str]


def read(environ: Mapping[str, str] | None = None) -> Environment:
    """Every variable parsed from `environ` (default: this process's environment, now);
    ValueError naming the first bad one."""
    env = os.environ if environ is None else environ
    values = {}
    explicit = set()
    for var in VARIABLES:
        raw = env.get(var.name)
        values[var.field] = var.parse(var.name, var.default if raw is None else raw)
        if raw is not None and raw.strip():
            explicit.add(var.name)
    return Environment(**values, explicit=frozenset(explicit))


def value(field: str, environ: Mapping[str, str] | None = None) -> Any:
    """One variable of `read()`'s (by its `Environment` field) parsed alone, for a caller that
    looks it up often: the kernel library's loader, which follows V1_CPU_KERNELS as it is
    now (tests switch it) at a microsecond a look, where `read()` parses every variable."""
    var = _BY_FIELD[field]
    raw = (os.environ if environ is None else environ).get(var.name)
    return var.parse(var.name, var.default if raw is None else raw)


def table() -> str:
    """The variables as a Markdown table (for docs/architecture.md)."""
    lines = ["| variable | default | what it does |", "|---|---|---|"]
    lines += [f"| `{v.name}` | `{v.default}` | {v.doc} |" for v in VARIABLES]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
