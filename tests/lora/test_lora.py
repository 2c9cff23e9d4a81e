"""LoRA adapters in the batch: v1's greedy tokens equal transformers + peft's merged models'
for several adapters and the base in one batch, chunked, with prefix hits; the prefix cache
keeps adapters apart; bad adapters are refused with a ValueError before anything runs."""

import shutil

import pytest

from tests.lora.conftest import LoRAFixture, write_adapter_config
from v1 import LLM, SamplingParams
from v1.lora.request import LoRARequest

N = 8
PROMPTS = [
    [5, 17, 3, 99, 42, 7, 64, 11, 23, 8, 1, 77],
    [9, 9, 120, 4, 56, 31, 2, 88, 14],
    [101, 6, 45, 3, 27, 70, 12, 5, 19, 33, 60, 2, 7, 81],
]


def _llm(fx: LoRAFixture, **kwargs) -> LLM:
    args = dict(
        enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4, num_gpu_blocks=256,
        multiprocess=False,
    )
    args.update(kwargs)
    return LLM(str(fx.base_dir), **args)


def _loras(fx: LoRAFixture) -> list[LoRARequest]:
    return [LoRARequest(f"adapter{i + 1}", i + 1, str(d)) for i, d in enumerate(fx.adapter_dirs)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


PARAMS = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kwargs", [
    {},  # the whole prompts in one step
    {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 5},  # chunked prefill
    {"max_loras": 1, "max_cpu_loras": 1},  # one adapter per step: slot and memory LRU
    {"num_gpu_blocks": 24, "max_model_len": 64},  # preemption (recompute) under a tiny pool
    {"async_scheduling": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_min": 1, "prompt_lookup_max": 2}},
], ids=["one-step", "chunked", "max-loras-1", "preempted", "async", "ngram-drafts"])
def test_two_adapters_and_base_in_one_batch_match_peft_merged(lora_fixture, kwargs):
    fx = lora_fixture
    l1, l2 = _loras(fx)
    # Every prompt with each adapter and with the base, all in one generate call.
    prompts = [p for p in PROMPTS for _ in range(3)]
    loras = [l1, l2, None] * len(PROMPTS)
    with _llm(fx, **kwargs) as llm:
        outputs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
        got = _tokens(outputs)
        # Each output names its adapter, as vLLM's.
        assert [(o.lora_request, o.outputs[0].lora_request) for o in outputs] == [
            (lora, lora) for lora in loras]
        core = llm.llm_engine.client.engine_core
        core.check_integrity()
        if "num_gpu_blocks" in kwargs:
            assert core.scheduler.num_preemptions > 0
        if "speculative_config" in kwargs:  # drafts were verified under the adapters
            assert llm.get_stats().spec_decode_num_draft_tokens > 0
    want = [fx.greedy(None if lr is None else lr.lora_int_id - 1, p, N)
            for p, lr in zip(prompts, loras)]
    assert got == want
    # The adapters change the tokens (the comparison above could not pass with them off).
    for i in range(len(PROMPTS)):
        assert got[3 * i] != got[3 * i + 2] and got[3 * i + 1] != got[3 * i + 2]


def test_prefix_cache_is_keyed_by_adapter(lora_fixture):
    fx = lora_fixture
    l1, l2 = _loras(fx)
    prompt = PROMPTS[2]
    want = {lr: fx.greedy(lr.lora_int_id - 1 if lr else None, prompt, N) for lr in (l1, l2, None)}
    with _llm(fx, max_num_batched_tokens=8) as llm:
        def run(lora: LoRARequest | None) -> tuple[list[int], int]:
            before = llm.get_stats().prefix_cache_hits
            out = llm.generate([prompt], PARAMS, lora_request=lora, use_tqdm=False)
            return out[0].outputs[0].token_ids, llm.get_stats().prefix_cache_hits - before

        tokens, hits = run(l1)
        assert tokens == want[l1] and hits == 0
        # The same prompt under another adapter, then the base: no block of l1's is shared.
        for lora in (l2, None):
            tokens, hits = run(lora)
            assert tokens == want[lora] and hits == 0
        # Under l1 again: its own blocks hit, and the tokens are the same.
        tokens, hits = run(l1)
        assert tokens == want[l1] and hits > 0
        llm.llm_engine.client.engine_core.check_integrity()


