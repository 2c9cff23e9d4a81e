"""The torch backend's plan of a step (`AttentionPlan`): what every layer's attention needs,
derived once from the step's metadata on the host, shared by the layers and run by
`torch_attn.paged_attention`.

Decodes are gathered in length buckets (at most MAX_GATHER_BYTES per call); prefills attend
to their fresh K/V without context, else to their gathered context; requests sharing leading
physical blocks form cascade groups (MIN_CASCADE_SAVING, MIN_CASCADE_SAVING_NATIVE). With the
C kernel, decodes and short chunks (NATIVE_PREFILL_MAX_KEYS, NATIVE_MAX_QUERIES) become its
entries: block-table row, query row, key range [start, end). Sliding-window layers get a plan
per window (the global one when no sequence is longer than the window). Each path, and how a
window is read: docs/design.md, "Attention on the CPU".
"""

import ctypes
import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from v1.attention.backends.abstract import AttentionMetadata
from v1.kernels.attention import BoundStep, PagedDecodeKernel, paged_decode_kernel

# Share a prefix only when it saves at least this many token reads in total: with the C
# kernel MIN_CASCADE_SAVING_NATIVE, since a cascade group costs an SDPA call and a merge per
# layer, more than the kernel's entries take to reread a short shared prefix (figures:
# docs/speculative.md, docs/benchmarks.md).
MIN_CASCADE_SAVING = 256
MIN_CASCADE_SAVING_NATIVE = 4096
# Decodes are padded to the longest of their bucket. A decode starts a new bucket (one more
# SDPA call) only when the bucket's shortest member would be padded by more than this many
# tokens and by more than BUCKET_RATIO times its own length.
BUCKET_MIN_PAD = 256
BUCKET_RATIO = 1.5
# The most K/V bytes one decode call gathers (a bucket is split into calls of this size).
MAX_GATHER_BYTES = 16 << 20
# With the C kernel, prefill chunks attending to at most this many keys after their shared
# prefix are run by the kernel too (one entry per query token), and so are verify steps (a
# generated token and its drafts: `AttentionMetadata.generated_cpu`) of at most
# NATIVE_MAX_QUERIES tokens whatever their keys. The entries reread their request's keys (one
# request's K/V of a layer stays in L2 at these lengths) where SDPA would gather them once,
# but an SDPA call costs more than a few entries' reads, and the drafts' rows are then
# attended exactly as decodes are (one kernel, one order), so a fused decode step
# (v1.models.fused_decode) runs verify steps too. Prompt chunks keep the rule by keys alone:
# a prompt's uncached tail after a prefix-cache hit is then attended as the same tokens were
# when the prompt came cold (SDPA past NATIVE_PREFILL_MAX_KEYS), so a hit does not change
# the numbers.
NATIVE_PREFILL_MAX_KEYS = 256
NATIVE_MAX_QUERIES = 32


class _Rows:
    """A set of query rows: a slice when they are contiguous (views, no copies), else an
    index tensor."""

    __slots__ = ("index", "start", "stop")

    def __init__(self, rows: np.ndarray, device: torch.device) -> None:
        rows = np.asarray(rows, dtype=np.int64)
        self.start, self.stop = int(rows[0]), int(rows[-1]) + 1
        contiguous = self.stop - self.start == len(rows) and bool(np.all(np.diff(rows) == 1))
        self.index = None if contiguous else torch.from_numpy(rows).to(device)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.start : self.stop] if self.index is None else x.index_select(0, self.index)

    def put(self, out: torch.Tensor, value: torch.Tensor) -> None:
        if self.index is None:
            out[self.start : self.stop] = value
        else:
            out.index_copy_(0, self.index, value)


@dataclass(slots=True)
class PrefillCall:
    q_start: int
    q_end: int
    seq_len: int
    start: int  # first key position read here (after the group's prefix, or the first
    # block of the window, or 0)
    blocks: torch.Tensor | None  # int64 block ids covering [start, seq_len); None: fresh K/V
    mask: torch.Tensor | None  # float [q_len, seq_len - start], -inf: hidden; None: causal
    need_lse: bool


