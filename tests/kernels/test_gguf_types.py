"""The kernel table's q4_0, q5_0, q5_1, f16 and bf16 rows (with q4_1 and q8_0 beside them where
the same check applies), on every variant this CPU runs: `dequantize` gives the gguf package's
bits (random blocks, extreme scales, every half), the matmuls are close to x @ dequantized.T,
and the int8 path gives a row the same bits whatever the call's rows."""

import platform

import gguf
import numpy as np
import pytest
import torch

from tests.worker.test_quant_kernels import close, int8_activations
from v1.kernels import library, variants
from v1.kernels.block_matmul import QuantBlocks, QuantKernels

pytestmark = pytest.mark.skipif(library.library() is None, reason="no C kernels")

BLOCKS = ("q4_0", "q5_0", "q5_1", "q4_1", "q8_0")  # 32 values, fp16 scale(s) first
HALVES = ("f16", "bf16")
NEW = ("q4_0", "q5_0", "q5_1", *HALVES)
# fp16 scales at the edges: largest finite (both signs), subnormals, zeros, -1.
EXTREME_SCALES = (0x7BFF, 0xFBFF, 0x0001, 0x03FF, 0x8001, 0x0000, 0x8000, 0xBC00)


def qtype(kind: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[kind.upper()]


def variant_names() -> list[str]:
    return library.candidates("", platform.machine(), variants.cpu_flags())


def paths(variant: str) -> tuple[QuantKernels, QuantKernels]:
    """The variant's tuned and reference kernels."""
    lib = library.load_variant(variant)
    assert not isinstance(lib, str), lib
    return QuantKernels(lib), QuantKernels(lib, reference=True)


def same_bits(a: torch.Tensor, b: np.ndarray) -> bool:
    """a and b hold the same floats bit for bit, any NaN equal to any NaN."""
    b = torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32))
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(torch.int32)[~nan],
                                                       b.view(torch.int32)[~nan])


def random_blocks(kind: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """n rows of k values as random bytes, the first blocks' scales (and mins, in another
    order) the extremes (the other blocks' random bytes hold inf and NaN among them)."""
    elems, size = gguf.GGML_QUANT_SIZES[qtype(kind)]
    blocks = torch.randint(0, 256, (n * k // elems, size), dtype=torch.uint8, generator=gen)
    halves = blocks[:, :4 if kind in ("q4_1", "q5_1") else 2].view(torch.int16)
    edge = torch.tensor(EXTREME_SCALES, dtype=torch.int32).to(torch.int16)
    for h in range(halves.shape[1]):
        halves[:len(edge), h] = edge.roll(3 * h)
    return blocks.reshape(n, -1)


def quantized(kind: str, w: torch.Tensor) -> torch.Tensor:
    """w [N, K] stored as `kind`, as a GGUF file holds it."""
    return torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype(kind)).view(np.uint8))


@pytest.mark.parametrize("variant", variant_names())
def test_dequantize_gives_gguf_bits(variant: str) -> None:
    tuned, reference = paths(variant)
    gen = torch.Generator().manual_seed(35)
    for kind in BLOCKS:
        blocks = random_blocks(kind, 24, 96, gen)
        with np.errstate(invalid="ignore"):  # inf x 0
            want = gguf.quants.dequantize(blocks.numpy(), qtype(kind))
        for kernels in (tuned, reference):
            assert same_bits(kernels.dequantize(QuantBlocks(kind, blocks)), want), kind
    # Every half there is, as 256 rows of 256, and rows of 1 .. 37 values (tails).
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.uint8)
    for kind in HALVES:
        for blocks in (every.reshape(256, 512), *(every[:2 * 8 * k].reshape(8, 2 * k)
                                                  for k in (1, 7, 17, 37))):
            want = gguf.quants.dequantize(blocks.numpy(), qtype(kind))
            for kernels in (tuned, reference):
                assert same_bits(kernels.dequantize(QuantBlocks(kind, blocks)), want), (
                    kind, blocks.shape)


@pytest.mark.parametrize("variant", variant_names())
def test_linear_is_close_to_the_dequantized_product(variant: str) -> None:
    """fp32 activations within rounding of x @ W.T, int8 ones of the same product with x
    quantized as the int8 path quantizes it (and the reference's bits); N = 37 ends on a part
    of every tile, K = 97 on a part of every vector (f16, bf16)."""
    tuned, reference = paths(variant)
    gen = torch.Generator().manual_seed(36)
    for kind in NEW:
        k = 97 if kind in HALVES else 96
        blocks = QuantBlocks(kind, quantized(kind, torch.randn(37, k, generator=gen)))
        deq = reference.dequantize(blocks)
        assert torch.equal(tuned.dequantize(blocks), deq)
        for m in (1, 2, 5, 16, 17, 64):
            x, bias = torch.randn(m, k, generator=gen), torch.randn(37, generator=gen)
            want = x.double() @ deq.double().T + bias
            for kernels in (tuned, reference):
                close(kernels.linear(blocks, x, bias), want, x, deq)
            if kind in HALVES:
                with pytest.raises(ValueError, match="no linear_i8"):
                    tuned.linear(blocks, x, bias, int8=True)
                continue
            got = tuned.linear(blocks, x, bias, int8=True)
            assert torch.equal(got, reference.linear(blocks, x, bias, int8=True)), (kind, m)
            close(got, int8_activations(x).double() @ deq.double().T + bias, x, deq)


@pytest.mark.parametrize("variant", variant_names())
def test_int8_rows_are_the_same_in_any_call(variant: str) -> None:
    """As tests/worker/test_quant_kernels.py's for q4_1 and q8_0: a row's int8 result alone
    and inside calls of 2 .. 40, 64, 65, 129 and 130 rows (both int8 tiles), bit for bit."""
    tuned, _ = paths(variant)
    for kind in ("q4_0", "q5_0", "q5_1"):
        for n, k in ((37, 96), (1, 32)):
            g = torch.Generator().manual_seed(n)
            blocks = QuantBlocks(kind, quantized(kind, torch.randn(n, k, generator=g)))
            x, bias = torch.randn(130, k, generator=g), torch.randn(n, generator=g)
            alone = torch.cat([tuned.linear(blocks, x[i:i + 1], bias, int8=True)
                               for i in range(130)])
            for m in (*range(2, 41), 64, 65, 129, 130):
                assert torch.equal(tuned.linear(blocks, x[:m], bias, int8=True), alone[:m]), (
                    kind, n, k, m)
