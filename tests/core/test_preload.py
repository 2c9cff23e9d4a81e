"""Declared prefixes: computed once, pinned in the block pool, never evicted, capped."""

import json

import pytest

from tests.core.utils import make_request, make_scheduler, run_step
from v1.engine.preload import preload_token_ids

SYSTEM = list(range(100, 116))  # 4 blocks of 4


def preload(s, prompts: list[list[int]], pin: bool = True) -> None:
    """What EngineCore.preload does, with the fake runner."""
    s.check_preload(prompts)
    for prompt in prompts:
        s.add_request(make_request(prompt, max_tokens=1))
        while s.has_requests():
            run_step(s)
        if pin:
            assert s.pin_prefix(prompt) == len(prompt) // 4


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
    with pytest.raises(ValueError, match=r"pin 5 blocks .* over the limit of 4"):
        s.check_preload([SYSTEM + [1, 2, 3, 4]])
    assert not s.has_requests()  # refused before anything ran
    preload(s, [SYSTEM])  # 4 blocks: exactly the cap
    with pytest.raises(ValueError, match="limit of 4"):
        s.check_preload([list(range(300, 304))])
    s.check_preload([SYSTEM])  # already pinned: nothing more
    # With 4 of 16 blocks pinned, a request needing all 16 can never run: refused at once.
    big = make_request(40, max_tokens=24)
    s.add_request(big)
    _, outs = run_step(s)
    assert [o.finish_reason for c in outs.values() for o in c.outputs] == ["length"]


def test_preload_needs_prefix_caching_and_a_short_enough_prompt():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        make_scheduler(enable_prefix_caching=False).check_preload([SYSTEM])
    with pytest.raises(ValueError, match="max_model_len - 1 = 39"):
        make_scheduler(max_model_len=40).check_preload([list(range(40))])


class FakeTokenizer:
    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and not add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def test_preload_prompt_forms(tmp_path):
    prompts = ["ab", [{"role": "system", "content": "c"}], [5, 6]]
    expected = [[1, 97, 98], [ord(c) for c in "<system>c"], [5, 6]]
    assert preload_token_ids(prompts, FakeTokenizer()) == expected
    file = tmp_path / "prompts.json"
    file.write_text(json.dumps(prompts))
    assert preload_token_ids(str(file), FakeTokenizer()) == expected
    with pytest.raises(ValueError, match="cannot read"):
        preload_token_ids(str(tmp_path / "missing.json"), FakeTokenizer())
    with pytest.raises(ValueError, match=r"preload_prompts\[0\]"):
        preload_token_ids([3.5], FakeTokenizer())
    with pytest.raises(ValueError, match="without a tokenizer"):
        preload_token_ids(["ab"], None)
