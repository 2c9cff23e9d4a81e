"""The engine's configuration: one validated dataclass per group (`ModelConfig`, `CacheConfig`,
`SchedulerConfig`, `ParallelConfig`, `SpeculativeConfig`, `InputLimits`, `LoRAConfig`), each
checking its own values when made (ValueError naming the option, its bound and the value), and
`EngineArgs`, vLLM's flat option names mapped onto them; `VllmConfig` holds one engine's groups
(as vLLM's).

Plain data: no torch, no environment reads (`v1.envs`), no directories made; every layer may
import it.
"""

from v1.config.cache import (
    DEFAULT_KV_CACHE_DISK_BYTES,
    KV_CACHE_DTYPES,
    CacheConfig,
    kv_cache_dtype_name,
    load_preload_prompts,
)
from v1.config.engine_args import EngineArgs
from v1.config.limits import DEFAULT_LIMITS, InputLimits
from v1.config.lora import LoRAConfig
from v1.config.model import (
    DTYPES,
    NO_QUANTIZATION,
    QUANTIZATION_METHODS,
    RUNNER_TYPES,
    ModelConfig,
    PoolerConfig,
    dtype_name,
)
from v1.config.parallel import DP_ROUTING_POLICIES, ParallelConfig
from v1.config.scheduler import SCHEDULING_POLICIES, SchedulerConfig
from v1.config.speculative import SpeculativeConfig
from v1.config.vllm import VllmConfig

__all__ = [
    "DEFAULT_KV_CACHE_DISK_BYTES", "DEFAULT_LIMITS", "DP_ROUTING_POLICIES", "DTYPES",
    "KV_CACHE_DTYPES", "NO_QUANTIZATION", "QUANTIZATION_METHODS", "RUNNER_TYPES",
    "SCHEDULING_POLICIES", "CacheConfig", "EngineArgs", "InputLimits", "LoRAConfig",
    "ModelConfig", "ParallelConfig", "PoolerConfig", "SchedulerConfig", "SpeculativeConfig",
    "VllmConfig", "dtype_name", "kv_cache_dtype_name", "load_preload_prompts",
]
