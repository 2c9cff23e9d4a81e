"""The paged decode kernel's groups: a verify step's entries (one request's rows: the same
block-table row and start, ends one apart) run together, sharing each chunk's K/V reads.
Every entry must still be the same bits as alone, whatever the group around it, the call's
other entries, the thread count or the cache dtype, and equal dense attention."""

import pytest
import torch

from v1.kernels.attention import paged_decode_kernel

B, KVH, D, H = 16, 3, 64, 9
NUM_BLOCKS = 48


def kernel_for(cache: torch.Tensor):
    kernel = paged_decode_kernel(cache, H)
    if kernel is None:
        pytest.skip(f"no native decode kernel for {cache.dtype} caches here")
    return kernel


def attend(kernel, cache, table, rows, starts, ends, query, threads):
    """out [n, H, D] of entries i: table row rows[i], keys [starts[i], ends[i]), query row i."""
    n = len(ends)
    out, lse = torch.empty(n, H, D), torch.empty(n, H)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # the bound step's thread count
    try:
        step = kernel.bind(table, torch.tensor(rows), torch.arange(n), torch.tensor(starts),
                           torch.tensor(ends), torch.empty(0, dtype=torch.int64), cache)
    finally:
        torch.set_num_threads(saved)
    kernel(step, query, cache, out, lse, D**-0.5)
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_verify_rows_are_the_same_bits_as_alone(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, B, KVH, D, generator=gen).to(dtype)
    kernel = kernel_for(cache)
    table = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:24] for _ in range(2)])
    table = table.to(torch.int32).contiguous()
    # Request 0: 13 rows (groups of 8 and 5) whose ends cross a chunk (32), a part (128 and
    # 256) and a block boundary; request 1: a decode and 3 rows of a verify step with a
    # sliding-window start; then request 0 again after it (a group of its own).
    ends0 = list(range(250, 263))
    entries = [(0, 0, e) for e in ends0] + [(1, 0, 95)] + [(1, 40, e) for e in (300, 301, 302)]
    entries += [(0, 0, 127), (0, 0, 128), (0, 0, 129), (0, 0, 0)]
    rows, starts, ends = (list(x) for x in zip(*entries))
    query = torch.randn(len(entries), H, D, generator=gen)
    outs = {threads: attend(kernel, cache, table, rows, starts, ends, query, threads)
            for threads in (1, 2)}
    for i in range(len(entries)):
        one = slice(i, i + 1)
        # Alone, an entry with fewer parts than threads is split by kv head: at 2 threads
        # one of up to 128 keys, at 3 one of up to 256 (its parts' heads merged).
        alone = {threads: attend(kernel, cache, table, rows[one], starts[one], ends[one],
                                 query[one], threads) for threads in (1, 2, 3)}
        ref_out, ref_lse = alone[1][0][0], alone[1][1][0]
        got = [(f"batch x{n}", out[i], lse[i]) for n, (out, lse) in outs.items()]
        got += [(f"alone x{n}", out[0], lse[0]) for n, (out, lse) in alone.items()]
        for where, out, lse in got:
            assert torch.equal(out, ref_out), (i, entries[i], where)
            assert torch.equal(lse, ref_lse), (i, entries[i], where)
    # Dense attention in float64 over each entry's keys.
    out, lse = outs[2]
    kv = cache.double()
    for i, (row, start, end) in enumerate(entries):
        pos = torch.arange(start, end)
        slots = table[row].long()[pos // B] * B + pos % B
        k = kv[0].reshape(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)
        v = kv[1].reshape(-1, KVH, D)[slots].repeat_interleave(H // KVH, dim=1)
        if end == start:
            assert torch.equal(out[i], torch.zeros(H, D)) and bool((lse[i] == -torch.inf).all())
            continue
        scores = torch.einsum("hd,thd->ht", query[i].double(), k) * D**-0.5
        ref = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[i].double(), ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lse[i].double(), scores.logsumexp(-1), atol=2e-5, rtol=1e-5)
