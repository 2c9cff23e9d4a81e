"""The LoRA group: how many adapters one step runs and memory keeps, and their largest rank."""

from dataclasses import dataclass

from v1.config.checks import check_ints


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """LoRA serving (vLLM's options): `max_loras` adapters run in one step (the GPU slots),
    each of rank <= `max_lora_rank`; `max_cpu_loras` (>= max_loras) stay loaded in memory,
    least recently used evicted beyond that."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1

    def __post_init__(self) -> None:
        check_ints(self, ("max_loras", "max_lora_rank", "max_cpu_loras"))
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
