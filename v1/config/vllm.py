"""vLLM's `VllmConfig`: every group of one engine's configuration in one object, as vLLM
hands it to a custom logits processor (`LogitsProcessor.__init__(vllm_config, ...)`)."""

from dataclasses import dataclass

from v1.config.cache import CacheConfig
from v1.config.lora import LoRAConfig
from v1.config.model import ModelConfig
from v1.config.parallel import ParallelConfig
from v1.config.scheduler import SchedulerConfig
from v1.config.speculative import SpeculativeConfig


@dataclass(frozen=True, slots=True)
class VllmConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    speculative_config: SpeculativeConfig | None = None
    lora_config: LoRAConfig | None = None
