"""The Triton attention backend against the torch reference, and the reference against dense math.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (tests/attention/conftest.py
sets TRITON_INTERPRET=1 before the ops are imported); with CUDA they are compiled and run on the
GPU. The torch reference is always evaluated on CPU copies. Shapes are kept small because the
interpreter executes every program of the grid in Python.
"""

import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from v1.attention.backends.abstract import AttentionMetadata, kv_cache_shape
from v1.attention.backends.torch_attn import (
    TorchAttentionImpl,
    paged_attention_reference,
    write_kv_cache,
)
from v1.attention.backends.triton_attn import TritonAttentionImpl
from v1.attention.ops import triton_reshape_and_cache, triton_unified_attention
from v1.attention.ops.triton_reshape_and_cache import reshape_and_cache
from v1.attention.ops.triton_unified_attention import unified_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = triton_unified_attention.INTERPRETED and triton_reshape_and_cache.INTERPRETED

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRETED,
    reason="no GPU and the kernels were imported without TRITON_INTERPRET=1",
)

ATOL, RTOL = 2e-5, 1e-5  # fp32 everywhere; observed errors are ~1e-6

# (q_len, seq_len) per request: the last q_len of seq_len positions are new this step.
DECODE = [(1, 17), (1, 1), (1, 40), (1, 33), (1, 8)]
PREFILL = [(20, 20), (7, 7), (33, 33)]
# Cached context of 20, 16, 45 and 3 tokens: multiples of the block size and not.
CHUNKED = [(9, 29), (19, 35), (5, 50), (30, 33)]
MIXED = [(1, 23), (12, 12), (1, 64), (10, 37), (1, 5), (25, 25), (6, 22)]
SCENARIOS = {"decode": DECODE, "prefill": PREFILL, "chunked": CHUNKED, "mixed": MIXED}
GQA = {"gqa1": (2, 2), "gqa3": (6, 2), "gqa4": (8, 2)}  # (num_heads, num_kv_heads)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D], new tokens of all requests packed
    key: torch.Tensor  # [T, KVH, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # context already written, new tokens not yet; unused slots NaN
    metadata: AttentionMetadata
    full_k: list[torch.Tensor]  # per request [seq_len, KVH, D], unpaged
    full_v: list[torch.Tensor]
    reqs: list[tuple[int, int]]


