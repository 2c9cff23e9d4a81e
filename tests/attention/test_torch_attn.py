"""The torch backend's fast path (batched decodes, cascade over shared prefixes) against its
per-request reference and against dense float64 attention; the cache write's padding rule;
sliding-window layers on every path (C kernel, SDPA decodes, prefills with and without
context), with the blocks before every window poisoned."""

import numpy as np
import pytest
import torch

from v1.attention.backends import torch_attn, torch_plan
from v1.attention.backends.abstract import AttentionMetadata, kv_cache_shape
from v1.attention.backends.torch_attn import (
    TorchAttentionImpl,
    paged_attention_reference,
    write_kv_cache,
    write_step_kv,
)
from v1.attention.backends.torch_plan import AttentionPlan
from v1.kernels.attention import PagedDecodeKernel, paged_decode_kernel

ATOL, RTOL = 2e-5, 1e-5


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Batch:
    """A packed step over a shuffled block pool. Requests of one group share their first
    `prefix` tokens' blocks (the same physical blocks, as after prefix-cache hits). Unused
    slots hold NaN, so reading one unmasked poisons the output; the shared blocks are written
    in the step itself when a member's new tokens cover them (a cold prompt and its hits
    scheduled together)."""

    def __init__(self, reqs, prefixes, num_heads, num_kv_heads, head_size, block_size, seed=0):
        gen = torch.Generator().manual_seed(seed)
        B = block_size
        shape = (num_kv_heads, head_size)
        group_kv = {
            g: (torch.randn(n, *shape, generator=gen), torch.randn(n, *shape, generator=gen))
            for g, n in prefixes.items()
        }
        own_blocks = [cdiv(s, B) - (prefixes[g] // B if g is not None else 0) for _, s, g in reqs]
        num_blocks = sum(own_blocks) + sum(n // B for n in prefixes.values()) + 2
        pool = iter(torch.randperm(num_blocks, generator=gen).tolist())
        group_blocks = {g: [next(pool) for _ in range(n // B)] for g, n in prefixes.items()}
        written_in_step = {g for g, n in prefixes.items()
                           if any(grp == g and s - q < n for q, s, grp in reqs)}
        max_blocks = max(cdiv(s, B) for _, s, _ in reqs) + 1
        table = np.full((len(reqs), max_blocks), next(pool), dtype=np.int32)  # stale padding
        self.kv_cache = torch.full(kv_cache_shape(num_blocks, B, *shape), float("nan"))
        q, k_new, v_new, slots = [], [], [], []
        self.full_k, self.full_v, self.reqs = [], [], reqs
        for r, (q_len, seq_len, g) in enumerate(reqs):
            shared = group_blocks.get(g, [])
            blocks = shared + [next(pool) for _ in range(own_blocks[r])]
            table[r, : len(blocks)] = blocks
            n_shared = len(shared) * B
            k = torch.randn(seq_len, *shape, generator=gen)
            v = torch.randn(seq_len, *shape, generator=gen)
            if g is not None:
                k[:n_shared], v[:n_shared] = group_kv[g]
            self.full_k.append(k)
            self.full_v.append(v)
            pos = torch.arange(seq_len)
            req_slots = torch.tensor(blocks)[pos // B].long() * B + pos % B
            ctx = seq_len - q_len
            first = n_shared if g in written_in_step else 0
            if ctx > first:
                write_kv_cache(k[first:ctx], v[first:ctx], self.kv_cache, req_slots[first:ctx])
            slots.append(req_slots[ctx:])
            k_new.append(k[ctx:])
            v_new.append(v[ctx:])
            q.append(torch.randn(q_len, num_heads, head_size, generator=gen))
        self.metadata = AttentionMetadata.build(
            np.array([r[0] for r in reqs]), np.array([r[1] for r in reqs]), table,
            torch.cat(slots),
        )
        self.query, self.key, self.value = torch.cat(q), torch.cat(k_new), torch.cat(v_new)

    def run_fast(self, scale, sliding_window=None, kv_cache=None):
        impl = TorchAttentionImpl(self.query.shape[1], self.query.shape[2], self.key.shape[1],
                                  scale, sliding_window=sliding_window)
        cache = (self.kv_cache if kv_cache is None else kv_cache).clone()
        out = impl.forward(self.query, self.key, self.value, cache, self.metadata)
        return out, cache

    def run_reference(self, scale, sliding_window=None):
        cache = self.kv_cache.clone()
        write_kv_cache(self.key, self.value, cache, self.metadata.slot_mapping)
        out = paged_attention_reference(self.query, cache, self.metadata, scale, sliding_window)
        return out, cache

    def out_of_window_poisoned(self, window):
        """The cache with NaN in every block that no query of the step can see through a
        window of `window` (blocks wholly before each request's first query's window and
        used by no other request that needs them): a path reading one unmasked, or failing to
        skip it, poisons its output."""
        B = self.kv_cache.shape[2]
        table = self.metadata.block_table.numpy()
        needed, seen = set(), set()
        for r, (q_len, seq_len, _) in enumerate(self.reqs):
            blocks = table[r, : cdiv(seq_len, B)].tolist()
            first = max(0, seq_len - q_len - window + 1) // B
            seen.update(blocks)
            needed.update(blocks[first:])
        cache = self.kv_cache.clone()
        dead = sorted(seen - needed)
        cache[:, dead] = float("nan")
        return cache, len(dead)

    def dense(self, scale, sliding_window=None):
        outs = []
        starts = self.metadata.query_start_loc_cpu
        for r, (q_len, seq_len, _) in enumerate(self.reqs):
            q = self.query[int(starts[r]) : int(starts[r + 1])].double()
            ratio = q.shape[1] // self.full_k[r].shape[1]
            k = self.full_k[r].double().repeat_interleave(ratio, dim=1)
            v = self.full_v[r].double().repeat_interleave(ratio, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q, k) * scale
            q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
            pos_k = torch.arange(seq_len)[None, :]
            visible = pos_k <= q_pos
            if sliding_window is not None:
                visible &= q_pos - pos_k < sliding_window
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        return torch.cat(outs)


# (q_len, seq_len, group): the group's first prefixes[group] tokens are shared blocks.
SCENARIOS = {
    "decode": ([(1, 17, None), (1, 1, None), (1, 40, None), (1, 33, None), (1, 8, None)], {}),
    "decode-lengths": ([(1, 3, None), (1, 600, None), (1, 47, None), (1, 90, None),
                        (1, 16, None)], {}),
    "prefill": ([(20, 20, None), (7, 7, None), (33, 33, None)], {}),
    "chunked": ([(9, 29, None), (19, 35, None), (5, 50, None), (30, 33, None)], {}),
    "mixed": ([(1, 23, None), (12, 12, None), (1, 64, None), (10, 37, None), (1, 5, None),
               (25, 25, None), (6, 22, None)], {}),
    "shared-decode": ([(1, 150, 0), (1, 170, 0), (1, 129, 0), (1, 300, 0), (1, 40, None)],
                      {0: 128}),
    "shared-prefill": ([(20, 150, 0), (5, 133, 0), (1, 160, 0), (40, 168, 0)], {0: 128}),
    "cold-and-hits": ([(150, 150, 0), (20, 148, 0), (9, 137, 0), (1, 200, 0)], {0: 128}),
    "two-groups": ([(1, 100, 0), (3, 90, 1), (1, 300, 0), (1, 95, 1), (2, 99, 0), (1, 87, 1),
                    (4, 4, None)], {0: 64, 1: 80}),
    # Prefills with more keys than the native kernel takes (SDPA), beside ones it takes.
    "long-prefills": ([(300, 300, None), (1, 40, None), (5, 400, None), (280, 300, None),
                       (30, 290, 0), (1, 280, 0)], {0: 256}),
    # Batch-1 generation: the kernel's plan of a lone decode is built apart (no planning).
    "lone-decode": ([(1, 150, None)], {}),
}
GQA = {"gqa1": (2, 2), "gqa3": (9, 3), "gqa4": (8, 2)}


@pytest.fixture(params=[True, False], ids=["flash-lse", "plain-lse"])
def lse_impl(request, monkeypatch):
    if not request.param:
        monkeypatch.setattr(torch_attn, "_flash_with_lse", None)
    return request.param


@pytest.fixture(params=["native", "sdpa"])
def decode_impl(request, monkeypatch):
    """Decodes through the C kernel (skipped without a C compiler) or through SDPA."""
    if request.param == "native":
        if paged_decode_kernel(torch.zeros(kv_cache_shape(1, 16, 3, 64)), 9) is None:
            pytest.skip("the native decode kernel is not available (no C compiler?)")
    else:
        monkeypatch.setenv("V1_CPU_KERNELS", "0")
    return request.param


@pytest.fixture
def always_cascade(monkeypatch):
    """Cascade any shared prefix, however small the saving (the tests' prefixes are short)."""
    for name in ("MIN_CASCADE_SAVING", "MIN_CASCADE_SAVING_NATIVE"):
        monkeypatch.setattr(torch_plan, name, 0)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size,gqa", [(16, "gqa3"), (8, "gqa1"), (16, "gqa4")])
def test_fast_path_matches_reference_and_dense(scenario, block_size, gqa, lse_impl,
                                                decode_impl, always_cascade):
    reqs, prefixes = SCENARIOS[scenario]
    if any(n % block_size for n in prefixes.values()):
        pytest.skip("prefix not a whole number of blocks")
    num_heads, num_kv_heads = GQA[gqa]
    batch = Batch(reqs, prefixes, num_heads, num_kv_heads, 64, block_size, seed=1)
    scale = 64**-0.5
    out, cache = batch.run_fast(scale)
    ref, ref_cache = batch.run_reference(scale)
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out.double(), batch.dense(scale), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("scenario", ["shared-decode", "shared-prefill", "cold-and-hits",
                                      "two-groups"])
def test_shared_prefixes_are_cascaded(scenario, always_cascade):
    reqs, prefixes = SCENARIOS[scenario]
    batch = Batch(reqs, prefixes, 9, 3, 64, 16)
    plan = AttentionPlan.build(batch.metadata, 16)
    assert len(plan.groups) == len(prefixes)
    for group, n in zip(plan.groups, prefixes.values()):
        assert len(group.blocks) == n // 16
    # A cold prompt writing the shared blocks in this step cannot read them as a prefix.
    if scenario == "cold-and-hits":
        cold = plan.prefills[0]
        assert cold.q_start == 0 and cold.start == 0 and cold.blocks is None


def test_plan_is_built_once_per_step():
    batch = Batch(*SCENARIOS["mixed"], 9, 3, 64, 16)
    plan = AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9)
    assert AttentionPlan.for_step(batch.metadata, batch.kv_cache.clone(), 9) is plan
    other = Batch(*SCENARIOS["mixed"], 9, 3, 64, 16)
    assert AttentionPlan.for_step(other.metadata, other.kv_cache, 9) is not plan


def test_decodes_of_very_different_lengths_are_bucketed():
    batch = Batch(*SCENARIOS["decode-lengths"], 9, 3, 64, 16)
    plan = AttentionPlan.build(batch.metadata, 16)
    assert len(plan.decodes) == 2
    long, short = sorted(plan.decodes, key=lambda b: b.rows.stop - b.rows.start)
    assert (long.rows.start, long.rows.stop, long.rows.index) == (1, 2, None)
    assert short.rows.index.tolist() == [0, 2, 3, 4]


def test_big_decode_gathers_are_split(monkeypatch):
    monkeypatch.setenv("V1_CPU_KERNELS", "0")  # the SDPA path
    batch = Batch(*SCENARIOS["decode"], 9, 3, 64, 16)
    block_bytes = batch.kv_cache[:, 0].nbytes
    monkeypatch.setattr(torch_plan, "MAX_GATHER_BYTES", 3 * block_bytes * 3)
    calls = AttentionPlan.build(batch.metadata, 16, block_bytes).decodes
    assert [(c.rows.start, c.rows.stop) for c in calls] == [(0, 3), (3, 5)]  # 3 blocks each
    out, _ = batch.run_fast(0.125)
    ref, _ = batch.run_reference(0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_decodes_of_similar_lengths_share_one_call_over_a_slice():
    batch = Batch(*SCENARIOS["decode"], 9, 3, 64, 16)
    (bucket,) = AttentionPlan.build(batch.metadata, 16).decodes
    assert (bucket.rows.start, bucket.rows.stop, bucket.rows.index) == (0, 5, None)


def test_write_kv_cache_skips_negative_slots():
    shape = kv_cache_shape(4, 8, 2, 16)
    cache = torch.zeros(shape)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3, -1, 17, -1, 30])
    write_kv_cache(key, value, cache, slots)
    flat = cache.view(2, 32, 2, 16)
    for i, s in [(0, 3), (2, 17), (4, 30)]:
        assert torch.equal(flat[0, s], key[i]) and torch.equal(flat[1, s], value[i])
    written = {3, 17, 30}
    others = [s for s in range(32) if s not in written]
    assert not flat[:, others].any()


def test_padded_slots_through_the_backend():
    """Rows past the real tokens (slot -1) are not written; the real ones are attended."""
    batch = Batch(*SCENARIOS["mixed"], 9, 3, 64, 16, seed=3)
    md = batch.metadata
    pad = 2
    padded_md = AttentionMetadata(
        md.num_actual_tokens, md.max_query_len, md.max_seq_len, md.query_start_loc,
        md.seq_lens, md.block_table, torch.cat([md.slot_mapping, torch.full((pad,), -1)]),
        md.query_start_loc_cpu, md.seq_lens_cpu,
    )
    impl = TorchAttentionImpl(9, 64, 3, 0.125)
    cache = batch.kv_cache.clone()
    q = torch.cat([batch.query, torch.randn(pad, 9, 64)])
    k = torch.cat([batch.key, torch.randn(pad, 3, 64)])
    v = torch.cat([batch.value, torch.randn(pad, 3, 64)])
    out = impl.forward(q, k, v, cache, padded_md)
    ref, ref_cache = batch.run_reference(0.125)
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())
    torch.testing.assert_close(out[: md.num_actual_tokens], ref, atol=ATOL, rtol=RTOL)


def test_small_shared_prefixes_are_not_worth_a_cascade():
    batch = Batch(*SCENARIOS["two-groups"], 9, 3, 64, 16)
    assert not AttentionPlan.build(batch.metadata, 16).groups


def test_the_c_kernel_rereads_what_sdpa_would_cascade():
    """Five decodes sharing 192 tokens save 768 reads in a cascade: worth an SDPA call when
    SDPA serves the decodes, not beside the C kernel, whose entries reread the prefix for
    less than the cascade's call and merge cost."""
    batch = Batch([(1, 200 + i, 0) for i in range(5)], {0: 192}, 9, 3, 64, 16)
    assert len(AttentionPlan.build(batch.metadata, 16).groups) == 1
    kernel = paged_decode_kernel(batch.kv_cache, 9)
    if kernel is None:
        pytest.skip("the native decode kernel is not available (no C compiler?)")
    plan = AttentionPlan.build(batch.metadata, 16, kernel=kernel)
    assert not plan.groups and plan.native.start.tolist() == [0] * 5


def test_native_kernel_serves_decodes_and_short_prefills(decode_impl, always_cascade,
                                                         monkeypatch):
    batch = Batch(*SCENARIOS["long-prefills"], 9, 3, 64, 16)
    plan = AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9)
    if decode_impl == "native":
        assert not plan.decodes
        # The decodes (rows 300 and 616) and the 30-token chunk after the shared prefix;
        # the 5-token chunk over 400 keys is a prompt's: SDPA, as it would be cold.
        assert plan.native.tokens.tolist() == [300, *range(586, 616), 616]
        assert plan.native.end.tolist() == [40, *range(261, 291), 280]
        assert plan.native.start.tolist() == [0] + [256] * 31
        assert [p.q_start for p in plan.prefills] == [0, 301, 306]
        # The same chunk as a verify step (a generated token and 4 drafts): the kernel's.
        md = batch.metadata
        md.generated_cpu = np.array([False, True, True, False, False, True])
        kernel = plan.native.kernel
        plan = AttentionPlan.build(md, 16, kernel=kernel)
        assert plan.native.tokens.tolist() == [300, *range(301, 306), *range(586, 616), 616]
        assert plan.native.end.tolist() == [40, *range(396, 401), *range(261, 291), 280]
        assert [p.q_start for p in plan.prefills] == [0, 306]
        monkeypatch.setattr(torch_plan, "NATIVE_MAX_QUERIES", 4)
        plan = AttentionPlan.build(md, 16, kernel=kernel)
        assert [p.q_start for p in plan.prefills] == [0, 301, 306]
    else:
        assert plan.native is None and plan.decodes and len(plan.prefills) == 4


def test_a_long_decode_is_the_same_bits_alone_and_in_a_batch(decode_impl):
    """The C kernel cuts an entry's keys into parts by the entry's own length (so one long
    decode uses every thread): its output must not depend on the other entries of the call
    nor on the thread count. Through SDPA, not on the other entries at one thread count:
    torch's kernel splits a lone query's keys over threads by its own rule (with torch's
    AVX2 kernels, on a Zen 3, 2 threads gave other bits than 1)."""
    batch = Batch(*SCENARIOS["decode-lengths"], 9, 3, 64, 16)
    impl = TorchAttentionImpl(9, 64, 3, 0.125)
    md = batch.metadata
    outs = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            outs["batch", n] = impl.forward(batch.query, batch.key, batch.value,
                                            batch.kv_cache.clone(), md)
            alone = AttentionMetadata.build(  # request 1 (600 keys) by itself
                np.array([1]), np.array([600]), md.block_table[1:2], md.slot_mapping[1:2]
            )
            outs["alone", n] = impl.forward(batch.query[1:2], batch.key[1:2], batch.value[1:2],
                                            batch.kv_cache.clone(), alone)
    finally:
        torch.set_num_threads(threads)
    for (where, n), out in outs.items():
        alone_ref = outs["alone", 1 if decode_impl == "native" else n][0]
        assert torch.equal(out[0 if where == "alone" else 1], alone_ref)
    ref, _ = batch.run_reference(0.125)
    torch.testing.assert_close(outs["batch", 2], ref, atol=ATOL, rtol=RTOL)


def test_lone_decode_plan_is_one_entry(decode_impl):
    """A step of one decode gets its kernel entry directly: its table row, query row, start
    and end are views of one 4-element tensor, and there is nothing else in the plan."""
    batch = Batch(*SCENARIOS["lone-decode"], 9, 3, 64, 16)
    for window, start in [(None, 0), (20, 130)]:
        plan = AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9, window)
        if decode_impl == "sdpa":
            assert plan.native is None and len(plan.decodes) == 1
            continue
        d = plan.native
        assert not (plan.decodes or plan.prefills or plan.groups)
        entry = (d.table_rows, d.tokens, d.start, d.end)
        assert [x.tolist() for x in entry] == [[0], [0], [start], [150]]
        assert len({x.untyped_storage().data_ptr() for x in entry}) == 1


def test_lone_decode_is_one_kernel_call(monkeypatch):
    """At batch 1 a layer's attention (the cache write included) is one call of the C
    kernel: the call, not its work, was most of what it cost."""
    batch = Batch(*SCENARIOS["lone-decode"], 9, 3, 64, 16)
    if paged_decode_kernel(batch.kv_cache, 9) is None:
        pytest.skip("the native decode kernel is not available (no C compiler?)")
    calls = []
    call = PagedDecodeKernel.__call__

    def counted(*args, **kwargs):
        calls.append(args[2])  # the query (None: only a write)
        return call(*args, **kwargs)

    monkeypatch.setattr(PagedDecodeKernel, "__call__", counted)
    monkeypatch.setattr(torch.Tensor, "index_copy_", None)  # the torch write would fail
    out, cache = batch.run_fast(0.125)
    assert len(calls) == 1 and calls[0] is batch.query
    monkeypatch.undo()
    ref, ref_cache = batch.run_reference(0.125)
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_native_write_stores_what_the_torch_write_stores(dtype, monkeypatch):
    """With the C kernel, the step's K/V go into the cache in one C call (no index_copy_),
    rounded to the cache's dtype exactly as torch rounds them (ties to even, subnormals,
    overflow; fp16 saturating at +-65504), NaN staying NaN, padding slots (-1) skipped; the
    rows may be strided, as in the fused q | k | v projection."""
    gen = torch.Generator().manual_seed(5)
    n, pad, kvh, d = 40, 3, 2, 16
    kv = torch.randn(2, n + pad, kvh, d, generator=gen)
    kv *= 10.0 ** torch.randint(-45, 9, kv.shape, generator=gen)  # subnormal .. beyond fp16
    bits = kv.view(torch.int32)
    bits[:, :, 0, :4] = (bits[:, :, 0, :4] & ~0xFFFF) | 0x8000  # bf16 ties
    bits[:, :, 0, 4:6] = (bits[:, :, 0, 4:6] & ~0x1FFF) | 0x1000  # fp16 ties
    kv[0, 0, 1, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 65519.0])
    fused = torch.cat([torch.zeros(n + pad, 1, d), kv[0], kv[1]], dim=1)  # strided rows
    key, value = fused[:, 1 : 1 + kvh], fused[:, 1 + kvh :]
    slots = torch.randperm(64, generator=gen)[: n + pad]
    slots[[3, 17, n + 1]] = -1
    table = torch.arange(4, dtype=torch.int32).view(1, 4)  # one 40-token prefill chunk
    qsl, seq = np.array([0, n + pad], dtype=np.int32), np.array([n + pad], dtype=np.int32)
    md = AttentionMetadata(n + pad, n + pad, n + pad, torch.from_numpy(qsl),
                           torch.from_numpy(seq), table, slots, qsl, seq)
    cache = torch.zeros(kv_cache_shape(4, 16, kvh, d), dtype=dtype)
    plan = AttentionPlan.for_step(md, cache, kvh)
    if plan.native is None:
        pytest.skip("no C kernel for this cache here (no C compiler, or fp16 without F16C)")
    expected = cache.clone()
    write_kv_cache(key, value, expected, slots)

    def no_index_copy(*args, **kwargs):
        raise AssertionError("the cache write went through torch")

    monkeypatch.setattr(torch.Tensor, "index_copy_", no_index_copy)
    write_step_kv(plan, key, value, cache, md.slot_mapping)
    nan = expected.isnan()
    assert nan.any() and torch.equal(cache.isnan(), nan)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(cache.view(bits)[~nan], expected.view(bits)[~nan])


def test_native_write_checks_its_input():
    """A slot past the cache, or fewer K/V rows than slots, is a ValueError (the C write
    would write, or read, out of bounds)."""
    batch = Batch(*SCENARIOS["decode"], 9, 3, 64, 16)
    plan = AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9)
    if plan.native is None:
        pytest.skip("the native decode kernel is not available (no C compiler?)")
    md = batch.metadata
    with pytest.raises(ValueError, match=r"key must be fp32 \[>= 5, 3, 64\], got .* \[4, 3, 64\]"):
        write_step_kv(plan, batch.key[:4], batch.value[:4], batch.kv_cache, md.slot_mapping)
    capacity = batch.kv_cache.shape[1] * 16
    past = AttentionMetadata(
        md.num_actual_tokens, md.max_query_len, md.max_seq_len, md.query_start_loc,
        md.seq_lens, md.block_table, torch.full_like(md.slot_mapping, capacity),
        md.query_start_loc_cpu, md.seq_lens_cpu,
    )
    plan = AttentionPlan.for_step(past, batch.kv_cache, 9)
    with pytest.raises(ValueError, match=f"slot {capacity} is past the cache's {capacity} "):
        write_step_kv(plan, batch.key, batch.value, batch.kv_cache, past.slot_mapping)
    # Rows of another (kv heads, head size) than the cache's: it would read past the rows.
    plan = AttentionPlan.for_step(md, batch.kv_cache, 9)
    key = batch.key[:, :1].contiguous()
    with pytest.raises(ValueError, match=r"key must be fp32 \[>= 5, 3, 64\], got .* \[5, 1, 64\]"):
        write_step_kv(plan, key, key, batch.kv_cache, md.slot_mapping)



