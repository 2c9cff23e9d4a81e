"""Declared prefixes: computed once, pinned in the block pool, never evicted, capped."""

import json

import pytest

from tests.core.utils import make_request, make_scheduler, run_step
from v1.config import EngineArgs, load_preload_prompts
from v1.engine.preload import preload_token_ids

SYSTEM = list(range(100, 116))  # 4 blocks of 4


def preload(s, prompts: list[list[int]], pin: bool = True) -> None:
    """What EngineCore.preload does, with the fake runner."""
    kv = s.kv_cache_manager
    kv.check_preload(prompts)
    for prompt in prompts:
        s.add_request(make_request(prompt, max_tokens=1))
        while s.has_requests():
            run_step(s)
        if pin:
            assert kv.pin_prefix(prompt) == len(prompt) // 4


def traffic(s, n: int = 4) -> None:
    """Cold requests that, together, need every block of the pool (evicting whatever is free)."""
    for _ in range(n):
        s.add_request(make_request(36, max_tokens=4))
    while s.has_requests():
        run_step(s)


@pytest.mark.parametrize("pin", [True, False])
def test_a_preloaded_prompt_hits_after_traffic_that_would_evict_it(pin):
    s = make_scheduler(num_blocks=16, max_model_len=40)
    preload(s, [SYSTEM], pin=pin)
    traffic(s)
    question = make_request(SYSTEM + [7, 8, 9], max_tokens=2)
    s.add_request(question)
    run_step(s)
    assert question.num_cached_tokens == (16 if pin else 0)
    while s.has_requests():
        run_step(s)
    s.check_integrity()


def test_pinned_accounting_and_reset():
    s = make_scheduler(num_blocks=16, max_model_len=40)
    preload(s, [SYSTEM, SYSTEM[:8] + [5, 6, 7, 8]])  # the second shares 2 of its 3 blocks
    pool = s.kv_cache_manager.block_pool
    assert len(pool.pinned) == 5
    assert all(b.ref_cnt == 1 for b in pool.pinned.values())
    assert pool.get_num_free_blocks() + len(pool.pinned) == pool.num_blocks
    s.check_integrity()
    # A request holding blocks refuses the reset; once it is done, the reset keeps the pins.
    r = make_request(SYSTEM + [1], max_tokens=3)
    s.add_request(r)
    run_step(s)
    assert not s.reset_prefix_cache()
    while s.has_requests():
        run_step(s)
    assert s.reset_prefix_cache()
    assert set(pool.cached_block_hash_to_block) == set(pool.pinned)
    s.check_integrity()
    again = make_request(SYSTEM + [2], max_tokens=1)
    s.add_request(again)
    run_step(s)
    assert again.num_cached_tokens == 16


def test_the_cap_holds():
    s = make_scheduler(num_blocks=16, max_model_len=40, preload_max_fraction=0.25)
    kv = s.kv_cache_manager
    with pytest.raises(ValueError, match=r"pin 5 blocks .* over the limit of 4"):
        kv.check_preload([SYSTEM + [1, 2, 3, 4]])
    assert not s.has_requests()  # refused before anything ran
    preload(s, [SYSTEM])  # 4 blocks: exactly the cap
    with pytest.raises(ValueError, match="limit of 4"):
        kv.check_preload([list(range(300, 304))])
    kv.check_preload([SYSTEM])  # already pinned: nothing more
    s.add_request(make_request(list(range(300, 305)), max_tokens=1))
    while s.has_requests():
        run_step(s)
    with pytest.raises(ValueError, match="limit of 4"):
        kv.pin_prefix(list(range(300, 304)))  # the same check when pinning


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_pins_leave_room_for_a_request_of_max_model_len(fraction):
    # 16 blocks of 4; max_model_len 40 needs 10 blocks: at most 6 may be pinned.
    s = make_scheduler(num_blocks=16, max_model_len=40, preload_max_fraction=fraction)
    with pytest.raises(ValueError, match=r"pin 7 of 16 blocks .* leaving 9: a request of "
                                         r"max_model_len 40 tokens needs 10"):
        s.kv_cache_manager.check_preload([list(range(100, 128))])
    preload(s, [list(range(100, 124))])  # 6 blocks
    # A cold request that grows to max_model_len runs to the end (no livelock).
    r = make_request(10, max_tokens=30, ignore_eos=True)
    s.add_request(r)
    for _ in range(200):
        if not s.has_requests():
            break
        run_step(s)
    assert r.num_tokens == 40 and r.get_finished_reason() == "length"
    assert s.make_stats().num_preemptions == 0
    s.check_integrity()


