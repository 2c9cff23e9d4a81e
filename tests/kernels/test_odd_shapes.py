"""The kernels at the edges of their tiles and loops, against torch: K not a multiple of 256,
M = 0..257, N = 1..29, head sizes 8..256, block sizes 1..16, a cache of more than 2^31
elements. Quick as plain tests; `make sanitize` runs them under AddressSanitizer and UBSan,
where a read or write past any buffer aborts the run."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.attention.test_torch_attn import ATOL, RTOL, Batch
from tests.worker.test_quant_kernels import int8_activations
from v1.attention.backends.abstract import AttentionMetadata
from v1.attention.backends.torch_attn import (
    TorchAttentionImpl,
    paged_attention_reference,
    write_kv_cache,
)
from v1.attention.backends.torch_plan import AttentionPlan
from v1.kernels.elementwise import native_ops
from v1.kernels.library import library
from v1.models.layers.ops import TorchOps
from v1.models.layers.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(library() is None, reason="no C kernels")

# Every tile edge of the quant kernels: 1-4 rows (dot tiles), 5-16 (pairs of rows per lane),
# 17-64 and beyond (16 rows per vector, 64 per tile), and the int8 path's groups (of up to
# 8 or 12 rows to 64 or 128 rows, then 8 or 16 rows per vector).
ROWS = (0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 63, 64, 65, 127, 129, 255, 256, 257)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("K", [32, 96, 288])
def test_quant_paths_every_tile_edge(kind: str, K: int) -> None:
    gen = torch.Generator().manual_seed(K)
    for N in (1, 2, 3, 5, 7, 13, 29):
        q = QuantizedWeight.quantize(torch.randn(N, K, generator=gen), kind)
        w = q.dequantize().double()
        bias = torch.randn(N, generator=gen)
        for M in ROWS if N in (1, 29) else ROWS[:12]:
            # Rows 7 floats further apart than K: the kernels must use the row stride.
            x = torch.randn(M, K + 7, generator=gen)[:, :K]
            scale = x.abs().double() @ w.abs().T + 1
            for path in ("fp32", "int8", "dense"):
                got = q.linear(x, bias, path=path)
                assert got.shape == (M, N) and got.dtype == torch.float32
                # int8: the activations as that path rounds them.
                xr = int8_activations(x) if path == "int8" and M else x
                ref = xr.double() @ w.T + bias.double()
                assert ((got.double() - ref).abs() <= 1e-5 * scale).all(), (N, M, path)


def test_elementwise_every_tail() -> None:
    ops, ref = native_ops(), TorchOps()
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 30):
        for rows in (0, 1, 5):
            x, res = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen)
            w = torch.randn(n, generator=gen)
            got, summed = ops.rms_norm(x, res.clone(), w, 1e-5)
            want, want_sum = ref.rms_norm(x, res, w, 1e-5)
            assert torch.equal(summed, want_sum)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            gate_up = torch.randn(rows, 2 * n, generator=gen)
            torch.testing.assert_close(ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up),
                                       rtol=1e-5, atol=1e-6)
        if n % 2 == 0:
            qk = torch.randn(3, 2, n, generator=gen)
            cos, sin = torch.randn(3, 1, n, generator=gen), torch.randn(3, 1, n, generator=gen)
            want = ref.rope(qk, cos, sin)
            assert torch.equal(ops.rope(qk.clone(), cos, sin), want)


# (q_len, seq_len, group): decodes beside short prefills that the kernel serves too.
ODD_BATCH = ([(1, 1, None), (1, 2, None), (1, 17, None), (3, 9, None), (1, 33, None),
              (5, 5, None)], {})


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("heads, kv_heads, head_size", [(1, 1, 8), (4, 2, 24), (6, 3, 72),
                                                        (2, 1, 256)])
@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_decode_odd_shapes(kv_dtype, heads, kv_heads, head_size, block_size) -> None:
    batch = Batch(*ODD_BATCH, heads, kv_heads, head_size, block_size)
    cache = batch.kv_cache.to(kv_dtype)
    plan = AttentionPlan.for_step(batch.metadata, cache, heads)
    if plan.native is None:
        pytest.skip("no paged decode kernel for this cache here")
    impl = TorchAttentionImpl(heads, head_size, kv_heads, 0.125)
    got_cache = cache.clone()
    out = impl.forward(batch.query, batch.key, batch.value, got_cache, batch.metadata)
    ref_cache = cache.clone()
    write_kv_cache(batch.key, batch.value, ref_cache, batch.metadata.slot_mapping)
    ref = paged_attention_reference(batch.query, ref_cache, batch.metadata, 0.125)
    assert torch.equal(got_cache.nan_to_num(), ref_cache.nan_to_num())
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_paged_decode_cache_past_2_to_the_31_elements() -> None:
    """A bf16 cache of 2^31 + 2048 elements (4 GiB, untouched but for the blocks used):
    offsets into it overflow 32 bits, in the write and in the reads of the last blocks."""
    kv_heads, head_size, B = 1, 64, 16
    num_blocks = (1 << 30) // (B * kv_heads * head_size) + 1
    try:
        cache = torch.empty(2, num_blocks, B, kv_heads, head_size, dtype=torch.bfloat16)
    except RuntimeError as e:  # no 4 GiB of address space to spare
        pytest.skip(str(e))
    assert cache.numel() > 1 << 31
    seq_len = 3 * B + 5
    blocks = np.arange(num_blocks - 4, num_blocks, dtype=np.int32)[None, :]  # the last ones
    cache[:, blocks[0]] = 0  # the reference reads whole blocks (NaN garbage * 0 is NaN)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(seq_len, kv_heads, head_size, generator=gen) for _ in range(2))
    pos = torch.arange(seq_len)
    slots = torch.from_numpy(blocks[0]).long()[pos // B] * B + pos % B
    write_kv_cache(k[:-1], v[:-1], cache, slots[:-1])
    md = AttentionMetadata.build(np.array([1]), np.array([seq_len]), blocks, slots[-1:])
    query = torch.randn(1, 2, head_size, generator=gen)
    impl = TorchAttentionImpl(2, head_size, kv_heads, 0.125)
    assert AttentionPlan.for_step(md, cache, 2).native is not None
    out = impl.forward(query, k[-1:], v[-1:], cache, md)
    ref = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], k.bfloat16().float().transpose(0, 1)[None].expand(
            1, 2, seq_len, head_size),
        v.bfloat16().float().transpose(0, 1)[None].expand(1, 2, seq_len, head_size),
        scale=0.125)
    torch.testing.assert_close(out, ref[0].transpose(0, 1), atol=ATOL, rtol=RTOL)