@pytest.mark.parametrize("scenario", ["decode", "lone-decode"])
def test_native_kernel_checks_the_block_table(scenario):
    """A block table too narrow for a sequence, or naming a block outside the cache, is a
    ValueError: the kernel reads blocks through it unchecked, so would read past them."""
    batch = Batch(*SCENARIOS[scenario], 9, 3, 64, 16)
    if paged_decode_kernel(batch.kv_cache, 9) is None:
        pytest.skip("the native decode kernel is not available (no C compiler?)")
    md, num_blocks = batch.metadata, batch.kv_cache.shape[1]
    longest = int(md.seq_lens_cpu.max())
    narrow = md.block_table[:, : cdiv(longest, 16) - 1]
    outside = md.block_table.clone()
    outside[0, 0] = num_blocks
    for table, error in [(narrow, f"{longest} keys need more than the block table's "),
                         (outside, f"block id {num_blocks} is outside the cache's ")]:
        bad = AttentionMetadata(
            md.num_actual_tokens, md.max_query_len, md.max_seq_len, md.query_start_loc,
            md.seq_lens, table, md.slot_mapping, md.query_start_loc_cpu, md.seq_lens_cpu,
        )
        with pytest.raises(ValueError, match=error):
            TorchAttentionImpl(9, 64, 3, 0.125).forward(
                batch.query, batch.key, batch.value, batch.kv_cache.clone(), bad)