def make_batch(
    reqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    *,
    seed: int = 0,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Batch:
    """A packed batch whose blocks are scattered over a shuffled pool.

    Every slot that holds no token (other requests' nothing, the tail of a last partial block,
    spare blocks, the block the padding of the block table points at) is NaN, so a kernel that
    reads one unmasked poisons its output.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [cdiv(seq_len, block_size) for _, seq_len in reqs]
    num_blocks = sum(blocks_per_req) + 3
    pool = torch.randperm(num_blocks, generator=gen)
    poison_block = int(pool[-1])
    max_blocks = max(blocks_per_req) + 1
    block_table = torch.full((len(reqs), max_blocks), poison_block, dtype=torch.int32)
    kv_cache = torch.full(
        kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), float("nan")
    )

    queries, keys, values, slots, full_k, full_v = [], [], [], [], [], []
    used = 0
    for r, (q_len, seq_len) in enumerate(reqs):
        n = blocks_per_req[r]
        block_table[r, :n] = pool[used : used + n].to(torch.int32)
        used += n
        k = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_size, generator=gen)
        full_k.append(k)
        full_v.append(v)
        pos = torch.arange(seq_len)
        req_slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        ctx = seq_len - q_len
        write_kv_cache(k[:ctx], v[:ctx], kv_cache, req_slots[:ctx])
        slots.append(req_slots[ctx:])
        keys.append(k[ctx:])
        values.append(v[ctx:])
        queries.append(torch.randn(q_len, num_heads, head_size, generator=gen))

    metadata = AttentionMetadata.build(
        np.array([q for q, _ in reqs]), np.array([s for _, s in reqs]), block_table,
        torch.cat(slots), device,
    )
    return Batch(
        query=torch.cat(queries).to(device, dtype),
        key=torch.cat(keys).to(device, dtype),
        value=torch.cat(values).to(device, dtype),
        kv_cache=kv_cache.to(device, dtype),
        metadata=metadata,
        full_k=full_k,
        full_v=full_v,
        reqs=reqs,
    )


def cpu_metadata(md: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        md.num_actual_tokens, md.max_query_len, md.max_seq_len,
        md.query_start_loc.cpu(), md.seq_lens.cpu(), md.block_table.cpu(),
        md.slot_mapping.cpu(), md.query_start_loc_cpu, md.seq_lens_cpu,
    )


def reference(batch: Batch, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """The torch backend's answer, computed on CPU in fp32."""
    kv_cache = batch.kv_cache.float().cpu().clone()
    md = cpu_metadata(batch.metadata)
    write_kv_cache(batch.key.float().cpu(), batch.value.float().cpu(), kv_cache, md.slot_mapping)
    return paged_attention_reference(batch.query.float().cpu(), kv_cache, md, scale,
                                     sliding_window)


def dense_causal_attention(
    batch: Batch, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Naive float64 attention from the unpaged K/V: query head h reads kv head h // ratio;
    with a window, query i sees keys j only where i - j < sliding_window."""
    outs = []
    starts = batch.metadata.query_start_loc_cpu
    num_heads = batch.query.shape[1]
    for r, (q_len, seq_len) in enumerate(batch.reqs):
        q = batch.query[int(starts[r]) : int(starts[r + 1])].double().cpu()  # [q_len, H, D]
        ratio = num_heads // batch.full_k[r].shape[1]
        k = batch.full_k[r].double().repeat_interleave(ratio, dim=1)  # [seq_len, H, D]
        v = batch.full_v[r].double().repeat_interleave(ratio, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)


def run_triton(batch: Batch, scale: float, kv_cache: torch.Tensor | None = None,
               **kwargs) -> torch.Tensor:
    kv_cache = (batch.kv_cache if kv_cache is None else kv_cache).clone()
    reshape_and_cache(batch.key, batch.value, kv_cache, batch.metadata.slot_mapping)
    out = torch.empty_like(batch.query)
    unified_attention(batch.query, kv_cache, out, batch.metadata, scale, **kwargs)
    return out


def poison_out_of_window(batch: Batch, window: int) -> tuple[torch.Tensor, int]:
    """The cache with NaN in every block wholly before its request's first query's window
    (blocks are not shared here): a kernel that loads one unmasked poisons its output."""
    kv_cache = batch.kv_cache.clone()
    block_size = kv_cache.shape[2]
    table = batch.metadata.block_table.cpu()
    dead = []
    for r, (q_len, seq_len) in enumerate(batch.reqs):
        first = max(0, seq_len - q_len - window + 1) // block_size
        dead += table[r, :first].tolist()
    kv_cache[:, dead] = float("nan")
    return kv_cache, len(dead)


# ----------------------------------------------------------------------------- reference


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size,gqa", [(16, "gqa1"), (8, "gqa3"), (32, "gqa4")])
def test_reference_matches_dense_attention(scenario, block_size, gqa):
    num_heads, num_kv_heads = GQA[gqa]
    batch = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, 64, block_size, seed=1)
    scale = 64**-0.5
    ref = reference(batch, scale)
    torch.testing.assert_close(ref.double(), dense_causal_attention(batch, scale), atol=ATOL,
                               rtol=RTOL)


# ----------------------------------------------------------------------------- cache write


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_exact(block_size, dtype):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_size = 6, 3, 64  # 3 kv heads: padded to 4 inside
    kv_cache = torch.randn(
        kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size), generator=gen
    ).to(DEVICE, dtype)
    num_tokens = 13
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7, 12]] = -1  # padding tokens
    # K and V as strided views of a packed qkv projection, with two extra padded rows.
    qkv = torch.randn(num_tokens + 2, 5 * num_kv_heads * head_size, generator=gen).to(DEVICE, dtype)
    key = qkv[:, 2 * num_kv_heads * head_size : 3 * num_kv_heads * head_size]
    key = key.view(-1, num_kv_heads, head_size)
    value = qkv[:, 4 * num_kv_heads * head_size :].view(-1, num_kv_heads, head_size)
    assert not key.is_contiguous()

    expected = kv_cache.clone()
    slots = slots.to(DEVICE)
    real = slots >= 0
    write_kv_cache(key[:num_tokens][real], value[:num_tokens][real], expected, slots[real])
    reshape_and_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


def test_reshape_and_cache_head_size_not_power_of_two():
    num_blocks, block_size, num_kv_heads, head_size = 3, 16, 2, 80
    kv_cache = torch.zeros(kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    kv_cache = kv_cache.to(DEVICE)
    key = torch.randn(5, num_kv_heads, head_size, device=DEVICE)
    value = torch.randn(5, num_kv_heads, head_size, device=DEVICE)
    slots = torch.tensor([0, 47, 16, -1, 33], device=DEVICE)
    expected = kv_cache.clone()
    write_kv_cache(key[[0, 1, 2, 4]], value[[0, 1, 2, 4]], expected, slots[[0, 1, 2, 4]])
    reshape_and_cache(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


# ----------------------------------------------------------------------------- attention


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("gqa", list(GQA))
def test_unified_attention_matches_reference(scenario, block_size, gqa):
    num_heads, num_kv_heads = GQA[gqa]
    batch = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, 64, block_size,
                       device=DEVICE)
    scale = 64**-0.5
    out = run_triton(batch, scale)
    torch.testing.assert_close(out.cpu(), reference(batch, scale), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "head_size,gqa,block_size",
    [(128, "gqa4", 16), (128, "gqa1", 32), (80, "gqa3", 16), (96, "gqa1", 8)],
)
def test_unified_attention_other_head_sizes(head_size, gqa, block_size):
    num_heads, num_kv_heads = GQA[gqa]
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_size, block_size, seed=2,
                       device=DEVICE)
    scale = head_size**-0.5
    out = run_triton(batch, scale)
    torch.testing.assert_close(out.cpu(), reference(batch, scale), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "block_m,tile_n,block_size",
    [
        (16, 16, 32),  # KV tile smaller than a page; 5 tokens x 3 heads per query tile
        (16, 32, 8),  # KV tile spans four pages
        (32, 16, 16),  # 10 tokens x 3 heads per tile, a 2-row remainder masked
        (64, 64, 16),
    ],
)
def test_unified_attention_tile_shapes(block_m, tile_n, block_size):
    batch = make_batch(MIXED, 6, 2, 64, block_size, seed=3, device=DEVICE)
    scale = 0.125
    out = run_triton(batch, scale, block_m=block_m, tile_n=tile_n)
    torch.testing.assert_close(out.cpu(), reference(batch, scale), atol=ATOL, rtol=RTOL)


def test_unified_attention_large_gqa_decode():
    # 16 query heads on one kv head: a decode fills a whole 16-row tile on its own.
    batch = make_batch(DECODE, 16, 1, 64, 16, seed=4, device=DEVICE)
    out = run_triton(batch, 0.125)
    torch.testing.assert_close(out.cpu(), reference(batch, 0.125), atol=ATOL, rtol=RTOL)


def test_unified_attention_strided_query_and_padded_rows():
    """Query as a view of a packed qkv tensor; padded rows (slot -1) are neither written to the
    cache nor to `out`; an empty request in the middle is fine."""
    num_heads, num_kv_heads, head_size, block_size = 6, 2, 64, 16
    reqs = [(1, 23), (10, 37), (12, 12)]
    batch = make_batch(reqs, num_heads, num_kv_heads, head_size, block_size, seed=5,
                       device=DEVICE)
    md = batch.metadata
    num_tokens, pad = md.num_actual_tokens, 3
    hd, kvd = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.zeros(num_tokens + pad, hd + 2 * kvd, device=DEVICE)
    qkv[:num_tokens, :hd] = batch.query.flatten(1)
    qkv[:num_tokens, hd : hd + kvd] = batch.key.flatten(1)
    qkv[:num_tokens, hd + kvd :] = batch.value.flatten(1)
    query = qkv[:, :hd].view(-1, num_heads, head_size)
    key = qkv[:, hd : hd + kvd].view(-1, num_kv_heads, head_size)
    value = qkv[:, hd + kvd :].view(-1, num_kv_heads, head_size)
    slot_mapping = torch.cat([md.slot_mapping, torch.full((pad,), -1, device=DEVICE)])
    # An empty request (nothing scheduled) between the first and the second.
    qsl = np.insert(md.query_start_loc_cpu, 1, md.query_start_loc_cpu[1])
    seq_lens = np.insert(md.seq_lens_cpu, 1, 7)
    block_table = torch.cat([md.block_table[:1], md.block_table[:1], md.block_table[1:]])
    padded = AttentionMetadata(
        num_tokens, md.max_query_len, md.max_seq_len,
        torch.from_numpy(qsl).to(DEVICE), torch.from_numpy(seq_lens).to(DEVICE), block_table,
        slot_mapping, qsl, seq_lens,
    )

    kv_cache = batch.kv_cache.clone()
    reshape_and_cache(key, value, kv_cache, slot_mapping)
    out = torch.full((num_tokens + pad, num_heads, head_size), 7.0, device=DEVICE)
    unified_attention(query, kv_cache, out, padded, 0.125)

    expected_cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected_cache, md.slot_mapping)
    assert torch.equal(kv_cache.isnan(), expected_cache.isnan())
    assert torch.equal(kv_cache.nan_to_num(), expected_cache.nan_to_num())
    torch.testing.assert_close(out[:num_tokens].cpu(), reference(batch, 0.125), atol=ATOL,
                               rtol=RTOL)
    assert torch.all(out[num_tokens:] == 7.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_unified_attention_half_precision(dtype):
    if INTERPRETED and dtype == torch.bfloat16:
        # The interpreter keeps bf16 as uint16 and tl.dot multiplies the bit patterns
        # (triton-lang/triton#11584: bf16 dot is not supported by the interpreter).
        pytest.skip("Triton's interpreter does not support tl.dot on bfloat16")
    batch = make_batch(MIXED, 6, 2, 64, 16, seed=6, device=DEVICE, dtype=dtype)
    out = run_triton(batch, 0.125)
    assert out.dtype == dtype
    # The reference sees the same rounded inputs, in fp32; P is rounded to `dtype` for P @ V.
    torch.testing.assert_close(out.float().cpu(), reference(batch, 0.125), atol=1e-2, rtol=1e-2)


def test_triton_backend_matches_torch_backend():
    num_heads, num_kv_heads, head_size = 6, 2, 64
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_size, 16, seed=7, device=DEVICE)
    scale = 1 / math.sqrt(head_size)
    triton_impl = TritonAttentionImpl(num_heads, head_size, num_kv_heads, scale)
    torch_impl = TorchAttentionImpl(num_heads, head_size, num_kv_heads, scale)
    triton_cache = batch.kv_cache.clone()
    torch_cache = batch.kv_cache.cpu().clone()
    md = batch.metadata
    out = triton_impl.forward(batch.query, batch.key, batch.value, triton_cache, md)
    ref = torch_impl.forward(batch.query.cpu(), batch.key.cpu(), batch.value.cpu(), torch_cache,
                             cpu_metadata(md))
    assert torch.equal(triton_cache.cpu().nan_to_num(), torch_cache.nan_to_num())
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL, rtol=RTOL)
    # The output holds no NaN although every unused cache slot does.
    assert not out.isnan().any()


@pytest.mark.parametrize("block_size,gqa", [(8, "gqa3"), (16, "gqa1"), (32, "gqa4")])
def test_encoder_only_matches_torch_backend(block_size, gqa):
    # Bidirectional (BERT family): whole sequences, each row sees every key of its sequence,
    # the later ones included; the torch backend's encoder_attention is the reference.
    from v1.attention.backends.abstract import AttentionType

    num_heads, num_kv_heads = GQA[gqa]
    head_size = 32
    batch = make_batch(PREFILL + [(1, 1), (40, 40)], num_heads, num_kv_heads, head_size,
                       block_size, seed=11, device=DEVICE)
    scale = 1 / math.sqrt(head_size)
    kw = {"attn_type": AttentionType.ENCODER_ONLY}
    triton_impl = TritonAttentionImpl(num_heads, head_size, num_kv_heads, scale, **kw)
    torch_impl = TorchAttentionImpl(num_heads, head_size, num_kv_heads, scale, **kw)
    md = batch.metadata
    out = triton_impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), md)
    ref = torch_impl.forward(batch.query.cpu(), batch.key.cpu(), batch.value.cpu(),
                             torch.empty(0), cpu_metadata(md))
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL, rtol=RTOL)
    causal = reference(batch, scale)
    assert not torch.allclose(ref, causal, atol=1e-3)  # it is not the causal answer
    with pytest.raises(ValueError, match="no sliding window"):
        unified_attention(batch.query, batch.kv_cache, batch.query.clone(), md, scale,
                          sliding_window=4, causal=False)


# ----------------------------------------------------------------------------- sliding window


@pytest.mark.parametrize("window", [1, 5, 19])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size,gqa", [(8, "gqa3"), (16, "gqa1")])
def test_unified_attention_sliding_window(scenario, block_size, gqa, window):
    """Decodes, prefills (window shorter than the prompt) and chunks after a cached context,
    against dense attention with the window's mask, with the blocks before every window NaN;
    the torch reference's window against the same."""
    num_heads, num_kv_heads = GQA[gqa]
    batch = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, 64, block_size, seed=8,
                       device=DEVICE)
    scale = 64**-0.5
    dense = dense_causal_attention(batch, scale, window)
    assert not torch.allclose(dense, dense_causal_attention(batch, scale), atol=1e-3)
    poisoned, num_dead = poison_out_of_window(batch, window)
    assert num_dead > 0 or scenario == "prefill"  # no context: nothing before a window
    out = run_triton(batch, scale, kv_cache=poisoned, sliding_window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), dense, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(reference(batch, scale, window).double(), dense, atol=ATOL,
                               rtol=RTOL)


@pytest.mark.parametrize(
    "block_m,tile_n,window",
    [
        (16, 16, 3),  # 5 tokens x 3 heads per query tile, KV tile of 16
        (32, 16, 2),  # 10 tokens per tile: its last rows see nothing of its first KV tile
        (64, 32, 7),  # 21 tokens per tile, KV tiles over four pages
        (16, 64, 40),  # the window spans several KV tiles: unmasked ones in the middle
    ],
)
def test_unified_attention_sliding_window_tile_shapes(block_m, tile_n, window):
    batch = make_batch(MIXED, 6, 2, 64, 8, seed=9, device=DEVICE)
    dense = dense_causal_attention(batch, 0.125, window)
    poisoned, _ = poison_out_of_window(batch, window)
    out = run_triton(batch, 0.125, kv_cache=poisoned, block_m=block_m, tile_n=tile_n,
                     sliding_window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), dense, atol=ATOL, rtol=RTOL)


