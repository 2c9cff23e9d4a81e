"""Bindings of the fused decode step (csrc/fused_decode_step.c) for `v1.models.fused_decode`:
every layer of an all-decode step in one C call, running the per-op path's kernels in its
order, so its results are the same bits.

What the C reads is checked here (ValueError naming the argument): `DecoderLayers`, built once
per set of weights (norms, `QuantBlocks` projections, biases, and the model's `ModelEnds` where
the step runs them too; it holds aliases of them, so the memory its structs point into lives as
long as it does, whatever becomes of the modules' tensors), and per call the hidden states or
token ids, RoPE tables, attention step and caches (checked again only when their stamps or the
step's shape change). The scratch buffers are `DecoderLayers`' own: one call at a time per
`DecoderLayers` (one per model).
"""

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from v1.kernels.attention import KV_DTYPES, MAX_HEAD_FLOATS, BoundStep, PagedDecodeKernel
from v1.kernels.block_matmul import BlockType, QuantBlocks, block_types, kernel_index
from v1.kernels.library import library
from v1.kernels.structs import CStruct, c_layout, check_layout
from v1.kernels.tensors import stamps

_F32 = torch.float32
# The cache dtype codes of fused_decode_step.c (its paged_decode kernels' order).
KV_CODES = {dtype: code for code, dtype in enumerate(KV_DTYPES)}


# The most shards a projection may have (csrc/fused_decode_step.h's DECODER_SHARDS).
MAX_SHARDS = 3


@dataclass(frozen=True, slots=True, eq=False)
class Projection:
    """A block-quantized matmul's weight, as its row ranges in order (one, or a fused
    projection's parts stored in different types: at most MAX_SHARDS), and its bias (None:
    none)."""

    shards: tuple[QuantBlocks, ...]
    bias: torch.Tensor | None


@dataclass(frozen=True, slots=True, eq=False)
class LayerWeights:
    """One pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)), the attention's
    projection q | k | v and its scores scaled by `scale`, the MLP's gate | up."""

    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    scale: float
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection


@dataclass(frozen=True, slots=True, eq=False)
class ModelEnds:
    """What the step runs around the layers, as the per-op forward does: the final norm, and
    where given the token embedding's blocks (None: the caller embeds) and the LM head's (None:
    the caller's head reads the hidden states the step returns)."""

    final_norm: torch.Tensor
    final_eps: float
    embedding: QuantBlocks | None
    head: QuantBlocks | None


class _Proj(CStruct):
    c_name = "decoder_proj"
    _fields_ = [("w", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("rows", ctypes.c_int64),
                ("type", ctypes.c_int32)]


_Shards = _Proj * MAX_SHARDS


class _Layer(CStruct):
    c_name = "decoder_layer"
    _fields_ = [
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
        ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("qkv", _Shards), ("o", _Shards), ("gate_up", _Shards), ("down", _Shards),
    ]


class _Dims(CStruct):
    c_name = "decoder_dims"
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "H", "KVH", "D", "I")]


class _Scratch(CStruct):
    c_name = "decoder_scratch"
    _fields_ = [(name, ctypes.c_void_p)
                for name in ("x", "qkv", "attn", "h", "gate_up", "act", "cos", "sin", "group")]


# Where the last layer's block output is in the scratch (kept in _Scratch's order).
_H = [name for name, _ in _Scratch._fields_].index("h")


class StepBuffers(NamedTuple):
    """What a caller reads of the scratch for T rows (views, valid until the next call):
    `h`, the last layer's block output (the step's output without ends), and `residual`,
    the residual stream (the step's input where the ends do not embed)."""

    h: torch.Tensor
    residual: torch.Tensor


class _Ends(CStruct):
    c_name = "decoder_ends"
    _fields_ = [("ids", ctypes.c_void_p), ("embed", _Proj), ("final_norm", ctypes.c_void_p),
                ("final_eps", ctypes.c_float), ("out", ctypes.c_void_p),
                ("head_kernel", ctypes.c_int32),
                ("head", _Shards), ("logits", ctypes.c_void_p)]


