"""One paged-attention kernel for a whole mixed batch: prefill chunks and decodes in one launch.

Inputs (the contract of `v1/attention/backends/abstract.py`): `query` [num_tokens, num_heads,
head_size], request `r` owning rows `query_start_loc[r] : query_start_loc[r + 1]`, its last
`q_len` positions of `seq_lens[r]`; `kv_cache` [2, num_blocks, block_size, num_kv_heads,
head_size], token `t` of request `r` in block `block_table[r, t // block_size]` at offset
`t % block_size`.

Grid: one program per (query tile, kv head); a tile is `BLOCK_Q` tokens of one request times
the `NUM_QUERIES_PER_KV` query heads of one kv head (`row = token * NUM_QUERIES_PER_KV +
head`). The grid depends only on shapes (CUDA-graph friendly, no device-to-host sync).
`CAUSAL` False: every row sees its whole sequence; `SLIDING_WINDOW` w > 0: row i sees keys
i - w < j <= i (w = 0 compiles the window out). How tiles find their request, walk the keys
and skip the window: docs/design.md, "Attention on a GPU: the Triton kernel".
"""

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from v1.attention.backends.abstract import AttentionMetadata


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest r in [0, num_reqs) with query_start_loc[r] // BLOCK_Q + r <= tile."""
    lo = tile * 0
    hi = lo + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        ok = first_tile <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _attend_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    kv_start,
    kv_end,
    block_table_row_ptr,
    k_head_ptr,
    v_head_ptr,
    stride_c_blk,
    stride_c_off,
    scale_log2,
    offs_d,
    kv_lo,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    offs_n = kv_start + tl.arange(0, TILE_N)
    if MASKED:
        n_valid = offs_n < kv_end
        if SLIDING_WINDOW > 0:
            n_valid = n_valid & (offs_n >= kv_lo)  # before the tile's window: not loaded
        blk = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
    else:
        blk = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE)
    kv_off = blk.to(tl.int64) * stride_c_blk + (offs_n % BLOCK_SIZE) * stride_c_off
    k_ptrs = k_head_ptr + kv_off[None, :] + offs_d[:, None]  # K^T: [HEAD_SIZE_PAD, TILE_N]
    v_ptrs = v_head_ptr + kv_off[:, None] + offs_d[None, :]  # V: [TILE_N, HEAD_SIZE_PAD]

    if MASKED:
        if HEAD_SIZE_PAD != HEAD_SIZE:
            d_valid = offs_d < HEAD_SIZE
            k = tl.load(k_ptrs, mask=n_valid[None, :] & d_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=n_valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None], other=0.0)
    else:
        if HEAD_SIZE_PAD != HEAD_SIZE:
            d_valid = offs_d < HEAD_SIZE
            k = tl.load(k_ptrs, mask=d_valid[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_valid[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)

    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, TILE_N], log2 units
    if MASKED and not CAUSAL:
        # Bidirectional: every row sees the sequence's keys, [0, kv_end = seq_len).
        s = tl.where(offs_n[None, :] < kv_end, s, float("-inf"))
    elif MASKED:
        # Causal: row at absolute position q_pos sees keys 0..q_pos. Every key that passes is
        # also < kv_end for real rows; padding rows are never stored.
        visible = offs_n[None, :] <= q_pos[:, None]
        if SLIDING_WINDOW > 0:
            # ... and only the last SLIDING_WINDOW of them (which are all >= kv_lo).
            visible = visible & (q_pos[:, None] - offs_n[None, :] < SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))

    # Online softmax. Without a window the first tile always holds key 0, which every row
    # sees, so m_i is finite from then on and no row ever computes exp2(-inf - -inf). With a
    # window a row may see none of the first (masked) tiles it meets: exponentiate against 0
    # while its max is still -inf (then alpha = p = 0 and the row stays empty).
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED and SLIDING_WINDOW > 0:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _unified_attention_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    out_ptr,  # [num_tokens, num_heads, head_size]
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    seq_lens_ptr,  # int32 [num_reqs]
    block_table_ptr,  # int32 [num_reqs, max_blocks_per_req]
    num_reqs,
    scale_log2,  # softmax scale * log2(e)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    stride_bt_req,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: global attention
    CAUSAL: tl.constexpr,  # False: bidirectional (encoder-only; no window)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)

    req = _find_request(query_start_loc_ptr, tile, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_tok0 = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q  # first new token of this tile
    if q_tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len

    # Rows: token-major, the NUM_QUERIES_PER_KV heads of this kv head inside.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    tok = q_tok0 + offs_m // NUM_QUERIES_PER_KV
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (tok < q_len)
    io_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_SIZE)
    q_row = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=io_mask,
        other=0.0,
    )
    q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = ctx_len + tok  # absolute position of each row's token

    # Keys [0, full_end) are visible to every row of the tile; the tile needs [0, kv_end).
    if CAUSAL:
        full_end = ctx_len + q_tok0 + 1
        kv_end = ctx_len + tl.minimum(q_tok0 + BLOCK_Q, q_len)
    else:  # every row sees the whole sequence; only the last partial tile is masked
        full_end = seq_len
        kv_end = seq_len
    num_full_tiles = full_end // TILE_N
    num_tiles = tl.cdiv(kv_end, TILE_N)

    block_table_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_req
    k_head_ptr = k_cache_ptr + kv_head * stride_c_head
    v_head_ptr = v_cache_ptr + kv_head * stride_c_head

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], dtype=tl.float32)

    kv_lo = 0  # the first key any row of the tile sees
    first_full = 0  # the unmasked tiles are [first_full, num_full_tiles)
    masked_from = num_full_tiles  # the causal tail: [masked_from, num_tiles)
    if SLIDING_WINDOW > 0:
        # The first row (position full_end - 1) sees keys from full_end - w; the last real
        # row (kv_end - 1) from kv_end - w, so every row sees all of [kv_end - w, full_end).
        kv_lo = tl.maximum(full_end - SLIDING_WINDOW, 0)
        first_tile = kv_lo // TILE_N
        all_see = tl.cdiv(tl.maximum(kv_end - SLIDING_WINDOW, 0), TILE_N)
        first_full = tl.maximum(first_tile, tl.minimum(all_see, num_full_tiles))
        masked_from = tl.maximum(first_full, num_full_tiles)
        for t in range(first_tile, first_full):
            acc, l_i, m_i = _attend_kv_tile(
                acc, l_i, m_i, q, q_pos, t * TILE_N, kv_end, block_table_row_ptr,
                k_head_ptr, v_head_ptr, stride_c_blk, stride_c_off, scale_log2, offs_d, kv_lo,
                BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_SIZE_PAD, True, DOT_PRECISION,
                SLIDING_WINDOW, CAUSAL,
            )
    for t in range(first_full, num_full_tiles):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, t * TILE_N, kv_end, block_table_row_ptr,
            k_head_ptr, v_head_ptr, stride_c_blk, stride_c_off, scale_log2, offs_d, kv_lo,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_SIZE_PAD, False, DOT_PRECISION, SLIDING_WINDOW,
            CAUSAL,
        )
    for t in range(masked_from, num_tiles):
        acc, l_i, m_i = _attend_kv_tile(
            acc, l_i, m_i, q, q_pos, t * TILE_N, kv_end, block_table_row_ptr,
            k_head_ptr, v_head_ptr, stride_c_blk, stride_c_off, scale_log2, offs_d, kv_lo,
            BLOCK_SIZE, TILE_N, HEAD_SIZE, HEAD_SIZE_PAD, True, DOT_PRECISION, SLIDING_WINDOW,
            CAUSAL,
        )

    if SLIDING_WINDOW > 0:
        # Rows past the tile's real tokens may see no key at all (0 / 0); never stored.
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_row[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def _default_tiles(
    num_queries_per_kv: int, max_query_len: int, head_size_pad: int, is_fp32: bool
) -> tuple[int, int]:
    """(BLOCK_M, TILE_N): enough rows for the longest chunk's tile, no more."""
    cap = 128 if head_size_pad <= 64 else 64
    cap = max(cap, triton.next_power_of_2(num_queries_per_kv))
    block_m = triton.next_power_of_2(max(1, num_queries_per_kv * max_query_len))
    block_m = min(max(16, block_m), cap)  # tl.dot needs at least 16 rows
    # fp32 (3xTF32 dots) needs twice the shared memory per tile: narrower KV tiles.
    return block_m, 32 if is_fp32 else 64


def unified_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    out: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    block_m: int | None = None,
    tile_n: int | None = None,
    sliding_window: int | None = None,
    causal: bool = True,
) -> torch.Tensor:
    """Causal paged attention for a packed mixed batch; writes `out` and returns it.

    query, out: [num_tokens, num_heads, head_size] (strided rows allowed, last dim contiguous).
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size], already holding this
    step's K/V. metadata: an `AttentionMetadata` (query_start_loc, seq_lens, block_table on the
    device; max_query_len). Rows of `out` past `query_start_loc[-1]` are left untouched.
    block_m / tile_n override the tile sizes (powers of two, block_m >= 16 and at least the GQA
    ratio, tile_n >= 16); the defaults pick BLOCK_M from max_query_len.
    sliding_window: a row at position i sees only keys j with i - j < sliding_window (None:
    global). Each distinct window is one more compiled variant of the kernel.
    causal=False: bidirectional (encoder-only layers): every row sees all of its sequence's
    keys, [0, seq_len); no window.
    """
    if not causal and sliding_window is not None:
        raise ValueError("bidirectional attention has no sliding window")
    _check_device(query)
    num_tokens, num_heads, head_size = query.shape
    _, num_blocks, block_size, num_kv_heads, kv_head_size = kv_cache.shape
    assert kv_head_size == head_size, (query.shape, kv_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert out.shape == query.shape
    assert query.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    query_start_loc = metadata.query_start_loc
    seq_lens = metadata.seq_lens
    block_table = metadata.block_table
    num_reqs = query_start_loc.shape[0] - 1
    if num_reqs <= 0 or num_tokens == 0:
        return out
    assert seq_lens.shape[0] >= num_reqs and block_table.shape[0] >= num_reqs
    assert block_table.stride(-1) == 1

    num_queries_per_kv = num_heads // num_kv_heads
    head_size_pad = max(16, triton.next_power_of_2(head_size))
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    assert key_cache.stride() == value_cache.stride()
    is_fp32 = key_cache.dtype == torch.float32
    default_m, default_n = _default_tiles(
        num_queries_per_kv, int(metadata.max_query_len), head_size_pad, is_fp32
    )
    block_m = block_m or default_m
    tile_n = tile_n or default_n
    assert block_m >= max(16, num_queries_per_kv) and block_m & (block_m - 1) == 0, block_m
    assert tile_n >= 16 and tile_n & (tile_n - 1) == 0, tile_n
    block_q = block_m // num_queries_per_kv

    # fp32 caches (CPU-parity runs) get 3xTF32 tensor-core dots, accurate to about fp32;
    # the flag is ignored for fp16/bf16 and by the interpreter.
    dot_precision = "tf32x3" if is_fp32 else "tf32"
    num_warps = 8 if block_m >= 128 else 4  # one warpgroup per 64 query rows

    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _unified_attention_kernel[grid](
        query,
        key_cache,
        value_cache,
        out,
        query_start_loc,
        seq_lens,
        block_table,
        num_reqs,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        NUM_QUERIES_PER_KV=num_queries_per_kv,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=head_size_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        DOT_PRECISION=dot_precision,
        SLIDING_WINDOW=sliding_window or 0,
        CAUSAL=causal,
        num_warps=num_warps,
        num_stages=2,
    )
    return out


# Triton picks compiled or interpreted when it decorates a kernel: TRITON_INTERPRET=1 must be in
# the environment before this module is imported for the kernels to run on CPU tensors.
INTERPRETED = isinstance(_unified_attention_kernel, InterpretedFunction)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "Triton kernels need a GPU; on CPU tensors they only run in Triton's interpreter "
            "(set TRITON_INTERPRET=1 before importing v1.attention.ops)"
        )
