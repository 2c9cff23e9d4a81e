"""Bindings of the kernel table's block-quantized matmuls (csrc/block_types.h), for
`v1.models.layers.quantized.QuantizedWeight`.

The table is read from the library at bind time (`BlockType`: each weight type's name, block
layout and kernels); a library whose table disagrees with the GGUF formats, or whose structs
disagree with the mirrors (`structs.check_layout`), is refused with `LayoutError`. Each call
checks what the C assumes (ValueError naming the argument): uint8 contiguous blocks
[N, K / block elems * block bytes]; fp32 activations [M, K], each row contiguous; fp32 bias of
exactly [N] (a broadcastable one would be read past its end); all on the CPU. Outputs are fp32.
"""

import ctypes
import functools
from dataclasses import dataclass

import torch

from v1.kernels.library import library
from v1.kernels.structs import CStruct, LayoutError, View, c_layout, check_layout, packer
from v1.kernels.tensors import stamp

# The weight types a `QuantizedWeight` holds: GGUF's block types by their lower-case names (the
# kernel table's row names), as (values per block, bytes per block), exactly gguf's
# GGML_QUANT_SIZES; beside them our layouts of the same blocks (`INTERLEAVED`). A weight's
# in_features is a whole number of its type's blocks. f16 / bf16 are "blocks" of one value. A
# library's table must agree with these sizes for every type both know; which types it has
# kernels for is its own (`QuantKernels.runs`).
BLOCK_SIZES = {
    "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210), "f16": (1, 2), "bf16": (1, 2),
    "q4_1x8": (32, 20), "q8_0x8": (32, 34), "q4_kx8": (256, 144), "q6_kx8": (256, 210),
}
# kind -> (the GGUF kind whose blocks it holds, rows): each group of `rows` rows stores its
# blocks b together, the block read as dwords, dword f of row i at 4 (rows f + i) from the
# group's block b (csrc/block_q4_1x8.c), then the bytes past a block's last whole dword (q6_k:
# its 2 of d), row by row. The same bytes, moved.
INTERLEAVED = {"q4_1x8": ("q4_1", 8), "q8_0x8": ("q8_0", 8), "q4_kx8": ("q4_k", 8),
               "q6_kx8": ("q6_k", 8)}
# Bytes at the start of a block moved to its end before it is read as dwords: q8_0's fp16 d,
# so that its 32 quants are the whole dwords and d the bytes past them (csrc/block_q8_0x8.c).
LEADING = {"q8_0x8": 2}
# The GGUF types among them (a file stores these).
GGUF_KINDS = frozenset(kind for kind in BLOCK_SIZES if kind not in INTERLEAVED)
# By the C's INT8_ISA (csrc/isa.h).
INT8_ISAS = ("portable", "avx2", "avx_vnni", "avx512_vnni", "neon_dotprod", "neon")
_F32 = torch.float32


class Matmul(CStruct):
    """`struct v1_matmul`: one call of a block kernel."""

    c_name = "v1_matmul"
    _fields_ = [("w", View), ("x", View), ("bias", ctypes.c_void_p), ("out", View),
                ("type", ctypes.c_int32), ("nthreads", ctypes.c_int32)]


_MATMUL = packer(Matmul)  # w, x (views: data, rows, cols, stride), bias, out, type, nthreads


def _row_mirror(kernel_count: int) -> type[CStruct]:
    class BlockTypeRow(CStruct):
        """`struct v1_block_type`: a row of the kernel table."""

        c_name = "v1_block_type"
        _fields_ = [("name", ctypes.c_char_p), ("block_elems", ctypes.c_int32),
                    ("block_bytes", ctypes.c_int32), ("interleave", ctypes.c_int32),
                    ("repack", ctypes.c_char_p),
                    ("kernels", ctypes.c_void_p * kernel_count),
                    ("reference", ctypes.c_void_p * kernel_count)]

    return BlockTypeRow


@dataclass(frozen=True, slots=True)
class BlockType:
    """A row of the library's kernel table: a weight type's block layout and the kernels it
    has (tuned for the library's ISA; `reference`: the plain C ones)."""

    name: str
    code: int  # its row
    block_elems: int
    block_bytes: int
    interleave: int  # rows whose blocks are stored interleaved (1: GGUF's layout)
    repack: str | None  # the row this library runs such blocks faster in, interleaved
    kernels: frozenset[str]
    reference: frozenset[str]


