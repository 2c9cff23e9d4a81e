"""The kernel table (csrc/block_types.h) and the structs the entry points take: the bindings'
ctypes mirrors match the C layouts (a mirror that does not is refused), the bindings take
each weight type's block layout and kernels from the C table, and every tuned kernel agrees
with its plain C reference (the int8 path bit for bit) in every variant this CPU runs."""

import ctypes
import dataclasses
import itertools
import platform

import pytest
import torch

from tests.kernels.test_gguf_types import quantized
from v1.kernels import block_matmul, fused_step, library
from v1.kernels.attention import PagedDecodeIO, PagedDecodeStep
from v1.kernels.block_matmul import (
    BLOCK_SIZES,
    INTERLEAVED,
    Matmul,
    QuantBlocks,
    QuantKernels,
    block_types,
    kernels,
)
from v1.kernels.structs import CStruct, LayoutError, View, c_layout, check_layout
from v1.kernels.variants import cpu_flags
from v1.models.layers.quantized import QUANTIZE_KINDS, QuantizedWeight

pytestmark = pytest.mark.skipif(library.library() is None, reason="no C kernels")

MIRRORS = (View, Matmul, PagedDecodeStep, PagedDecodeIO, fused_step._Proj, fused_step._Layer,
           fused_step._Dims, fused_step._Scratch, fused_step._Ends, fused_step._Call)


def variants() -> list[ctypes.CDLL]:
    names = library.candidates("", platform.machine(), cpu_flags())
    libs = [library.load_variant(name) for name in names]
    return [lib for lib in libs if not isinstance(lib, str)]


@pytest.mark.parametrize("lib", variants(), ids=lambda lib: lib._name.rsplit("/", 1)[-1])
def test_every_mirror_matches_its_struct(lib: ctypes.CDLL) -> None:
    layout = c_layout(lib)
    table_row = block_matmul._row_mirror(len(block_matmul._table(lib)[1]))
    check_layout(layout, *MIRRORS, table_row)
    # Every struct the C describes has its mirror here, and each mirror is what it names.
    assert set(layout) == {m.c_name for m in (*MIRRORS, table_row)}
    assert layout["v1_matmul"]["w"] == (0, ctypes.sizeof(View))


def test_a_mirror_that_disagrees_is_refused() -> None:
    layout = c_layout(library.library())

    class Swapped(CStruct):  # rows and cols swapped: same size, other offsets
        c_name = "v1_view"
        _fields_ = [("data", ctypes.c_void_p), ("cols", ctypes.c_int64),
                    ("rows", ctypes.c_int64), ("stride", ctypes.c_int64)]

    class Narrow(CStruct):  # an int32 where the C has an int64
        c_name = "v1_view"
        _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int32),
                    ("cols", ctypes.c_int64), ("stride", ctypes.c_int64)]

    class Missing(CStruct):  # a field short
        c_name = "v1_view"
        _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_int64),
                    ("cols", ctypes.c_int64)]

    class Unknown(CStruct):
        c_name = "v1_no_such_struct"
        _fields_ = [("data", ctypes.c_void_p)]

    for mirror in (Swapped, Narrow, Missing):
        with pytest.raises(LayoutError, match="struct v1_view"):
            check_layout(layout, mirror)
    with pytest.raises(LayoutError, match="no struct v1_no_such_struct"):
        check_layout(layout, Unknown)
    # The library's side moved: a field at another offset than the mirror's.
    moved = {**layout, "v1_matmul": {**layout["v1_matmul"], "type": (4, 4)}}
    with pytest.raises(LayoutError, match="v1_matmul.*type"):
        check_layout(moved, Matmul)


def test_the_bindings_read_the_table() -> None:
    lib = library.library()
    q = kernels(lib)
    types = block_types(lib)
    assert q.types is types
    # The C's rows, in its order: GGUF's layouts and ours, every kernel, tuned and reference
    # (f16 and bf16 have no int8 path).
    assert list(types) == ["q4_1", "q4_1x8", "q8_0", "q8_0x8", "q4_0", "q5_0", "q5_1", "f16",
                           "bf16", "q4_k", "q4_kx8", "q5_k", "q6_k", "q6_kx8"]
    for code, (name, t) in enumerate(types.items()):
        assert (t.name, t.code, (t.block_elems, t.block_bytes)) == (name, code,
                                                                    BLOCK_SIZES[name])
        assert t.interleave == INTERLEAVED.get(name, (name, 1))[1]
        int8 = {"linear_i8"} if name not in ("f16", "bf16") else set()
        assert t.kernels == t.reference == {"linear_f32", "dequantize", *int8}
    # A row another one's blocks are repacked into holds that one's blocks.
    assert all(INTERLEAVED[t.repack][0] == t.name for t in types.values() if t.repack)
    # A library whose interleave disagrees with ours is refused.
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(INTERLEAVED, "q4_1x8", ("q4_1", 4))
        with pytest.raises(LayoutError, match="q4_1x8 interleaves 8 rows, ours 4"):
            block_matmul._table.__wrapped__(lib)
    # A weight's shape is read through its row: other block bytes, another K.
    blocks = torch.zeros(3, 40, dtype=torch.uint8)
    w = QuantBlocks("q4_1", blocks)
    w.checked(types)
    assert (w.N, w.K, w.code, w.row_bytes) == (3, 64, 0, 40)
    other = {"q4_1": dataclasses.replace(types["q4_1"], block_bytes=10, block_elems=16)}
    w = QuantBlocks("q4_1", blocks)
    w.checked(other)
    assert (w.N, w.K) == (3, 64)  # 4 blocks of 10 bytes, 16 values each
    with pytest.raises(ValueError, match="not one of"):
        QuantBlocks("q8_0", blocks).checked(other)
    # Interleaved rows come in whole groups.
    with pytest.raises(ValueError, match="N a multiple of 8"):
        QuantBlocks("q4_1x8", blocks).checked(types)


