"""Self-attention over the paged KV cache: everything between the layer's input norm and its
residual add.

qkv_proj (one matmul, rows q | k | v) -> optional per-head RMSNorm of q and k (Qwen 3,
Gemma 3) -> RoPE on q and k -> the attention backend (which writes K/V into the paged cache,
expands KV heads for GQA and applies the layer's sliding window) -> o_proj.
"""

import torch
from torch import nn

from v1.attention.backends.abstract import AttentionImpl
from v1.models.layers.linear import Linear
from v1.models.layers.norm import RMSNorm
from v1.models.step_plan import StepPlan


class Attention(nn.Module):
    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm_eps: float | None,  # None: no q/k norms
        qk_norm_unit_offset: bool,
        sliding_window: int | None,
        attn_impl_cls: type[AttentionImpl],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.sliding_window = sliding_window
        self.qkv_proj = Linear(
            hidden_size, self.q_size + 2 * self.kv_size,
            bias=qkv_bias, device=device, dtype=dtype,
        )
        self.o_proj = Linear(
            self.q_size, hidden_size, bias=o_bias, device=device, dtype=dtype
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(
                head_dim, qk_norm_eps, device, dtype, unit_offset=qk_norm_unit_offset
            )
            self.k_norm = RMSNorm(
                head_dim, qk_norm_eps, device, dtype, unit_offset=qk_norm_unit_offset
            )
        # The backend is plain Python (not a module): it owns no parameters, only shapes.
        self.attn = attn_impl_cls(
            num_heads, head_dim, num_kv_heads, scale, sliding_window=sliding_window
        )

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor,
        step: StepPlan,
    ) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        ops = step.ops
        qkv = self.qkv_proj(hidden_states, step.rows)
        qk_end = self.q_size + self.kv_size
        if self.q_norm is None or self.k_norm is None:
            # q and k are adjacent in the fused output: rotate both heads' sets in one go.
            qk = qkv[:, :qk_end].view(num_tokens, self.num_heads + self.num_kv_heads, -1)
        else:
            # Per-head norms: each head's vector is a row (copies: the slices are strided).
            q = self.q_norm(qkv[:, : self.q_size].reshape(-1, self.head_dim), None, ops)[0]
            k = self.k_norm(qkv[:, self.q_size : qk_end].reshape(-1, self.head_dim), None, ops)[0]
            qk = torch.cat(
                (q.view(num_tokens, self.num_heads, -1), k.view(num_tokens, self.num_kv_heads, -1)),
                dim=1,
            )
        qk = ops.rope(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn.forward(q, k, v, kv_cache, step.metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size), step.rows)
