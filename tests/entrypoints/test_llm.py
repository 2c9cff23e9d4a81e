"""`LLM` end to end on the real default model, checked token for token against HF."""

import json

import pytest
import torch

from tests.entrypoints.conftest import PLAIN_PROMPTS, SYSTEM
from v1 import LLM, SamplingParams
from v1.attention.backends.abstract import kv_cache_shape
from v1.engine.core import resolve_device_and_dtype
from v1.outputs import RequestOutput
from v1.worker.model_runner import _DEFAULT_CPU_KV_CACHE_BYTES

MAX_TOKENS = 32


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    """Where two greedy outputs first differ (or the shorter one ends); None if equal."""
    if ours == ref:
        return None
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))


def assert_matches_hf(llm: LLM, outputs: list[RequestOutput], hf_greedy) -> None:
    """The correctness bar. fp32 on CPU computes what HF computes: every output must equal
    HF's. Where float rounding really differs (bf16 on a GPU) vLLM's rule applies: equal
    until the first divergence, where each side's token is in the other's top-5 logprobs."""
    device, dtype = resolve_device_and_dtype(llm.engine_args.device, llm.engine_args.dtype)
    exact = device.type == "cpu" and dtype == torch.float32
    diverged: list[str] = []
    for k, out in enumerate(outputs):
        ours = out.outputs[0]
        ref = hf_greedy(out.prompt_token_ids, MAX_TOKENS)
        i = first_divergence(ours.token_ids, ref.token_ids)
        if i is None:
            continue
        diverged.append(f"prompt #{k} at token {i}")
        if exact:
            continue
        tail = f"({len(diverged)} of {len(outputs)} prompts diverge so far)"
        # Same tokens, one side stopped early: not a rounding difference.
        assert i < min(len(ours.token_ids), len(ref.token_ids)), f"{diverged[-1]}: length {tail}"
        a, b = ours.token_ids[i], ref.token_ids[i]
        assert a in ref.top5[i], f"{diverged[-1]}: ours {a} not in HF top-5 {tail}"
        assert b in ours.logprobs[i], f"{diverged[-1]}: HF {b} not in our top-5 {tail}"
    if exact:
        assert not diverged, (
            f"{len(diverged)} of {len(outputs)} prompts diverge from HF: {'; '.join(diverged)}"
        )


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


def record_steps(llm: LLM, monkeypatch) -> list[dict[str, int]]:
    """Each step's tokens per request id, as the runner of an in-process engine gets them."""
    runner = llm.llm_engine.client.engine_core.model_runner
    execute = runner.execute_model
    steps: list[dict[str, int]] = []

    def record(scheduler_output):
        steps.append(dict(scheduler_output.num_scheduled_tokens))
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute_model", record)
    return steps


def check_idle(llm: LLM) -> None:
    llm.llm_engine.client.call_utility("check_integrity")
    assert not llm.llm_engine.output_processor.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm(make_llm) -> LLM:
    return make_llm()


def mixed_prompts(chat_prompts) -> list[str]:
    return PLAIN_PROMPTS[:5] + chat_prompts[:3]


def test_default_config_matches_hf(llm, hf_greedy, chat_prompts):
    outputs = llm.generate(mixed_prompts(chat_prompts), GREEDY, use_tqdm=False)
    assert len(outputs) == 8
    assert_matches_hf(llm, outputs, hf_greedy)
    assert all(o.finished and o.outputs[0].text for o in outputs)
    check_idle(llm)


def test_second_pass_hits_prefix_cache(llm, hf_greedy, chat_prompts):
    prompts = mixed_prompts(chat_prompts)
    llm.generate(prompts, GREEDY, use_tqdm=False)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(llm, outputs, hf_greedy)
    long_ones = [o for o in outputs if len(o.prompt_token_ids) > 16]
    assert long_ones and all(o.num_cached_tokens > 0 for o in long_ones)
    assert llm.get_stats().prefix_cache_hits > 0
    check_idle(llm)


