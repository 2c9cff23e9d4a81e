"""Bindings of the paged decode kernel and cache write (csrc/paged_decode.h), for the torch
attention backend (`v1.attention.backends.torch_attn`).

`PagedDecodeKernel.bind` checks a step's entries once per step and cache shape (block ids
against the cache, the table's width against the longest entry, slots against its capacity,
every index against what it indexes); each layer's call then checks its tensors (dtypes, shapes,
contiguous heads per row, else copied; fp32 outputs with contiguous rows). Anything else raises
ValueError naming the argument.
"""

import ctypes
import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from v1.kernels.library import library
from v1.kernels.structs import CStruct, View, c_layout, check_layout, packer

_F32 = torch.float32

# Cache dtype -> the entry point's suffix. fp16 needs F16C: the portable library has none,
# and torch reads such caches.
KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# The kernel keeps an entry's queries and sums (2 H D floats) on its thread's stack (a
# group of a request's rows: up to 8 entries, fewer past 8192 floats: csrc/paged_decode.h).
MAX_HEAD_FLOATS = 64 * 128


class PagedDecodeStep(CStruct):
    """`struct paged_decode_step` (csrc/kernels.h): what every layer's call of a step
    shares, passed by address (converting it per call, as ctypes arguments, was most of what
    a batch-1 call cost)."""

    c_name = "paged_decode_step"

    _fields_ = [
        ("table", ctypes.c_void_p), ("table_row", ctypes.c_int64),
        ("table_rows", ctypes.c_void_p), ("tok", ctypes.c_void_p),
        ("start", ctypes.c_void_p), ("end", ctypes.c_void_p), ("R", ctypes.c_int64),
        ("slots", ctypes.c_void_p), ("num_slots", ctypes.c_int64),
        ("KVH", ctypes.c_int64), ("D", ctypes.c_int64),
        ("B", ctypes.c_int64), ("half", ctypes.c_int64), ("nthreads", ctypes.c_int64),
    ]


class PagedDecodeIO(CStruct):
    """`struct paged_decode_io` (csrc/kernels.h): one layer's call."""

    c_name = "paged_decode_io"
    _fields_ = [("q", View), ("k", View), ("v", View), ("out", View),
                ("lse", ctypes.c_void_p), ("cache", ctypes.c_void_p), ("scale", ctypes.c_float)]


# q, k, v, out (views: data, rows, cols, stride), lse, cache, scale
_IO = packer(PagedDecodeIO)


@dataclass(slots=True)
class BoundStep:
    """A step's entries checked against caches of one shape (`PagedDecodeKernel.bind`). It
    keeps the tensors the struct points into alive."""

    struct: PagedDecodeStep
    address: int
    cache_shape: torch.Size
    tensors: tuple[torch.Tensor, ...]
    max_token: int  # the highest query row an entry reads (-1: none)
    num_slots: int


