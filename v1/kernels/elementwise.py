"""Bindings of the elementwise ops (csrc/elementwise.c): RMSNorm fused with the residual add,
RoPE in place, SiLU-and-mul, matching `v1.models.layers.ops.TorchOps` (docs/benchmarks.md,
"Elementwise ops"). Each op takes fp32 CPU tensors whose rows are each contiguous (any
distance apart, as in views of a fused projection), else ValueError naming the argument, and
allocates fp32 contiguous outputs.
"""

import ctypes
import functools

import torch

from v1.kernels.library import library
from v1.kernels.structs import View, c_layout, check_layout, packer
from v1.kernels.tensors import stamp

_F32 = torch.float32
_VIEW = packer(View)  # data, rows, cols, stride


class NativeOps:
    """The ops of `v1.models.layers.ops.TorchOps`, each one C call on the calling thread."""

    __slots__ = ("_norm", "_rope", "_silu_and_mul", "_tables")

    def __init__(self, lib: ctypes.CDLL) -> None:
        check_layout(c_layout(lib), View)
        p, view = ctypes.c_void_p, ctypes.c_char_p  # views: _VIEW's bytes
        self._norm = lib.v1_rms_norm  # (x or NULL, residual, weight, eps, out)
        self._norm.argtypes = [view, view, p, ctypes.c_float, view]
        self._rope = lib.v1_rope  # (qk [rows, heads * D], D, cos, sin)
        self._rope.argtypes = [view, ctypes.c_int64, p, p]
        self._silu_and_mul = lib.v1_silu_and_mul  # (gate_up, out)
        self._silu_and_mul.argtypes = [view, view]
        for fn in (self._norm, self._rope, self._silu_and_mul):
            fn.restype = None
        # The last rope tables checked: (cos, sin, (their stamps, the qk shape)), held.
        self._tables: tuple | None = None

    def rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), the sum written into `residual` in place; with
        no residual, (norm(x), x). x, residual [rows, n]; weight [n]."""
        shape = x.shape
        x_strides = _check_rows("x", x, 2)
        rows, n = shape
        if residual is not None:
            res_strides = _check_rows("residual", residual, 2)
            if residual.shape != shape:
                raise ValueError(f"residual {list(residual.shape)} is not x's {list(shape)}")
        if (
            weight.dtype is not _F32 or not weight.is_cpu or not weight.is_contiguous()
            or weight.shape != (n,)
        ):
            raise ValueError(f"weight must be contiguous fp32 [{n}] on the CPU, got "
                             f"{weight.dtype} {list(weight.shape)} on {weight.device}")
        out = x.new_empty(rows, n)  # x's dtype, fp32, whatever torch's default
        if residual is None:
            residual, x_view, res_strides = x, None, x_strides
        else:
            x_view = _VIEW.pack(x.data_ptr(), rows, n, x_strides[0])
        self._norm(x_view, _VIEW.pack(residual.data_ptr(), rows, n, res_strides[0]),
                   weight.data_ptr(), eps, _VIEW.pack(out.data_ptr(), rows, n, n))
        return out, residual

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """qk [T, heads, D] rotated in place (see TorchOps.rope); cos, sin [T, 1, D]. The
        tables, the same for every layer of a forward, are checked once per forward (see
        `tensors.stamp`)."""
        strides = _check_rows("qk", qk, 3)
        rows, heads, head_dim = qk.shape
        if strides[1] != head_dim or head_dim % 2:
            raise ValueError(f"qk's heads must be contiguous and of even size, got shape "
                             f"{[rows, heads, head_dim]} strides {strides}")
        tables = self._tables
        stamps = (stamp(cos), stamp(sin), qk.shape)
        if tables is None or cos is not tables[0] or sin is not tables[1] or (
            stamps != tables[2]
        ):
            for name, table in (("cos", cos), ("sin", sin)):
                if (
                    table.dtype is not _F32 or not table.is_cpu or not table.is_contiguous()
                    or table.shape != (rows, 1, head_dim)
                ):
                    raise ValueError(f"{name} must be contiguous fp32 [{rows}, 1, {head_dim}] "
                                     f"on the CPU, got {table.dtype} {list(table.shape)}")
            self._tables = (cos, sin, stamps)
        self._rope(_VIEW.pack(qk.data_ptr(), rows, heads * head_dim, strides[0]), head_dim,
                   cos.data_ptr(), sin.data_ptr())
        return qk

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [rows, 2n] = [gate | up]: a new [rows, n]."""
        strides = _check_rows("gate_up", gate_up, 2)
        rows, n2 = gate_up.shape
        if n2 % 2:
            raise ValueError(f"gate_up has {n2} columns: expected gate and up, n each")
        out = gate_up.new_empty(rows, n2 // 2)
        self._silu_and_mul(_VIEW.pack(gate_up.data_ptr(), rows, n2, strides[0]),
                           _VIEW.pack(out.data_ptr(), rows, n2 // 2, n2 // 2))
        return out


def _check_rows(name: str, t: torch.Tensor, dim: int) -> tuple[int, ...]:
    """`t`'s strides, once checked: fp32, `dim`-dimensional, on the CPU, its last dimension
    contiguous."""
    strides = t.stride()
    if t.dtype is not _F32 or not t.is_cpu or len(strides) != dim or strides[-1] != 1:
        raise ValueError(f"{name} must be fp32, {dim}-D, on the CPU, with contiguous rows; got "
                         f"{t.dtype} {list(t.shape)} strides {strides} on {t.device}")
    return strides


def native_ops(lib: ctypes.CDLL | None = None) -> NativeOps | None:
    """The ops of `lib` (default: this process's library), or None without one."""
    lib = library() if lib is None else lib
    return None if lib is None else _bind(lib)


@functools.cache
def _bind(lib: ctypes.CDLL) -> NativeOps:
    return NativeOps(lib)