@dataclass(slots=True)
class DecodeBucket:
    rows: _Rows  # the query rows of these decodes
    blocks: torch.Tensor  # int64 [R * nb]: their blocks after their group's prefix, padded
    mask: torch.Tensor | None  # float [R, 1, 1, nb * B], -inf on padding; None: no padding
    # Rows (of R * nb * B) of the gathered K/V past each sequence's end (or before its
    # window): zeroed after the gather, because such a slot may hold anything (NaN included)
    # and NaN * 0 is NaN.
    pad_rows: torch.Tensor | None


@dataclass(slots=True)
class _NativeDecodes:
    """The queries the C kernel serves this step: per entry (int64 each) its request's
    block-table row, its query row, and the key positions [start, end) it attends to."""

    kernel: PagedDecodeKernel  # the one the plan was made for
    table: torch.Tensor  # int32 [num_reqs, max_blocks], contiguous: the step's block table
    table_rows: torch.Tensor
    tokens: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    slot_mapping: torch.Tensor  # the metadata's: the kernel writes the step's K/V too
    slots: torch.Tensor  # the same as int64, contiguous
    # The entries checked and bound for the step's caches by its first call (every layer's
    # cache has the same shape).
    step: BoundStep | None = None

    def bound(self, kv_cache: torch.Tensor) -> BoundStep:
        if self.step is None:
            self.step = self.kernel.bind(self.table, self.table_rows, self.tokens, self.start,
                                         self.end, self.slots, kv_cache)
        return self.step


@dataclass(slots=True)
class CascadeGroup:
    rows: _Rows  # the query rows of all members
    blocks: torch.Tensor  # int64 [k]: the shared prefix blocks