def test_chat_with_an_adapter(lora_fixture):
    fx = lora_fixture
    l1, _ = _loras(fx)
    messages = [{"role": "user", "content": " ".join(f"w{t}" for t in PROMPTS[0])}]
    with _llm(fx) as llm:
        out = llm.chat(messages, PARAMS, use_tqdm=False, lora_request=l1)
    assert out[0].prompt_token_ids == PROMPTS[0]
    assert out[0].outputs[0].token_ids == fx.greedy(0, PROMPTS[0], N)


def test_bad_adapters_raise_value_error_before_running(lora_fixture, tmp_path):
    fx = lora_fixture
    l1, _ = _loras(fx)
    big_rank = tmp_path / "big"
    shutil.copytree(fx.adapter_dirs[0], big_rank)
    dora = tmp_path / "dora"
    shutil.copytree(fx.adapter_dirs[0], dora)
    write_adapter_config(dora, use_dora=True)
    cases = [
        (LoRARequest("missing", 7, str(tmp_path / "nowhere")), "no adapter_config.json"),
        (LoRARequest("big", 8, str(big_rank)), "rank 8 exceeds max_lora_rank 4"),
        (LoRARequest("dora", 9, str(dora)), "use_dora is not supported"),
        # One id must mean one adapter: 2 is adapter2's, loaded below.
        (LoRARequest("other", 2, str(dora)), "already names"),
    ]
    with _llm(fx, max_lora_rank=4) as llm:
        with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank 4"):
            llm.generate([PROMPTS[0]], PARAMS, lora_request=l1, use_tqdm=False)
        ok = LoRARequest("adapter2", 2, str(fx.adapter_dirs[1]))  # rank 4
        llm.generate([PROMPTS[0]], PARAMS, lora_request=ok, use_tqdm=False)
        for lora, message in cases:
            with pytest.raises(ValueError, match=message):
                llm.generate([PROMPTS[0]], PARAMS, lora_request=lora, use_tqdm=False)
        # The engine serves on.
        out = llm.generate([PROMPTS[1]], PARAMS, lora_request=ok, use_tqdm=False)
        assert out[0].outputs[0].token_ids == fx.greedy(1, PROMPTS[1], N)
        assert llm.llm_engine.list_loras() == {2}
        llm.llm_engine.client.engine_core.check_integrity()


def test_lora_request_without_enable_lora_is_refused(lora_fixture):
    fx = lora_fixture
    with LLM(str(fx.base_dir), multiprocess=False, num_gpu_blocks=64) as llm:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.generate([PROMPTS[0]], PARAMS, lora_request=_loras(fx)[0], use_tqdm=False)


def test_lora_request_checks():
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(ValueError, match="lora_path must not be empty"):
        LoRARequest("a", 1)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM("unused", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="max_lora_rank must be an integer >= 1"):
        LLM("unused", enable_lora=True, max_lora_rank=0)
    with pytest.raises(ValueError, match="cannot be combined with enable_lora"):
        LLM("unused", enable_lora=True, kv_cache_dir="/tmp")


@pytest.mark.slow
def test_data_parallel_cores_serve_adapters(lora_fixture):
    """Two engine-core processes: `add_lora` reaches both, the router keys prefixes by
    adapter, and the tokens are the merged models'."""
    fx = lora_fixture
    l1, l2 = _loras(fx)
    prompts = [p for p in PROMPTS[:2] for _ in range(3)]
    loras = [l1, l2, None] * 2
    with _llm(fx, multiprocess=True, data_parallel_size=2) as llm:
        got = _tokens(llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False))
        assert llm.llm_engine.list_loras() == {1, 2}
    want = [fx.greedy(None if lr is None else lr.lora_int_id - 1, p, N)
            for p, lr in zip(prompts, loras)]
    assert got == want
