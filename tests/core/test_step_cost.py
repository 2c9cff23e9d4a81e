"""The per-step shortcuts of the scheduler and the KV cache manager: decodes
that need no `allocate_slots` call, appends that skip the block hasher, and the batch-order
slices of the step's output. Each test checks that a shortcut is taken, and that it is exact
across the transitions that change it (new block, full block, placeholder, preemption,
finish). Block size 4."""

import pytest

from tests.core.utils import fake_model_output, make_request, make_scheduler, run_step
from v1.core.kv_cache_manager import KVCacheManager
from v1.core.kv_cache_utils import NONE_HASH, hash_block_tokens, make_block_hasher
from v1.outputs import ModelRunnerOutput
from v1.request import Request
from v1.sampling_params import SamplingParams

BS = 4


def count_allocations(s) -> list[str]:
    """Record the request id of every `allocate_slots` call the scheduler makes."""
    calls: list[str] = []
    allocate = s.kv_cache_manager.allocate_slots

    def spy(request, *args):
        calls.append(request.request_id)
        return allocate(request, *args)

    s.kv_cache_manager.allocate_slots = spy
    return calls


@pytest.mark.parametrize("caching", [True, False])
def test_decode_calls_allocate_slots_only_to_open_or_fill_a_block(caching):
    s = make_scheduler(enable_prefix_caching=caching)
    a = make_request(5, max_tokens=12)
    s.add_request(a)
    calls = count_allocations(s)
    positions = []  # the position each step computes, when it called allocate_slots
    for _ in range(12):
        out = s.schedule()
        if calls:
            positions.append(a.num_computed_tokens - 1)
            calls.clear()
        s.update_from_output(out, fake_model_output(s, out))
        s.check_integrity()
    # The prompt (0-4), then each decode that opens a block (8, 12); with caching also
    # each that fills one (7, 11, 15), which makes it findable at once.
    assert positions == ([4, 7, 8, 11, 12, 15] if caching else [4, 8, 12])
    assert a.is_finished()


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("prompt_len", [4, 5, 7, 8])
def test_quiet_limit_is_exact(caching, prompt_len):
    """Up to the limit allocate_slots changes nothing; one token more, it has work."""
    kv = KVCacheManager(16, BS, enable_caching=caching)
    r = make_request(prompt_len, max_tokens=20)
    assert kv.allocate_slots(r, prompt_len) is not None
    r.num_computed_tokens = prompt_len
    r.append_output_token_ids([1] * 8)
    limit = kv.num_quiet_tokens[r.request_id]
    blocks = list(kv.req_to_blocks[r.request_id])
    index = dict(kv.block_pool.cached_block_hash_to_block)
    for n in range(1, limit - prompt_len + 1):
        assert kv.allocate_slots(r, n) == []
        assert kv.req_to_blocks[r.request_id] == blocks
        assert kv.block_pool.cached_block_hash_to_block == index
    kv.allocate_slots(r, limit - prompt_len + 1)
    grew = len(kv.req_to_blocks[r.request_id]) > len(blocks)
    indexed = len(kv.block_pool.cached_block_hash_to_block) > len(index)
    assert grew or indexed
    kv.check_integrity()


def test_quiet_limit_waits_for_a_placeholder_block_to_be_indexed():
    # Async: the step that fills block 1 computes a placeholder (position 7), so the block
    # cannot be hashed yet. The limit stays below it until a step finds the hash known.
    s = make_scheduler(async_scheduling=True)
    a = make_request(7, max_tokens=8)
    s.add_request(a)
    index = s.kv_cache_manager.block_pool.cached_block_hash_to_block
    out1 = s.schedule()  # prompt 0-6, samples position 7 (a placeholder now)
    out2 = s.schedule()  # computes position 7: block 1 is full, its last token unknown
    assert len(a.block_hashes) == 1 and len(index) == 1
    assert s.kv_cache_manager.num_quiet_tokens[a.request_id] == 7
    s.update_from_output(out1, ModelRunnerOutput([a.request_id], [[11]]))
    assert len(a.block_hashes) == 2  # the token is known: block 1 hashes
    calls = count_allocations(s)
    s.schedule()  # position 8: a new block, and block 1 is indexed now
    assert calls == [a.request_id] and a.block_hashes[1] in index
    s.update_from_output(out2, ModelRunnerOutput([a.request_id], [[12]]))
    s.check_integrity()