def test_unified_attention_window_as_long_as_the_sequences():
    """A window of at least every sequence length is global attention; one shorter is not."""
    batch = make_batch(MIXED, 6, 2, 64, 16, seed=10, device=DEVICE)
    longest = max(s for _, s in MIXED)
    out = run_triton(batch, 0.125)
    for window in (longest, 10**6):
        torch.testing.assert_close(run_triton(batch, 0.125, sliding_window=window), out,
                                   atol=1e-6, rtol=1e-6)
    shorter = run_triton(batch, 0.125, sliding_window=longest - 1)
    torch.testing.assert_close(shorter.cpu().double(),
                               dense_causal_attention(batch, 0.125, longest - 1), atol=ATOL,
                               rtol=RTOL)
    assert not torch.allclose(shorter, out, atol=1e-3)


def test_triton_backend_matches_torch_backend_with_window():
    num_heads, num_kv_heads, head_size, window = 8, 2, 64, 6
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_size, 16, seed=11, device=DEVICE)
    scale = 1 / math.sqrt(head_size)
    triton_impl = TritonAttentionImpl(num_heads, head_size, num_kv_heads, scale,
                                      sliding_window=window)
    torch_impl = TorchAttentionImpl(num_heads, head_size, num_kv_heads, scale,
                                    sliding_window=window)
    md = batch.metadata
    out = triton_impl.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), md)
    ref = torch_impl.forward(batch.query.cpu(), batch.key.cpu(), batch.value.cpu(),
                             batch.kv_cache.cpu().clone(), cpu_metadata(md))
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.cpu().double(), dense_causal_attention(batch, scale, window),
                               atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- compiled


