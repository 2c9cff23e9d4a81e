"""The attention backend interface: what the model runner hands a backend each step.

The paged KV cache of one layer is one tensor:

    kv_cache[0] = K, kv_cache[1] = V, each [num_blocks, block_size, num_kv_heads, head_size]

Token `t` of a request lives in block `block_table[req, t // block_size]` at offset
`t % block_size`; `slot_mapping[i] = block * block_size + offset` for each new token `i`.
Request `r` owns query rows `query_start_loc[r] : query_start_loc[r + 1]`, its last `q_len`
positions of `seq_lens[r]`. DECODER attention is causal within the new tokens and sees all the
context; ENCODER_ONLY is bidirectional, each sequence whole in its step. With
`sliding_window=w` a query at i sees keys i - w < j <= i (transformers' meaning; it only masks).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on the device
    seq_lens: torch.Tensor  # int32 [num_reqs], on the device
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], on the device
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], on the device
    # Host copies, for backends that plan work on the CPU.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    # Per request: whether the step's tokens are all generated ones (a decode, or a verify
    # step's token and drafts), not prompt tokens; None: unknown (taken as prompt tokens).
    generated_cpu: np.ndarray | None = None
    # The backend's plans of this step (what every layer's call shares), keyed by what they
    # depend on: made once per step, before the forward where the runner plans the step,
    # and read by every layer. They live and die with this value: no cache outside it.
    plans: dict[Any, Any] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        query_lens: np.ndarray,  # int [num_reqs]: this step's tokens per request
        seq_lens: np.ndarray,  # int [num_reqs]: their lengths after this step
        block_table: np.ndarray | torch.Tensor,
        slot_mapping: np.ndarray | torch.Tensor,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """The metadata of requests in query order, tensors copied to `device`."""
        query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = np.asarray(seq_lens, dtype=np.int32)

        def on_device(x: np.ndarray | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(x).to(device, non_blocking=True)

        return cls(
            num_actual_tokens=int(query_start_loc[-1]),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=on_device(query_start_loc),
            seq_lens=on_device(seq_lens),
            block_table=on_device(block_table),
            slot_mapping=on_device(slot_mapping),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_size)


class AttentionType:
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


ATTENTION_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY)


class AttentionImpl(ABC):
    """One layer's attention over the paged cache; stateless apart from its shapes."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        attn_type: str = AttentionType.DECODER,
    ):
        # Every backend reads query head h from kv head h // (num_heads // num_kv_heads).
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of {num_kv_heads}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be None or at least 1, not {sliding_window}")
        if attn_type not in ATTENTION_TYPES:
            raise ValueError(f"attn_type must be one of {ATTENTION_TYPES}, got {attn_type!r}")
        if attn_type == AttentionType.ENCODER_ONLY and sliding_window is not None:
            raise ValueError("an encoder-only layer has no sliding window")
        self.attn_type = attn_type
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        # Keys this far back or further are hidden: i - j < sliding_window (None: global).
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # kv_cache_shape(...)
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Write this step's K/V into the cache at `slot_mapping`, then attend."""