@dataclass(slots=True)
class AttentionPlan:
    """What every layer of one step needs, derived once from the step's metadata (host side)."""

    num_tokens: int
    block_size: int
    any_padding_slot: bool
    prefills: list[PrefillCall] = field(default_factory=list)
    decodes: list[DecodeBucket] = field(default_factory=list)  # SDPA path
    native: _NativeDecodes | None = None  # C kernel path (then `decodes` is empty)
    groups: list[CascadeGroup] = field(default_factory=list)
    sliding_window: int | None = None  # the window this plan masks by (None: global)

    @classmethod
    def for_step(
        cls, metadata: AttentionMetadata, kv_cache: torch.Tensor, num_heads: int,
        sliding_window: int | None = None, query_dtype: torch.dtype = torch.float32,
        lib: ctypes.CDLL | None | Literal["process"] = "process",
    ) -> "AttentionPlan":
        """The plan of this step and window, kept in `metadata.plans`: made once (by the
        runner's step plan, before the forward) and reused by every layer, whose caches
        share one shape. One plan per distinct window; a window longer than every sequence
        shares the global plan. `query_dtype`: the activations' (the C kernel serves fp32);
        `lib`: the kernel library (as `paged_decode_kernel` takes it)."""
        # Contiguity too: the C kernel (chosen, or not, per key) addresses and writes a
        # cache by its shape alone, so a same-shaped strided cache needs a plan without it.
        key = (kv_cache.shape, kv_cache.dtype, kv_cache.device, kv_cache.is_contiguous(),
               num_heads, query_dtype)
        plans = metadata.plans
        plan = plans.get((key, sliding_window))
        if plan is not None:
            return plan
        window = _effective_window(sliding_window, metadata.seq_lens_cpu)
        plan = plans.get((key, window))
        if plan is None:
            # Gathers are sized by what SDPA reads: the blocks widened to the query's dtype.
            shape = kv_cache.shape  # [2, num_blocks, ...]: one block's K and V
            block_bytes = shape[0] * math.prod(shape[2:]) * query_dtype.itemsize
            plan = cls.build(metadata, kv_cache.shape[2], block_bytes,
                             paged_decode_kernel(kv_cache, num_heads, query_dtype, lib), window)
            plans[(key, window)] = plan
        plans[(key, sliding_window)] = plan
        return plan

    @classmethod
    def build(
        cls, metadata: AttentionMetadata, block_size: int, block_bytes: int = 1,
        kernel: PagedDecodeKernel | None = None, sliding_window: int | None = None,
    ) -> "AttentionPlan":
        """`block_bytes`: one block's K and V together, to size the decode gathers;
        `kernel`: plan the decodes for this C kernel instead; `sliding_window`: hide keys
        that many positions back or further."""
        qsl = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        num_reqs = len(seq_lens)
        slots = metadata.slot_mapping
        w = _effective_window(sliding_window, seq_lens)
        plan = cls(
            num_tokens=int(qsl[num_reqs]),
            block_size=block_size,
            # In numpy where the slots are on the CPU: a torch reduction costs a few ops.
            any_padding_slot=bool(slots.numel()) and bool(
                ((slots.numpy() if slots.is_cpu else slots.cpu().numpy()) < 0).any()),
            sliding_window=w,
        )
        if kernel is not None and num_reqs == 1 and qsl[1] - qsl[0] == 1:
            plan.native = _lone_decode(metadata, kernel, int(qsl[0]), int(seq_lens[0]), w)
            return plan
        step = _Step(metadata, block_size, qsl, seq_lens, w)
        min_saving = MIN_CASCADE_SAVING if kernel is None else MIN_CASCADE_SAVING_NATIVE
        prefix = _cascade_groups(plan, step, min_saving)
        # The first key each request reads itself: after its shared prefix; with a window,
        # the first key its first query sees (in blocks: the block holding that key).
        if w is None:
            key_lo = prefix * block_size
        else:
            key_lo = np.maximum(seq_lens - step.q_lens - w + 1, 0)
        short = np.zeros(num_reqs, dtype=bool)  # prefill chunks the kernel takes
        if kernel is not None:
            short = _native_entries(plan, step, kernel, prefix)
        else:
            _sdpa_decodes(plan, step, key_lo, block_bytes)
        _prefills(plan, step, np.flatnonzero((step.q_lens > 1) & ~short),
                  key_lo // block_size, prefix)
        return plan

    def native_only(self) -> "_NativeDecodes | None":
        """The C kernel's entries where they are all of the step's attention: no SDPA
        decodes, prefills or cascade groups (so no lse), every query row an entry. With fp32
        K/V the kernel's call stores them too (`native_write`), so a layer's attention is
        that one call: the fused decode step (v1.models.fused_decode) makes it from C."""
        if self.native is None or self.decodes or self.prefills or self.groups:
            return None
        return self.native

    def native_write(
        self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> "_NativeDecodes | None":
        """The plan's C kernel if it can store this K/V: one C call (per token: two row
        copies, converted to the cache's dtype) instead of two index_copy_ and, for a 16-bit
        cache, two conversions; at a few tokens those cost mostly dispatch."""
        native_step = self.native
        if (
            native_step is not None
            and slot_mapping is native_step.slot_mapping
            and key.dtype == value.dtype == torch.float32
        ):
            return native_step
        return None


class _Step:
    """A step's host arrays, as the planning functions below read them."""

    def __init__(self, metadata: AttentionMetadata, block_size: int, qsl: np.ndarray,
                 seq_lens: np.ndarray, window: int | None) -> None:
        num_reqs = len(seq_lens)
        self.metadata = metadata
        self.dev = metadata.slot_mapping.device
        self.B = block_size
        self.qsl, self.seq_lens, self.w = qsl, seq_lens, window
        self.q_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
        self.table = metadata.block_table.cpu().numpy()
        self.num_blocks = -(-seq_lens // block_size)
        self.ctx_blocks = (seq_lens - self.q_lens) // block_size  # full blocks before the queries

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.dev)


def _lone_decode(metadata: AttentionMetadata, kernel: PagedDecodeKernel, q_row: int,
                 seq_len: int, w: int | None) -> _NativeDecodes:
    """A lone decode (batch-1 generation, where this runs once per token): one kernel
    entry, no cascade. Built directly: the general planning is ~30 numpy calls on 1-element
    arrays, ~40 us a step, as much as a few layers' attention."""
    slots, table = metadata.slot_mapping, metadata.block_table
    start = 0 if w is None else seq_len - w
    # Its table row, query row, start and end, as 1-element views of one tensor. (The
    # kernel serves CPU caches: the runner's metadata is there, and its table int32.)
    entry = torch.from_numpy(np.array([[0], [q_row], [start], [seq_len]], dtype=np.int64))
    if table.dtype != torch.int32 or not table.is_contiguous():
        table = table.to(torch.int32).contiguous()
    return _NativeDecodes(
        kernel, table, *entry.unbind(), slots,
        slots if slots.dtype == torch.int64 and slots.is_contiguous()
        else slots.to(torch.int64).contiguous(),
    )


def _cascade_groups(plan: AttentionPlan, s: _Step, min_saving: int) -> np.ndarray:
    """Adds the cascade groups (requests whose leading blocks are the same physical blocks;
    not with a window); returns each request's shared prefix, in blocks."""
    prefix = np.zeros(len(s.seq_lens), dtype=np.int64)
    active = np.flatnonzero((s.q_lens > 0) & (s.ctx_blocks > 0))
    if len(active) < 2 or s.w is not None:
        return prefix
    table, ctx_blocks = s.table, s.ctx_blocks
    first = table[active, 0]
    for b in np.unique(first):
        members = active[first == b]
        if len(members) < 2:
            continue
        ref = members[np.argmax(ctx_blocks[members])]
        width = int(ctx_blocks[members].max())
        same = table[members, :width] == table[ref, :width]
        same &= np.arange(width)[None, :] < ctx_blocks[members][:, None]
        # lcp[i]: leading blocks member i shares with the reference row.
        lcp = np.where(same.all(1), width, np.argmin(same, axis=1))
        # Keep the members and prefix length that save the most reads.
        order = np.argsort(-lcp, kind="stable")
        saving = lcp[order] * np.arange(len(order))  # (n - 1) * k for the top n
        best = int(np.argmax(saving))
        if saving[best] * s.B < min_saving:
            continue
        k = int(lcp[order[best]])
        chosen = np.sort(members[order[: best + 1]])
        prefix[chosen] = k
        tokens = np.concatenate([np.arange(s.qsl[r], s.qsl[r + 1]) for r in chosen])
        plan.groups.append(CascadeGroup(_Rows(tokens, s.dev), s.tensor(table[ref, :k])))
    return prefix


def _native_entries(
    plan: AttentionPlan, s: _Step, kernel: PagedDecodeKernel, prefix: np.ndarray
) -> np.ndarray:
    """Makes the C kernel's entries: decodes, and prefill chunks with few keys left after
    their prefix (a prompt that hit the cache) or verify steps, as one decode-like entry
    per query token (token i of a chunk sees [start, its own position]); long chunks stay
    with SDPA (per-token entries would reread keys). Returns which chunks it took."""
    q_lens, seq_lens, w, B = s.q_lens, s.seq_lens, s.w, s.B
    # (An entry reads at most `w` keys with a window.)
    keys = seq_lens - prefix * B if w is None else np.minimum(seq_lens, w)
    generated = s.metadata.generated_cpu
    verify = (np.zeros(len(q_lens), dtype=bool) if generated is None
              else generated & (q_lens <= NATIVE_MAX_QUERIES))
    short = (q_lens > 1) & ((keys <= NATIVE_PREFILL_MAX_KEYS) | verify)
    rows = np.flatnonzero((q_lens == 1) | short)
    if len(rows):
        n = q_lens[rows]
        owner = np.repeat(rows, n)  # request of each entry
        i = np.arange(len(owner)) - np.repeat(np.cumsum(n) - n, n)  # index in chunk
        end = seq_lens[owner] - q_lens[owner] + i + 1
        start = prefix[owner] * B if w is None else np.maximum(end - w, 0)
        slots = s.metadata.slot_mapping
        plan.native = _NativeDecodes(
            kernel, s.metadata.block_table.to(torch.int32).contiguous(), s.tensor(owner),
            s.tensor(s.qsl[owner] + i), s.tensor(start), s.tensor(end),
            slots, slots.to(torch.int64).contiguous(),
        )
    return short


def _sdpa_decodes(plan: AttentionPlan, s: _Step, key_lo: np.ndarray, block_bytes: int) -> None:
    """Adds the decodes' SDPA calls: batched, bucketed by the number of blocks left after
    their prefix, at most MAX_GATHER_BYTES gathered per call."""
    dec = np.flatnonzero(s.q_lens == 1)
    if not len(dec):
        return
    B = s.B
    rest = s.num_blocks[dec] - key_lo[dec] // B
    order = np.argsort(rest, kind="stable")
    dec, rest = dec[order], rest[order]
    cut = [0]
    for i in range(1, len(dec)):
        pad = rest[i] - rest[cut[-1]]
        if pad * B > BUCKET_MIN_PAD and rest[i] > BUCKET_RATIO * rest[cut[-1]]:
            cut.append(i)
    cut.append(len(dec))
    for lo, hi in zip(cut[:-1], cut[1:]):
        nb = int(rest[hi - 1])
        keep = np.argsort(dec[lo:hi])  # back in query order: rows may be a slice
        bucket_rows, bucket_n = dec[lo:hi][keep], rest[lo:hi][keep]
        # Gather at most MAX_GATHER_BYTES per call: the copy stays in the last-level
        # cache for SDPA to read, and comes from the heap, not fresh (faulted) pages.
        per_call = max(1, MAX_GATHER_BYTES // (nb * block_bytes))
        for c in range(0, len(bucket_rows), per_call):
            rows, n = bucket_rows[c : c + per_call], bucket_n[c : c + per_call]
            plan.decodes.append(_decode_call(rows, n, nb, key_lo, s.table, s.seq_lens,
                                             s.qsl, B, s.dev, s.w is not None))


def _prefills(plan: AttentionPlan, s: _Step, requests: np.ndarray, first_blk: np.ndarray,
              prefix: np.ndarray) -> None:
    """Adds one SDPA call per prefill chunk (anything with more than one query) in
    `requests`, reading from block `first_blk[r]`."""
    w, B = s.w, s.B
    for r in requests.tolist():
        seq_len, q_len = int(s.seq_lens[r]), int(s.q_lens[r])
        start = int(first_blk[r]) * B
        blocks = hidden = None
        if seq_len > q_len:
            blocks = s.tensor(s.table[r, start // B : s.num_blocks[r]])
            pos_q = np.arange(seq_len - q_len, seq_len)[:, None]
            pos_k = np.arange(start, seq_len)[None, :]
            hidden = pos_k > pos_q
            if w is not None:
                hidden |= pos_q - pos_k >= w
        elif w is not None and q_len > w:  # no context: the fresh K/V, windowed
            pos = np.arange(q_len)
            hidden = (pos[None, :] > pos[:, None]) | (pos[:, None] - pos[None, :] >= w)
        mask = None
        if hidden is not None:
            mask = torch.from_numpy(np.where(hidden, -np.inf, 0).astype(np.float32)).to(s.dev)
        plan.prefills.append(PrefillCall(
            int(s.qsl[r]), int(s.qsl[r + 1]), seq_len, start, blocks, mask, bool(prefix[r])
        ))


def _decode_call(
    rows: np.ndarray, n: np.ndarray, nb: int, first: np.ndarray, table: np.ndarray,
    seq_lens: np.ndarray, qsl: np.ndarray, B: int, dev: torch.device, windowed: bool = False,
) -> DecodeBucket:
    """One SDPA call for decode requests `rows`: each attends to its `n` blocks from the one
    holding key position `first[r]` (after its prefix), padded to `nb` blocks. `windowed`:
    also hide the keys before `first[r]` in that block (else `first` is a block start)."""
    j = np.arange(nb)[None, :]
    first_blk = first[rows, None] // B
    cols = first_blk + np.where(j < n[:, None], j, 0)
    blocks = table[rows[:, None], cols]
    pos = first_blk * B + np.arange(nb * B)[None, :]
    pad = pos >= seq_lens[rows, None]
    if windowed:
        pad |= pos < first[rows, None]
    mask = pad_rows = None
    if pad.any():
        m = np.where(pad, -np.inf, 0.0).astype(np.float32)[:, None, None, :]
        mask = torch.from_numpy(m).to(dev)
        pad_rows = torch.from_numpy(np.flatnonzero(pad)).to(dev)
    block_ids = torch.from_numpy(np.ascontiguousarray(blocks.reshape(-1), dtype=np.int64))
    return DecodeBucket(_Rows(qsl[rows], dev), block_ids.to(dev), mask, pad_rows)


def _effective_window(sliding_window: int | None, seq_lens: np.ndarray) -> int | None:
    """The window, or None where it hides nothing: no sequence of the step is longer."""
    if sliding_window is None or len(seq_lens) == 0 or sliding_window >= int(seq_lens.max()):
        return None
    return int(sliding_window)
