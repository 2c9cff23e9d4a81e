"""GGUF block-quantized weights (every type of `block_matmul.BLOCK_SIZES`: Q4_0 ... Q8_0, the
K-quants, F16, BF16) multiplied as they are stored.

A `QuantizedWeight` keeps a weight's blocks bit-exact in the GGUF/ggml layout, one row of
blocks per output row (a loaded file's blocks are its read-only mapping itself: nothing here
writes into `blocks`, every change makes a new tensor), so fused projections are plain tensor
indexing and `torch.cat` on `blocks` while loading; loaded, `repack_for` may move the same bytes
into a layout the kernels run faster (`block_matmul.INTERLEAVED`: rows interleaved; never a
second copy). `quantize` rounds as ggml does (Q4_1, Q8_0); `dequantize` computes what gguf's
dequantizers do, in either layout. A fused projection whose shards are stored in different
types is a `QuantizedShards`.

`linear(x, bias, path)` on CPU with fp32 activations runs the C kernels (`v1.kernels.block_matmul`)
where the library has them for the type; otherwise the reference, dequantize then F.linear.
Paths (`PATHS`): "int8" (activations quantized per block of 32; a row's result is the same bits
whatever else is in its call; a type without int8 kernels takes "fp32"),
"fp32" (blocks dequantized in registers; summation order depends on the call's row count),
"dense" (dequantized once, oneDNN GEMM). The step plan picks each row's path (`MatmulPolicy`; big
prompt chunks' by the machine's calibration, `v1.models.calibration`).
Paths and measurements: docs/benchmarks.md, "Matmul paths".
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from v1.envs import Environment
from v1.kernels.block_matmul import (
    BLOCK_SIZES,
    INTERLEAVED,
    LEADING,
    QuantBlocks,
    QuantKernels,
    kernels,
)
from v1.kernels.interleave import BlockParts, relayout
from v1.kernels.tensors import weight_empty
from v1.models.layers.onednn import ONEDNN_LINEAR, onednn_linear

PATHS = ("fp32", "int8", "dense", "torch")
# The kinds `QuantizedWeight.quantize` makes (and the torch code dequantizes itself).
QUANTIZE_KINDS = ("q4_1", "q8_0")
# Calls of at least this many rows take "dense" when they go by count: from about 256 rows
# oneDNN's GEMM outruns the fp32 block path by more than the dequantization costs.
DENSE_MIN_ROWS = 256
# An interleaved embedding looks up at most this many ids by dequantizing each one's group of
# rows (a decode step's); more take the gather, which does not dequantize 8 rows per id.
FEW_IDS = 2


@dataclass(frozen=True, slots=True)
class MatmulPolicy:
    """How rows choose a path. `all_int8` (the default): every row "int8", so a token's numbers
    never depend on its step's other rows. Otherwise prompt tokens' rows take "int8" when
    `prompt_int8`, and the rest go by the call's row count (`path_for`).

    `prompt_dense_min_rows` (none by default; set by the machine's calibration,
    v1.models.calibration): (kind, rows) pairs: the prompt rows of a call of at least that
    many rows by a weight of that kind take "dense" instead, where oneDNN's GEMM on the
    dequantized weight outruns the int8 kernels (CPUs whose int8 dot products are slow next
    to their BLAS, kinds whose int8 tile is). The trade: a prompt token's numbers then depend
    on the size of the chunk it was computed in (int8 below the threshold, dense fp32 at or
    above it), so the same prompt split into other chunks may give other logits. Generated
    tokens' rows never change path for it."""

    all_int8: bool = True
    prompt_int8: bool = True
    int8_min_rows: int | None = None
    dense_min_rows: int | None = DENSE_MIN_ROWS
    prompt_dense_min_rows: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_env(cls, env: Environment) -> "MatmulPolicy":
        return cls(env.quant_all_int8, env.quant_prompt_int8, env.quant_int8_min_rows)

    def path_for(self, m: int) -> str:
        """The path of an m-row call whose rows are not split by kind: the one default rule."""
        if self.all_int8 or (self.int8_min_rows is not None and m >= self.int8_min_rows):
            return "int8"
        return "dense" if self.dense_min_rows is not None and m >= self.dense_min_rows else "fp32"

    def rows(self, is_prompt: np.ndarray | None, q: QuantKernels | None) -> "MatmulRows":
        """One forward's rows, `is_prompt[t]` telling whether row t is a prompt token's (None:
        none is), multiplied by the block kernels `q` (None: the torch reference). Prompt rows
        are split from the others only where that changes a path."""
        if is_prompt is None or not is_prompt.any():
            return MatmulRows(self, q)
        m = len(is_prompt)
        dense = frozenset(kind for kind, rows in self.prompt_dense_min_rows if m >= rows)
        if not dense and (self.all_int8 or not self.prompt_int8):
            return MatmulRows(self, q)
        if is_prompt.all():
            return MatmulRows(self, q, m, dense)
        return MatmulRows(self, q, m, dense, torch.from_numpy(np.flatnonzero(is_prompt)),
                          torch.from_numpy(np.flatnonzero(~is_prompt)))


