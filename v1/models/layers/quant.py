"""GGUF block-quantized weights (Q4_1, Q8_0) multiplied as they are stored.

A `QuantizedWeight` keeps a weight's blocks bit-exact in the GGUF/ggml layout, one row of
blocks per output row, so rows can be reordered or concatenated (fused q/k/v, gate/up) with
plain tensor indexing and `torch.cat` on `blocks`. `quantize` rounds as ggml does; the torch
reference (`dequantize`, then F.linear) computes what gguf's own dequantizers compute.

`linear` on CPU with fp32 activations runs C kernels (`v1.kernels.quant`, built with the
package; V1_CPU_KERNELS=0, other devices or dtypes: the torch reference). Two paths:
- "fp32": each block is dequantized to fp32 in registers and meets the fp32 activations by
  FMA, so the result is x @ dequantize().T up to fp32 rounding (sums in another order). One
  row: d * (q . x) + m * sum(x) per block of 4 weight rows (fewer operations per block: at
  batch 1 the arithmetic, not memory, bounds the time); 2-4 rows, dot products of dequantized
  blocks; from 5 rows, a few weight rows are dequantized into an L1 buffer and the
  activations, transposed once per call, run against it as outer products (see
  v1/kernels/csrc/quant.c). Either way each weight byte is read and dequantized once per
  call (for up to 64 rows).
- "int8", llama.cpp's way: activations quantized per block of 32 to int8 (q8_0 rounding,
  fp32 scale), integer dot products of 4-byte groups (AVX-512 VNNI vpdpbusd, else AVX-VNNI,
  else AVX2 vpmaddubsw, else plain C: whatever the compiler targets), block scales applied in
  fp32 and q4_1's offsets through the activation block sums. Up to 16 rows, 16 weight rows
  sit in a vector's lanes (their 4-byte groups transposed in registers) against one
  activation row's group, broadcast; from 17 rows, 16 activation rows sit in the lanes against
  one weight row's group, broadcast. Each weight block is read once per call. A row's result
  is bit for bit the same whatever the number of rows in the call, whichever of the two tiles
  serves it and whichever variant of the library runs (exact integer block sums, then one
  explicit-FMA recurrence over the blocks: quant.c). The results are not fp32's: each
  activation is rounded to 1/254 of its block's largest magnitude.
The library's other variants (x86-64-v3, portable; `v1/kernels/variants.py`) compute the
int8 path's results bit for bit and the fp32 path's up to rounding
(tests/worker/test_quant_kernels.py runs each), but are not tuned: their 64-byte vectors lower
to pairs or quads of smaller ones and spill.

The kernels split their rows over torch's thread count on the library's own worker threads,
not OpenMP's (v1/kernels/csrc/pool.c): under OMP_WAIT_POLICY=PASSIVE, the engine's
setting, waking OpenMP's sleeping threads cost ~40 us per call, more than a batch-1 layer
matmul takes, 120 calls a step (the figures below are with the pool; with OpenMP, at
a505452, the fp32 path's row took 0.51-1.28 of oneDNN's time from 1 to 64 rows).

Which path for which rows. Every row takes "int8" (ALL_INT8, the default), prompt tokens'
and generated tokens' (decode, speculative drafts) alike, at any batch size: so a token's
numbers do not depend on what else ran in its step (a draft, a neighbour's prompt, a chunk
boundary), and at a few rows int8 is also the faster path. The 30 layers + LM head of the
default model (q4_1 layers, q8_0 head), ms per step, each of the 121 weights once in turn (so
their 94 MB stream from memory, as in the model); 2 threads of an AVX-512 VNNI Xeon (Sapphire
Rapids, shared with other jobs: load ~2.5; medians of 7 interleaved rounds; "int8 before" is
tile_i8 alone, at 9ef4849):

    rows              1      2      4      5      8      16
    fp32            11.1   16.7   21.0   32.0   32.5   44.2
    int8 before     23.1   23.3   23.6   23.9   24.1   25.5
    int8            10.6   11.6   12.9   14.6   15.9   21.9

With each weight in cache between its calls (`bench/bench_quant_kernels.py --rows
1,2,4,5,8 --rounds 5 --sample-ms 10`, same machine) int8 takes 4.8 / 5.4 / 7.9 / 6.3 / 6.8 ms
where fp32 takes 10.2 / 16.3 / 21.4 / 22.3 / 17.4 (one row: a layer 0.109 ms against 0.254,
the head 1.55 against 2.62): at one row the int8 path's arithmetic is well under half the
fp32 path's, but streaming the blocks bounds both near the memory's pace (one thread:
8.4 ms against 10.1 for the 94 MB, ~11 GB/s, where one core reads ~14 GB/s).

Measured quality (bench/bench_quant.py's accuracy, against fp32; `V1_QUANT_ALL_INT8=0|1
.venv/bin/python bench/bench_quant.py --child accuracy --modes gguf`): perplexity x1.0016
(x1.0017 with generated rows on the fp32 path), greedy agreement 0.651 of positions (0.727),
0.583 before the first divergence (0.651); gguf+fp16: x1.0021 (x1.0014), 0.716 (0.794).
V1_QUANT_ALL_INT8=0 restores the paths by count: generated rows on "fp32" up to
DENSE_MIN_ROWS, prompt rows on "int8" (PROMPT_INT8), the figures below;
V1_QUANT_INT8_MIN_ROWS=n then sends every batch of n rows or more through int8.

Before ALL_INT8, by `bench/bench_quant_kernels.py` (2 threads of an AVX-512 VNNI EPYC; 30
layers + LM head in the GGUF's kinds relative to fp32 oneDNN on prepacked weights; load ~1,
`bench/results/quant_kernels.txt`):

    rows       1      2      4      8      16     32     64
    fp32     0.30   0.35   0.43   0.62   0.72   0.85   1.00
    int8     0.59   0.49   0.47   0.43   0.38   0.40   0.47

fp32 activations won up to 4 rows then (int8's 16-lane tile left 15 of 16 lanes idle at one
row), int8 from 8. Int8 everywhere then gave greedy agreement 0.61 with fp32, and the fp32
path's sums change order with the row count (1, 2-4, 5+ rows), so a decode row's last bits
depended on its step's other rows (PROMPT_INT8's comment).

From DENSE_MIN_ROWS rows (prefill chunks) a third path, "dense": the whole weight dequantized
by C into fp32 once per call, then oneDNN's GEMM. At a505452 (OpenMP threads; `--rows
32,64,128,512,2048 --rounds 3`, load ~2; model in the GGUF's kinds vs fp32 oneDNN):

    rows      32     64     128    512    2048
    fp32     1.05   1.10   1.13   1.32   1.57
    dense    2.47   1.90   1.44   1.14   1.07
    int8     0.47   0.50   0.51   0.58   0.69

and now (`--rows 256,2048 --rounds 3`, `bench/results/quant_kernels_prefill.txt`): fp32 1.29
/ 1.95, dense 1.33 / 1.09, int8 0.61 / 0.83.
"""

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from v1.kernels.block_matmul import BLOCK_BYTES, QK, QuantBlocks, kernels
from v1.models.layers.onednn import ONEDNN_LINEAR, onednn_linear

