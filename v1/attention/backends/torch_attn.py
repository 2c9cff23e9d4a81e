"""Attention in plain torch: the CPU backend, and the reference for the Triton kernels.

Two implementations of the same contract (see `abstract.py`):

- `paged_attention_reference`: per request, gather its context K/V out of the blocks and run
  causal SDPA. Short and obviously right; the Triton tests compare against it.
- `paged_attention`: what `TorchAttentionImpl` runs. Same results up to float rounding, planned
  once per step (`AttentionPlan`) and shared by every layer:
  * decodes (one query each) are batched: their K/V blocks are gathered into one padded
    [R, kv_heads, S, D] view and attended in one SDPA call, in buckets of similar length so
    that padding stays small;
  * prefills attend to their fresh K/V directly when they have no context (no cache read),
    else to their gathered context, one SDPA call each;
  * cascade: requests whose leading blocks are the same physical blocks (a shared system
    prompt hit in the prefix cache) attend to that shared prefix together, in one call over
    all their queries, which reads the prefix once instead of once per request. Each request
    then attends to the rest of its context alone, and the two partial results are merged
    with their log-sum-exps: with l_p, l_r the prefix's and the rest's logsumexp of the
    scaled scores, out = o_r + sigmoid(l_p - l_r) * (o_p - o_r).

SDPA gets 4-D [batch, heads, len, dim] tensors: on CPU that selects the flash kernel (blocked,
GQA aware, strided inputs), which is several times faster than the math fallback that 3-D
inputs get.

Decodes have a faster option still: a small C kernel (`v1/kernels/csrc/paged_decode.h`,
~150 lines; bindings in `v1.kernels.attention`) that reads each request's K/V in place
through its block table, with an online softmax, one request per task of the kernels'
worker pool. SDPA spends most of a decode in per-(request, head) overhead and needs the
gathered copy; the kernel needs neither and is 3-4x faster at 64 decodes. Without the
kernels (V1_CPU_KERNELS=0), for other dtypes or shapes, the SDPA path above runs instead.
In a step it serves, the cache write is C too (`kv_write`, the same bits as
`write_kv_cache`), in the kernel's call, and what every layer's call shares (the entries,
slots, shapes) is checked and converted for ctypes once per step: at batch 1 a layer's
attention is a few microseconds of work, and was mostly call overhead.

The cache may hold a narrower dtype than the model computes in (kv_cache_dtype "bfloat16" or
"float16" under an fp32 model: half the bytes per token, twice the tokens per pool). The
cache write converts this step's K/V once (into fp16 saturating at +-65504: an inf key
would make attention NaN); every read widens exactly what it reads back to the query's
dtype: the C kernel per K/V row (bf16: a 16-bit shift into the high half of an
fp32; fp16: F16C's vcvtph2ps), the SDPA paths and the reference after their gather. All the
arithmetic stays fp32, so a 16-bit cache gives bit for bit the fp32 cache's result on K/V
that were 16-bit values to begin with. A prefill without context that SDPA runs attends to
its fresh, unrounded K/V (it reads no cache); one the C kernel takes (a short prompt) reads
them back from the cache, rounded, as every later step does.

Sliding-window layers (`sliding_window=w`, see `abstract.py`: query i sees keys j with
i - w < j <= i) get a plan of their own, built once per step and window. A window no sequence
of the step is longer than is no window at all and shares the global plan. Otherwise:
  * every path starts reading at the block of the first key its queries can see, so whole
    blocks before the window are never read (a decode reads at most ceil(w / B) + 1 blocks);
  * the C kernel needs no change: its entries attend to [start, end), and start becomes
    max(0, end - w);
  * SDPA decodes and prefill chunks mask the keys before each query's window in the first
    block they gather (those rows are zeroed too, like padding);
  * there is no cascade (a shared prefix is mostly out of the window, and where it is not,
    different queries would need different parts of it).
"""

import threading
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata
from v1.kernels.attention import BoundStep, PagedDecodeKernel, paged_decode_kernel