DEFAULT_POLICY = MatmulPolicy()


@dataclass(frozen=True, slots=True)
class MatmulRows:
    """One forward's path per activation row. A call with `num_rows` rows (the forward's
    own layers) runs its prompt rows (`prompt`; None: all rows) on `prompt_path` (by a weight
    of a kind in `prompt_dense`: "dense") and the others (`other`) by their count; any other
    call (the LM head's fewer rows) by its count alone."""

    policy: MatmulPolicy
    q: QuantKernels | None  # the step's block kernels; None: the torch reference
    num_rows: int = -1  # -1: no row is split out by kind
    prompt_dense: frozenset[str] = frozenset()
    prompt: torch.Tensor | None = None
    other: torch.Tensor | None = None

    def prompt_path(self, kind: str | None) -> str | None:
        """The prompt rows' path by a weight of `kind`; None: by the call's count."""
        if kind in self.prompt_dense:
            return "dense"
        return "int8" if self.policy.prompt_int8 and not self.policy.all_int8 else None

    def path(self, m: int, kind: str | None = None) -> str | None:
        """The path every row of an m-row call by a weight of `kind` (None: of none in
        `prompt_dense`) takes; None where prompt rows and the others take different paths
        (`linear` splits the call)."""
        if m != self.num_rows:
            return self.policy.path_for(m)
        path = self.prompt_path(kind)
        if path is None:
            return self.policy.path_for(m)
        return path if self.prompt is None else None

    def linear(
        self, weight: "QuantizedWeight", x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`weight.linear(x, bias)` with each row on its path."""
        m = x.numel() // weight.in_features
        if self.q is None:
            return weight.linear(x, bias, "torch")
        path = self.path(m, weight.kind)
        if path is not None:
            return weight.linear(x, bias, path, self.q)
        assert self.prompt is not None and self.other is not None
        rows = x.reshape(m, weight.in_features)
        out = x.new_empty(m, weight.out_features)
        out[self.prompt] = weight.linear(rows[self.prompt], bias, self.prompt_path(weight.kind),
                                         self.q)
        out[self.other] = weight.linear(rows[self.other], bias,
                                        self.policy.path_for(len(self.other)), self.q)
        return out.reshape(*x.shape[:-1], weight.out_features)


class QuantizedWeight:
    """A [out_features, in_features] weight as GGUF blocks (uint8 [out, in / block values *
    block bytes], `BLOCK_SIZES`; in_features a multiple of the kind's block values), in GGUF's
    layout or an interleaved one (`kind` says which: `block_matmul.INTERLEAVED`; then
    out_features is a multiple of its rows)."""

    __slots__ = ("kind", "out_features", "in_features", "blocks", "_kernel_blocks")

    def __init__(self, kind: str, blocks: torch.Tensor, out_features: int, in_features: int):
        if kind not in BLOCK_SIZES:
            raise ValueError(f"quantization kind {kind!r} is not one of {sorted(BLOCK_SIZES)}")
        elems, nbytes = BLOCK_SIZES[kind]
        if in_features <= 0 or in_features % elems:
            raise ValueError(f"in_features={in_features} must be a positive multiple of "
                             f"{elems} ({kind})")
        if out_features <= 0 or out_features % _rows(kind):
            raise ValueError(f"out_features={out_features} must be a positive multiple of "
                             f"{_rows(kind)} ({kind})")
        shape = (out_features, in_features // elems * nbytes)
        if blocks.dtype != torch.uint8 or tuple(blocks.shape) != shape:
            raise ValueError(
                f"{kind} blocks must be uint8 {list(shape)}, got {blocks.dtype} "
                f"{list(blocks.shape)}"
            )
        self.kind = kind
        self.out_features = out_features
        self.in_features = in_features
        self.blocks = blocks.contiguous()
        self._kernel_blocks: QuantBlocks | None = None  # `blocks`, as the kernels take them

    @classmethod
    def quantize(cls, w: torch.Tensor, kind: str = "q8_0") -> "QuantizedWeight":
        """Blocks of the fp32 weight `w` [out, in], rounded as ggml's reference quantizers (in
        `kind`'s layout)."""
        if kind in INTERLEAVED:
            weight = cls.quantize(w, INTERLEAVED[kind][0])
            weight.repack(kind)
            return weight
        if kind not in QUANTIZE_KINDS:
            raise ValueError(f"quantization kind {kind!r} is not one of {QUANTIZE_KINDS}")
        qk = BLOCK_SIZES[kind][0]
        if w.dim() != 2 or w.shape[1] % qk:
            raise ValueError(
                f"weight shape {list(w.shape)}: expected [out, in] with in a multiple of {qk}"
            )
        out_features, in_features = w.shape
        x = w.detach().to(torch.float32).reshape(out_features, -1, qk)
        if kind == "q8_0":
            d = x.abs().amax(-1, keepdim=True) / 127
            q = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
            parts = [_fp16_bytes(d), q]
        else:
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            d = (hi - lo) / 15
            # ggml: MIN(15, (int8_t)((x - min) * id + 0.5f)), a truncation of a value >= 0.
            q = ((x - lo) * _inverse(d) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
            parts = [_fp16_bytes(d), _fp16_bytes(lo), q[..., :16] | (q[..., 16:] << 4)]
        blocks = torch.cat(parts, -1).reshape(out_features, -1)
        return cls(kind, blocks, out_features, in_features)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def gguf_kind(self) -> str:
        """The GGUF type of the blocks, whatever their layout ("q4_1" for "q4_1x8")."""
        return INTERLEAVED.get(self.kind, (self.kind,))[0]

    def repack(self, kind: str) -> None:
        """The same blocks moved into `kind`'s layout (GGUF's, or an interleaved one of the same
        GGUF type), in place: `blocks` is replaced, the old tensor freed once unreferenced."""
        if kind not in BLOCK_SIZES or INTERLEAVED.get(kind, (kind,))[0] != self.gguf_kind:
            raise ValueError(f"{self.kind} blocks cannot be laid out as {kind!r}")
        if self.out_features % _rows(kind):
            raise ValueError(f"{kind} needs a multiple of {_rows(kind)} rows, the weight has "
                             f"{self.out_features}")
        if kind != self.kind:
            self.blocks = _interleave(kind, _plain(self.kind, self.blocks))
            self.kind = kind

    def repack_for(self, q: QuantKernels | None) -> None:
        """Move the blocks into the layout the kernels `q` run faster (`_layout_for`)."""
        self.repack(_layout_for(self.kind, self.out_features, q))

    @classmethod
    def stacked(
        cls, parts: Sequence["QuantizedWeight"], q: QuantKernels | None
    ) -> "QuantizedWeight":
        """Weights of one kind in GGUF's layout stacked by rows into one (one block tensor, so
        that a fused matmul reads it whole), laid out for the kernels `q` as it is written
        where every part's rows allow (`repack_for`'s layout): each part moved once, rather
        than joined, then moved."""
        kind, in_features = parts[0].kind, parts[0].in_features
        out_features = sum(w.out_features for w in parts)
        layout = _layout_for(kind, out_features, q)
        blocks = weight_empty(out_features, parts[0].blocks.shape[1])
        if layout == kind or any(w.out_features % _rows(layout) for w in parts):
            return cls(kind, torch.cat([w.blocks for w in parts], out=blocks), out_features,
                       in_features)
        for w, rows in zip(parts, blocks.split([w.out_features for w in parts]), strict=True):
            _relayout(layout, w.blocks, True, rows)
        return cls(layout, blocks, out_features, in_features)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in], computed as gguf's reference dequantizers do."""
        return _dequantize(self.gguf_kind, _plain(self.kind, self.blocks))

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [*ids.shape, in] for token ids: only the rows asked for are dequantized
        (up to FEW_IDS ids of an interleaved kind: each one's group of rows)."""
        flat = ids if ids.dim() == 1 else ids.reshape(-1)
        rows = _rows(self.kind)
        few = flat.tolist() if rows > 1 and 0 < flat.numel() <= FEW_IDS else []
        q = kernels() if few and all(0 <= i < self.out_features for i in few) else None
        if q is not None and q.has(self.kind, "dequantize") and self.blocks.is_cpu:
            # Each id's whole group of rows through the C kernel, then its row: at a decode
            # step's few ids, cheaper than the gather's ~15 torch ops below.
            parts = []
            for i in few:
                group, row = divmod(i, rows)
                blocks = QuantBlocks(self.kind, self.blocks[group * rows : (group + 1) * rows])
                parts.append(q.dequantize(blocks)[row : row + 1])
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            return out if ids.dim() == 1 else out.reshape(*ids.shape, self.in_features)
        if rows == 1:
            blocks = self.blocks[flat]
        else:  # each id's own row out of its group (the layout: `_relayout`), not the group's
            size, lead, dwords, tail = _block_parts(self.kind)
            groups = self.blocks.view(self.out_features // rows, -1, rows * size)
            group, row = flat // rows, flat % rows
            body = groups[..., :rows * dwords * 4].unflatten(-1, (dwords, rows, 4))
            parts = [body[group, :, :, row].flatten(-2)]  # [ids, block, dwords * 4]
            if tail:
                rest = groups[..., rows * dwords * 4:].unflatten(-1, (rows, tail))[group, :, row]
                parts.insert(0 if lead else 1, rest)
            blocks = torch.cat(parts, -1).flatten(1)
        return _dequantize(self.gguf_kind, blocks).reshape(*ids.shape, self.in_features)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str | None = None,
        q: QuantKernels | None = None,
    ) -> torch.Tensor:
        """x [..., in] @ weight.T (+ bias [out]) -> [..., out] on `path` (one of PATHS; None:
        `DEFAULT_POLICY.path_for` the row count). The C kernels (`q`; None: this process's
        library, looked up) serve fp32 CPU activations where they run this kind
        (`QuantKernels.runs`); anything else takes the torch reference."""
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"input has {x.shape[-1]} features, the weight takes {self.in_features}"
            )
        # Exactly [out] on every path: the kernels read out_features values.
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias has shape {list(bias.shape)}, expected [{self.out_features}]")
        if path is not None and path not in PATHS:
            raise ValueError(f"path {path!r} is not one of {PATHS}")
        m = x.numel() // self.in_features
        if path is None:
            path = DEFAULT_POLICY.path_for(m)
        native = (path != "torch" and m > 0 and x.dtype == torch.float32 and x.is_cpu
                  and self.blocks.is_cpu)
        if native and q is None:
            q = kernels()
        if not native or q is None or not q.runs(self.kind):
            return F.linear(x, self.dequantize().to(x.dtype), bias)
        if path == "int8" and not q.has(self.kind, "linear_i8"):
            path = "fp32"
        if bias is not None:
            bias = bias.contiguous()
        kb = self.kernel_blocks()
        if path == "dense":
            w = q.dequantize(kb)
            if ONEDNN_LINEAR:
                return onednn_linear(x, w, bias, self.out_features)
            return F.linear(x, w, bias)
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = q.linear(kb, rows, bias, int8=path == "int8")
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def kernel_blocks(self) -> QuantBlocks:
        """`blocks` as the kernels take them (made again where `blocks` was replaced)."""
        kb = self._kernel_blocks
        if kb is None or kb.tensor is not self.blocks:
            kb = self._kernel_blocks = QuantBlocks(self.kind, self.blocks)
        return kb

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.kind}, {self.out_features}x{self.in_features})"


