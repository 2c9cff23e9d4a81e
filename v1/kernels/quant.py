"""Bindings of the GGUF block-quantized matmuls (csrc/quant.c), for
`v1.models.layers.quant.QuantizedWeight`, whose docstring says which path serves which batch.

Each call checks what the C assumes, raising ValueError naming the argument: blocks uint8,
contiguous, [N, K / 32 * block bytes] (`QuantBlocks`: once, and again when they change);
activations fp32 [M, K] whose rows are each contiguous (any distance apart); bias fp32 [N]
exactly (a broadcastable one would be read past its end); all on the CPU. Outputs are
allocated here, fp32 whatever torch's default dtype. The pool's threads:
torch.get_num_threads() of the calling thread, per call.
"""

import ctypes
import functools

import torch

from v1.kernels.library import library
from v1.kernels.tensors import stamp

QK = 32  # values per block
# Bytes per block. q8_0: fp16 d, int8 qs[32]; x = d * q. q4_1: fp16 d, fp16 m, uint8 qs[16];
# x = d * nibble + m, element j < 16 the low nibble of qs[j], element j + 16 its high nibble.
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
KIND_CODE = {"q4_1": 0, "q8_0": 1}
INT8_ISAS = ("portable", "avx2", "avx_vnni", "avx512_vnni")  # by the C's INT8_ISA
_F32 = torch.float32


class QuantKernels:
    """The matmul paths of one library: `linear` (fp32 or int8 activations) and
    `dequantize` (the whole weight, for the dense path)."""

    __slots__ = ("_fp32", "_int8", "_dequantize", "int8_isa")

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        # (kind, blocks, N, K, x, x row stride, M, bias or NULL, out, out row stride, threads)
        self._fp32 = lib.v1_q_linear_f32
        self._int8 = lib.v1_q_linear_i8
        for fn in (self._fp32, self._int8):
            fn.argtypes = [i32, p, i64, i64, p, i64, i64, p, p, i64, i32]
            fn.restype = i32
        self._dequantize = lib.v1_q_dequantize  # (kind, blocks, N, K, out[N, K], threads)
        self._dequantize.argtypes = [i32, p, i64, i64, p, i32]
        self._dequantize.restype = None
        lib.v1_q_int8_isa.restype = i32
        self.int8_isa = INT8_ISAS[lib.v1_q_int8_isa()]

    def linear(
        self, w: "QuantBlocks", x: torch.Tensor, bias: torch.Tensor | None, int8: bool = False
    ) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) as a new fp32 [M, N], W [N, K] the weight `w` holds;
        `int8`: through int8 activations (see the C). M may be 0."""
        w_ptr = w.checked()
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
        fn = self._int8 if int8 else self._fp32
        if fn(
            w.code, w_ptr, N, K, x.data_ptr(), strides[0], M,
            None if bias is None else bias.data_ptr(), out.data_ptr(), N,
            torch.get_num_threads(),
        ):
            raise MemoryError(f"no scratch memory for a {M} x {K} matmul")
        return out

    def dequantize(self, w: "QuantBlocks") -> torch.Tensor:
        """The weight `w` holds as a new fp32 [N, K]."""
        w_ptr = w.checked()
        out = torch.empty(w.N, w.K, dtype=torch.float32)
        self._dequantize(w.code, w_ptr, w.N, w.K, out.data_ptr(), torch.get_num_threads())
        return out


class QuantBlocks:
    """A weight's blocks as the kernels take them: uint8 [N, K / 32 * block bytes],
    contiguous, on the CPU. Checked when first used and again whenever the tensor may have
    changed in place since (`tensors.stamp`), not on every call: a batch-1 matmul is ~20 us,
    and the checks were a tenth of it. The tensor is held, so its memory stays the kernels'
    to read."""

    __slots__ = ("kind", "tensor", "N", "K", "code", "_stamp")

    def __init__(self, kind: str, tensor: torch.Tensor) -> None:
        self.kind, self.tensor = kind, tensor
        self.N = self.K = self.code = 0
        self._stamp = (0, -1)  # no tensor's

    def checked(self) -> int:
        """The blocks' address, after checking them if they may have changed since."""
        t = self.tensor
        now = stamp(t)
        if now != self._stamp:
            self.N, self.K = _check_blocks(self.kind, t)
            self.code = KIND_CODE[self.kind]
            self._stamp = now
        return now[0]


def _check_blocks(kind: str, blocks: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a weight's blocks, checked."""
    bytes_per_block = BLOCK_BYTES.get(kind)
    if bytes_per_block is None:
        raise ValueError(f"kind {kind!r} is not one of {sorted(BLOCK_BYTES)}")
    if (
        blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_cpu
        or not blocks.is_contiguous() or blocks.shape[1] % bytes_per_block
        or blocks.shape[1] == 0
    ):
        raise ValueError(f"blocks ({kind}) must be contiguous uint8 [N, K / {QK} * "
                         f"{bytes_per_block}] on the CPU, got {blocks.dtype} "
                         f"{list(blocks.shape)} on {blocks.device}")
    return blocks.shape[0], blocks.shape[1] // bytes_per_block * QK


def kernels(lib: ctypes.CDLL | None = None) -> QuantKernels | None:
    """The quant kernels of `lib` (default: this process's library), or None without one."""
    lib = library() if lib is None else lib
    return None if lib is None else _bind(lib)


@functools.cache
def _bind(lib: ctypes.CDLL) -> QuantKernels:
    return QuantKernels(lib)