def _weights(kind: str, n: int, k: int, gen: torch.Generator) -> QuantBlocks:
    w = torch.randn(n, k, generator=gen)
    if kind in QUANTIZE_KINDS or kind in INTERLEAVED:  # ours (q4_1x8) among them
        return QuantBlocks(kind, QuantizedWeight.quantize(w, kind).blocks)
    return QuantBlocks(kind, quantized(kind, w))


@pytest.mark.parametrize("lib", variants(), ids=lambda lib: lib._name.rsplit("/", 1)[-1])
def test_tuned_kernels_match_their_reference(lib: ctypes.CDLL) -> None:
    tuned, reference = kernels(lib), QuantKernels(lib, reference=True)
    gen = torch.Generator().manual_seed(0)
    for kind, t in block_types(lib).items():
        if t.block_elems > 32:  # the K-quants: test_block_kquants.py
            continue
        for rows, k in ((1, 32), (17, 64), (33, 96)):
            n = -(-rows // t.interleave) * t.interleave  # whole groups of interleaved rows
            w = _weights(kind, n, k, gen)
            deq = reference.dequantize(w)
            torch.testing.assert_close(tuned.dequantize(w), deq, rtol=1e-6, atol=1e-6)
            # tile_i8_few in one group, in groups (the last one short), tile_i8 (past
            # GROUPED_ROWS_MAX: 64 rows with AVX2, 128 with AVX-512).
            for m in (1, 3, 5, 16, 17, 40, 130):
                x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
                # The int8 path: the same bits, whichever tile serves the rows.
                if "linear_i8" in t.kernels:
                    assert torch.equal(tuned.linear(w, x, bias, int8=True),
                                       reference.linear(w, x, bias, int8=True)), (kind, n, k, m)
                torch.testing.assert_close(tuned.linear(w, x, None),
                                           reference.linear(w, x, None), rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(reference.linear(w, x, bias), x @ deq.T + bias,
                                           rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lib", variants(), ids=lambda lib: lib._name.rsplit("/", 1)[-1])
def test_interleaved_blocks_give_the_plain_bits(lib: ctypes.CDLL) -> None:
    """q4_1 and q8_0 blocks repacked as q4_1x8, q8_0x8: the int8 path gives the same bits as
    from GGUF's layout, dequantize the same values and the fp32 path the same within rounding
    (q8_0's larger products: 1e-5), at every tile (a last half vector of rows with 16 lanes:
    N = 40)."""
    q = kernels(lib)
    gen = torch.Generator().manual_seed(1)
    for (kind, x8), (n, k) in itertools.product((("q4_1", "q4_1x8"), ("q8_0", "q8_0x8")),
                                               ((40, 64), (16, 96))):
        plain = QuantizedWeight.quantize(torch.randn(n, k, generator=gen), kind)
        moved = QuantizedWeight(kind, plain.blocks.clone(), n, k)
        moved.repack(x8)
        assert not torch.equal(moved.blocks, plain.blocks)
        a, b = plain.kernel_blocks(), moved.kernel_blocks()
        assert torch.equal(q.dequantize(a), q.dequantize(b))
        for m in (1, 2, 5, 8, 16, 17, 40, 130):
            x, bias = torch.randn(m, k, generator=gen), torch.randn(n, generator=gen)
            assert torch.equal(q.linear(a, x, bias, int8=True), q.linear(b, x, bias, int8=True))
            tol = 1e-6 if kind == "q4_1" else 1e-5
            torch.testing.assert_close(q.linear(a, x, bias), q.linear(b, x, bias), rtol=tol,
                                       atol=tol)


def test_library_takes_an_explicit_setting(monkeypatch) -> None:
    monkeypatch.setenv("V1_CPU_KERNELS", "0")
    assert library.library() is None
    assert library.library(" OFF ") is None
    assert library.library("1") is not None  # the argument, not the environment
    monkeypatch.setenv("V1_CPU_KERNELS", "1")
    assert library.library() is library.library("1")