def _rows(kind: str) -> int:
    """The rows `kind` interleaves (1: GGUF's layout)."""
    return INTERLEAVED.get(kind, (kind, 1))[1]


def _layout_for(kind: str, out_features: int, q: QuantKernels | None) -> str:
    """The layout of a `kind` weight of `out_features` rows that the kernels `q` run faster:
    their table's `repack` for the kind where the rows allow it, else `kind` itself (no
    kernels: `kind`)."""
    row = None if q is None else q.types.get(kind)
    layout = None if row is None else row.repack
    return layout if layout is not None and out_features % _rows(layout) == 0 else kind


def _block_parts(kind: str) -> BlockParts:
    """An interleaved `kind`'s block as its layout reads it."""
    size, lead = BLOCK_SIZES[kind][1], LEADING.get(kind, 0)
    dwords, tail = divmod(size - lead, 4)
    assert not (lead and tail), f"{kind}: leading bytes and bytes past the last dword"
    return BlockParts(size, lead, dwords, tail + lead)


def _relayout(
    kind: str, blocks: torch.Tensor, interleave: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`blocks` [N, nb * bytes] of an interleaved `kind` moved from GGUF's layout into
    `kind`'s (`interleave`) or back, into `out` (contiguous, of `blocks`' shape; None: a new
    tensor), which is returned. `kind`'s layout: each group of its rows interleaved, [group,
    row, block, dword] -> [group, block, dword, row], dwords of 4 bytes, then a block's bytes
    past its last whole dword, or its `LEADING` ones, [group, block, row, tail]. Interleaved
    kinds come from a kernel library's table: its C moves them (`v1.kernels.interleave`)."""
    move = relayout()
    if move is None:
        raise ValueError(f"{kind} blocks need a kernel library, and none is loaded "
                         f"(V1_CPU_KERNELS=0, or no variant built for this CPU)")
    if out is None:  # a weight the kernels stream, or a throwaway plain copy
        out = (weight_empty(*blocks.shape) if interleave
               else torch.empty_like(blocks, memory_format=torch.contiguous_format))
    move(blocks.contiguous(), out, _rows(kind), _block_parts(kind), interleave)
    return out