def block_types(lib: ctypes.CDLL) -> dict[str, BlockType]:
    """The kernel table of `lib`, by type name, its mirrors checked (LayoutError)."""
    return _table(lib)[0]


def kernel_index(lib: ctypes.CDLL, kernel: str) -> int:
    """Where `kernel` ("linear_f32", "linear_i8", "dequantize") sits in a row of `lib`'s
    table: the index the C calls it by."""
    return _table(lib)[1].index(kernel)


@functools.cache
def _table(lib: ctypes.CDLL) -> tuple[dict[str, BlockType], tuple[str, ...]]:
    """(the table, the kernels' names by their index in a row)."""
    name_of = lib.v1_block_kernel_name
    name_of.argtypes = [ctypes.c_int32]
    name_of.restype = ctypes.c_char_p
    names = []
    while (name := name_of(len(names))) is not None:
        names.append(name.decode())
    row = _row_mirror(len(names))
    check_layout(c_layout(lib), View, Matmul, row)
    get = lib.v1_block_types
    get.argtypes = [ctypes.POINTER(ctypes.c_int32)]
    get.restype = ctypes.POINTER(row)
    count = ctypes.c_int32()
    rows = get(ctypes.byref(count))
    table = {}
    for code in range(count.value):
        r = rows[code]
        t = BlockType(r.name.decode(), code, r.block_elems, r.block_bytes, r.interleave,
                      r.repack.decode() if r.repack else None,
                      frozenset(n for n, fn in zip(names, r.kernels) if fn),
                      frozenset(n for n, fn in zip(names, r.reference) if fn))
        ours = BLOCK_SIZES.get(t.name)
        if ours is not None and (t.block_elems, t.block_bytes) != ours:
            raise LayoutError(f"the kernel library's {t.name} blocks are {t.block_elems} values "
                              f"in {t.block_bytes} bytes, GGUF's {ours[0]} in {ours[1]}")
        interleave = INTERLEAVED.get(t.name, (t.name, 1))[1]
        if ours is not None and t.interleave != interleave:
            raise LayoutError(f"the kernel library's {t.name} interleaves {t.interleave} rows, "
                              f"ours {interleave}")
        table[t.name] = t
    return table, tuple(names)