def test_strided_cache_gets_its_own_plan():
    """A layer whose cache is a strided view of the same shape as the previous layer's
    does not reuse that layer's plan: the C kernel, which would address (and write) it as
    contiguous, does not serve it."""
    batch = Batch(*SCENARIOS["decode"], 9, 3, 64, 16)
    if paged_decode_kernel(batch.kv_cache, 9) is None:
        pytest.skip("the native decode kernel is not available (no C compiler?)")
    batch.run_fast(0.125)  # a contiguous cache's plan for this metadata
    wide = torch.zeros(*batch.kv_cache.shape[:-1], 128)
    strided = wide[..., ::2]
    strided.copy_(batch.kv_cache)
    impl = TorchAttentionImpl(9, 64, 3, 0.125)
    out = impl.forward(batch.query, batch.key, batch.value, strided, batch.metadata)
    assert not wide[..., 1::2].any()  # nothing written between the view's elements
    ref, _ = batch.run_reference(0.125)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [None, 1, 7, 100, 1000])
def test_lone_decode_plan_matches_the_general_plan(window):
    """The lone decode's directly built entry is the one the general planning gives it
    (planned there beside a request with nothing scheduled), over random lengths."""
    kernel = paged_decode_kernel(torch.zeros(kv_cache_shape(1, 16, 2, 16)), 4)
    if kernel is None:
        pytest.skip("the native decode kernel is not available (no C compiler?)")
    rng = np.random.default_rng(7)
    for _ in range(50):
        seq_len = int(rng.integers(1, 900))
        table = torch.from_numpy(rng.integers(0, 64, (2, 60)).astype(np.int32))
        slots = torch.tensor([int(rng.integers(0, 1024))])
        plans = []
        for qsl, seq in (([0, 1], [seq_len]), ([0, 1, 1], [seq_len, 0])):
            qsl, seq = np.array(qsl, dtype=np.int32), np.array(seq, dtype=np.int32)
            md = AttentionMetadata(1, 1, seq_len, torch.from_numpy(qsl), torch.from_numpy(seq),
                                   table[: len(seq)], slots, qsl, seq)
            plans.append(AttentionPlan.build(md, 16, 1, kernel, window))
        lone, general = plans
        for f in ("table_rows", "tokens", "start", "end"):
            assert torch.equal(getattr(lone.native, f), getattr(general.native, f)), f
        for f in ("num_tokens", "any_padding_slot", "sliding_window", "prefills", "decodes",
                  "groups"):
            assert getattr(lone, f) == getattr(general, f), f