def test_chunked_prefill_budget_16(make_llm, hf_greedy, chat_prompts, monkeypatch):
    llm = make_llm(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    steps = record_steps(llm, monkeypatch)
    outputs = llm.generate(mixed_prompts(chat_prompts), GREEDY, use_tqdm=False)
    assert_matches_hf(llm, outputs, hf_greedy)
    # Both limits held, and both bound: ~150-token prompts went in chunks of 8, 16 a step.
    assert max(sum(step.values()) for step in steps) == 16
    assert max(n for step in steps for n in step.values()) == 8
    check_idle(llm)


def test_shared_system_prompt(make_llm, hf_greedy, chat_prompts):
    llm = make_llm()
    outputs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
    assert_matches_hf(llm, outputs, hf_greedy)
    stats = llm.get_stats()
    # Every prompt after the first reuses the system prompt's blocks.
    assert stats.prefix_cache_hit_rate > 0.5
    check_idle(llm)


def test_preemption_under_tiny_kv_pool(make_llm, hf_greedy, chat_prompts):
    # 24 blocks of 16 = 384 tokens for 8 requests of ~150 tokens + 32 outputs each.
    llm = make_llm(num_gpu_blocks=24, max_model_len=384)
    outputs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
    assert llm.get_stats().num_preemptions > 0
    assert_matches_hf(llm, outputs, hf_greedy)
    check_idle(llm)


def test_priority_scheduling(make_llm, hf_greedy, chat_prompts):
    llm = make_llm(scheduling_policy="priority", max_num_seqs=3, num_gpu_blocks=40,
                   max_model_len=512)
    prompts = mixed_prompts(chat_prompts)
    priority = [3, 1, 2, 0, 3, 1, 0, 2]
    outputs = llm.generate(prompts, GREEDY, priority=priority, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == [
        llm.llm_engine.processor.tokenize_prompt(p)[1] for p in prompts
    ]
    # Three run at a time, so requests start in waves: by priority, not in the order given
    # (FCFS would start prompts 0-2 first, prompt 0 having priority 3). Within a priority,
    # prefix-aware admission may start a later arrival first (longer cached prefix).
    first = [o.metrics.first_token_time for o in outputs]
    assert all(first[i] <= first[j] for i in range(len(prompts)) for j in range(len(prompts))
               if priority[i] < priority[j])
    assert_matches_hf(llm, outputs, hf_greedy)
    check_idle(llm)


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    a = llm.generate(["Tell me a story."] * 2, params, use_tqdm=False)
    b = llm.generate(["Tell me a story."], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_n_greater_than_one_shares_prompt(llm, monkeypatch):
    assert llm.reset_prefix_cache()  # nothing cached from earlier tests, stats from zero
    steps = record_steps(llm, monkeypatch)
    n = 3
    params = SamplingParams(n=n, temperature=1.0, seed=7, max_tokens=8)
    (out,) = llm.generate([f"{SYSTEM}Name a fruit:"], params, use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert all(samples) and len(set(samples)) == n, samples  # seeds 7, 8, 9: n samples
    # The prompt was computed once: the other samples hit all its full blocks (bar the
    # one holding the last token) and computed only the rest.
    prompt_len = len(out.prompt_token_ids)
    shared = (prompt_len - 1) // 16 * 16
    assert shared >= 7 * 16
    assert llm.get_stats().prefix_cache_hits == (n - 1) * shared
    num_decoded = sum(len(s) - 1 for s in samples)
    computed = sum(sum(step.values()) for step in steps)
    assert computed == prompt_len + (n - 1) * (prompt_len - shared) + num_decoded
    check_idle(llm)


def test_reset_prefix_cache_preempts_running_requests(llm, hf_greedy, chat_prompts):
    """As vLLM's examples/features/reset_kv: requests added one per LLMEngine step, and at step
    10 `reset_prefix_cache(reset_running_requests=True)`. Refused without the flag while they
    hold blocks; with it they are preempted, recompute, and still answer as HF does."""
    engine = llm.llm_engine
    prompts = mixed_prompts(chat_prompts)[:4]
    before = llm.get_stats().num_preemptions
    pending, finished, step = list(enumerate(prompts)), {}, 0
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(str(i), prompt, GREEDY)
        if step == 10:
            assert engine.reset_prefix_cache() is False
            assert engine.reset_prefix_cache(reset_running_requests=True) is True
            assert llm.get_stats().num_preemptions == before + len(prompts)
        for out in engine.step():
            if out.finished:
                finished[int(out.request_id)] = out
        step += 1
    assert_matches_hf(llm, [finished[i] for i in range(len(prompts))], hf_greedy)
    check_idle(llm)


def test_chat(llm, hf_tokenizer):
    conversations = [
        [{"role": "user", "content": "What is 2+2?"}],
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Où est la salle d'étude ?"},
            {"role": "assistant", "content": "Au premier étage."},
            {"role": "user", "content": "Merci !"},
        ],
    ]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=16),
                       use_tqdm=False)
    for conversation, out in zip(conversations, outputs, strict=True):
        assert out.prompt_token_ids == hf_tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=True, return_dict=False
        )
    assert "4" in outputs[0].outputs[0].text


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


