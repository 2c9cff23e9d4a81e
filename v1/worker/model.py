"""The Llama-family decoder for paged attention.

One forward runs every scheduled token of the step (prefill chunks and decodes of many
requests, packed into one flat [T] batch); the attention backend sorts out which token sees
which context through the paged KV cache and `AttentionMetadata`. Everything else in the model
is per token, so it needs no notion of requests at all.

Layout differences from transformers' `LlamaForCausalLM`, all for speed:
- q/k/v projections are one `qkv_proj` matmul and gate/up one `gate_up_proj` matmul;
  `load_weights` takes HF-named tensors and copies each into its slice of the fused weight.
- RoPE reads a cos/sin table precomputed for every position instead of recomputing it.
Parameters are created uninitialised (`skip_init`): an inference model always gets its
weights from a checkpoint, and random init of 135M parameters would cost a second per load.
"""

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata
from v1.worker.ops import StepOps, ops_for_step


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings as one dict with at least `rope_type` and `rope_theta`.

    transformers 5 keeps them in `config.rope_parameters`; older configs (and config.json files
    written by them) use `config.rope_theta` plus an optional `config.rope_scaling` dict whose
    type key is `rope_type` or the older `type`. Merge whatever is there.
    """
    params: dict[str, Any] = {}
    for attr in ("rope_scaling", "rope_parameters"):
        value = getattr(config, attr, None)
        if isinstance(value, dict):
            params.update(value)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def rope_inv_freq(config: Any, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, computed exactly as transformers does so
    that the cos/sin tables (and hence logits) match it bit for bit."""
    params = rope_parameters(config)
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for Llama models")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponents)

    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        # Llama 3.1: leave high frequencies alone, divide low ones by `factor`, and blend
        # smoothly in between (wavelengths measured against the original context length).
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """RoPE in the neox / HF "rotate_half" layout: dimension i pairs with i + head_dim / 2."""

    def __init__(self, config: Any, head_dim: int, max_position: int, device: torch.device):
        super().__init__()
        inv_freq = rope_inv_freq(config, head_dim)
        # position * inv_freq is one fp32 product, the same one transformers computes per step.
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Kept in fp32 whatever the model dtype; cast per step, like transformers.
        self.register_buffer("cos_cache", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(device), persistent=False)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's tables for `rope` (see `ops`), [T, 1, head_dim] each: cat(cos, cos)
        and cat(-sin, sin). Built once per forward and shared by every layer."""
        cos = self.cos_cache[positions].to(dtype)
        sin = self.sin_cache[positions].to(dtype)
        return torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)


def _onednn_linear_available() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        ) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN_LINEAR = _onednn_linear_available()


class PackedWeight:
    """A oneDNN-prepacked copy of a [out, in] fp32 weight for small-batch matmuls on CPU.

    MKL (behind F.linear) repacks the weight on every call, which costs a decode batch of
    64 rows about a quarter of its GEMM time; oneDNN multiplies against a copy packed once
    (for a batch of ~64 rows) in 20-35% less time up to ~128 rows (measured here: 30 layers
    at 64 rows 145 -> 111 ms, the LM head 37 -> 27 ms). For big batches (prefill) MKL is as
    fast or faster, so callers use this only for small ones. The copy is rebuilt when the
    weight changes in place (new weights loaded) and costs one more weight's memory.
    """

    __slots__ = ("_key", "_packed")

    BATCH_HINT = 64
    MAX_ROWS = 128  # above this, F.linear (MKL)

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._packed: torch.Tensor | None = None

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
        max_rows: int = MAX_ROWS,
    ) -> torch.Tensor:
        if (
            not _ONEDNN_LINEAR
            or x.dim() != 2
            or x.shape[0] > max_rows
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or weight.dtype != torch.float32
        ):
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            with torch.inference_mode(False), torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(
                    weight.detach(), self.BATCH_HINT
                )
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self._packed, bias, "none", [], ""
        )


class Linear(nn.Linear):
    """nn.Linear whose small CPU batches go through a prepacked weight (`PackedWeight`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """The weight and eps of an RMSNorm; the step's `ops.rms_norm` applies them."""

    def __init__(self, hidden_size: int, eps: float, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, ops: StepOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        attn_impl_cls: type[AttentionImpl],
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = skip_init(
            Linear, config.hidden_size, self.q_size + 2 * self.kv_size,
            bias=bias, device=device, dtype=dtype,
        )
        self.o_proj = skip_init(
            Linear, self.q_size, config.hidden_size, bias=bias, device=device, dtype=dtype
        )
        # The backend is plain Python (not a module): it owns no parameters, only shapes.
        self.attn = attn_impl_cls(
            self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5
        )

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        ops: StepOps,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        # q and k are adjacent in the fused output: rotate both heads' sets in one go.
        qk = qkv[:, : self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim
        )
        qk = ops.rope(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        # The backend writes k/v into the paged cache and expands kv heads for GQA itself.
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, device: torch.device, dtype: torch.dtype):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for a Llama model (expected silu)")
        self.intermediate_size = config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = skip_init(
            Linear, config.hidden_size, 2 * self.intermediate_size,
            bias=bias, device=device, dtype=dtype,
        )
        self.down_proj = skip_init(
            Linear, self.intermediate_size, config.hidden_size,
            bias=bias, device=device, dtype=dtype,
        )

    def forward(self, x: torch.Tensor, ops: StepOps) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: Any,
        attn_impl_cls: type[AttentionImpl],
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.self_attn = LlamaAttention(config, attn_impl_cls, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        ops: StepOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual blocks, as transformers computes them, with each residual add
        moved into the norm after it: takes and returns (block output, residual stream before
        that output is added); the first layer gets residual None."""
        x, residual = self.input_layernorm(hidden_states, residual, ops)
        x = self.self_attn(rope, x, kv_cache, attn_metadata, ops)
        x, residual = self.post_attention_layernorm(x, residual, ops)
        return self.mlp(x, ops), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        attn_impl_cls: type[AttentionImpl],
        max_position: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.embed_tokens = skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_impl_cls, device, dtype)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        # One table shared by all layers: positions are the same in every layer.
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_position, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        ops = ops_for_step(hidden_states)
        rope = self.rotary_emb.cos_sin(positions, hidden_states.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                rope, hidden_states, residual, kv_cache, attn_metadata, ops
            )
        return self.norm(hidden_states, residual, ops)[0]


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head. `forward` returns final hidden states for every token; the
    runner picks the rows it samples from and calls `compute_logits` on just those."""

    def __init__(
        self,
        config: Any,
        attn_impl_cls: type[AttentionImpl],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_position: int | None = None,
    ):
        super().__init__()
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.max_position = max_position or config.max_position_embeddings
        self.model = LlamaModel(config, attn_impl_cls, self.max_position, device, dtype)
        # Tied: the LM head is the embedding matrix itself (compute_logits reads it there).
        self.lm_head: nn.Linear | None = None
        if not self.tie_word_embeddings:
            self.lm_head = skip_init(
                nn.Linear, config.hidden_size, config.vocab_size,
                bias=False, device=device, dtype=dtype,
            )
        self._packed_head = PackedWeight()  # the LM head's (possibly tied) weight, packed
        # Inference only: no autograd bookkeeping on any parameter.
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[torch.Tensor],  # one per layer, kv_cache_shape(...)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # fp32 [N, vocab]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # The rows are the sampled tokens only (at most max_num_seqs): pack at any count.
        return self._packed_head.linear(hidden_states, weight, None, max_rows=1 << 16).float()

    # ---- weight loading -----------------------------------------------------------------

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        """HF projection name -> (our fused projection, first row, end row) in that weight."""
        q = self.config.num_attention_heads * head_dim_of(self.config)
        kv = self.config.num_key_value_heads * head_dim_of(self.config)
        inter = self.config.intermediate_size
        return {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, q + kv),
            "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, 2 * inter),
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the
        parameters, each q/k/v and gate/up tensor into its slice of the fused weight.
        Raises if a parameter was never written, since parameters start uninitialised."""
        params = dict(self.named_parameters())
        shards = self._fused_shards()
        # Rows still unwritten per parameter: fused ones arrive in pieces.
        pending: dict[str, int] = {name: p.shape[0] for name, p in params.items()}
        for hf_name, tensor in weights:
            name = hf_name
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints saved this derived buffer; we build our own
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            # e.g. model.layers.3.self_attn.k_proj.weight -> ...qkv_proj.weight, rows [q, q+kv)
            parts = name.split(".")
            rows: tuple[int, int] | None = None
            if len(parts) >= 2 and parts[-2] in shards:
                fused, start, end = shards[parts[-2]]
                name = ".".join([*parts[:-2], fused, parts[-1]])
                rows = (start, end)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
            dst = params[name].data
            if rows is not None:
                dst = dst[rows[0] : rows[1]]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            pending[name] -= dst.shape[0]
        missing = sorted(name for name, rows_left in pending.items() if rows_left != 0)
        if missing:
            raise ValueError(f"checkpoint lacks (or repeats) weights for: {missing}")


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