# How `linear` multiplies on CPU: "fp32" (blocks dequantized in registers, fp32 activations),
# "int8" (activations quantized per block to int8, integer dot products), or "torch" (the
# reference: dequantize, F.linear). Without `path`: "int8" (ALL_INT8); with ALL_INT8 off,
# by the batch's size (`_path_for`) or the rows' kind (PROMPT_INT8).
PATHS = ("fp32", "int8", "dense", "torch")


def _int8_min_rows(value: str | None) -> int | None:
    """V1_QUANT_INT8_MIN_ROWS: unset or empty for None, else a row count >= 1."""
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"V1_QUANT_INT8_MIN_ROWS={value!r}: expected an integer >= 1 or empty")
    return int(value)


INT8_MIN_ROWS: int | None = _int8_min_rows(os.environ.get("V1_QUANT_INT8_MIN_ROWS"))
# Batches of at least this many rows (prefill) take "dense": the whole weight dequantized to
# fp32 by C once per call, then oneDNN's fp32 GEMM, which outruns the fp32 block path from
# about 256 rows while the dequantization costs a few rows' worth of work (figures in the
# module docstring). The results are the fp32 path's up to rounding (same weights).
DENSE_MIN_ROWS: int | None = 256


def _prompt_int8(value: str | None) -> bool:
    """V1_QUANT_PROMPT_INT8: "1" (unset) or "0"."""
    if value not in (None, "", "0", "1"):
        raise ValueError(f"V1_QUANT_PROMPT_INT8={value!r}: expected 0 or 1")
    return value != "0"


