"""KV cache manager and block pool: exact block ids and free-list order where that is the
point. Block size 4 throughout."""

import pytest

from tests.core.utils import make_request
from v1.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from v1.core.kv_cache_manager import KVCacheManager
from v1.core.kv_cache_utils import NONE_HASH, hash_block_tokens

BS = 4


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]


def schedule_prompt(kv: KVCacheManager, request) -> list[int]:
    """What the scheduler does for a waiting request: look up, allocate, advance."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit) is not None
    kv.record_prefix_hit(request, num_hit)
    request.num_computed_tokens = request.num_tokens
    return kv.get_block_ids(request.request_id)


def test_free_queue_o1_operations():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft_n(1) == [blocks[0]]
    q.remove(blocks[2])
    q.append(blocks[0])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q.get_all_free_blocks()] == [2, 1, 3, 4, 0]
    assert q.num_free_blocks == 5
    assert q.popleft_n(2) == [blocks[2], blocks[1]]
    with pytest.raises(ValueError, match="cannot take 4 blocks: only 3 are free"):
        q.popleft_n(4)
    assert q.num_free_blocks == 3  # a refused take changes nothing
    assert q.popleft_n(3) == [blocks[3], blocks[4], blocks[0]]
    assert q.get_all_free_blocks() == [] and q.num_free_blocks == 0


def test_block_hashes_chain_and_partial_tail_is_not_hashed():
    request = make_request(10)  # 2 full blocks + 2 tokens
    assert len(request.block_hashes) == 2
    h0 = hash_block_tokens(NONE_HASH, request.all_token_ids[:4])
    assert request.block_hashes == [h0, hash_block_tokens(h0, request.all_token_ids[4:8])]
    request.append_output_token_ids([1])
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([1])  # 12 tokens: the third block is full now
    assert len(request.block_hashes) == 3


def test_prefix_hit_on_repeated_prompt_shares_blocks():
    kv = KVCacheManager(10, BS)
    a = make_request(10)
    assert schedule_prompt(kv, a) == [0, 1, 2]
    b = make_request(a.prompt_token_ids)
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert schedule_prompt(kv, make_request(a.prompt_token_ids)) == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.block_pool.blocks[:4]] == [2, 2, 1, 1]
    # The partial tail block (2) was never hashed, so it was not shared.
    assert kv.block_pool.blocks[2].block_hash is None
    kv.check_integrity()


def test_fully_cached_prompt_still_computes_last_token():
    kv = KVCacheManager(10, BS)
    a = make_request(8)  # exactly two full blocks
    schedule_prompt(kv, a)
    b = make_request(a.prompt_token_ids)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4 and len(hits) == 1  # capped at num_tokens - 1


def test_cache_salt_changes_every_hash():
    salted = make_request(8, cache_salt="alice")
    plain = make_request(salted.prompt_token_ids)
    other = make_request(salted.prompt_token_ids, cache_salt="bob")
    assert not set(salted.block_hashes) & set(plain.block_hashes)
    assert not set(salted.block_hashes) & set(other.block_hashes)
    kv = KVCacheManager(10, BS)
    prompt = salted.prompt_token_ids + [1, 2, 3, 4]
    schedule_prompt(kv, make_request(prompt, cache_salt="alice"))
    assert kv.get_computed_blocks(make_request(prompt, cache_salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_request(prompt))[1] == 0
    assert kv.get_computed_blocks(make_request(prompt, cache_salt="alice"))[1] == 8


def test_free_order_tail_first_and_lru_eviction():
    kv = KVCacheManager(6, BS)
    a = make_request(9)  # blocks 0, 1 full + 2 partial
    b = make_request([50 + i for i in range(8)])  # blocks 3, 4 full
    schedule_prompt(kv, a)
    schedule_prompt(kv, b)
    assert free_ids(kv) == [5]
    kv.free(a)
    # The unhashed partial block goes to the front; hashed ones to the end, tail first.
    assert free_ids(kv) == [2, 5, 1, 0]
    kv.free(b)
    assert free_ids(kv) == [2, 5, 1, 0, 4, 3]
    # Eviction order: unhashed first, then least recently freed, each request's tail first.
    c = make_request([90 + i for i in range(16)])
    assert schedule_prompt(kv, c) == [2, 5, 1, 0]
    assert kv.get_computed_blocks(make_request(a.prompt_token_ids))[1] == 0  # evicted
    hits, n = kv.get_computed_blocks(make_request(b.prompt_token_ids + [1]))
    assert [blk.block_id for blk in hits] == [3, 4] and n == 8  # survived
    kv.free(c)
    kv.check_integrity()


def test_hit_on_free_block_removes_it_from_free_list():
    kv = KVCacheManager(6, BS)
    a = make_request(9)
    schedule_prompt(kv, a)
    kv.free(a)
    assert free_ids(kv) == [2, 3, 4, 5, 1, 0]
    b = make_request(a.prompt_token_ids[:8] + [7, 7])
    assert schedule_prompt(kv, b) == [0, 1, 2]
    assert free_ids(kv) == [3, 4, 5]
    assert kv.block_pool.blocks[0].ref_cnt == 1
    kv.check_integrity()


def test_new_blocks_never_evict_the_requests_own_hits():
    # Pool of 4: after A is freed, all 4 blocks are free, 2 of them cached hits for B.
    kv = KVCacheManager(4, BS)
    a = make_request(8)
    schedule_prompt(kv, a)
    kv.free(a)
    b = make_request(a.prompt_token_ids + [5] * 8)  # 16 tokens: 2 hits + 2 new blocks
    assert schedule_prompt(kv, b) == [0, 1, 2, 3]
    kv.free(b)
    # 4 hits + 2 new blocks = 6 > 4: refused, though all 4 blocks are "free".
    c = make_request(a.prompt_token_ids + [5] * 12)
    hits, n = kv.get_computed_blocks(c)
    assert len(hits) == 4  # its own chain: 0, 1, and B's 2, 3
    assert kv.allocate_slots(c, 20 - n + 4, hits, n) is None
    kv.check_integrity()


def test_failed_allocation_leaves_ref_counts_unchanged():
    kv = KVCacheManager(4, BS)
    a = make_request(8)
    schedule_prompt(kv, a)
    b = make_request(a.prompt_token_ids + [3] * 12)
    before = [blk.ref_cnt for blk in kv.block_pool.blocks]
    before_free = free_ids(kv)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits, n) is None
    assert [blk.ref_cnt for blk in kv.block_pool.blocks] == before
    assert free_ids(kv) == before_free
    assert b.request_id not in kv.req_to_blocks
    kv.check_integrity()


def test_reset_prefix_cache_refused_while_in_use():
    kv = KVCacheManager(4, BS)
    a = make_request(8)
    schedule_prompt(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request(a.prompt_token_ids))[1] == 0
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
    kv.check_integrity()


def test_hit_rate_stats_and_rolling_window():
    kv = KVCacheManager(16, BS)
    kv.prefix_cache_metrics._window_size = 2
    a = make_request(9)
    schedule_prompt(kv, a)
    schedule_prompt(kv, make_request(a.prompt_token_ids))
    stats = kv.prefix_cache_metrics.total()
    assert (stats.requests, stats.queries, stats.hits) == (2, 18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)
    schedule_prompt(kv, make_request(a.prompt_token_ids))
    schedule_prompt(kv, make_request(a.prompt_token_ids))
    assert kv.prefix_cache_metrics.recent_hit_rate() == pytest.approx(16 / 18)


def test_caching_disabled_never_hits():
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_request(9)
    schedule_prompt(kv, a)
    assert kv.get_computed_blocks(make_request(a.prompt_token_ids)) == ([], 0)
    assert not kv.block_pool.cached_block_hash_to_block


def test_get_new_blocks_more_than_free():
    pool = BlockPool(2, True)
    with pytest.raises(ValueError, match="cannot get 3 blocks"):
        pool.get_new_blocks(3)