def _interleave(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF-layout blocks [N, nb * bytes] in `kind`'s layout (`_relayout`; a new tensor;
    GGUF's layout: `blocks` itself)."""
    return blocks if _rows(kind) == 1 else _relayout(kind, blocks, interleave=True)


def _plain(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """`kind`'s blocks in GGUF's layout (`_interleave` undone: a new tensor where it moves
    bytes)."""
    return blocks if _rows(kind) == 1 else _relayout(kind, blocks, interleave=False)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (a block of equal values), as ggml."""
    return torch.where(d == 0, 0.0, 1.0 / d)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exactly: torch.round rounds halves to even."""
    a = x.abs()
    whole = a.floor()
    return torch.sign(x) * (whole + (2 * (a - whole)).floor())


def _fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).view(torch.uint8)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _dequantize(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF-layout `kind` blocks [rows, nb * bytes] as fp32 [rows, nb * values], the bits of
    gguf's reference: the torch code's for its kinds (`QUANTIZE_KINDS`), else this process's
    library's dequantize kernel (bit-identical to gguf's by the kernel table's contract), else
    gguf's own (numpy)."""
    elems, nbytes = BLOCK_SIZES[kind]
    rows, nb = blocks.shape[0], blocks.shape[1] // nbytes  # nb named: rows may be 0 (no ids)
    if rows == 0:
        return torch.empty(0, nb * elems)
    if kind in QUANTIZE_KINDS:
        b = blocks.reshape(rows, nb, nbytes)
        d = _fp16(b[..., 0:2])
        if kind == "q8_0":
            w = b[..., 2:].contiguous().view(torch.int8).to(torch.float32) * d
        else:
            qs = b[..., 4:]
            q = torch.cat((qs & 15, qs >> 4), -1).to(torch.float32)
            w = d * q + _fp16(b[..., 2:4])
        return w.reshape(rows, nb * elems)
    q = kernels()
    if q is not None and q.has(kind, "dequantize"):
        return q.dequantize(QuantBlocks(kind, blocks.contiguous()))
    import gguf  # only a GGUF file's types come here

    w = gguf.quants.dequantize(blocks.contiguous().numpy(),
                               gguf.GGMLQuantizationType[kind.upper()])
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32).reshape(rows, nb * elems))