# Prompt tokens' rows take "int8" whatever the batch (`prompt_rows`): prefill is most of a
# shared-prompt workload's matmul rows, where int8 takes 0.6-0.8 of packed fp32's time and
# "dense" 1.1-1.3, at perplexity +0.4% (module docstring). The path is per row, not per batch,
# because int8's results are: a row's output does not depend on the other rows of its call, so
# a prompt's KV is the same at any chunk size or batch composition. With ALL_INT8 (the
# default) generated tokens' rows take "int8" too and this split has nothing left to do. With
# ALL_INT8 off, generated tokens' rows (decode, drafts, a preempted request's recomputed
# output) take the fp32 path, fp32's exact weights; but its sums change order with the row
# count (1, 2-4, 5+ rows: see quant.c), so unlike oneDNN's fp32 a decode row's last bits
# depend on its step's other rows, drafts included: greedy tokens agree with and without
# drafts until a near-tie (issue 22's note). Blocks computed as generated tokens and reused
# by a later prompt (multi-turn chat) then hold fp32-path K/V where a cold prompt would have
# int8's: outputs may differ with what is cached, within the lossy modes' rule (DESIGN.md).
# V1_QUANT_PROMPT_INT8=0 turns it off.
PROMPT_INT8: bool = _prompt_int8(os.environ.get("V1_QUANT_PROMPT_INT8"))


@dataclass(slots=True)
class _PromptRows:
    """One forward's split of its activation rows, when some are prompt tokens'."""

    num_rows: int
    prompt: torch.Tensor | None  # row indices; None: every row is a prompt token's
    other: torch.Tensor | None


def _split(is_prompt: np.ndarray | None) -> _PromptRows | None:
    """None where no row is a prompt token's (a decode step) or every row takes int8 anyway
    (ALL_INT8): nothing to do per matmul."""
    if is_prompt is None or ALL_INT8 or not PROMPT_INT8 or not is_prompt.any():
        return None
    if is_prompt.all():
        return _PromptRows(len(is_prompt), None, None)
    return _PromptRows(len(is_prompt), torch.from_numpy(np.flatnonzero(is_prompt)),
                       torch.from_numpy(np.flatnonzero(~is_prompt)))


def _all_int8(value: str | None) -> bool:
    """V1_QUANT_ALL_INT8: "1" (unset) or "0"."""
    if value not in (None, "", "0", "1"):
        raise ValueError(f"V1_QUANT_ALL_INT8={value!r}: expected 0 or 1")
    return value != "0"


# Every row of every call takes "int8" unless a `path` is given: generated tokens' rows
# (decode, speculative drafts) as well as prompt tokens', at any batch size. int8's rows do not
# depend on each other (the two int8 tiles give a row the same numbers whatever the call's
# row count: quant.c), so a token's numbers no longer depend on what else ran in its step, and
# at a few rows the int8 path is also the faster one (module docstring). V1_QUANT_ALL_INT8=0:
# the paths before, generated rows by count (fp32 below DENSE_MIN_ROWS) and prompt rows by
# PROMPT_INT8.
ALL_INT8: bool = _all_int8(os.environ.get("V1_QUANT_ALL_INT8"))


# Per thread: two in-process engines may run forwards on two threads at once.
_forward = threading.local()


@contextlib.contextmanager
def prompt_rows(is_prompt: np.ndarray | None) -> Iterator[None]:
    """Within (on this thread): every `linear` call on a quantized weight whose input has
    len(is_prompt) rows runs the rows where is_prompt holds through "int8" and the others by
    their count (the LM head's fewer rows, by their count alone). None, or PROMPT_INT8 off:
    no split."""
    saved = getattr(_forward, "rows", None)
    _forward.rows = _split(is_prompt)
    try:
        yield
    finally:
        _forward.rows = saved