def test_native_kernel_only_for_what_it_supports():
    kernel = paged_decode_kernel
    if kernel(torch.zeros(kv_cache_shape(1, 16, 3, 64)), 9) is None:
        pytest.skip("the native decode kernel is not available (no C compiler?)")
    assert kernel(torch.zeros(kv_cache_shape(1, 16, 3, 64), dtype=torch.float64), 9) is None
    bf16_cache = torch.zeros(kv_cache_shape(1, 16, 3, 64), dtype=torch.bfloat16)
    assert kernel(bf16_cache, 9, torch.bfloat16) is None  # fp32 queries only
    assert kernel(torch.zeros(kv_cache_shape(1, 16, 3, 60)), 9) is None  # head size % 8
    assert kernel(torch.zeros(kv_cache_shape(1, 16, 2, 64)), 9) is None  # 9 heads on 2


def test_native_kernel_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("V1_CPU_KERNELS", "0")
    assert paged_decode_kernel(torch.zeros(kv_cache_shape(1, 16, 3, 64)), 9) is None


# ---- sliding window ----------------------------------------------------------------------------

WINDOWS = [1, 7, 24, 260]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("block_size,gqa", [(16, "gqa3"), (8, "gqa1"), (16, "gqa4")])
def test_sliding_window_matches_dense(scenario, block_size, gqa, window, decode_impl,
                                      always_cascade):
    """Every path with a window shorter than some sequence of the step: decodes (C kernel or
    SDPA), prefills without context (window shorter and longer than the prompt), chunks
    after a cached context, shared prefixes (no cascade then), with the blocks before every
    window NaN; and the reference's window against dense attention."""
    reqs, prefixes = SCENARIOS[scenario]
    if any(n % block_size for n in prefixes.values()):
        pytest.skip("prefix not a whole number of blocks")
    if window >= max(s for _, s, _ in reqs):
        pytest.skip("the window hides nothing here (test_window_as_long_as_the_sequences)")
    num_heads, num_kv_heads = GQA[gqa]
    batch = Batch(reqs, prefixes, num_heads, num_kv_heads, 64, block_size, seed=1)
    scale = 64**-0.5
    dense = batch.dense(scale, window)
    # The window changes the answer here, so a path that ignored it would fail.
    assert not torch.allclose(dense, batch.dense(scale), atol=1e-3)
    poisoned, num_dead = batch.out_of_window_poisoned(window)
    out, cache = batch.run_fast(scale, window, kv_cache=poisoned)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), dense, atol=ATOL, rtol=RTOL)
    ref, ref_cache = batch.run_reference(scale, window)
    torch.testing.assert_close(ref.double(), dense, atol=ATOL, rtol=RTOL)
    # The step's cache write is the same (outside the poisoned blocks).
    alive = ~poisoned.isnan()
    assert torch.equal(cache[alive], ref_cache[alive])
    if scenario == "decode-lengths" and window <= 24:
        assert num_dead > 0  # the 600-token decode's early blocks were poisoned