class _Call(CStruct):
    c_name = "fused_step_call"
    _fields_ = [
        ("layers", ctypes.c_void_p), ("num_layers", ctypes.c_int64), ("dims", ctypes.c_void_p),
        ("T", ctypes.c_int64), ("residual", ctypes.c_void_p), ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p), ("positions", ctypes.c_void_p),
        ("max_position", ctypes.c_int64), ("step", ctypes.c_void_p),
        ("kv_caches", ctypes.c_void_p), ("scratch", ctypes.c_void_p),
        ("kv_dtype", ctypes.c_int32), ("int8", ctypes.c_int32), ("nthreads", ctypes.c_int32),
        ("ends", ctypes.c_void_p),
    ]


class DecoderLayers:
    """The layers as fused_decode_step.c reads them (an array of `struct decoder_layer`), their
    RoPE tables (`rope`: cos and sin [max_position, 1, head_dim], as
    `RotaryEmbedding.cos_table` and `sin_table` hold them), and the model's `ends` (None: none
    run in the step), checked once against the kernel table of `lib` (default: this process's
    library), with what its calls reuse: the scratch buffers, the caches last checked. Holds
    every tensor it points into."""

    def __init__(
        self, layers: Sequence[LayerWeights], num_heads: int, num_kv_heads: int, head_dim: int,
        rope: tuple[torch.Tensor, torch.Tensor], lib: ctypes.CDLL | None = None,
        ends: ModelEnds | None = None,
    ) -> None:
        if not layers:
            raise ValueError("layers: expected at least one layer")
        if (
            num_kv_heads < 1 or num_heads % num_kv_heads or head_dim < 8 or head_dim % 8
            or num_heads * head_dim > MAX_HEAD_FLOATS
        ):
            raise ValueError(f"heads: {num_heads} query heads, {num_kv_heads} kv heads of "
                             f"{head_dim} (a multiple of 8) do not fit the decode kernel")
        lib = library() if lib is None else lib
        if lib is None:
            raise ValueError("no kernel library: the fused decode step needs one")
        types = block_types(lib)
        first = layers[0]
        first.qkv.shards[0].checked(types), first.down.shards[0].checked(types)  # their K
        hidden, inter = first.qkv.shards[0].K, first.down.shards[0].K
        q_size = num_heads * head_dim
        # (N, K) of each projection.
        shapes = {"qkv": (q_size + 2 * num_kv_heads * head_dim, hidden), "o": (hidden, q_size),
                  "gate_up": (2 * inter, hidden), "down": (hidden, inter)}
        # Detached aliases of the tensors the structs point into: they keep that storage
        # alive, and a `.data =` on a module's tensor leaves them as they were. A change of
        # that storage in place (resize_, set_, share_memory_) moves what they point to: new
        # weights, or any such change, are followed by `FusedDecode.replan`.
        self._tensors: list[torch.Tensor] = []
        structs = []
        for i, layer in enumerate(layers):
            projs = {}
            for name, (n, k) in shapes.items():
                proj: Projection = getattr(layer, name)
                if proj.bias is not None:
                    self._vector(f"layers[{i}].{name}.bias", proj.bias, n)
                projs[name] = self._shards(f"layers[{i}].{name}", proj, n, k, types)
            self._vector(f"layers[{i}].input_norm", layer.input_norm, hidden)
            self._vector(f"layers[{i}].post_norm", layer.post_norm, hidden)
            structs.append(_Layer(layer.input_norm.data_ptr(), layer.post_norm.data_ptr(),
                                  layer.input_eps, layer.post_eps, layer.scale, **projs))
        self.array = (_Layer * len(structs))(*structs)
        self.num_layers = len(structs)
        self.dims = _Dims(hidden, num_heads, num_kv_heads, head_dim, inter)
        cos, sin = rope
        self.max_position = cos.shape[0] if cos.dim() == 3 else 0
        for name, table in (("cos", cos), ("sin", sin)):
            if (
                table.dtype is not _F32 or not table.is_cpu or not table.is_contiguous()
                or table.shape != (self.max_position, 1, head_dim) or not self.max_position
            ):
                raise ValueError(f"rope: {name} must be contiguous fp32 [max_position, 1, "
                                 f"{head_dim}] on the CPU, got {table.dtype} "
                                 f"{list(table.shape)} (and the other table's rows)")
            self._tensors.append(table.detach())
        self.rope = cos.data_ptr(), sin.data_ptr()
        # Scratch widths per row, in _Scratch's order (the residual stream's last: the step's
        # own where the ends embed).
        self._widths = (hidden, shapes["qkv"][0], q_size, hidden, 2 * inter, inter, head_dim,
                        head_dim, hidden)
        self._scratch: list[torch.Tensor] = []
        self._scratch_rows = 0
        self.scratch = _Scratch()
        self._group: torch.Tensor | None = None  # one group of the embedding's rows
        self.ends = None if ends is None else self._ends(ends, hidden, types)
        self.embeds = self.ends is not None and ends.embedding is not None
        self.vocab = 0 if self.ends is None else self.ends.head[0].rows  # 0: no head
        # The caches last checked: (their stamps, the step's cache shape, the kernel's dtype,
        # their addresses for the C).
        self._caches: tuple | None = None

    def _ends(self, ends: ModelEnds, hidden: int, types: dict[str, BlockType]) -> _Ends:
        self._vector("final_norm", ends.final_norm, hidden)
        embed = _Proj()
        if (blocks := ends.embedding) is not None:
            w = blocks.checked(types)
            row = types[blocks.kind]
            if blocks.K != hidden or "dequantize" not in row.kernels:
                raise ValueError(f"embedding: [{blocks.N}, {blocks.K}] {blocks.kind} blocks, "
                                 f"expected [vocab, {hidden}] blocks this library dequantizes")
            self._tensors.append(blocks.tensor.detach())
            self._group = torch.empty(row.interleave, hidden, dtype=_F32)
            embed = _Proj(w, None, blocks.N, blocks.code)
        head = _Shards()
        if (blocks := ends.head) is not None:
            blocks.checked(types)  # its N, read next (a block weight knows it once checked)
            head = self._shards("head", Projection((blocks,), None), blocks.N, hidden, types)
        # ids, out, logits and head_kernel are the call's.
        return _Ends(embed=embed, final_norm=ends.final_norm.data_ptr(),
                     final_eps=ends.final_eps, head=head)

    def _shards(self, name: str, proj: Projection, n: int, k: int,
                types: dict[str, BlockType]) -> ctypes.Array:
        """`proj`'s shards as the C reads them, each checked: [rows, k] blocks with both linear
        kernels in this library, their rows adding up to n."""
        if not 1 <= len(proj.shards) <= MAX_SHARDS:
            raise ValueError(f"{name}: {len(proj.shards)} shards, expected 1 to {MAX_SHARDS}")
        shards, row = [], 0
        for blocks in proj.shards:
            w = blocks.checked(types)
            if blocks.K != k:
                raise ValueError(f"{name}: weight [{blocks.N}, {blocks.K}] in a projection "
                                 f"of [{n}, {k}]")
            if not {"linear_f32", "linear_i8"} <= types[blocks.kind].kernels:
                raise ValueError(f"{name}: {blocks.kind} blocks lack a linear kernel in this "
                                 f"library")
            self._tensors.append(blocks.tensor.detach())
            bias = None if proj.bias is None else proj.bias.data_ptr() + 4 * row
            shards.append(_Proj(w, bias, blocks.N, blocks.code))
            row += blocks.N
        if row != n:
            raise ValueError(f"{name}: weight of {row} rows, expected [{n}, {k}]")
        return _Shards(*shards)

    def _vector(self, name: str, t: torch.Tensor, n: int) -> None:
        if t.dtype is not _F32 or not t.is_cpu or t.shape != (n,) or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous fp32 [{n}] on the CPU, got {t.dtype} "
                             f"{list(t.shape)} on {t.device}")
        self._tensors.append(t.detach())

    def scratch_for(self, rows: int) -> StepBuffers:
        """The scratch for `rows` rows (`self.scratch` points into it, in _Scratch's order,
        the residual stream's kept beside it), and what the caller reads of it."""
        if rows > self._scratch_rows:
            self._scratch = [torch.empty(rows, w, dtype=_F32) for w in self._widths]
            self._scratch_rows = rows
            group = 0 if self._group is None else self._group.data_ptr()
            self.scratch = _Scratch(*(t.data_ptr() for t in self._scratch[:-1]), group)
        return StepBuffers(self._scratch[_H][:rows], self._scratch[-1][:rows])

    def caches(
        self, kv_caches: Sequence[torch.Tensor], shape: torch.Size, kernel: PagedDecodeKernel
    ) -> ctypes.Array:
        """The caches' addresses, one per layer, after checking them where they may have
        changed since the last call."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"kv_caches: {len(kv_caches)} caches for {self.num_layers} layers")
        now = stamps(kv_caches)
        last = self._caches
        if last is not None and last[0] == now and last[1] == shape and (
            last[2] is kernel.kv_dtype
        ):
            return last[3]
        for cache in kv_caches:
            kernel.check_cache(cache, shape)
        array = (ctypes.c_void_p * self.num_layers)(*(address for address, _ in now))
        self._caches = (now, shape, kernel.kv_dtype, array)
        return array


class FusedDecoder:
    """`v1_fused_decode_step` of one library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        check_layout(c_layout(lib), _Proj, _Layer, _Dims, _Scratch, _Ends, _Call)
        # The head's kernel by its path (fp32, int8 activations), as the table numbers them.
        self._linear = (kernel_index(lib, "linear_f32"), kernel_index(lib, "linear_i8"))
        self._fn = lib.v1_fused_decode_step
        self._fn.argtypes = [ctypes.POINTER(_Call)]
        self._fn.restype = ctypes.c_int32

    def __call__(
        self, layers: DecoderLayers, hidden: torch.Tensor | None, positions: torch.Tensor,
        step: BoundStep, kernel: PagedDecodeKernel,
        kv_caches: Sequence[torch.Tensor], int8: bool, *, ids: torch.Tensor | None = None,
        logits: torch.Tensor | None = None, head_int8: bool = False,
    ) -> torch.Tensor:
        """Runs every layer on `hidden` [T, hidden] (the embeddings; None where `ids` [T]
        gives the tokens whose rows `layers`' ends look up), at `positions` [T] (their rows
        of the RoPE tables), and stores each layer's K/V through `step` into its cache.
        `int8`: every projection through int8 activations, else fp32 ones. Without ends it
        returns the last layer's block output [T, hidden], which the caller's final norm adds
        to `hidden` (left, in place, the residual stream before it: a view of the scratch,
        valid until the next call); with them, the final norm's output (a new tensor), and
        the LM head's into `logits` [T, vocab] where given (`head_int8`: its path)."""
        dims = layers.dims
        ends = layers.ends
        if ends is None and (ids is not None or logits is not None):
            raise ValueError("ids, logits: these layers run no embedding or LM head")
        if (hidden is None) != (ids is not None) or (ids is not None and not layers.embeds):
            raise ValueError("hidden, ids: one of the two, ids only for layers that embed them")
        if hidden is None:
            rows = ids.shape[0] if ids is not None and ids.dim() == 1 else 0
        else:
            shape = hidden.shape
            if (
                hidden.dtype is not _F32 or not hidden.is_cpu or len(shape) != 2
                or shape[1] != dims.hidden or shape[0] < 1 or not hidden.is_contiguous()
            ):
                raise ValueError(f"hidden must be contiguous fp32 [T >= 1, {dims.hidden}] on "
                                 f"the CPU, got {hidden.dtype} {list(shape)} on {hidden.device}")
            rows = shape[0]
        if ids is not None and (
            ids.dtype is not torch.int64 or not ids.is_cpu or ids.shape != (rows,)
            or not ids.is_contiguous() or rows < 1
        ):
            raise ValueError(f"ids must be contiguous int64 [T >= 1] on the CPU (T = {rows} "
                             f"rows), got {ids.dtype} {list(ids.shape)} on {ids.device}")
        if logits is not None and (
            logits.dtype is not _F32 or not logits.is_cpu or not logits.is_contiguous()
            or logits.shape != (rows, layers.vocab) or not layers.vocab
        ):
            raise ValueError(f"logits must be contiguous fp32 [{rows}, vocab] on the CPU for "
                             f"layers with an LM head (vocab {layers.vocab}), got "
                             f"{logits.dtype} {list(logits.shape)}")
        if (
            positions.dtype is not torch.int64 or not positions.is_cpu
            or positions.shape != (rows,) or not positions.is_contiguous()
        ):
            raise ValueError(f"positions must be contiguous int64 [{rows}] on the CPU, got "
                             f"{positions.dtype} {list(positions.shape)} on {positions.device}")
        cache_shape = step.cache_shape
        if (
            len(cache_shape) != 5 or cache_shape[3] != dims.KVH or cache_shape[4] != dims.D
            or step.max_token >= rows or step.num_slots > rows
        ):
            raise ValueError(f"step: bound for caches {list(cache_shape)}, query rows up to "
                             f"{step.max_token} and {step.num_slots} slots; expected "
                             f"{dims.KVH} kv heads of {dims.D} and at most {rows} rows")
        caches = layers.caches(kv_caches, cache_shape, kernel)
        buffers = layers.scratch_for(rows)
        if hidden is None:
            hidden = buffers.residual
        out = buffers.h
        if ends is not None:
            out = torch.empty(rows, dims.hidden, dtype=_F32)
            ends.out = out.data_ptr()
            ends.ids = None if ids is None else ids.data_ptr()
            ends.logits = None if logits is None else logits.data_ptr()
            ends.head_kernel = self._linear[head_int8]
        status = self._fn(_Call(
            ctypes.addressof(layers.array), layers.num_layers, ctypes.addressof(dims), rows,
            hidden.data_ptr(), *layers.rope, positions.data_ptr(), layers.max_position,
            step.address,
            ctypes.addressof(caches), ctypes.addressof(layers.scratch),
            KV_CODES[kernel.kv_dtype], int8, torch.get_num_threads(),
            None if ends is None else ctypes.addressof(ends),
        ))
        if status == -1:
            raise MemoryError(f"no scratch memory for a {rows}-row decode step's matmuls")
        if status == -5:
            bad = positions[(positions < 0) | (positions >= layers.max_position)][0]
            raise ValueError(f"positions: {int(bad)} is outside the RoPE tables' "
                             f"{layers.max_position} positions")
        if status == -4:
            assert ids is not None
            bad = ids[(ids < 0) | (ids >= ends.embed.rows)][0]
            raise ValueError(f"ids: token id {int(bad)} is outside the vocabulary "
                             f"[0, {ends.embed.rows})")
        if status == -2:
            raise ValueError(f"kv_caches: this library has no {kernel.kv_dtype} decode kernel")
        if status:  # -3 (checked against at build) or a kernel's own failure
            raise RuntimeError(f"the fused decode step failed (status {status}): a weight's "
                               f"kernel is missing from this library or failed")
        return out


def fused_decoder(lib: ctypes.CDLL | None = None) -> FusedDecoder | None:
    """The fused decode step of `lib` (default: this process's library), or None without
    one."""
    lib = library() if lib is None else lib
    return None if lib is None else _bind(lib)


@functools.cache
def _bind(lib: ctypes.CDLL) -> FusedDecoder:
    return FusedDecoder(lib)
