"""Attention on the GPU with Triton: one cache-write kernel and one unified attention kernel.

`forward` writes this step's K/V at `slot_mapping` (negative slots are padding, skipped), then
runs one launch of the unified kernel over the packed batch (windowed if the layer is;
`causal=False` for encoder-only layers). Same contract as `TorchAttentionImpl`, its reference;
without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1). A 16-bit `kv_cache_dtype`
under an fp32 model attends as a 16-bit model does, unlike the CPU path (docs/models.md).
"""

import torch

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata, AttentionType
from v1.attention.ops.triton_reshape_and_cache import reshape_and_cache
from v1.attention.ops.triton_unified_attention import unified_attention


class TritonAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        reshape_and_cache(key, value, kv_cache, metadata.slot_mapping)
        out = query.new_empty(query.shape)
        return unified_attention(query, kv_cache, out, metadata, self.scale,
                                 sliding_window=self.sliding_window,
                                 causal=self.attn_type != AttentionType.ENCODER_ONLY)