class QuantizedShards:
    """A fused projection (q | k | v, gate | up) whose row ranges are stored in different
    types (llama.cpp's K-quant mixes keep some layers' attn_v in Q6_K beside Q4_K q and k):
    each shard its own `QuantizedWeight`, in row order, multiplied on its own and the
    outputs concatenated, so each keeps its file's blocks (no fp32 copy, no conversion)."""

    __slots__ = ("shards", "out_features", "in_features")

    def __init__(self, shards: Sequence[QuantizedWeight]) -> None:
        if len({w.in_features for w in shards}) != 1:
            raise ValueError(f"shards of one projection differ in in_features: {list(shards)}")
        self.shards = tuple(shards)
        self.out_features = sum(w.out_features for w in shards)
        self.in_features = shards[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.shards)

    @property
    def gguf_kind(self) -> str:
        """The shards' GGUF types, in row order, joined by "+" ("q4_k+q4_k+q6_k")."""
        return "+".join(w.gguf_kind for w in self.shards)

    def repack_for(self, q: QuantKernels | None) -> None:
        for w in self.shards:
            w.repack_for(q)

    def dequantize(self) -> torch.Tensor:
        return torch.cat([w.dequantize() for w in self.shards])

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, rows: MatmulRows | None = None
    ) -> torch.Tensor:
        """x [..., in] @ weight.T (+ bias [out]) -> [..., out], each shard on the path `rows`
        gives it (None: `QuantizedWeight.linear`'s default)."""
        sizes = [w.out_features for w in self.shards]
        biases = [None] * len(sizes) if bias is None else bias.split(sizes)
        outs = [w.linear(x, b) if rows is None else rows.linear(w, x, b)
                for w, b in zip(self.shards, biases, strict=True)]
        return torch.cat(outs, -1)

    def __repr__(self) -> str:
        return f"QuantizedShards({self.gguf_kind}, {self.out_features}x{self.in_features})"


def block_weights(kernel: object) -> list[QuantizedWeight]:
    """The `QuantizedWeight`s a layer's `kernel` multiplies by (none for other forms)."""
    if isinstance(kernel, QuantizedWeight):
        return [kernel]
    return list(kernel.shards) if isinstance(kernel, QuantizedShards) else []
