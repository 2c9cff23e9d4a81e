"""`LoRARequest`: which adapter a request runs with, as vLLM's `vllm.lora.request`."""

import os

import msgspec


class LoRARequest(msgspec.Struct, omit_defaults=True, array_like=True, frozen=True):
    """An adapter for one or more requests: `lora_name` (what the server's `model` field
    names it by), `lora_int_id` (>= 1, the engine's key for it: the adapter LRU, the GPU
    slots and the prefix cache's block hashes are keyed by it, so one id must always mean
    one adapter), and `lora_path`, a PEFT adapter folder (`adapter_config.json` and
    `adapter_model.safetensors`). `base_model_name`: the model it adapts (informational, as
    vLLM's; `/v1/models` lists it as the adapter's parent).

    Equal and hashed by name, as vLLM's. The fields are checked here, in the caller's
    process: a name or path of another type would fail only when sent to an engine-core
    process (a `pathlib.Path` path is taken as its text).
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
        if isinstance(self.lora_path, os.PathLike):
            msgspec.structs.force_setattr(self, "lora_path", os.fspath(self.lora_path))
        for field in ("lora_name", "lora_path", "base_model_name"):
            value = getattr(self, field)
            if not isinstance(value, str) and not (field == "base_model_name" and value is None):
                raise ValueError(f"LoRARequest {field} must be a str, got {value!r}")
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