class PagedDecodeKernel:
    """One cache dtype's `v1_paged_decode_*`: attends query rows to K/V read in place through
    the block table, and stores the step's new K/V first if given."""

    def __init__(self, decode: ctypes._CFuncPtr, kv_dtype: torch.dtype) -> None:
        decode.argtypes = [ctypes.c_void_p, ctypes.c_char_p]  # (step, _IO's bytes)
        decode.restype = None
        self._decode = decode
        self.kv_dtype = kv_dtype

    def bind(
        self, table: torch.Tensor, table_rows: torch.Tensor, tokens: torch.Tensor,
        start: torch.Tensor, end: torch.Tensor, slots: torch.Tensor, kv_cache: torch.Tensor,
    ) -> BoundStep:
        """The step for caches shaped as `kv_cache` [2, num_blocks, B, KVH, D]: entry i reads
        query row tokens[i] and key positions [start[i], end[i]) through block-table row
        table_rows[i] of `table` (int32 [num_reqs, width]); new K/V row j goes to flat slot
        slots[j] (negative: padding). Every index is checked against what it indexes (in
        numpy: on these few-element arrays, a torch reduction costs several times more)."""
        self.check_cache(kv_cache, kv_cache.shape)
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        if (
            table.dtype is not torch.int32 or table.dim() != 2 or not table.is_contiguous()
            or not table.is_cpu
        ):
            raise ValueError(f"table must be contiguous int32 [num_reqs, width] on the CPU, got "
                             f"{table.dtype} {list(table.shape)}")
        entries = (table_rows, tokens, start, end)
        n = table_rows.shape[0] if table_rows.dim() == 1 else -1
        for name, t in (*zip(("table_rows", "tokens", "start", "end"), entries),
                        ("slots", slots)):
            if t.dtype is not torch.int64 or t.dim() != 1 or t.stride(0) != 1 or not t.is_cpu or (
                name != "slots" and t.shape[0] != n
            ):
                raise ValueError(f"{name} must be contiguous int64 [{n if n >= 0 else 'R'}] "
                                 f"on the CPU, got {t.dtype} {list(t.shape)}")
        capacity = num_blocks * block_size
        if slots.shape[0] and int(slots.numpy().max()) >= capacity:
            raise ValueError(f"slot {int(slots.numpy().max())} is past the cache's {capacity} "
                             f"slots")
        max_token = -1
        if n > 0:
            lo, hi, backwards = _bounds(entries)
            if lo[0] < 0 or hi[0] >= table.shape[0]:
                raise ValueError(f"table row {lo[0] if lo[0] < 0 else hi[0]} is outside the "
                                 f"block table's {table.shape[0]} rows")
            if lo[1] < 0:
                raise ValueError(f"query row {lo[1]} is negative")
            if lo[2] < 0 or backwards:
                raise ValueError("key positions must satisfy 0 <= start <= end")
            # The kernel reads blocks through the table unchecked: a row too short for a
            # sequence, or a block id outside the cache, would read past them.
            if -(-hi[3] // block_size) > table.shape[1]:
                raise ValueError(f"{hi[3]} keys need more than the block table's "
                                 f"{table.shape[1]} blocks of {block_size}")
            if table.numel():
                ids = table.numpy()
                t_lo, t_hi = int(ids.min()), int(ids.max())
                if t_lo < 0 or t_hi >= num_blocks:
                    raise ValueError(f"block id {t_lo if t_lo < 0 else t_hi} is outside the "
                                     f"cache's {num_blocks} blocks")
            max_token = hi[1]
        half = num_blocks * block_size * num_kv_heads * head_dim  # K's (V's) values
        struct = PagedDecodeStep(
            table.data_ptr(), table.stride(0), table_rows.data_ptr(), tokens.data_ptr(),
            start.data_ptr(), end.data_ptr(), max(n, 0), slots.data_ptr(), slots.shape[0],
            num_kv_heads, head_dim, block_size, half, torch.get_num_threads(),
        )
        return BoundStep(struct, ctypes.addressof(struct), kv_cache.shape,
                         (table, *entries, slots), max_token, slots.shape[0])

    def __call__(
        self, step: BoundStep, query: torch.Tensor | None, kv_cache: torch.Tensor,
        out: torch.Tensor | None, lse: torch.Tensor | None, scale: float,
        key: torch.Tensor | None = None, value: torch.Tensor | None = None,
    ) -> None:
        """Attend the step's entries (query [T, H, D] fp32 into out, same shape, and lse
        [T, H] if given; query None: none), after storing key / value (fp32 [n, KVH, D],
        n >= the step's slots) at the step's slots if given: in one call, as a layer's call
        costs more than its work at batch 1. (Each shape is read once: docs/kernels.md.)"""
        self.check_cache(kv_cache, step.cache_shape)
        _, _, _, num_kv_heads, head_dim = step.cache_shape
        k = v = q = o = (0, 0, 0, 0)
        lse_ptr = 0
        if key is not None or value is not None:
            if key is None or value is None:
                raise ValueError("key and value go together")
            for name, t in (("key", key), ("value", value)):
                # It copies the cache's KVH * D values per row: other rows would be read past.
                shape = t.shape
                if t.dtype is not _F32 or not t.is_cpu or len(shape) != 3 or (
                    shape[1] != num_kv_heads or shape[2] != head_dim
                    or shape[0] < step.num_slots
                ):
                    raise ValueError(f"{name} must be fp32 [>= {step.num_slots}, "
                                     f"{num_kv_heads}, {head_dim}], got {t.dtype} {list(shape)}")
            key, value = rows_contiguous(key, head_dim), rows_contiguous(value, head_dim)
            width = num_kv_heads * head_dim
            k = (key.data_ptr(), key.shape[0], width, key.stride(0))
            v = (value.data_ptr(), value.shape[0], width, value.stride(0))
        if query is not None:
            shape = query.shape
            if query.dtype is not _F32 or not query.is_cpu or len(shape) != 3 or (
                shape[2] != head_dim or shape[1] % num_kv_heads
                or shape[1] * head_dim > MAX_HEAD_FLOATS or shape[0] <= step.max_token
            ):
                raise ValueError(f"query must be fp32 [> {step.max_token}, a multiple of "
                                 f"{num_kv_heads} heads, {head_dim}], got {query.dtype} "
                                 f"{list(shape)}")
            if out is None or out.dtype is not _F32 or not out.is_cpu or out.shape != shape:
                raise ValueError(f"out must be fp32 {list(shape)} on the CPU, got "
                                 f"{None if out is None else (out.dtype, list(out.shape))}")
            out_strides = out.stride()
            if out_strides[2] != 1 or out_strides[1] != head_dim:
                raise ValueError(f"out must have contiguous rows, got strides {out_strides}")
            if lse is not None and (
                lse.dtype is not _F32 or not lse.is_cpu or lse.shape != shape[:2]
                or not lse.is_contiguous()
            ):
                raise ValueError(f"lse must be contiguous fp32 {list(shape[:2])}, got "
                                 f"{lse.dtype} {list(lse.shape)}")
            query = rows_contiguous(query, head_dim)
            width = shape[1] * head_dim
            q = (query.data_ptr(), shape[0], width, query.stride(0))
            o = (out.data_ptr(), shape[0], width, out_strides[0])
            lse_ptr = 0 if lse is None else lse.data_ptr()
        self._decode(step.address, _IO.pack(*q, *k, *v, *o, lse_ptr, kv_cache.data_ptr(), scale))

    def check_cache(self, kv_cache: torch.Tensor, shape: torch.Size) -> None:
        """`kv_cache` contiguous, of this kernel's dtype and of `shape` [2, num_blocks,
        block_size, kv_heads, head_size % 8 == 0], on the CPU."""
        if (
            kv_cache.dtype is not self.kv_dtype or not kv_cache.is_cpu
            or not kv_cache.is_contiguous() or kv_cache.shape != shape
            or len(shape) != 5 or shape[0] != 2 or shape[4] % 8
        ):
            raise ValueError(f"kv_cache must be contiguous {self.kv_dtype} {list(shape)} "
                             f"[2, num_blocks, block_size, kv_heads, head_size % 8 == 0] on "
                             f"the CPU, got {kv_cache.dtype} {list(kv_cache.shape)}")


# Up to this many entries `_bounds` reads them as Python lists: numpy's per-call cost is most
# of what checking a decode step's few entries takes (docs/benchmarks.md, "Fused decode step").
LIST_MAX_ENTRIES = 32


def _bounds(entries: tuple[torch.Tensor, ...]) -> tuple[list[int], list[int], bool]:
    """The least and greatest value of each int64 [n >= 1] tensor of (table_rows, tokens,
    start, end), and whether any entry ends before its start."""
    if entries[0].shape[0] <= LIST_MAX_ENTRIES:
        lists = [t.tolist() for t in entries]
        return ([min(x) for x in lists], [max(x) for x in lists],
                any(map(int.__lt__, lists[3], lists[2])))
    e = np.stack([t.numpy() for t in entries])
    return e.min(axis=1).tolist(), e.max(axis=1).tolist(), bool((e[3] < e[2]).any())


def rows_contiguous(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`x` [n, heads, head_dim] with each row's heads * head_dim values contiguous (rows may
    be strided, as the query's and key's are in the fused q | k | v projection), copied if
    they are not."""
    strides = x.stride()
    if strides[2] != 1 or strides[1] != head_dim:
        return x.contiguous()
    return x


def paged_decode_kernel(
    kv_cache: torch.Tensor, num_heads: int, query_dtype: torch.dtype = torch.float32,
    lib: ctypes.CDLL | None | Literal["process"] = "process",
) -> PagedDecodeKernel | None:
    """The kernel for this cache (CPU, fp32 / bf16 / fp16 where the library has it,
    contiguous, head size a multiple of 8, not too many heads) and fp32 queries, if this
    process has kernels (`lib`: a library, None for none, or "process": this process's,
    looked up with `v1.kernels.library`); else None."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    if (
        kv_cache.device.type != "cpu"
        or kv_cache.dtype not in KV_DTYPES
        or query_dtype != torch.float32
        or not kv_cache.is_contiguous()
        or head_dim % 8
        or num_heads % num_kv_heads
        or num_heads * head_dim > MAX_HEAD_FLOATS
    ):
        return None
    if lib == "process":
        lib = library()
    return None if lib is None else _bind(lib, kv_cache.dtype)


@functools.cache
def _bind(lib: ctypes.CDLL, kv_dtype: torch.dtype) -> PagedDecodeKernel | None:
    """None where the library lacks this dtype's kernel (fp16 without F16C)."""
    decode = getattr(lib, f"v1_paged_decode_{KV_DTYPES[kv_dtype]}", None)
    if decode is None:
        return None
    check_layout(c_layout(lib), View, PagedDecodeStep, PagedDecodeIO)
    return PagedDecodeKernel(decode, kv_dtype)