@pytest.mark.parametrize("include", [False, True])
def test_multibyte_stop_string(llm, include):
    # Greedy output: ' as "おやく'. Each kana is two byte-level tokens: "や" is complete
    # only after the second, and neither token decodes to it alone.
    prompt = "In Japanese, hello is written"
    (full,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8),
                           use_tqdm=False)
    head, stop, _ = full.outputs[0].text.partition("や")
    assert stop and head.endswith("お"), full.outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=8, stop=["や"],
                            include_stop_str_in_output=include)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "や"
    assert completion.text == (head + stop if include else head)
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
    assert_matches_hf(llm, [out], hf_greedy)


def test_detokenize_false_gives_token_ids_only(llm):
    # vLLM's: the same tokens, no text; logprobs without their tokens' text.
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    (with_text,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    params.detokenize = False
    (ids_only,) = llm.generate(["The capital of France is"], params, use_tqdm=False)
    a, b = with_text.outputs[0], ids_only.outputs[0]
    assert a.text and b.text == "" and b.token_ids == a.token_ids
    assert all(lp.decoded_token is None for step in b.logprobs for lp in step.values())
    assert not SamplingParams(spaces_between_special_tokens=False).spaces_between_special_tokens


def test_sampling_params_that_are_not_sampling_params_are_named(llm):
    # A dict (vLLM takes none either) was read as a list of its keys, then failed far away.
    for bad in ({"temperature": 0}, [GREEDY, "x"]):
        with pytest.raises(ValueError, match=r"^sampling_params must be a SamplingParams"):
            llm.generate(["hi"] * len(bad), bad, use_tqdm=False)


@pytest.fixture(scope="module")
def model_for_64(default_model_path):
    """`default_model` loaded for an engine's max_model_len 64, as an engine process loads
    it: RoPE tables of 64 positions, every one of which the test below reaches."""
    from v1.attention.backends.torch_attn import TorchAttentionImpl
    from v1.models.loader import load_model

    loaded = load_model(str(default_model_path), torch.float32, torch.device("cpu"),
                        TorchAttentionImpl, max_model_len=64)
    (rope,) = loaded.model.model.rotary_embs.values()
    assert loaded.max_model_len == 64 and rope.cos_table.shape[0] == 64
    return loaded


@pytest.mark.parametrize("prompt_len, max_tokens", [(64, None), (64, 8), (61, 8), (65, 1)])
def test_output_capped_by_max_model_len(model_for_64, hf_greedy, hf_tokenizer, prompt_len,
                                        max_tokens):
    """As vLLM's LLM: a prompt may fill max_model_len (its one output token needs no KV
    slot), and generation stops there whatever max_tokens asks; longer prompts are refused."""
    max_model_len = 64
    prompt = hf_tokenizer(SYSTEM).input_ids[:prompt_len]
    assert len(prompt) == prompt_len
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    with LLM(loaded_model=model_for_64, max_model_len=max_model_len, num_gpu_blocks=8) as llm:
        if prompt_len > max_model_len:
            with pytest.raises(ValueError, match="max_model_len"):
                llm.generate([prompt], params, use_tqdm=False)
        else:
            (out,) = llm.generate([prompt], params, use_tqdm=False)
            num_expected = max(max_model_len - prompt_len, 1)
            assert out.outputs[0].token_ids == hf_greedy(prompt, num_expected).token_ids
            assert out.outputs[0].finish_reason == "length"
        check_idle(llm)


def test_kv_cache_sized_from_memory(default_model, hf_greedy, chat_prompts):
    """Without num_gpu_blocks the pool is as many blocks as the KV memory budget holds."""
    cfg = default_model.hf_config
    # K and V of 16 tokens in every layer, fp32.
    block_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 16

    def pool_of(llm: LLM) -> tuple[int, list[torch.Tensor]]:
        core = llm.llm_engine.client.engine_core
        return core.scheduler.kv_cache_manager.num_blocks, core.model_runner.kv_caches

    with LLM(loaded_model=default_model, max_model_len=1024) as llm:  # the default budget
        num_blocks, kv_caches = pool_of(llm)
        assert num_blocks == _DEFAULT_CPU_KV_CACHE_BYTES // block_bytes
        assert len(kv_caches) == cfg.num_hidden_layers
        assert sum(t.nbytes for t in kv_caches) == num_blocks * block_bytes
        shape = kv_cache_shape(num_blocks, 16, cfg.num_key_value_heads, cfg.head_dim)
        assert all(t.shape == shape and t.dtype == torch.float32 for t in kv_caches)
        outputs = llm.generate(mixed_prompts(chat_prompts)[4:6], GREEDY, use_tqdm=False)
        assert_matches_hf(llm, outputs, hf_greedy)
        check_idle(llm)

    # An explicit budget: whole blocks only.
    with LLM(loaded_model=default_model, max_model_len=256,
             kv_cache_memory=20 * block_bytes + block_bytes // 2) as llm:
        assert pool_of(llm)[0] == 20
    with pytest.raises(ValueError, match="less than one KV block"):
        LLM(loaded_model=default_model, max_model_len=256, kv_cache_memory=block_bytes - 1)
    with pytest.raises(ValueError, match="max_model_len"):  # 15 blocks: 240 tokens < 256
        LLM(loaded_model=default_model, max_model_len=256, kv_cache_memory=15 * block_bytes)


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
    assert_matches_hf(llm, outputs, hf_greedy)
    if "num_gpu_blocks" in config:
        assert llm.get_stats().num_preemptions > 0
    check_idle(llm)


# ---- the engine core in its own process (the default) -------------------------------------


def test_multiprocess_llm_matches_hf(hf_greedy, chat_prompts):
    from v1.engine.core_client import SyncMPClient

    # Float weights: HF parity is fp32's (a .gguf file's default runs its blocks).
    with LLM(num_gpu_blocks=256, max_model_len=1024, quantization="none") as llm:
        client = llm.llm_engine.client
        assert isinstance(client, SyncMPClient)
        outputs = llm.generate(mixed_prompts(chat_prompts), GREEDY, use_tqdm=False)
        assert_matches_hf(llm, outputs, hf_greedy)
        (chat,) = llm.chat([{"role": "user", "content": "What is 2+2?"}],
                           SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        assert "4" in chat.outputs[0].text
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(["x " * 3000], GREEDY, use_tqdm=False)
        check_idle(llm)
        proc = client._res.proc
    assert not proc.is_alive()


def test_multiprocess_option(monkeypatch, default_model):
    import v1.engine.llm_engine as llm_engine_module

    with pytest.raises(ValueError, match="multiprocess=False"):
        LLM(loaded_model=default_model, multiprocess=True)

    class Chosen(Exception):
        pass

    def inproc(*args):
        raise Chosen

    monkeypatch.setattr(llm_engine_module, "InprocClient", inproc)
    monkeypatch.setenv("V1_ENABLE_MULTIPROCESSING", "0")
    with pytest.raises(Chosen):
        LLM()


def test_preload_prompts_pin_a_system_prompt(make_llm, hf_greedy, hf_tokenizer, tmp_path):
    """A declared system prompt (a JSON file, as --preload-prompts reads it) is computed at
    start-up and stays cached through traffic that fills the pool many times over; the
    outputs stay HF's. Over the cap, the engine refuses to start, naming both numbers."""
    file = tmp_path / "prompts.json"
    file.write_text(json.dumps([[{"role": "system", "content": SYSTEM}]]))
    llm = make_llm(num_gpu_blocks=48, max_model_len=256, preload_prompts=str(file))
    stats = llm.get_stats()
    assert stats.prefix_cache_queries == 0  # the preload is not traffic
    filler = [" ".join(["word"] * 150) + f" {i}" for i in range(8)]  # ~10 blocks each
    llm.generate(filler, SamplingParams(max_tokens=4), use_tqdm=False)
    prompt = hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    outputs = llm.generate([prompt], GREEDY, use_tqdm=False)
    system = hf_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}], tokenize=False, add_generation_prompt=False
    )
    num_system_tokens = len(hf_tokenizer.encode(system, add_special_tokens=False))
    # The system prompt's full blocks (the filler evicted everything else).
    assert outputs[0].num_cached_tokens == num_system_tokens // 16 * 16 > 0
    assert_matches_hf(llm, outputs, hf_greedy)
    check_idle(llm)
    with pytest.raises(ValueError, match=r"over the limit of 2 \(preload_max_fraction"):
        make_llm(num_gpu_blocks=48, max_model_len=256, preload_prompts=str(file),
                 preload_max_fraction=0.05)