@pytest.mark.parametrize("scenario", ["decode", "chunked", "mixed", "shared-prefill"])
def test_window_as_long_as_the_sequences(scenario, decode_impl, always_cascade):
    """A window of at least every sequence length is global attention: the same plan object
    as no window, the same output bit for bit; one a token shorter is not."""
    reqs, prefixes = SCENARIOS[scenario]
    longest = max(s for _, s, _ in reqs)
    batch = Batch(reqs, prefixes, 9, 3, 64, 16, seed=2)
    out, _ = batch.run_fast(0.125)
    for window in (longest, longest + 1, 10**9):
        plan = AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9, window)
        assert plan is AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9)
        assert plan.sliding_window is None
        assert torch.equal(batch.run_fast(0.125, window)[0], out)
    shorter = AttentionPlan.for_step(batch.metadata, batch.kv_cache, 9, longest - 1)
    assert shorter.sliding_window == longest - 1
    windowed, _ = batch.run_fast(0.125, longest - 1)
    torch.testing.assert_close(windowed.double(), batch.dense(0.125, longest - 1), atol=ATOL,
                               rtol=RTOL)
    assert not torch.allclose(windowed, out, atol=1e-3)


def test_window_of_one_is_the_own_value():
    """Each query sees only its own key: the output is the token's own V, on every path."""
    batch = Batch(*SCENARIOS["mixed"], 8, 2, 64, 16, seed=4)
    out, _ = batch.run_fast(0.125, 1)
    own_v = batch.value.repeat_interleave(4, dim=1)  # query head h reads kv head h // 4
    torch.testing.assert_close(out, own_v, atol=ATOL, rtol=RTOL)


