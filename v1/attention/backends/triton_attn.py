"""Attention on the GPU with Triton: one cache-write kernel and one unified attention kernel.

`forward` writes this step's K/V into the paged cache at `slot_mapping` (negative slots are
padding, skipped), then runs one launch of the unified kernel over the whole packed batch,
masked by the layer's sliding window if any; encoder-only layers run it with `causal=False`.
Same contract as `TorchAttentionImpl`, its reference. Without a GPU the kernels run only in
Triton's interpreter (TRITON_INTERPRET=1 set before the ops are imported), on CPU tensors.

With a `kv_cache_dtype` other than the model's, the write casts K/V to it (fp16 saturating) and
attention casts the query to it, accumulating in fp32 and storing the output in the query's
dtype: an fp32 model with a 16-bit cache attends as a 16-bit model does (unlike the CPU path).
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