class QuantKernels:
    """The matmul paths of one library: `linear` (fp32 or int8 activations) and
    `dequantize` (the whole weight, for the dense path); with `reference`, the table's plain
    C kernels instead of the tuned ones (for tests: one thread, slow)."""

    __slots__ = ("_run", "_index", "_reference", "types", "int8_isa")

    def __init__(self, lib: ctypes.CDLL, reference: bool = False) -> None:
        self.types, names = _table(lib)
        self._index = {name: i for i, name in enumerate(names)}
        self._reference = int(reference)
        self._run = lib.v1_block_run  # (kernel, reference, struct v1_matmul *)
        self._run.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p]  # _MATMUL's
        self._run.restype = ctypes.c_int32
        lib.v1_block_int8_isa.restype = ctypes.c_int32
        self.int8_isa = INT8_ISAS[lib.v1_block_int8_isa()]

    def has(self, kind: str, kernel: str) -> bool:
        """Whether this library's table has `kernel` ("linear_f32", "linear_i8",
        "dequantize") for `kind` blocks."""
        row = self.types.get(kind)
        return row is not None and kernel in row.kernels

    def runs(self, kind: str) -> bool:
        """Whether this library runs `kind` blocks: it has their fp32 matmul and their
        dequantization (the int8 matmul is optional: without it such a weight's rows take
        the fp32 path)."""
        return self.has(kind, "linear_f32") and self.has(kind, "dequantize")

    def linear(
        self, w: "QuantBlocks", x: torch.Tensor, bias: torch.Tensor | None, int8: bool = False
    ) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) as a new fp32 [M, N], W [N, K] the weight `w` holds;
        `int8`: through int8 activations (see csrc/block_tiles.h). M may be 0."""
        w_ptr = w.checked(self.types)
        N, K = w.N, w.K
        strides = x.stride()
        if x.dtype is not _F32 or not x.is_cpu or len(strides) != 2:
            raise ValueError(f"x must be fp32 [M, {K}] on the CPU, got {x.dtype} "
                             f"{list(x.shape)} on {x.device}")
        M, k = x.shape
        if k != K or strides[1] != 1:  # rows any distance apart, overlapping too (reads)
            raise ValueError(f"x must be [M, {K}] with contiguous rows, got {list(x.shape)} "
                             f"strides {strides}")
        if bias is not None and (
            bias.dtype is not _F32 or not bias.is_cpu or bias.shape != (N,)
            or bias.stride(0) != 1
        ):
            raise ValueError(f"bias must be contiguous fp32 [{N}] on the CPU, got {bias.dtype} "
                             f"{list(bias.shape)} strides {bias.stride()} on {bias.device}")
        out = x.new_empty(M, N)  # x's dtype, fp32, whatever torch's default
        if M == 0:
            return out
        call = _MATMUL.pack(w_ptr, N, K, w.row_bytes, x.data_ptr(), M, K, strides[0],
                            0 if bias is None else bias.data_ptr(), out.data_ptr(), M, N, N,
                            w.code, torch.get_num_threads())
        self._call("linear_i8" if int8 else "linear_f32", w, call, f"a {M} x {K} matmul")
        return out

    def dequantize(self, w: "QuantBlocks") -> torch.Tensor:
        """The weight `w` holds as a new fp32 [N, K]."""
        w_ptr = w.checked(self.types)
        out = torch.empty(w.N, w.K, dtype=torch.float32)
        call = _MATMUL.pack(w_ptr, w.N, w.K, w.row_bytes, 0, 0, 0, 0, 0, out.data_ptr(), w.N,
                            w.K, w.K, w.code, torch.get_num_threads())
        self._call("dequantize", w, call, f"dequantizing a {w.N} x {w.K} weight")
        return out

    def _call(self, kernel: str, w: "QuantBlocks", call: bytes, what: str) -> None:
        status = self._run(self._index[kernel], self._reference, call)
        if status == -1:
            raise MemoryError(f"no scratch memory for {what}")
        if status:
            raise ValueError(f"{w.kind} blocks have no {kernel} kernel in this library")


class QuantBlocks:
    """A weight's blocks as the kernels take them: uint8 [N, K / block elems * block bytes],
    contiguous, on the CPU, N a multiple of the type's rows interleaved. Checked when first
    used and again whenever the tensor may have changed in place since (`tensors.stamp`), not
    on every call (the checks were a tenth of a batch-1 matmul). The tensor is held, so its
    memory stays the kernels' to read."""

    __slots__ = ("kind", "tensor", "N", "K", "code", "row_bytes", "_stamp")

    def __init__(self, kind: str, tensor: torch.Tensor) -> None:
        self.kind, self.tensor = kind, tensor
        self.N = self.K = self.code = self.row_bytes = 0
        self._stamp = (0, -1)  # no tensor's

    def checked(self, types: dict[str, BlockType]) -> int:
        """The blocks' address, after checking them against their row of the kernel table
        `types` if they may have changed since."""
        t = self.tensor
        now = stamp(t)
        if now != self._stamp:
            row = types.get(self.kind)
            if row is None:
                raise ValueError(f"kind {self.kind!r} is not one of {sorted(types)}")
            self.N, self.K = _check_blocks(row, t)
            self.code, self.row_bytes = row.code, t.shape[1]
            self._stamp = now
        return now[0]


def _check_blocks(row: BlockType, blocks: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a weight's blocks of type `row`, checked."""
    if (
        blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_cpu
        or not blocks.is_contiguous() or blocks.shape[1] % row.block_bytes
        or blocks.shape[1] == 0 or blocks.shape[0] % row.interleave
    ):
        raise ValueError(f"blocks ({row.name}) must be contiguous uint8 [N, K / "
                         f"{row.block_elems} * {row.block_bytes}] on the CPU, N a multiple of "
                         f"{row.interleave}, got {blocks.dtype} {list(blocks.shape)} on "
                         f"{blocks.device}")
    return blocks.shape[0], blocks.shape[1] // row.block_bytes * row.block_elems


def kernels(lib: ctypes.CDLL | None = None) -> QuantKernels | None:
    """The quant kernels of `lib` (default: this process's library), or None without one."""
    lib = library() if lib is None else lib
    return None if lib is None else _bind(lib)


@functools.cache
def _bind(lib: ctypes.CDLL) -> QuantKernels:
    return QuantKernels(lib)