def test_sliding_window_plans(always_cascade):
    """One plan per window and step (reused by every layer of that window); a windowed plan
    reads only the window's blocks and has no cascade."""
    reqs, prefixes = SCENARIOS["shared-decode"]  # decodes of 150..300 tokens on 128 shared
    batch = Batch(reqs, prefixes, 9, 3, 64, 16)
    md, cache = batch.metadata, batch.kv_cache
    glob = AttentionPlan.for_step(md, cache, 9)
    w20 = AttentionPlan.for_step(md, cache, 9, 20)
    w33 = AttentionPlan.for_step(md, cache, 9, 33)
    assert len({id(glob), id(w20), id(w33)}) == 3 and glob.groups and not w20.groups
    # Alternating layers (as Gemma 3's) reuse them.
    assert AttentionPlan.for_step(md, cache, 9, 20) is w20
    assert AttentionPlan.for_step(md, cache, 9) is glob

    seq_lens = np.array([s for _, s, _ in reqs])
    # SDPA decodes: the blocks from the one holding key seq_len - w: 2 or 3 blocks, not 19.
    plan = AttentionPlan.build(md, 16, sliding_window=20)
    assert sum(b.blocks.numel() for b in plan.decodes) <= 3 * len(reqs)
    # C kernel entries: [max(0, seq_len - w), seq_len).
    kernel = paged_decode_kernel(cache, 9)
    if kernel is not None:
        plan = AttentionPlan.build(md, 16, kernel=kernel, sliding_window=20)
        assert plan.native.end.tolist() == seq_lens.tolist()
        assert plan.native.start.tolist() == (seq_lens - 20).tolist()


def test_sliding_window_must_be_positive():
    with pytest.raises(ValueError, match="sliding_window"):
        TorchAttentionImpl(9, 64, 3, 0.125, sliding_window=0)
    assert TorchAttentionImpl(9, 64, 3, 0.125, sliding_window=4).sliding_window == 4
    assert TorchAttentionImpl(9, 64, 3, 0.125).sliding_window is None


def test_heads_must_be_a_multiple_of_kv_heads():
    # Checked once in AttentionImpl, for every backend.
    with pytest.raises(ValueError, match="not a multiple"):
        TorchAttentionImpl(8, 64, 3, 0.125)
