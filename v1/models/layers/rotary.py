"""Rotary position embeddings: the frequencies of each `rope_type` (default, linear, dynamic,
llama3, yarn), computed with transformers' own operations in the same order so the tables
match it bit for bit in fp32, and a cos/sin table for every position the model can see.

`dynamic` is the unscaled table here: transformers rescales only past
`max_position_embeddings`, which `max_model_len` never exceeds. `longrope` (Phi-3 128k) is
refused: it switches tables by the batch's length, which cached keys cannot follow.
"""

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of one layer type as one dict with at least `rope_type` and
    `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters`, nested by layer type for models
    whose layer types differ (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}});
    older configs (and config.json files written by them) use `config.rope_theta` plus an
    optional `config.rope_scaling` dict whose type key is `rope_type` or the older `type`.
    Merge whatever is there.
    """
    params: dict[str, Any] = {}
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(config, attr, None)
        if not isinstance(value, dict):
            continue
        if layer_type is not None and isinstance(value.get(layer_type), dict):
            value = value[layer_type]
        elif any(isinstance(v, dict) for v in value.values()):
            raise ValueError(
                f"config.{attr} is given per layer type ({sorted(value)}); "
                f"ask for one of them, not {layer_type!r}"
            )
        params.update(value)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def rope_inv_freq(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2] in fp32, attention scaling of cos and sin) for
    one set of `rope_parameters`, exactly as transformers computes them."""
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim

    if rope_type == "default":
        return 1.0 / (base**exponents), 1.0
    if rope_type == "linear":
        return 1.0 / (base**exponents) / params["factor"], 1.0
    if rope_type == "dynamic":
        # transformers' formula at seq_len = max_position_embeddings (see the module doc).
        factor = params["factor"]
        seq_len = max_position_embeddings
        base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return 1.0 / (base**exponents), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(1.0 / (base**exponents), params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, base, dim, max_position_embeddings)
    raise ValueError(
        f"unsupported rope type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: leave high frequencies alone, divide low ones by `factor`, and blend
    smoothly in between (wavelengths measured against the original context length)."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    params: dict[str, Any], base: float, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly between
    the dimensions that make `beta_fast` and `beta_slow` turns over the original context;
    cos and sin are scaled by the attention factor (0.1 ln(factor) + 1 by default)."""
    original = params.get("original_max_position_embeddings", max_position_embeddings)
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """RoPE in the neox / HF "rotate_half" layout: dimension i pairs with i + head_dim / 2.

    Holds a cos/sin table for positions [0, max_position), built once: one fp32 product
    position * inv_freq per entry, the same one transformers computes per step.
    """

    def __init__(
        self,
        params: dict[str, Any],
        head_dim: int,
        max_position_embeddings: int,
        max_position: int,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(params, head_dim, max_position_embeddings)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
        # The tables `ops.rope` reads, [max_position, 1, head_dim]: cat(cos, cos) and
        # cat(-sin, sin), in fp32 whatever the model dtype (cast per step, like transformers).
        # Stored whole (twice the memory of cos and sin: 64 MB for 128K positions of 64),
        # a step's are one index each: built per step, they cost 7 ops of a decode step.
        self.register_buffer(
            "cos_table", torch.cat((cos, cos), -1).unsqueeze(1).to(device), persistent=False
        )
        self.register_buffer(
            "sin_table", torch.cat((-sin, sin), -1).unsqueeze(1).to(device), persistent=False
        )

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tables for `ops.rope`, [T, 1, head_dim] each: cat(cos, cos) and
        cat(-sin, sin). Built once per forward and shared by every layer that uses them."""
        cos, sin = self.cos_table[positions], self.sin_table[positions]
        if dtype != torch.float32:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin
