"""Attention on the GPU with Triton: one cache-write kernel and one unified attention kernel.

`forward` writes this step's K/V into the paged cache at `slot_mapping` (negative slots are
padding and skipped), then runs a single launch of the unified paged-attention kernel over the
whole packed batch (prefill chunks with cached context and decodes together), masked by the
layer's sliding window if it has one (a constexpr of the kernel). Same contract as
`TorchAttentionImpl`, which is its reference. Without a GPU the kernels only run in Triton's
interpreter (TRITON_INTERPRET=1 set before the ops are imported), on CPU tensors.

The cache may hold another dtype than the model's (kv_cache_dtype): the write casts K/V to
it on store (into fp16, saturating), and attention casts the query to it on load, runs its
dots in it with fp32 accumulation, and stores the output in the query's dtype. So an fp32
model with a 16-bit cache attends as a 16-bit model does (query and P rounded too, unlike
the CPU path).

Encoder-only layers (bidirectional, BERT family) write their K/V the same way and run the
same kernel without the causal mask (`causal=False`): each sequence is whole in its step.
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
