"""LoRA adapters served beside the base model (vLLM's multi-LoRA): `request.LoRARequest` names a
request's adapter (a shared type, importing nothing of the engine); `peft` reads adapter
folders; `layers` adds each row's adapter delta in one batched pass; `worker_manager` keeps
adapters loaded (LRU) and in slots. Beside `v1.models`, used by the worker and engine core,
never by `v1.core`.
"""

from v1.lora.request import LoRARequest

__all__ = ["LoRARequest"]
