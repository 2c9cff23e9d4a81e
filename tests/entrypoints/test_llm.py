"""`LLM` end to end on the real default model, checked token for token against HF."""

import pytest

from v1 import LLM, SamplingParams
from v1.outputs import RequestOutput

MAX_TOKENS = 32


def assert_matches_hf(outputs: list[RequestOutput], hf_greedy) -> None:
    """vLLM's rule: equal until the first divergence; there, each side's token must be in
    the other's top-5 logprobs, and the comparison stops."""
    for out in outputs:
        ours = out.outputs[0]
        ref = hf_greedy(out.prompt_token_ids, MAX_TOKENS)
        for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids)):
            if a != b:
                assert a in ref.top5[i], f"{out.prompt!r}: ours {a} not in HF top-5 at {i}"
                assert b in ours.logprobs[i], f"{out.prompt!r}: HF {b} not in our top-5 at {i}"
                break
        else:
            assert len(ours.token_ids) == len(ref.token_ids), out.prompt


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)


@pytest.fixture(scope="module")
def make_llm(default_model):
    made = []

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_gpu_blocks", 256)
        kwargs.setdefault("max_model_len", 1024)
        llm = LLM(loaded_model=default_model, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def check_idle(llm: LLM) -> None:
    llm.llm_engine.client.call_utility("check_integrity")
    assert not llm.llm_engine.output_processor.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm()


def mixed_prompts(chat_prompts) -> list[str]:
    from tests.entrypoints.conftest import PLAIN_PROMPTS

    return PLAIN_PROMPTS[:5] + chat_prompts[:3]


def test_default_config_matches_hf(llm, hf_greedy, chat_prompts):
    outputs = llm.generate(mixed_prompts(chat_prompts), GREEDY, use_tqdm=False)
    assert len(outputs) == 8
    assert_matches_hf(outputs, hf_greedy)
    assert all(o.finished and o.outputs[0].text for o in outputs)
    check_idle(llm)


def test_second_pass_hits_prefix_cache(llm, hf_greedy, chat_prompts):
    prompts = mixed_prompts(chat_prompts)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, hf_greedy)
    long_ones = [o for o in outputs if len(o.prompt_token_ids) > 16]
    assert long_ones and all(o.num_cached_tokens > 0 for o in long_ones)
    assert llm.get_stats().prefix_cache_hits > 0
    check_idle(llm)


def test_chunked_prefill_budget_16(make_llm, hf_greedy, chat_prompts):
    llm = make_llm(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    outputs = llm.generate(mixed_prompts(chat_prompts), GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, hf_greedy)
    check_idle(llm)


def test_shared_system_prompt(make_llm, hf_greedy, chat_prompts):
    llm = make_llm()
    outputs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(outputs, hf_greedy)
    stats = llm.get_stats()
    # Every prompt after the first reuses the system prompt's blocks.
    assert stats.prefix_cache_hit_rate > 0.5
    check_idle(llm)


def test_preemption_under_tiny_kv_pool(make_llm, hf_greedy, chat_prompts):
    # 24 blocks of 16 = 384 tokens for 8 requests of ~150 tokens + 32 outputs each.
    llm = make_llm(num_gpu_blocks=24, max_model_len=384)
    outputs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    assert_matches_hf(outputs, hf_greedy)
    check_idle(llm)


def test_priority_scheduling(make_llm, hf_greedy, chat_prompts):
    llm = make_llm(scheduling_policy="priority", max_num_seqs=3, num_gpu_blocks=40,
                   max_model_len=512)
    prompts = mixed_prompts(chat_prompts)
    outputs = llm.generate(prompts, GREEDY, priority=[3, 1, 2, 0, 3, 1, 0, 2], use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [
        llm.llm_engine.processor.tokenize_prompt(p)[1] for p in prompts
    ]
    assert_matches_hf(outputs, hf_greedy)
    check_idle(llm)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    a = llm.generate(["Tell me a story."] * 2, params, use_tqdm=False)
    b = llm.generate(["Tell me a story."], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_n_greater_than_one_shares_prompt(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    (out,) = llm.generate(["Name a fruit:"], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids for c in out.outputs)
    check_idle(llm)


def test_chat(llm):
    (out,) = llm.chat(
        [{"role": "user", "content": "What is 2+2?"}],
        SamplingParams(temperature=0, max_tokens=16), use_tqdm=False,
    )
    assert "4" in out.outputs[0].text


def test_stop_string(llm):
    (full,) = llm.generate(["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12),
                           use_tqdm=False)
    assert " 6," in full.outputs[0].text
    (out,) = llm.generate(
        ["1, 2, 3, 4,"], SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]),
        use_tqdm=False,
    )
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == " 6"
    assert out.outputs[0].text == full.outputs[0].text.split(" 6")[0]
    check_idle(llm)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", {}, "empty"),
        ("x " * 3000, {}, "max_model_len"),
        ([1, 2, 10**6], {}, "1000000"),
        ([1, -1], {}, "-1"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"temperature": -1}, "temperature"),
        ("hi", {"top_p": 0}, "top_p"),
    ],
)
def test_bad_inputs_raise_and_engine_keeps_working(llm, hf_greedy, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    check_idle(llm)
    (out,) = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)
    assert_matches_hf([out], hf_greedy)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM("/no/such/model")


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize(
    "config, prompt_set",
    [
        ({}, "mixed"),
        # 24 blocks of 16 = 384 tokens for 8 requests of ~150 tokens + 32 outputs each.
        ({"num_gpu_blocks": 24, "max_model_len": 384}, "chat"),
    ],
    ids=["default", "tiny_kv_pool"],
)
def test_async_scheduling_matches_sync(make_llm, hf_greedy, chat_prompts, config, prompt_set):
    prompts = mixed_prompts(chat_prompts) if prompt_set == "mixed" else chat_prompts
    sync = make_llm(**config).generate(prompts, GREEDY, use_tqdm=False)
    llm = make_llm(async_scheduling=True, **config)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert token_ids(outputs) == token_ids(sync)
    assert_matches_hf(outputs, hf_greedy)
    if "num_gpu_blocks" in config:
        assert llm.get_stats().num_preemptions > 0
    check_idle(llm)


# ---- the engine core in its own process (the default) -------------------------------------


def test_multiprocess_llm_matches_hf(hf_greedy, chat_prompts):
    from v1.engine.core_client import SyncMPClient

    with LLM(num_gpu_blocks=256, max_model_len=1024) as llm:
        client = llm.llm_engine.client
        assert isinstance(client, SyncMPClient)
        outputs = llm.generate(mixed_prompts(chat_prompts), GREEDY, use_tqdm=False)
        assert_matches_hf(outputs, hf_greedy)
        (chat,) = llm.chat([{"role": "user", "content": "What is 2+2?"}],
                           SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert "4" in chat.outputs[0].text
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(["x " * 3000], GREEDY, use_tqdm=False)
        check_idle(llm)
        proc = client._res.proc
    assert not proc.is_alive()


def test_multiprocess_option(monkeypatch, default_model):
    import v1.entrypoints.llm as llm_module

    with pytest.raises(ValueError, match="multiprocess=False"):
        LLM(loaded_model=default_model, multiprocess=True)

    class Chosen(Exception):
        pass

    def inproc(*args):
        raise Chosen

    monkeypatch.setattr(llm_module, "InprocClient", inproc)
    monkeypatch.setenv("V1_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(Chosen):
        LLM()