def test_quiet_limit_is_dropped_on_preemption_and_finish_and_rebuilt_on_resume():
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a, b = make_request(7, max_tokens=8), make_request(7, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    quiet = s.kv_cache_manager.num_quiet_tokens
    seen_preempted = seen_resumed = False
    for _ in range(100):
        if not s.has_requests():
            break
        out, _ = run_step(s)
        s.check_integrity()  # each entry equals the limit its blocks give
        for req_id in out.preempted_req_ids:
            seen_preempted = True
            assert req_id not in quiet
        if any(out.scheduled_cached_reqs.resumed_from_preemption):
            seen_resumed = True
        assert quiet.keys() == {r.request_id for r in s.running}
    assert seen_preempted and seen_resumed
    assert not quiet
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_check_integrity_catches_a_stale_quiet_limit():
    s = make_scheduler()
    a = make_request(5, max_tokens=8)
    s.add_request(a)
    run_step(s)
    s.kv_cache_manager.num_quiet_tokens[a.request_id] += 1
    with pytest.raises(AssertionError, match="quiet limit"):
        s.check_integrity()


def test_check_integrity_catches_a_full_block_left_unhashed():
    # A hash threshold past the next full block: appends skip the hasher, so the block it
    # fills is never hashed (nor findable), which nothing else would notice.
    s = make_scheduler()
    a = make_request(6, max_tokens=8)
    s.add_request(a)
    run_step(s)
    a._next_hash_len += BS
    run_step(s)  # position 7 fills block 1
    with pytest.raises(AssertionError, match="unhashed block"):
        s.check_integrity()


def test_check_integrity_catches_a_mutated_shared_empty_block_id_list():
    s = make_scheduler()
    s.add_request(make_request(5, max_tokens=4))
    run_step(s)
    shared = s.schedule().scheduled_cached_reqs.new_block_ids[0]
    shared.append(3)  # as a consumer extending the list it was handed would
    try:
        with pytest.raises(AssertionError, match="shared empty block-id list"):
            s.check_integrity()
    finally:
        shared.clear()


def test_decode_steps_share_one_empty_block_id_list():
    s = make_scheduler()
    for _ in range(3):
        s.add_request(make_request(5, max_tokens=4))
    run_step(s)
    out = s.schedule()  # positions 5: every block has room
    first, *rest = out.scheduled_cached_reqs.new_block_ids
    assert first == [] and all(ids is first for ids in rest)


def test_cached_rows_line_up_with_the_batch_after_an_admission_preempts():
    # Priority: `urgent` arrives and needs a seat: `lax` (scheduled this step, last in
    # the running order) is preempted. The cached rows are the running requests left, in
    # batch order, each with its own blocks and computed count.
    s = make_scheduler(policy="priority", max_num_seqs=3)
    keep1 = make_request(6, priority=1, max_tokens=10)
    keep2 = make_request(8, priority=2, max_tokens=10)
    lax = make_request(5, priority=5, max_tokens=10)
    for r in (keep1, keep2, lax):
        s.add_request(r)
    run_step(s)
    urgent = make_request(4, priority=0, max_tokens=2)
    s.add_request(urgent)
    out = s.schedule()
    assert out.preempted_req_ids == {lax.request_id}
    assert list(out.num_scheduled_tokens) == [keep1.request_id, keep2.request_id,
                                              urgent.request_id]
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == [keep1.request_id, keep2.request_id]
    assert cached.num_computed_tokens == [6, 8]
    # keep2's position 8 opens its third block.
    assert cached.new_block_ids == [[], s.kv_cache_manager.get_block_ids(keep2.request_id)[2:]]
    s.update_from_output(out, fake_model_output(s, out))
    s.check_integrity()


class CountingHasher:
    """Wraps the real hasher, counting calls."""

    def __init__(self, block_size: int) -> None:
        self.inner = make_block_hasher(block_size)
        self.block_size = block_size
        self.calls = 0

    def __call__(self, request: Request) -> list[bytes]:
        self.calls += 1
        return self.inner(request)


def test_appends_call_the_hasher_only_when_a_block_fills():
    hasher = CountingHasher(BS)
    r = Request("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20), block_hasher=hasher)
    assert hasher.calls == 1 and len(r.block_hashes) == 1
    for token in range(7, 13):  # 7, 8 fill block 1; 9-12 fill block 2
        r.append_output_token_ids([token])
    assert hasher.calls == 3 and len(r.block_hashes) == 3
    r.append_output_token_ids(list(range(13, 23)))  # 10 tokens at once: blocks 3 and 4
    assert hasher.calls == 4 and len(r.block_hashes) == 5
    expected, parent = [], NONE_HASH
    for start in range(0, 20, BS):
        parent = hash_block_tokens(parent, r.all_token_ids[start : start + BS])
        expected.append(parent)
    assert r.block_hashes == expected


def test_make_block_hasher_rejects_a_bad_block_size():
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        make_block_hasher(0)
