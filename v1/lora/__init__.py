"""LoRA adapters served beside the base model (vLLM's multi-LoRA): `LoRARequest` names an
adapter for a request; `v1.lora.peft` reads PEFT adapter folders; `v1.lora.layers` wraps the
model's linear layers to add each row's adapter delta in one batched pass;
`v1.lora.worker_manager` keeps the adapters loaded (LRU) and in which slot each runs.

Layering: `request.py` is a shared type (it imports nothing of the engine); the rest sits
beside `v1.models` (it reads `v1.models.layers`) and is used by the worker and the engine
core, never by `v1.core`.
"""

from v1.lora.request import LoRARequest

__all__ = ["LoRARequest"]
