"""Binding of csrc/interleave.c: a weight's blocks moved between GGUF's layout and an
interleaved one (the layouts: `v1.models.layers.quantized._relayout`), on the kernels' pool."""

import ctypes
import functools
from typing import NamedTuple

import torch

from v1.kernels.library import library

# The most rows a group interleaves (csrc/interleave.c's MAX_ROWS).
MAX_ROWS = 16


class BlockParts(NamedTuple):
    """An interleaved type's block as its layout reads it: its bytes, the leading bytes moved
    to its end, the whole 4-byte words after them, and the bytes moved after the words (the
    leading ones, or those past the last word)."""

    size: int
    lead: int
    dwords: int
    rest: int


class Relayout:
    """`v1_relayout` of one library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.v1_relayout
        i32, i64 = ctypes.c_int32, ctypes.c_int64
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, i64, i64, i32, i32, i32, i32,
                             i32, i32, i32]
        self._fn.restype = None

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, rows: int, parts: BlockParts,
                 interleave: bool) -> None:
        """`src` [N, blocks * size] uint8, GGUF's layout (`interleave`) or ours, moved into
        `dst` (the same shape, not overlapping it) in the other; N a multiple of `rows`."""
        for name, t in (("src", src), ("dst", dst)):
            if (
                t.dtype is not torch.uint8 or not t.is_cpu or t.dim() != 2
                or not t.is_contiguous() or t.shape != src.shape
            ):
                raise ValueError(f"{name} must be contiguous uint8 {list(src.shape)} on the "
                                 f"CPU, got {t.dtype} {list(t.shape)}")
        n, width = src.shape
        size, lead, dwords, rest = parts
        if (
            not 1 <= rows <= MAX_ROWS or min(lead, dwords, rest) < 0 or size < 1
            or n % rows or width % size or (lead and rest != lead)
            or lead + 4 * dwords + (0 if lead else rest) != size
        ):
            raise ValueError(f"blocks [{n}, {width}] are not groups of {rows} rows of "
                             f"{size}-byte blocks of {parts}")
        if src.numel() == 0:
            return
        a, b = src.data_ptr(), dst.data_ptr()
        if a < b + dst.nbytes and b < a + src.nbytes:
            raise ValueError("dst overlaps src")
        self._fn(a, b, n // rows, width // size, rows, size, lead, dwords, rest,
                 int(interleave), torch.get_num_threads())


def relayout(lib: ctypes.CDLL | None = None) -> Relayout | None:
    """The relayout of `lib` (default: this process's library), or None without one."""
    lib = library() if lib is None else lib
    return None if lib is None else _bind(lib)


@functools.cache
def _bind(lib: ctypes.CDLL) -> Relayout:
    return Relayout(lib)
