"""`LoRARequest`: which adapter a request runs with, as vLLM's `vllm.lora.request`."""

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True, frozen=True):
    """An adapter for one or more requests: `lora_name` (what the server's `model` field
    names it by), `lora_int_id` (>= 1, the engine's key for it: the adapter LRU, the GPU
    slots and the prefix cache's block hashes are keyed by it, so one id must always mean
    one adapter), and `lora_path`, a PEFT adapter folder (`adapter_config.json` and
    `adapter_model.safetensors`). `base_model_name`: the model it adapts (informational, as
    vLLM's; `/v1/models` lists it as the adapter's parent).

    Equal and hashed by name, as vLLM's.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or not (
            1 <= self.lora_int_id < 2**63
        ):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError(f"LoRA {self.lora_name!r}: lora_path must not be empty")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
