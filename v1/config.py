"""Engine configuration, with vLLM's option names. Plain data: every layer may read it."""

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("v1")

# generation_config.json's keys that become default sampling parameters (vLLM's list), and
# the SamplingParams field each sets.
GENERATION_CONFIG_DEFAULTS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def cache_root() -> Path:
    """Where converted weights and built kernels are kept: $V1_CACHE_DIR, else ~/.cache/v1."""
    return Path(os.environ.get("V1_CACHE_DIR") or Path.home() / ".cache" / "v1").expanduser()


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Caps one request's prefill chunk per step (0: no cap) so several prompts progress.
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"  # "fcfs" | "priority"
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}) when chunked prefill is off, "
                "or the longest prompt could never be scheduled"
            )


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: derive from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes; None: the device's default budget
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")


@dataclass(slots=True)
class EngineArgs:
    """The user-facing engine options, named as vLLM names them."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct, GGUF)
    # With a hub id as `model`: the branch, tag or commit to find in the local HF cache.
    revision: str | None = None
    # Where requests' default sampling parameters come from: "auto", the model's
    # generation_config.json; "vllm", vLLM's own (SamplingParams' defaults); or a directory
    # holding a generation_config.json.
    generation_config: str = "auto"
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 2048 on CPU, 8192 on GPU
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    async_scheduling: bool = False
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    # vLLM's spellings of the two above, accepted as they mean the same.
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    # On GPU, the fraction of its memory the engine may use, the weights included (None:
    # the KV cache gets 85% of what is free after loading). Accepted, and unused, on CPU.
    gpu_memory_utilization: float | None = None
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    seed: int = 0
    def __post_init__(self) -> None:
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        gen = self.generation_config
        if gen not in ("auto", "vllm") and not Path(gen).expanduser().is_dir():
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a directory holding a "
                f"generation_config.json, got {gen!r}"
            )

    def get_diff_sampling_param(self, model_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """vLLM's: the default sampling parameters the model's creator recommends, for
        requests that do not set them: generation_config.json's temperature, top_p, top_k,
        min_p, repetition_penalty and max_new_tokens (as max_tokens), as SamplingParams
        keywords. Read from `model_dir` (the loaded model's HF directory) under "auto", from
        the given directory under a path; nothing under "vllm" or without the file."""
        if self.generation_config == "vllm":
            return {}
        folder = model_dir if self.generation_config == "auto" else self.generation_config
        file = Path(folder).expanduser() / "generation_config.json"
        try:
            config = json.loads(file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {file}: {e}") from e
        defaults = {
            ours: config[key]
            for key, ours in GENERATION_CONFIG_DEFAULTS.items()
            if isinstance(config, dict) and config.get(key) is not None
        }
        if defaults:
            logger.info(
                "default sampling parameters from %s, for requests that do not set them: %s "
                "(generation_config='vllm' / --generation-config vllm turns this off)",
                file, defaults,
            )
        return defaults

    def _either(self, name: str, vllm_name: str) -> int | None:
        """An option given under our name or vLLM's (both: they must agree)."""
        ours, vllms = getattr(self, name), getattr(self, vllm_name)
        if ours is not None and vllms is not None and ours != vllms:
            raise ValueError(f"{name}={ours} and {vllm_name}={vllms} disagree: give one")
        return vllms if ours is None else ours

    def create_configs(
        self, model_max_len: int, on_gpu: bool
    ) -> tuple[SchedulerConfig, CacheConfig]:
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context length {model_max_len}"
            )
        batched = self.max_num_batched_tokens
        if batched is None:
            batched = 8192 if on_gpu else 2048
            if not self.enable_chunked_prefill:
                batched = max(batched, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=batched,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
            async_scheduling=self.async_scheduling,
        )
        kv_cache_memory = self._either("kv_cache_memory", "kv_cache_memory_bytes")
        if kv_cache_memory is None and on_gpu and self.gpu_memory_utilization is not None:
            kv_cache_memory = _gpu_kv_cache_budget(self.gpu_memory_utilization)
        cache_config = CacheConfig(
            block_size=self.block_size,
            num_gpu_blocks=self._either("num_gpu_blocks", "num_gpu_blocks_override"),
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=self.enable_prefix_caching,
        )
        return scheduler_config, cache_config


def _gpu_kv_cache_budget(utilization: float) -> int:
    """vLLM's gpu_memory_utilization: the KV cache gets what the weights (loaded by now) and
    everything else on the GPU leave of `utilization` of its memory."""
    import torch  # here only: this module is plain data otherwise

    free, total = torch.cuda.mem_get_info()
    return int(total * utilization) - (total - free)
