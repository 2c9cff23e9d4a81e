"""Attention in plain torch: the CPU backend, and the reference for the Triton kernels.

Two implementations of the contract in `abstract.py`, equal up to float rounding:
`paged_attention_reference` (per request, gather its context K/V and run causal SDPA: short,
obviously right, the others are tested against it) and `paged_attention`, what
`TorchAttentionImpl` runs: planned once per step (`torch_plan.AttentionPlan`), with decode
buckets, cascade, and the C paged-decode kernel (`v1.kernels.attention`, which also writes the
step's K/V, the same bits as `write_kv_cache`) where it serves the step. A 16-bit cache under an
fp32 model is widened on every read; arithmetic stays fp32. Encoder-only layers run
`torch_encoder.encoder_attention`. Each path and its cost: docs/design.md, "Attention on the CPU".
"""

import torch
import torch.nn.functional as F

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata, AttentionType
from v1.attention.backends.torch_encoder import encoder_attention
from v1.attention.backends.torch_plan import AttentionPlan, CascadeGroup, DecodeBucket, PrefillCall

# fp16's largest finite value. K/V beyond it are stored saturated, as vLLM's fp8 cache writes
# saturate: an inf key or value would make the softmax, and every later output, NaN.
_FP16_MAX = torch.finfo(torch.float16).max


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the cache's dtype (a no-op when it is the model's); into fp16, saturating."""
    if x.dtype == dtype:
        return x
    x = x.to(dtype)
    if dtype == torch.float16:
        x.clamp_(-_FP16_MAX, _FP16_MAX)  # after the cast: in place on the copy; NaN stays
    return x


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token i's K/V at flat slot `slot_mapping[i]`; a negative slot is padding and
    stores nothing. Rows of key/value beyond `len(slot_mapping)` are ignored."""
    n = slot_mapping.shape[0]
    key, value = key[:n], value[:n]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    # Converted to the cache's dtype here, once.
    flat[0].index_copy_(0, slot_mapping, _to_cache_dtype(key, kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, _to_cache_dtype(value, kv_cache.dtype))


def paged_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Per request: gather its context K/V from the blocks (in the query's dtype), then
    causal SDPA (GQA aware), hiding keys `sliding_window` or more positions back if a
    window is given."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu
    for r, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        q_start, q_end = int(starts[r]), int(starts[r + 1])
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_table[r, :num_blocks].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].to(query.dtype)  # [seq_len, kvh, d]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].to(query.dtype)
        # Query i sits at position seq_len - q_len + i and sees keys up to there (and, with a
        # window, only the last `sliding_window` of those).
        mask = None
        windowed = sliding_window is not None and sliding_window < seq_len
        if q_len > 1 or windowed:
            pos_q = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            pos_k = torch.arange(seq_len, device=query.device).unsqueeze(0)
            mask = pos_k <= pos_q
            if windowed:
                mask &= pos_q - pos_k < sliding_window
        o = F.scaled_dot_product_attention(  # [1, h, q_len, d]
            query[q_start:q_end].transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


class TorchAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        if self.attn_type == AttentionType.ENCODER_ONLY:
            return encoder_attention(query, key, value, metadata, self.scale)
        plan = AttentionPlan.for_step(
            metadata, kv_cache, self.num_heads, self.sliding_window, query.dtype
        )
        if plan.native_write(key, value, metadata.slot_mapping) is not None:
            # The C kernel stores the K/V and attends in one call (it runs before any other
            # part of the step's attention reads the cache).
            return paged_attention(query, key, value, kv_cache, plan, self.scale, write=True)
        write_step_kv(plan, key, value, kv_cache, metadata.slot_mapping)
        return paged_attention(query, key, value, kv_cache, plan, self.scale)


def write_step_kv(
    plan: AttentionPlan, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store the step's K/V: by the plan's C kernel if it can (`plan.native_write`), else
    as `write_kv_cache` (without its padding filter when no slot is padding)."""
    if (native_step := plan.native_write(key, value, slot_mapping)) is not None:
        native_step.kernel(native_step.bound(kv_cache), None, kv_cache, None, None, 0.0,
                           key, value)
        return
    if plan.any_padding_slot:
        write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    n = slot_mapping.shape[0]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, _to_cache_dtype(key[:n], kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, _to_cache_dtype(value[:n], kv_cache.dtype))


def _sdpa_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA on [b, h, q, d] / [b, kvh, k, d] that also returns logsumexp [b, h, q] of the
    scaled, masked scores (natural log). `mask` is additive (float)."""
    if _flash_with_lse is not None:
        out, lse = _flash_with_lse(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    # Portable fallback: the same in plain ops.
    ratio = q.shape[1] // k.shape[1]
    if ratio > 1:
        k, v = k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = scores.logsumexp(-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


# The CPU flash kernel behind SDPA, which also returns the logsumexp (a private aten op:
# looked up once, with the plain-ops fallback above if this torch lacks it).
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _gather(
    kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `blocks`, in order, in `dtype` (the query's; a 16-bit cache is widened
    after the gather, so only the needed blocks are): [len(blocks) * B, kvh, d] each.

    One index_select per cache half along its first dimension (whole blocks, contiguous
    rows): that is the parallel, memcpy-like path; selecting along dim 1 of the [2, ...]
    view runs single-threaded and several times slower.
    """
    two, num_blocks, B, kvh, d = kv_cache.shape
    k = kv_cache[0].view(num_blocks, B * kvh * d).index_select(0, blocks).to(dtype)
    v = kv_cache[1].view(num_blocks, B * kvh * d).index_select(0, blocks).to(dtype)
    return k.view(-1, kvh, d), v.view(-1, kvh, d)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    write: bool = False,
) -> torch.Tensor:
    """The step's attention for query [T, h, d]; key/value are this step's new K/V, already
    in the cache, or with `write` (where `plan.native_write` allows it) stored by the C
    kernel's call first. Matches `paged_attention_reference` up to float rounding; like it,
    it never lets a slot past a sequence's end change the result."""
    # Contiguous whatever the query's strides (empty_like would keep a permuted query's).
    out = query.new_empty(*query.shape)
    lse = None
    if plan.groups:
        lse = torch.empty(query.shape[0], query.shape[1], dtype=torch.float32,
                          device=query.device)
    if (native_decodes := plan.native) is not None:
        native_decodes.kernel(native_decodes.bound(kv_cache), query, kv_cache, out, lse, scale,
                              *((key, value) if write else ()))
    for bucket in plan.decodes:
        _decode_bucket(query, kv_cache, bucket, scale, out, lse)
    for p in plan.prefills:
        _prefill(query, key, value, kv_cache, p, scale, out, lse)
    for g in plan.groups:
        assert lse is not None
        _cascade_group(query, kv_cache, g, scale, out, lse)
    return out


def _decode_bucket(
    query: torch.Tensor, kv_cache: torch.Tensor, bucket: DecodeBucket, scale: float,
    out: torch.Tensor, lse: torch.Tensor | None,
) -> None:
    """One SDPA call for a bucket of decodes (their gathered, padded K/V)."""
    num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], kv_cache.shape[3]
    # A decode's query heads that share a kv head are the rows of one [g, d] query of
    # that kv head: SDPA then reads each K/V row once per kv head, not once per head.
    q = bucket.rows.take(query)
    R = q.shape[0]
    q = q.view(R, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k, v = _gather(kv_cache, bucket.blocks, query.dtype)
    if bucket.pad_rows is not None:
        k.view(k.shape[0], -1).index_fill_(0, bucket.pad_rows, 0.0)
        v.view(v.shape[0], -1).index_fill_(0, bucket.pad_rows, 0.0)
    # [R, kvh, S, d], strided views of the gathered rows
    k = k.view(R, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v.view(R, -1, num_kv_heads, head_dim).transpose(1, 2)
    if lse is None:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, scale=scale)
    else:
        o, o_lse = _sdpa_lse(q, k, v, bucket.mask, scale)
        bucket.rows.put(lse, o_lse.reshape(R, num_heads))
    bucket.rows.put(out, o.reshape(R, num_heads, head_dim))


def _prefill(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    p: PrefillCall, scale: float, out: torch.Tensor, lse: torch.Tensor | None,
) -> None:
    """One SDPA call for a prefill chunk: its fresh K/V, or its gathered context."""
    q = query[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, h, q_len, d]
    if p.blocks is None:  # no context: the fresh K/V are the whole sequence
        k, v = key[p.q_start : p.q_end], value[p.q_start : p.q_end]
    else:
        k, v = _gather(kv_cache, p.blocks, query.dtype)
        k, v = k[: p.seq_len - p.start], v[: p.seq_len - p.start]
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if p.need_lse:
        assert lse is not None
        o, o_lse = _sdpa_lse(q, k, v, p.mask, scale)
        lse[p.q_start : p.q_end] = o_lse[0].transpose(0, 1)
    else:
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True,
        )
    out[p.q_start : p.q_end] = o[0].transpose(0, 1)


def _cascade_group(
    query: torch.Tensor, kv_cache: torch.Tensor, g: CascadeGroup, scale: float, out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """A cascade group's shared prefix, attended once for all its queries and merged into
    what each request's own part gave (by their log-sum-exps)."""
    num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], kv_cache.shape[3]
    group_size = num_heads // num_kv_heads
    k, v = _gather(kv_cache, g.blocks, query.dtype)
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    # No mask here, so the query heads of one kv head can be stacked into one longer
    # query [group_size * Tg, d] of that kv head: fewer, bigger blocks for the kernel.
    q = g.rows.take(query)
    Tg = q.shape[0]
    q = q.view(Tg, num_kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
    q = q.reshape(1, num_kv_heads, group_size * Tg, head_dim)
    o_p, l_p = _sdpa_lse(q, k, v, None, scale)
    o_p = o_p.view(num_kv_heads, group_size, Tg, head_dim).permute(2, 0, 1, 3)
    o_p = o_p.reshape(Tg, num_heads, head_dim)
    l_p = l_p.view(num_kv_heads, group_size, Tg).permute(2, 0, 1).reshape(Tg, num_heads)
    o_r, l_r = g.rows.take(out), g.rows.take(lse)
    g.rows.put(out, torch.lerp(o_r, o_p, torch.sigmoid(l_p - l_r).unsqueeze(-1)))
