"""Attention in plain torch: the CPU backend and the reference for the Triton kernels."""

import torch
import torch.nn.functional as F

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    n = slot_mapping.shape[0]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, key[:n])
    flat[1].index_copy_(0, slot_mapping, value[:n])


class TorchAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return paged_attention_reference(query, kv_cache, metadata, self.scale)


def paged_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Per request: gather its context K/V from the blocks, then causal SDPA (GQA aware)."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu
    for r, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        q_start, q_end = int(starts[r]), int(starts[r + 1])
        q_len = q_end - q_start
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_table[r, :num_blocks].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]  # [seq_len, kvh, d]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
        q = query[q_start:q_end].transpose(0, 1)  # [h, q_len, d]
        # Query i sits at position seq_len - q_len + i and sees keys up to there.
        mask = None
        if q_len > 1:
            pos_q = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
            mask = torch.arange(seq_len).unsqueeze(0) <= pos_q
        o = F.scaled_dot_product_attention(
            q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
            enable_gqa=True,
        )
        out[q_start:q_end] = o.transpose(0, 1)
    return out
