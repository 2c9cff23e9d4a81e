"""Encoder-only (bidirectional) attention in torch: the torch backend's ENCODER_ONLY mode, and
the reference of the Triton kernel's bidirectional variant.

Every sequence is whole in its step and attends to its own fresh K/V; the KV cache is not
touched. Sequences are sorted by length and padded into buckets (MAX_PAD_FRACTION,
BUCKET_TOKENS), one SDPA call per bucket under a key-padding mask, planned once per step in
`AttentionMetadata.plans` (docs/design.md, "Attention on the CPU").
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from v1.attention.backends.abstract import AttentionMetadata

# A bucket's padded slots may be at most this fraction padding...
MAX_PAD_FRACTION = 0.2
# ... and hold at most this many slots (or one sequence, if it is longer).
BUCKET_TOKENS = 8192


@dataclass(slots=True)
class _Bucket:
    num_seqs: int
    seq_len: int  # the longest of the bucket; every sequence padded to it
    index: torch.Tensor  # int64 [num_seqs * seq_len]: each padded slot's row (padding: row 0)
    rows: torch.Tensor  # int64 [n]: the real rows, in slot order
    keep: torch.Tensor | None  # int64 [n]: the real slots (None: no padding)
    mask: torch.Tensor | None  # bool [num_seqs, 1, 1, seq_len], True: a real key (None: none)


_PLAN_KEY = "encoder buckets"  # in `AttentionMetadata.plans`


def _plan(metadata: AttentionMetadata, device: torch.device) -> list[_Bucket]:
    cached = metadata.plans.get(_PLAN_KEY)
    if cached is not None:
        return cached
    starts = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
    lens = starts[1:] - starts[:-1]
    if (lens != metadata.seq_lens_cpu).any():
        raise ValueError("encoder-only attention needs every sequence whole in one step "
                         "(no chunked prefill, no prefix caching)")
    order = [int(i) for i in np.argsort(-lens, kind="stable") if lens[i] > 0]
    buckets = []
    i = 0
    while i < len(order):
        longest = int(lens[order[i]])
        members = [order[i]]
        real = longest
        while i + len(members) < len(order):
            n = int(lens[order[i + len(members)]])
            slots = (len(members) + 1) * longest
            if slots > BUCKET_TOKENS or (slots - real - n) > MAX_PAD_FRACTION * slots:
                break
            members.append(order[i + len(members)])
            real += n
        i += len(members)
        buckets.append(_bucket(members, starts, lens, longest, device))
    metadata.plans[_PLAN_KEY] = buckets
    return buckets


def _bucket(members: list[int], starts: np.ndarray, lens: np.ndarray, longest: int,
            device: torch.device) -> _Bucket:
    offsets = np.arange(longest)
    valid = offsets[None, :] < lens[members][:, None]  # [B, L]
    index = np.where(valid, starts[members][:, None] + offsets[None, :], 0).reshape(-1)
    flat_valid = valid.reshape(-1)
    padded = not bool(flat_valid.all())

    def on_device(x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    return _Bucket(
        num_seqs=len(members),
        seq_len=longest,
        index=on_device(index),
        rows=on_device(index[flat_valid]),
        keep=on_device(np.flatnonzero(flat_valid)) if padded else None,
        mask=on_device(valid[:, None, None, :]) if padded else None,
    )


def encoder_attention(
    query: torch.Tensor,  # [T, h, d]
    key: torch.Tensor,  # [T, kvh, d]
    value: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Bidirectional attention of each sequence over itself: the step's rows
    [query_start_loc[r], query_start_loc[r + 1]) are all of sequence r's tokens."""
    out = query.new_empty(*query.shape)
    for b in _plan(metadata, query.device):
        o = F.scaled_dot_product_attention(
            _padded(query, b), _padded(key, b), _padded(value, b), attn_mask=b.mask,
            scale=scale, enable_gqa=True,
        )
        o = o.transpose(1, 2).reshape(b.num_seqs * b.seq_len, *query.shape[1:])
        out.index_copy_(0, b.rows, o if b.keep is None else o.index_select(0, b.keep))
    return out


def _padded(x: torch.Tensor, b: _Bucket) -> torch.Tensor:
    """Rows [T, heads, d] of the bucket's sequences as [B, heads, L, d], padding included."""
    return x.index_select(0, b.index).view(b.num_seqs, b.seq_len, *x.shape[1:]).transpose(1, 2)