def test_add_request_counts_a_pinned_prefix_as_free_for_the_request():
    # Pinned straight in the pool (past the cap, which preload would refuse): 8 of 16 blocks.
    s = make_scheduler(num_blocks=16, max_model_len=64)
    kv = s.kv_cache_manager
    system = list(range(100, 132))
    s.add_request(make_request(system, max_tokens=1))
    while s.has_requests():
        run_step(s)
    kv.block_pool.pin(kv.get_computed_blocks(make_request(system + [0]))[0])
    # 42 tokens: 11 blocks, 8 of them pinned hits: 3 new of the 8 unpinned.
    question = make_request(system + list(range(10)), max_tokens=1)
    s.add_request(question)
    cold = make_request(33, max_tokens=1)  # 9 blocks, no pinned prefix: never fits
    s.add_request(cold)
    _, outs = run_step(s)
    assert question.num_cached_tokens == 32
    [ignored] = [o for c in outs.values() for o in c.outputs if o.request_id == cold.request_id]
    assert ignored.stop_reason == (
        "prompt of 33 tokens needs 9 blocks of 4 besides its pinned prefix, which exceeds the "
        "KV cache's 8 unpinned blocks (of 16)"
    )


def test_a_preload_prompt_that_did_not_run_is_not_pinned():
    s = make_scheduler(num_blocks=16, max_model_len=40)
    with pytest.raises(ValueError, match="was not computed: 2 of its 2 full blocks"):
        s.kv_cache_manager.pin_prefix(list(range(8)))


def test_preload_needs_prefix_caching_and_a_short_enough_prompt():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_scheduler(enable_prefix_caching=False).kv_cache_manager.check_preload([SYSTEM])
    with pytest.raises(ValueError, match="max_model_len - 1 = 39"):
        make_scheduler(max_model_len=40).kv_cache_manager.check_preload([list(range(40))])


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and not add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def test_preload_prompt_forms(tmp_path):
    prompts = ["ab", [{"role": "system", "content": "c"}], [5, 6]]
    expected = [[1, 97, 98], [ord(c) for c in "<system>c"], [5, 6]]
    assert preload_token_ids(prompts, FakeTokenizer(), 100) == expected
    with pytest.raises(ValueError, match=r"preload_prompts\[0\]"):
        preload_token_ids([3.5], FakeTokenizer(), 100)
    with pytest.raises(ValueError, match="without a tokenizer"):
        preload_token_ids(["ab"], None, 100)
    # Messages as LLM.chat takes them (text parts: joined by newlines), or a clear error.
    parts = [{"role": "system", "content": [{"type": "text", "text": "c"},
                                            {"type": "text", "text": "d"}]}]
    assert preload_token_ids([parts], FakeTokenizer(), 100) == [[ord(c) for c in "<system>c\nd"]]
    with pytest.raises(ValueError, match=r"preload_prompts\[0\]: .*text only"):
        preload_token_ids([[{"role": "system", "content": [{"type": "image_url"}]}]],
                          FakeTokenizer(), 100)
    # Token ids are checked against the vocabulary, as the processor checks them.
    for bad in ([5, 100], [-1], [True, False]):
        with pytest.raises(ValueError, match=r"preload_prompts\[0\]: token id .* out of voc"):
            preload_token_ids([bad], FakeTokenizer(), 100)


def test_preload_prompts_are_read_with_the_engine_arguments(tmp_path):
    prompts = ["ab", [5, 6]]
    file = tmp_path / "prompts.json"
    file.write_text(json.dumps(prompts))
    assert EngineArgs(preload_prompts=str(file)).preload_prompts == prompts  # read at once
    assert EngineArgs(preload_prompts=prompts).preload_prompts == prompts
    # A plain string is not a prompt: a file that is not there fails before anything loads.
    with pytest.raises(ValueError, match="'You are a helpful assistant.' is not a file"):
        EngineArgs(preload_prompts="You are a helpful assistant.")
    file.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_preload_prompts(str(file))
    file.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="must be a list of prompts"):
        load_preload_prompts(str(file))