# fp16's largest finite value. K/V beyond it are stored saturated, as vLLM's fp8 cache writes
# saturate: an inf key or value would make the softmax, and every later output, NaN.
_FP16_MAX = torch.finfo(torch.float16).max


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in the cache's dtype (a no-op when it is the model's); into fp16, saturating."""
    if x.dtype == dtype:
        return x
    x = x.to(dtype)
    if dtype == torch.float16:
        x.clamp_(-_FP16_MAX, _FP16_MAX)  # after the cast: in place on the copy; NaN stays
    return x


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store token i's K/V at flat slot `slot_mapping[i]`; a negative slot is padding and
    stores nothing. Rows of key/value beyond `len(slot_mapping)` are ignored."""
    n = slot_mapping.shape[0]
    key, value = key[:n], value[:n]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    # Converted to the cache's dtype here, once.
    flat[0].index_copy_(0, slot_mapping, _to_cache_dtype(key, kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, _to_cache_dtype(value, kv_cache.dtype))


def paged_attention_reference(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Per request: gather its context K/V from the blocks (in the query's dtype), then
    causal SDPA (GQA aware), hiding keys `sliding_window` or more positions back if a
    window is given."""
    block_size = kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = metadata.query_start_loc_cpu
    for r, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        q_start, q_end = int(starts[r]), int(starts[r + 1])
        q_len = q_end - q_start
        if q_len == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_table[r, :num_blocks].long()
        k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].to(query.dtype)  # [seq_len, kvh, d]
        v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].to(query.dtype)
        # Query i sits at position seq_len - q_len + i and sees keys up to there (and, with a
        # window, only the last `sliding_window` of those).
        mask = None
        windowed = sliding_window is not None and sliding_window < seq_len
        if q_len > 1 or windowed:
            pos_q = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
            pos_k = torch.arange(seq_len, device=query.device).unsqueeze(0)
            mask = pos_k <= pos_q
            if windowed:
                mask &= pos_q - pos_k < sliding_window
        o = F.scaled_dot_product_attention(  # [1, h, q_len, d]
            query[q_start:q_end].transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=True,
        )
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


class TorchAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = AttentionPlan.for_step(
            metadata, kv_cache, self.num_heads, self.sliding_window, query.dtype
        )
        if plan.native_write(key, value, metadata.slot_mapping) is not None:
            # The C kernel stores the K/V and attends in one call (it runs before any other
            # part of the step's attention reads the cache).
            return paged_attention(query, key, value, kv_cache, plan, self.scale, write=True)
        plan.write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        return paged_attention(query, key, value, kv_cache, plan, self.scale)


# ---- the fast path ------------------------------------------------------------------------------

# Share a prefix only when it saves at least this many token reads in total.
MIN_CASCADE_SAVING = 256
# Decodes are padded to the longest of their bucket. A decode starts a new bucket (one more
# SDPA call) only when the bucket's shortest member would be padded by more than this many
# tokens and by more than BUCKET_RATIO times its own length.
BUCKET_MIN_PAD = 256
BUCKET_RATIO = 1.5
# The most K/V bytes one decode call gathers (a bucket is split into calls of this size).
MAX_GATHER_BYTES = 16 << 20
# With the C kernel, prefill chunks attending to at most this many keys after their shared
# prefix are run by the kernel too (one entry per query token).
NATIVE_PREFILL_MAX_KEYS = 256


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
class _Prefill:
    q_start: int
    q_end: int
    seq_len: int
    start: int  # first key position read here (after the group's prefix, or the first
    # block of the window, or 0)
    blocks: torch.Tensor | None  # int64 block ids covering [start, seq_len); None: fresh K/V
    mask: torch.Tensor | None  # float [q_len, seq_len - start], -inf: hidden; None: causal
    need_lse: bool


@dataclass(slots=True)
class _DecodeBucket:
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
class _Group:
    rows: _Rows  # the query rows of all members
    blocks: torch.Tensor  # int64 [k]: the shared prefix blocks


@dataclass(slots=True)
class AttentionPlan:
    """What every layer of one step needs, derived once from the step's metadata (host side)."""

    num_tokens: int
    block_size: int
    any_padding_slot: bool
    prefills: list[_Prefill] = field(default_factory=list)
    decodes: list[_DecodeBucket] = field(default_factory=list)  # SDPA path
    native: _NativeDecodes | None = None  # C kernel path (then `decodes` is empty)
    groups: list[_Group] = field(default_factory=list)
    sliding_window: int | None = None  # the window this plan masks by (None: global)

    _local = threading.local()

    @classmethod
    def for_step(
        cls, metadata: AttentionMetadata, kv_cache: torch.Tensor, num_heads: int,
        sliding_window: int | None = None, query_dtype: torch.dtype = torch.float32,
    ) -> "AttentionPlan":
        """The plan of this metadata and window, built by the first layer that needs it and
        reused by the others (every layer's cache has the same shape): one plan per distinct
        window in the step, where a window longer than every sequence shares the global one.
        `query_dtype`: the activations' (the C kernel serves fp32 ones only)."""
        # Contiguity too: the C kernel (chosen, or not, per key) addresses and writes a
        # cache by its shape alone, so a same-shaped strided cache needs a plan without it.
        key = (kv_cache.shape, kv_cache.dtype, kv_cache.device, kv_cache.is_contiguous(),
               num_heads, query_dtype)
        cached = getattr(cls._local, "cached", None)
        if cached is not None and cached[0] is metadata and cached[1] == key:
            plans = cached[2]
            plan = plans.get(sliding_window)
            if plan is not None:
                return plan
        else:
            plans = {}
            cls._local.cached = (metadata, key, plans)
        window = _effective_window(sliding_window, metadata.seq_lens_cpu)
        plan = plans.get(window)
        if plan is None:
            # Gathers are sized by what SDPA reads: the blocks widened to the query's dtype.
            block_bytes = kv_cache[:, 0].numel() * query_dtype.itemsize
            plan = cls.build(metadata, kv_cache.shape[2], block_bytes,
                             paged_decode_kernel(kv_cache, num_heads, query_dtype), window)
            plans[window] = plan
        plans[sliding_window] = plan
        return plan

    @classmethod
    def build(
        cls, metadata: AttentionMetadata, block_size: int, block_bytes: int = 1,
        kernel: PagedDecodeKernel | None = None, sliding_window: int | None = None,
    ) -> "AttentionPlan":
        """`block_bytes`: one block's K and V together, to size the decode gathers;
        `kernel`: plan the decodes for this C kernel instead; `sliding_window`: hide keys
        that many positions back or further."""
        dev = metadata.slot_mapping.device
        B = block_size
        qsl = np.asarray(metadata.query_start_loc_cpu, dtype=np.int64)
        seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)
        num_reqs = len(seq_lens)
        slots = metadata.slot_mapping
        w = _effective_window(sliding_window, seq_lens)
        plan = cls(
            num_tokens=int(qsl[num_reqs]),
            block_size=B,
            any_padding_slot=bool(slots.numel()) and bool((slots < 0).any()),
            sliding_window=w,
        )
        if kernel is not None and num_reqs == 1 and qsl[1] - qsl[0] == 1:
            # A lone decode (batch-1 generation, where this runs once per token): one kernel
            # entry, no cascade. Built directly: the general planning below is ~30 numpy
            # calls on 1-element arrays, ~40 us a step, as much as a few layers' attention.
            seq_len = int(seq_lens[0])
            start = 0 if w is None else seq_len - w
            # Its table row, query row, start and end, as 1-element views of one tensor.
            entry = torch.tensor([0, int(qsl[0]), start, seq_len], dtype=torch.int64).to(dev)
            plan.native = _NativeDecodes(
                kernel, metadata.block_table.to(torch.int32).contiguous(),
                *(entry[i : i + 1] for i in range(4)),
                slots, slots.to(torch.int64).contiguous(),
            )
            return plan
        q_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
        table = metadata.block_table.cpu().numpy()
        num_blocks = -(-seq_lens // B)
        ctx_blocks = (seq_lens - q_lens) // B  # full blocks entirely before the queries

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(dev)

        # Cascade groups: requests whose leading blocks are the same physical blocks (not
        # with a window).
        prefix = np.zeros(num_reqs, dtype=np.int64)  # shared prefix blocks per request
        active = np.flatnonzero((q_lens > 0) & (ctx_blocks > 0))
        if len(active) > 1 and w is None:
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
                if saving[best] * B < MIN_CASCADE_SAVING:
                    continue
                k = int(lcp[order[best]])
                chosen = np.sort(members[order[: best + 1]])
                prefix[chosen] = k
                tokens = np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in chosen])
                plan.groups.append(_Group(_Rows(tokens, dev), tensor(table[ref, :k])))

        # The first key each request reads itself: after its shared prefix; with a window,
        # the first key its first query sees (in blocks: the block holding that key).
        if w is None:
            key_lo = prefix * B
        else:
            key_lo = np.maximum(seq_lens - q_lens - w + 1, 0)
        first_blk = key_lo // B

        # Decodes: batched, bucketed by the number of blocks left after their prefix.
        dec = np.flatnonzero(q_lens == 1)
        short = np.zeros(num_reqs, dtype=bool)
        if kernel is not None:
            # The kernel attends one query at a time, so a prefill chunk with few keys
            # left after its prefix (a prompt that hit the cache) goes there too, as one
            # decode-like entry per query token: token i of the chunk sees [start, its own
            # position]. Long ones stay with SDPA (per-token entries would reread keys).
            # (An entry reads at most `w` keys with a window.)
            keys = seq_lens - prefix * B if w is None else np.minimum(seq_lens, w)
            short = (q_lens > 1) & (keys <= NATIVE_PREFILL_MAX_KEYS)
            rows = np.flatnonzero((q_lens == 1) | short)
            if len(rows):
                n = q_lens[rows]
                owner = np.repeat(rows, n)  # request of each entry
                i = np.arange(len(owner)) - np.repeat(np.cumsum(n) - n, n)  # index in chunk
                end = seq_lens[owner] - q_lens[owner] + i + 1
                start = prefix[owner] * B if w is None else np.maximum(end - w, 0)
                plan.native = _NativeDecodes(
                    kernel, metadata.block_table.to(torch.int32).contiguous(), tensor(owner),
                    tensor(qsl[owner] + i), tensor(start), tensor(end),
                    slots, slots.to(torch.int64).contiguous(),
                )
        elif len(dec):
            rest = num_blocks[dec] - first_blk[dec]
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
                    plan.decodes.append(_decode_call(rows, n, nb, key_lo, table, seq_lens,
                                                     qsl, B, dev, w is not None))

        # Prefill chunks (and anything with more than one query): one call each.
        for r in np.flatnonzero((q_lens > 1) & ~short).tolist():
            seq_len, q_len = int(seq_lens[r]), int(q_lens[r])
            start = int(first_blk[r]) * B
            blocks = hidden = None
            if seq_len > q_len:
                blocks = tensor(table[r, start // B : num_blocks[r]])
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
                mask = torch.from_numpy(np.where(hidden, -np.inf, 0).astype(np.float32)).to(dev)
            plan.prefills.append(_Prefill(
                int(qsl[r]), int(qsl[r + 1]), seq_len, start, blocks, mask, bool(prefix[r])
            ))
        return plan

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

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if (native_step := self.native_write(key, value, slot_mapping)) is not None:
            native_step.kernel(native_step.bound(kv_cache), None, kv_cache, None, None, 0.0,
                               key, value)
            return
        if self.any_padding_slot:
            write_kv_cache(key, value, kv_cache, slot_mapping)
            return
        n = slot_mapping.shape[0]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
        flat[0].index_copy_(0, slot_mapping, _to_cache_dtype(key[:n], kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, _to_cache_dtype(value[:n], kv_cache.dtype))


def _decode_call(
    rows: np.ndarray, n: np.ndarray, nb: int, first: np.ndarray, table: np.ndarray,
    seq_lens: np.ndarray, qsl: np.ndarray, B: int, dev: torch.device, windowed: bool = False,
) -> _DecodeBucket:
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
    return _DecodeBucket(_Rows(qsl[rows], dev), block_ids.to(dev), mask, pad_rows)


def _effective_window(sliding_window: int | None, seq_lens: np.ndarray) -> int | None:
    """The window, or None where it hides nothing: no sequence of the step is longer."""
    if sliding_window is None or len(seq_lens) == 0 or sliding_window >= int(seq_lens.max()):
        return None
    return int(sliding_window)


def _sdpa_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA on [b, h, q, d] / [b, kvh, k, d] that also returns logsumexp [b, h, q] of the
    scaled, masked scores (natural log). `mask` is additive (float)."""
    if _flash_with_lse is not None:
        out, lse = _flash_with_lse(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return out, lse
    # Portable fallback: the same in plain ops.
    ratio = q.shape[1] // k.shape[1]
    if ratio > 1:
        k, v = k.repeat_interleave(ratio, 1), v.repeat_interleave(ratio, 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = scores.logsumexp(-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


# The CPU flash kernel behind SDPA, which also returns the logsumexp (a private aten op:
# looked up once, with the plain-ops fallback above if this torch lacks it).
_flash_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _gather(
    kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `blocks`, in order, in `dtype` (the query's; a 16-bit cache is widened
    after the gather, so only the needed blocks are): [len(blocks) * B, kvh, d] each.

    One index_select per cache half along its first dimension (whole blocks, contiguous
    rows): that is the parallel, memcpy-like path; selecting along dim 1 of the [2, ...]
    view runs single-threaded and several times slower.
    """
    two, num_blocks, B, kvh, d = kv_cache.shape
    k = kv_cache[0].view(num_blocks, B * kvh * d).index_select(0, blocks).to(dtype)
    v = kv_cache[1].view(num_blocks, B * kvh * d).index_select(0, blocks).to(dtype)
    return k.view(-1, kvh, d), v.view(-1, kvh, d)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    write: bool = False,
) -> torch.Tensor:
    """The step's attention for query [T, h, d]; key/value are this step's new K/V, already
    in the cache, or with `write` (where `plan.native_write` allows it) stored by the C
    kernel's call first. Matches `paged_attention_reference` up to float rounding; like it,
    it never lets a slot past a sequence's end change the result."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    # Contiguous whatever the query's strides (empty_like would keep a permuted query's).
    out = query.new_empty(*query.shape)
    lse = None
    if plan.groups:
        lse = torch.empty(query.shape[0], num_heads, dtype=torch.float32, device=query.device)

    num_kv_heads = kv_cache.shape[3]
    if (native_decodes := plan.native) is not None:
        native_decodes.kernel(native_decodes.bound(kv_cache), query, kv_cache, out, lse, scale,
                              *((key, value) if write else ()))
    for bucket in plan.decodes:
        # A decode's query heads that share a kv head are the rows of one [g, d] query of
        # that kv head: SDPA then reads each K/V row once per kv head, not once per head.
        q = bucket.rows.take(query)
        R = q.shape[0]
        q = q.view(R, num_kv_heads, num_heads // num_kv_heads, head_dim)
        k, v = _gather(kv_cache, bucket.blocks, query.dtype)
        if bucket.pad_rows is not None:
            k.view(k.shape[0], -1).index_fill_(0, bucket.pad_rows, 0.0)
            v.view(v.shape[0], -1).index_fill_(0, bucket.pad_rows, 0.0)
        # [R, kvh, S, d], strided views of the gathered rows
        k = k.view(R, -1, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(R, -1, num_kv_heads, head_dim).transpose(1, 2)
        if lse is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask, scale=scale)
        else:
            o, o_lse = _sdpa_lse(q, k, v, bucket.mask, scale)
            bucket.rows.put(lse, o_lse.reshape(R, num_heads))
        bucket.rows.put(out, o.reshape(R, num_heads, head_dim))

    for p in plan.prefills:
        q = query[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, h, q_len, d]
        if p.blocks is None:  # no context: the fresh K/V are the whole sequence
            k, v = key[p.q_start : p.q_end], value[p.q_start : p.q_end]
        else:
            k, v = _gather(kv_cache, p.blocks, query.dtype)
            k, v = k[: p.seq_len - p.start], v[: p.seq_len - p.start]
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if p.need_lse:
            assert lse is not None
            o, o_lse = _sdpa_lse(q, k, v, p.mask, scale)
            lse[p.q_start : p.q_end] = o_lse[0].transpose(0, 1)
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                enable_gqa=True,
            )
        out[p.q_start : p.q_end] = o[0].transpose(0, 1)

    group_size = num_heads // num_kv_heads
    for g in plan.groups:
        assert lse is not None
        k, v = _gather(kv_cache, g.blocks, query.dtype)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        # No mask here, so the query heads of one kv head can be stacked into one longer
        # query [group_size * Tg, d] of that kv head: fewer, bigger blocks for the kernel.
        q = g.rows.take(query)
        Tg = q.shape[0]
        q = q.view(Tg, num_kv_heads, group_size, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(1, num_kv_heads, group_size * Tg, head_dim)
        o_p, l_p = _sdpa_lse(q, k, v, None, scale)
        o_p = o_p.view(num_kv_heads, group_size, Tg, head_dim).permute(2, 0, 1, 3)
        o_p = o_p.reshape(Tg, num_heads, head_dim)
        l_p = l_p.view(num_kv_heads, group_size, Tg).permute(2, 0, 1).reshape(Tg, num_heads)
        o_r, l_r = g.rows.take(out), g.rows.take(lse)
        g.rows.put(out, torch.lerp(o_r, o_p, torch.sigmoid(l_p - l_r).unsqueeze(-1)))
    return out
