"""The KV cache's group: block size, how many blocks, their dtype, the prefix cache, its
preloaded prompts and its disk tier."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from v1.config.checks import check_choice, check_fraction, check_int, check_ints

# kv_cache_dtype's accepted spellings -> the dtype's name ("auto": the model's dtype).
KV_CACHE_DTYPES = {
    "auto": "auto",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
    "float32": "float32", "fp32": "float32",
}

# kv_cache_disk_bytes when kv_cache_dir is given alone.
DEFAULT_KV_CACHE_DISK_BYTES = 8 << 30


def kv_cache_dtype_name(kv_cache_dtype: str) -> str:
    """The canonical name of a kv_cache_dtype spelling ("bf16" -> "bfloat16"); ValueError
    for others (fp8 among them: no kernel here reads it)."""
    check_choice("kv_cache_dtype", kv_cache_dtype, tuple(KV_CACHE_DTYPES))
    return KV_CACHE_DTYPES[kv_cache_dtype]


@dataclass(slots=True)
class CacheConfig:
    """The KV cache. Its size is `num_gpu_blocks` if given, else the blocks that fit
    `kv_cache_memory` bytes, else (the model runner decides, on the device) the blocks that
    fit `gpu_memory_utilization` of a GPU's memory or the device's default budget. Every value
    is checked when the config is made; the disk tier's directory is opened (and refused if
    it cannot be written) by the engine, before the model loads."""

    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: derive from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes; None: the device's default budget
    enable_prefix_caching: bool = True
    # Declared prefixes (`--preload-prompts`) may pin at most this fraction of the blocks.
    preload_max_fraction: float = 0.5
    # What the KV cache stores (vLLM's name): "auto" (the model's dtype), "bfloat16",
    # "float16" or "float32"; any spelling of KV_CACHE_DTYPES, kept canonical.
    cache_dtype: str = "auto"
    # On a GPU, with no kv_cache_memory: the fraction of its memory the engine may use,
    # weights included (vLLM's); None: 85% of what is free after loading.
    gpu_memory_utilization: float | None = None
    # The disk tier under the prefix cache: its directory and byte bound (None: the default).
    kv_cache_dir: str | None = None
    kv_cache_disk_bytes: int | None = None

    def __post_init__(self) -> None:
        self.cache_dtype = kv_cache_dtype_name(self.cache_dtype)
        check_ints(self, ("block_size",), ("num_gpu_blocks", "kv_cache_memory"))
        check_fraction("preload_max_fraction", self.preload_max_fraction)
        if self.gpu_memory_utilization is not None:
            check_fraction("gpu_memory_utilization", self.gpu_memory_utilization)
        if self.kv_cache_dir is None:
            if self.kv_cache_disk_bytes is not None:
                raise ValueError("kv_cache_disk_bytes needs kv_cache_dir")
            return
        if self.kv_cache_disk_bytes is not None:
            check_int("kv_cache_disk_bytes", self.kv_cache_disk_bytes)
        if not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir (the disk tier) needs enable_prefix_caching")

    def disk_bytes(self) -> int:
        """The disk tier's byte bound (kv_cache_dir given)."""
        return self.kv_cache_disk_bytes or DEFAULT_KV_CACHE_DISK_BYTES


def load_preload_prompts(spec: str | list[Any]) -> list[Any]:
    """The prompts of `preload_prompts` (v1/engine/preload.py): a list, or the path of a JSON
    file holding one, read here so that a bad one fails before the model loads."""
    if isinstance(spec, str):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(
                f"preload_prompts: {spec!r} is not a file (give the path of a JSON list of "
                "prompts, or a list of prompts)"
            )
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"preload_prompts: cannot read {spec}: {e}") from e
    if not isinstance(spec, list):
        raise ValueError(f"preload_prompts must be a list of prompts, got {type(spec).__name__}")
    return spec