def _path_for(m: int) -> str:
    """The path of a batch of m rows (no prompt-row split)."""
    if INT8_MIN_ROWS is not None and m >= INT8_MIN_ROWS:
        return "int8"
    return "dense" if DENSE_MIN_ROWS is not None and m >= DENSE_MIN_ROWS else "fp32"


def path_for_rows(m: int) -> str | None:
    """The path every row of an m-row `linear` call without `path` takes, in the current
    forward on this thread (`prompt_rows`); None where the call's rows are split between
    paths (some prompt tokens' rows, some not). The one rule: `QuantizedWeight.linear` asks
    it, and so does the fused decode step (v1.models.fused_decode), which must choose as
    the per-op path does to compute the same bits."""
    if ALL_INT8:
        return "int8"
    split = getattr(_forward, "rows", None)
    if split is not None and split.num_rows == m:
        return "int8" if split.prompt is None else None
    return _path_for(m)


class QuantizedWeight:
    """A [out_features, in_features] weight as GGUF blocks (uint8 [out, in / 32 * bytes])."""

    __slots__ = ("kind", "out_features", "in_features", "blocks", "_kernel_blocks")

    def __init__(self, kind: str, blocks: torch.Tensor, out_features: int, in_features: int):
        if kind not in BLOCK_BYTES:
            raise ValueError(f"quantization kind {kind!r} is not one of {sorted(BLOCK_BYTES)}")
        if in_features <= 0 or in_features % QK:
            raise ValueError(f"in_features={in_features} must be a positive multiple of {QK}")
        if out_features <= 0:
            raise ValueError(f"out_features={out_features} must be positive")
        shape = (out_features, in_features // QK * BLOCK_BYTES[kind])
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
        """Blocks of the fp32 weight `w` [out, in], rounded as ggml's reference quantizers."""
        if kind not in BLOCK_BYTES:
            raise ValueError(f"quantization kind {kind!r} is not one of {sorted(BLOCK_BYTES)}")
        if w.dim() != 2 or w.shape[1] % QK:
            raise ValueError(
                f"weight shape {list(w.shape)}: expected [out, in] with in a multiple of {QK}"
            )
        out_features, in_features = w.shape
        x = w.detach().to(torch.float32).reshape(out_features, -1, QK)
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

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in], computed as gguf's reference dequantizers do."""
        return _dequantize(self.kind, self.blocks)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [*ids.shape, in] for token ids: only the rows asked for are dequantized."""
        rows = _dequantize(self.kind, self.blocks[ids.reshape(-1)])
        return rows.reshape(*ids.shape, self.in_features)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, path: str | None = None
    ) -> torch.Tensor:
        """x [..., in] @ weight.T (+ bias [out]) -> [..., out]. `path` (one of PATHS)
        overrides the choice by batch size; the C kernels serve fp32 CPU activations when
        there are kernels, anything else takes the torch reference."""
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
            path = path_for_rows(m)
        if path is None:  # prompt rows through "int8", the others by their count
            split = _forward.rows
            assert split.prompt is not None and split.other is not None
            rows = x.reshape(m, self.in_features)
            out = x.new_empty(m, self.out_features)
            out[split.prompt] = self.linear(rows[split.prompt], bias, "int8")
            out[split.other] = self.linear(rows[split.other], bias, _path_for(len(split.other)))
            return out.reshape(*x.shape[:-1], self.out_features)
        native = (path != "torch" and m > 0 and x.dtype == torch.float32 and x.is_cpu
                  and self.blocks.is_cpu)
        q = kernels() if native else None
        if q is None:
            return F.linear(x, self.dequantize().to(x.dtype), bias)
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
    rows, nb = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[kind]
    b = blocks.reshape(rows, nb, BLOCK_BYTES[kind])  # nb named: rows may be 0 (no token ids)
    d = _fp16(b[..., 0:2])
    if kind == "q8_0":
        w = b[..., 2:].contiguous().view(torch.int8).to(torch.float32) * d
    else:
        qs = b[..., 4:]
        q = torch.cat((qs & 15, qs >> 4), -1).to(torch.float32)
        w = d * q + _fp16(b[..., 2:4])
    return w.reshape(rows, nb * QK)
