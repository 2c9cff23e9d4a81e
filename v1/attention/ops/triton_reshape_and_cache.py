"""Write this step's K/V into the paged KV cache (Triton).

`kv_cache` has the layout of `abstract.kv_cache_shape`:
`[2, num_blocks, block_size, num_kv_heads, head_size]`. New token `i` goes to slot
`slot_mapping[i] = block * block_size + offset`; a negative slot marks a padding token and is
skipped. One program copies one token: all of its kv heads, for K and V.
"""

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache_ptr,
    slot_mapping_ptr,  # int64 [num_tokens]
    block_size,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_blk,
    stride_c_off,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # A padding token (negative slot) copies no head at all.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    slot = tl.maximum(slot, 0)
    blk = slot // block_size
    off = slot % block_size

    offs_h = tl.arange(0, KV_HEADS_PAD)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HEAD_SIZE)
    tok64 = tok.to(tl.int64)

    k = tl.load(
        key_ptr + tok64 * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :],
        mask=mask,
    )
    v = tl.load(
        value_ptr + tok64 * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :],
        mask=mask,
    )
    # Into an fp16 cache from a wider dtype (static: the pointers' types), +-65504 where inf
    # would be.
    if key_cache_ptr.dtype.element_ty == tl.float16 and key_ptr.dtype.element_ty != tl.float16:
        k = tl.clamp(k.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
        v = tl.clamp(v.to(tl.float32), -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)
    dst = blk * stride_c_blk + off * stride_c_off
    dst = dst + offs_h[:, None] * stride_c_head + offs_d[None, :]
    tl.store(key_cache_ptr + dst, k, mask=mask)
    tl.store(value_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy `key`/`value` rows `[: len(slot_mapping)]` into `kv_cache` at `slot_mapping`.

    key, value: [num_tokens, num_kv_heads, head_size] (rows may be strided, the last dim must be
    contiguous; extra padded rows beyond `len(slot_mapping)` are ignored).
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size], contiguous in its last dim.
    slot_mapping: [n] integer slots; negative entries are skipped.
    Values are cast to the cache's dtype on store; into fp16 (from a wider dtype) they
    saturate at +-65504, as the torch backend's write does (an inf key would make attention
    NaN).
    """
    _check_device(key)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    assert key.shape[0] >= num_tokens and value.shape[0] >= num_tokens
    assert key.shape[1:] == (num_kv_heads, head_size), (key.shape, kv_cache.shape)
    assert value.shape[1:] == (num_kv_heads, head_size), (value.shape, kv_cache.shape)
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    assert key_cache.stride() == value_cache.stride()

    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        block_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_SIZE_PAD=triton.next_power_of_2(head_size),
        num_warps=4 if num_kv_heads * head_size >= 1024 else 1,
    )


# Triton picks compiled or interpreted when it decorates a kernel: TRITON_INTERPRET=1 must be in
# the environment before this module is imported for the kernels to run on CPU tensors.
INTERPRETED = isinstance(_reshape_and_cache_kernel, InterpretedFunction)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not INTERPRETED:
        raise RuntimeError(
            "Triton kernels need a GPU; on CPU tensors they only run in Triton's interpreter "
            "(set TRITON_INTERPRET=1 before importing v1.attention.ops)"
        )
