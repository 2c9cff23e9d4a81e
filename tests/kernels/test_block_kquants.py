"""The kernel table's K-quant rows (q4_k, q5_k, q6_k: csrc/block_ktiles.h, block_ref_k.c;
q4_kx8 and q6_kx8, their superblocks with 8 rows interleaved) in every variant this CPU runs:
dequantize gives gguf's values bit for bit (random superblocks, extreme fp16 scales and mins
among them), the matmuls are close to x @ dequantized.T, the int8 path gives the reference's
bits and each row the same bits whatever M and whatever the layout."""

import ctypes
import platform

import gguf
import numpy as np
import pytest
import torch

from v1.kernels import library
from v1.kernels.block_matmul import INTERLEAVED, QuantBlocks, QuantKernels, block_types
from v1.kernels.variants import cpu_flags
from v1.models.layers.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(library.library() is None, reason="no C kernels")

KINDS = ("q4_k", "q5_k", "q6_k")
INTERLEAVED_AS = {"q4_k": "q4_kx8", "q6_k": "q6_kx8"}
# The fp16 fields of each superblock: d and dmin, or q6_k's d at its end.
HALVES = {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
# Largest finite, smallest subnormal, largest subnormal, zero, minus zero, negative, -largest.
EXTREME = np.array([0x7BFF, 0x0001, 0x03FF, 0x0000, 0x8000, 0xBC00, 0xFBFF], dtype=np.uint16)


def variants() -> list[ctypes.CDLL]:
    names = library.candidates("", platform.machine(), cpu_flags())
    libs = [library.load_variant(name) for name in names]
    return [lib for lib in libs if not isinstance(lib, str)]


def gguf_type(kind: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[kind.upper()]


def superblocks(kind: str, n: int, k: int, rng: np.random.Generator,
                extreme: bool = False) -> np.ndarray:
    """[n, k / 256 * bytes] random superblocks: random bytes, the fp16 fields small finite
    scales, or with `extreme` any of EXTREME or random finite halves."""
    size = gguf.GGML_QUANT_SIZES[gguf_type(kind)][1]
    b = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for at in HALVES[kind]:
        if extreme:
            h = rng.choice(EXTREME, size=(n, k // 256))
            finite = rng.integers(0, 0x7C00, size=h.shape, dtype=np.uint16)  # below inf
            sign = rng.integers(0, 2, size=h.shape, dtype=np.uint16) << 15
            h = np.where(rng.random(h.shape) < 0.5, h, finite | sign)
        else:
            h = (rng.standard_normal((n, k // 256)) * 1e-2).astype(np.float16).view(np.uint16)
        b[:, :, at:at + 2] = h.astype("<u2")[..., None].view(np.uint8)
    return b.reshape(n, -1)


@pytest.fixture(scope="module", params=variants(), ids=lambda lib: lib._name.rsplit("/", 1)[-1])
def lib(request) -> ctypes.CDLL:
    return request.param


def test_the_rows_are_ggufs(lib: ctypes.CDLL) -> None:
    types = block_types(lib)
    int8_isa = QuantKernels(lib).int8_isa
    for kind in KINDS:
        t = types[kind]
        assert (t.block_elems, t.block_bytes) == gguf.GGML_QUANT_SIZES[gguf_type(kind)]
        # q4_k repacked where q4_1 is (the AVX2 and AVX-512 builds); q6_k where the int8 dot
        # products are VNNI's (AVX2 alone runs GGUF's layout faster: block_types.c)
        repack = INTERLEAVED_AS.get(kind) if types["q4_1"].repack else None
        if kind == "q6_k" and int8_isa not in ("avx_vnni", "avx512_vnni"):
            repack = None
        assert (t.interleave, t.repack) == (1, repack)
        assert t.kernels == t.reference == {"linear_f32", "linear_i8", "dequantize"}
    for kind, moved in INTERLEAVED_AS.items():
        t = types[moved]
        assert (t.block_elems, t.block_bytes) == (256, types[kind].block_bytes)
        assert (t.interleave, INTERLEAVED[moved]) == (8, (kind, 8))
        assert t.kernels == t.reference == {"linear_f32", "linear_i8", "dequantize"}


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_ggufs_bit_for_bit(lib: ctypes.CDLL, kind: str) -> None:
    rng = np.random.default_rng(0)
    tuned, reference = QuantKernels(lib), QuantKernels(lib, reference=True)
    for extreme in (False, True):
        blocks = superblocks(kind, 19, 768, rng, extreme)
        want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf_type(kind)).copy())
        w = QuantBlocks(kind, torch.from_numpy(blocks))
        for q in (tuned, reference):
            got = q.dequantize(w)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (kind, extreme)


@pytest.mark.parametrize("kind", KINDS)
def test_matmuls_match_the_dequantized_product(lib: ctypes.CDLL, kind: str) -> None:
    """N = 37 (no multiple of any tile), K = 3 superblocks; the int8 path the reference's
    bits, every row of it the bits it has alone."""
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(1)
    tuned, reference = QuantKernels(lib), QuantKernels(lib, reference=True)
    n, k = 37, 768
    blocks = superblocks(kind, n, k, rng)
    w = QuantBlocks(kind, torch.from_numpy(blocks))
    deq = torch.from_numpy(gguf.quants.dequantize(blocks, gguf_type(kind)).copy())
    alone = {}
    for m in (1, 2, 5, 16, 17, 64):
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        exact = x.double() @ deq.double().T + bias.double()
        y8 = tuned.linear(w, x, bias, int8=True)
        assert torch.equal(y8, reference.linear(w, x, bias, int8=True)), (kind, m)
        # int8 activations: a relative error of about 1/127 per value, averaged over K
        assert ((y8 - exact).norm() / exact.norm()).item() < 2e-2, (kind, m)
        for q in (tuned, reference):
            torch.testing.assert_close(q.linear(w, x, bias).double(), exact, rtol=1e-4,
                                       atol=1e-4 * exact.abs().max().item())
        # each row's bits whatever M: against the same rows at M = 1
        for r in (0, m - 1):
            key = x[r].numpy().tobytes()
            if key not in alone:
                alone[key] = tuned.linear(w, x[r:r + 1], bias, int8=True)[0]
            assert torch.equal(y8[r], alone[key]), (kind, m, r)
        one = tuned.linear(w, x[m // 2:m // 2 + 1], bias, int8=True)[0]
        assert torch.equal(y8[m // 2], one), (kind, m)


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_that_is_not_finite_takes_the_fp32_path(lib: ctypes.CDLL, kind: str) -> None:
    rng = np.random.default_rng(2)
    tuned = QuantKernels(lib)
    blocks = superblocks(kind, 9, 512, rng)
    w = QuantBlocks(kind, torch.from_numpy(blocks))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    x[1, 300] = float("inf")
    y8 = tuned.linear(w, x, None, int8=True)
    torch.testing.assert_close(y8[1], tuned.linear(w, x[1:2], None)[0], equal_nan=True)
    assert torch.equal(y8[0], tuned.linear(w, x[:1], None, int8=True)[0])
    assert torch.equal(y8[2], tuned.linear(w, x[2:], None, int8=True)[0])


def interleaved(kind: str, blocks: np.ndarray) -> np.ndarray:
    """`kind`'s rows (any dtype: a byte's index moves as the byte) interleaved by 8: each
    group's superblock b together, dword f of row i at dword 8 f + i, then the bytes past the
    last whole dword (q6_k's d) row by row (csrc/block_q4_kx8.c, block_q6_kx8.c)."""
    n, size = blocks.shape[0], gguf.GGML_QUANT_SIZES[gguf_type(kind)][1]
    grouped = blocks.reshape(n // 8, 8, -1, size)
    head = grouped[..., :size // 4 * 4].reshape(n // 8, 8, grouped.shape[2], -1, 4)
    head = head.transpose(0, 2, 3, 1, 4).reshape(n // 8, grouped.shape[2], -1)
    tail = grouped[..., size // 4 * 4:].transpose(0, 2, 1, 3).reshape(head.shape[:2] + (-1,))
    return np.concatenate([head, tail], -1).reshape(n, -1)


@pytest.mark.parametrize("kind", INTERLEAVED_AS)
def test_interleaved_rows_give_the_plain_bits(lib: ctypes.CDLL, kind: str) -> None:
    """q4_kx8 and q6_kx8 (N = 40: on AVX-512 the last 16 rows are one group) dequantize to
    gguf's bits, their int8 path gives the plain rows' bits at every M (tuned and reference)
    and linear_f32 their values; the layout moves every byte once, as the bindings' does."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    tuned, reference = QuantKernels(lib), QuantKernels(lib, reference=True)
    n, k, kx8 = 40, 768, INTERLEAVED_AS[kind]
    blocks = superblocks(kind, n, k, rng, extreme=True)
    moved = interleaved(kind, blocks)
    order = interleaved(kind, np.arange(blocks.size).reshape(blocks.shape))
    assert np.array_equal(np.sort(order, None), np.arange(blocks.size))
    assert np.array_equal(moved.reshape(-1), blocks.reshape(-1)[order.reshape(-1)])
    assert not np.array_equal(moved, blocks)
    if kind == "q6_k":  # group 1's superblock 2: 52 runs of 8 dwords, then the 8 rows' d
        group = moved[8:16].reshape(-1)[2 * 8 * 210:3 * 8 * 210]
        assert np.array_equal(group[52 * 32:], blocks[8:16, 2 * 210 + 208:2 * 210 + 210].ravel())
    w8 = QuantBlocks(kx8, torch.from_numpy(moved))
    repacked = QuantizedWeight(kind, torch.from_numpy(blocks.copy()), n, k)
    repacked.repack(kx8)
    assert torch.equal(repacked.blocks, w8.tensor)
    # A fused projection's shards stacked: laid out as written where this library repacks
    # and every shard is whole groups of rows; else joined as they are.
    def stacked(*ends: int) -> QuantizedWeight:
        parts = [QuantizedWeight(kind, torch.from_numpy(blocks[a:b].copy()), b - a, k)
                 for a, b in zip((0, *ends), ends)]
        return QuantizedWeight.stacked(parts, tuned)
    whole, uneven = stacked(16, 40), stacked(4, 40)
    repacks = tuned.types[kind].repack == kx8
    assert whole.kind == (kx8 if repacks else kind) and uneven.kind == kind
    assert torch.equal(whole.blocks, w8.tensor if repacks else torch.from_numpy(blocks))
    assert torch.equal(uneven.blocks, torch.from_numpy(blocks))
    want = torch.from_numpy(gguf.quants.dequantize(blocks, gguf_type(kind)).copy())
    for q in (tuned, reference):
        assert torch.equal(q.dequantize(w8).view(torch.int32), want.view(torch.int32))
    blocks = superblocks(kind, n, k, rng)
    w, w8 = QuantBlocks(kind, torch.from_numpy(blocks)), QuantBlocks(
        kx8, torch.from_numpy(interleaved(kind, blocks)))
    for m in (1, 2, 3, 5, 16, 17, 64, 75):  # 75: q4_kx8's tiles of 32 rows, and 11
        x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
        y8 = tuned.linear(w, x, bias, int8=True)
        assert torch.equal(tuned.linear(w8, x, bias, int8=True), y8), m
        assert torch.equal(reference.linear(w8, x, bias, int8=True), y8), m
        torch.testing.assert_close(tuned.linear(w8, x, bias), tuned.linear(w, x, bias))
    x[1, 300] = float("inf")  # that row through linear_f32, the interleaved row's own
    torch.testing.assert_close(tuned.linear(w8, x, bias, int8=True)[1],
                               tuned.linear(w, x[1:2], bias)[0], equal_nan=True)


@pytest.mark.parametrize("kind", INTERLEAVED_AS)
def test_large_weights_repack_on_several_threads(kind: str) -> None:
    """A weight of over 1 MiB, 65 row groups, moved on the kernels' pool with 3 threads
    allowed (each claims chunks of groups as it comes free): the reference layout's bytes,
    and back."""
    size = gguf.GGML_QUANT_SIZES[gguf_type(kind)][1]
    blocks = np.random.default_rng(5).integers(0, 256, (520, 32 * size), dtype=np.uint8)
    weight = QuantizedWeight(kind, torch.from_numpy(blocks.copy()), 520, 32 * 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        weight.repack(INTERLEAVED_AS[kind])
        assert np.array_equal(weight.blocks.numpy(), interleaved(kind, blocks))
        weight.repack(kind)
    finally:
        torch.set_num_threads(threads)
    assert np.array_equal(weight.blocks.numpy(), blocks)
