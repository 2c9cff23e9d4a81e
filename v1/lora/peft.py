"""PEFT adapter folders: `adapter_config.json` beside `adapter_model.safetensors`, as
`peft`'s `save_pretrained` writes them.

Read: `r`, `lora_alpha`, `use_rslora` (alpha / sqrt(r)) and the A/B tensors of
`TARGET_MODULES`, a module's rank being its A's rows (so `rank_pattern` works). What this engine
cannot apply is a ValueError naming it (DoRA, trained biases, `modules_to_save`,
`alpha_pattern`, embedding or LM-head adapters), rather than served wrong.
"""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from v1.lora.request import LoRARequest

# The HF projections an adapter may target (vLLM's packed modules: q/k/v and gate/up run as
# one fused matmul each here; an adapter may target any subset of them).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
# What a trained adapter's weights are stored in; others (integers, fp8 / fp4 that torch may
# not even convert) are refused rather than cast.
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.("
    + "|".join(TARGET_MODULES)
    + r")\.lora_([AB])\.weight$"
)


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One adapted projection: delta(x) = scale * (x @ lora_a.T) @ lora_b.T."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True, slots=True)
class LoRAModel:
    """A loaded adapter: (layer index, HF projection name) -> its module. `rank`: the
    largest module rank."""

    lora_int_id: int
    lora_name: str
    rank: int
    modules: dict[tuple[int, str], LoRAModule]

    @property
    def nbytes(self) -> int:
        return sum(
            m.lora_a.numel() * m.lora_a.element_size() + m.lora_b.numel() * m.lora_b.element_size()
            for m in self.modules.values()
        )


def _refuse(request: LoRARequest, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {why}")


def _adapter_file(request: LoRARequest, name: str) -> Path | None:
    """The folder's file `name`, None if there is none. A path that cannot be looked at
    (too long, `~user` of no user, no permission) is a ValueError like a missing one,
    never an OSError out of the engine core."""
    try:
        path = Path(request.lora_path).expanduser() / name
        return path if path.is_file() else None
    except (OSError, RuntimeError) as e:
        raise _refuse(request, f"the path cannot be read ({e})") from None


def read_adapter_config(request: LoRARequest) -> dict[str, Any]:
    """The folder's adapter_config.json, checked for what this engine can apply."""
    config_file = _adapter_file(request, CONFIG_NAME)
    if config_file is None:
        raise _refuse(request, f"no {CONFIG_NAME} there (not a PEFT adapter folder)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _refuse(request, f"{CONFIG_NAME} is not readable JSON ({e})") from None
    if not isinstance(config, dict):
        raise _refuse(request, f"{CONFIG_NAME} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _refuse(request, f"peft_type {peft_type!r} is not LORA")
    r, alpha = config.get("r"), config.get("lora_alpha")
    for name, value in (("r", r), ("lora_alpha", alpha)):
        if (
            not isinstance(value, (int, float)) or isinstance(value, bool)
            or not math.isfinite(value) or value <= 0
        ):
            raise _refuse(request, f"{name} must be a positive finite number, got {value!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    refused = [name for name, present in unsupported.items() if present]
    if refused:
        raise _refuse(request, f"{', '.join(refused)} is not supported")
    return config


def load_adapter(
    request: LoRARequest, max_lora_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAModel:
    """Read and check a PEFT folder: a ValueError naming the problem (missing files, a key
    this engine cannot apply, a rank above `max_lora_rank`, A and B that do not pair up).
    Shapes against the model are checked where the model is (`LoRAWorkerManager`)."""
    config = read_adapter_config(request)
    weights_file = _adapter_file(request, WEIGHTS_NAME)
    if weights_file is None:
        raise _refuse(request, f"no {WEIGHTS_NAME} there (only safetensors are read)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights_file)
    except (OSError, SafetensorError) as e:
        raise _refuse(request, f"{WEIGHTS_NAME} is not readable ({e})") from None
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _refuse(
                request, f"tensor {key!r} is not a LoRA A/B weight of "
                f"{', '.join(TARGET_MODULES)} (only those projections can be adapted)",
            )
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = tensor
    if not pairs:
        raise _refuse(request, f"{WEIGHTS_NAME} holds no LoRA weights")
    alpha = float(config["lora_alpha"])
    use_rslora = bool(config.get("use_rslora", False))
    modules: dict[tuple[int, str], LoRAModule] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise _refuse(request, f"layer {layer} {proj} has lora_A or lora_B missing")
        a, b = ab["A"], ab["B"]
        if a.dtype not in WEIGHT_DTYPES or b.dtype not in WEIGHT_DTYPES:
            raise _refuse(
                request, f"layer {layer} {proj}: lora_A is {a.dtype} and lora_B {b.dtype}; "
                f"adapter weights must be one of {', '.join(map(str, WEIGHT_DTYPES))}",
            )
        # Shapes before the rank is read: a 0-d or rank-0 pair is refused, never divided by.
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or a.shape[0] == 0:
            raise _refuse(
                request, f"layer {layer} {proj}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not pair up as [r, in] and [out, r] with r >= 1",
            )
        rank = a.shape[0]
        if rank > max_lora_rank:
            raise _refuse(request, f"rank {rank} exceeds max_lora_rank {max_lora_rank}")
        scale = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        modules[(layer, proj)] = LoRAModule(a.to(dtype), b.to(dtype), scale)
    return LoRAModel(
        request.lora_int_id, request.lora_name, max(m.rank for m in modules.values()), modules
    )