_COMPILE_SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from v1.attention.ops import triton_reshape_and_cache as R, triton_unified_attention as U

    INT_PTRS = {"query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                "block_table_ptr": "*i32", "slot_mapping_ptr": "*i64"}

    def compile_for_h100(kernel, dtype, constants, num_warps):
        sig = {}
        for name in kernel.arg_names:
            if name in constants:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = INT_PTRS.get(name, "*" + dtype)
            else:
                sig[name] = "fp32" if name == "scale_log2" else "i32"
        src = ASTSource(kernel, sig, constants)
        opts = {"num_warps": num_warps, "num_stages": 2}
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)

    # The production path (bf16, GQA 3, prefill-sized tile) must use tensor cores; head 80
    # also exercises the masked head dimension. (fp32's 3xTF32 variant compiles too, in ~6 s.)
    # The sliding-window variant (its extra loop and masks) must compile too, and the
    # bidirectional one (encoder-only layers: BERT's 12 heads of 64, no GQA).
    for dtype, prec, qpk, d, block_m, tile_n, window, causal in [
        ("bf16", "tf32", 3, 80, 64, 64, 0, True),
        ("bf16", "tf32", 3, 80, 64, 64, 512, True),
        ("bf16", "tf32", 1, 64, 64, 64, 0, False),
    ]:
        c = dict(NUM_QUERIES_PER_KV=qpk, HEAD_SIZE=d, HEAD_SIZE_PAD=triton.next_power_of_2(d),
                 BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_Q=block_m // qpk, TILE_N=tile_n,
                 DOT_PRECISION=prec, SLIDING_WINDOW=window, CAUSAL=causal)
        k = compile_for_h100(U._unified_attention_kernel, dtype, c, 4)
        assert "mma" in k.asm["ptx"], (dtype, window, "no tensor-core instructions")
    compile_for_h100(R._reshape_and_cache_kernel, "bf16",
                     dict(NUM_KV_HEADS=3, HEAD_SIZE=64, KV_HEADS_PAD=4, HEAD_SIZE_PAD=64), 1)
    print("compiled")
    """
)


@pytest.mark.slow
@pytest.mark.skipif(DEVICE == "cuda", reason="the other tests compile and run the kernels")
def test_kernels_compile_for_h100(tmp_path):
    """The interpreter accepts code the compiler rejects: compile both kernels for sm_90."""
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a real compile, not a cache hit
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
