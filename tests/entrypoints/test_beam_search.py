"""`LLM.beam_search` on the real default model (fp32), against transformers' beam search.

The semantics compared. vLLM's beam search (ours) runs every prompt for max_tokens steps,
keeps every beam's end-of-text candidates as finished sequences, and ranks sequences by
cumulative logprob / length ** length_penalty with the prompt counted in the length. With
`length_penalty=0.0` and `early_stopping="never"` transformers does the same search (its own
docstring calls this the canonical beam search): ranking by cumulative logprob alone, and
never stopping while a live beam could still beat a finished one. Its length penalty
counts only generated tokens, so only at 0 do the two rankings agree. One difference
remains, shown by `test_end_of_text_beyond_the_top_beams`: transformers keeps an
end-of-text candidate as a finished sequence only when it ranks among the step's top
num_beams candidates, vLLM (and so ours) whenever it is among its beam's top 2 * num_beams.
"""

import pytest
import torch

from v1 import LLM
from v1.beam_search import beam_search, get_beam_search_score
from v1.outputs import CompletionOutput, Logprob, RequestOutput
from v1.sampling_params import BeamSearchParams

MAX_TOKENS = 10
# Where transformers and vLLM make the same search (see the module): no end-of-text
# candidate (fibonacci, the chat answer) or one among the top beams ("colors", step 8).
PARITY_PROMPTS = ["def fibonacci(n):", "List three colors:"]
CHAT_QUESTION = "What is the late fee?"


@pytest.fixture(scope="module")
def llm(default_model):
    with LLM(loaded_model=default_model, max_model_len=256, num_gpu_blocks=128) as llm:
        yield llm


@pytest.fixture(scope="module")
def chat_prompt(hf_tokenizer) -> str:
    return hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_QUESTION}], add_generation_prompt=True, tokenize=False
    )


def hf_beam_search(hf_model, prompt_ids: list[int], beam_width: int,
                   stop_ids: list[int]) -> tuple[list[int], float]:
    """transformers' best sequence (generated tokens, up to its end-of-text token) and its
    score, which at length_penalty 0 is its cumulative logprob."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([prompt_ids]), num_beams=beam_width, do_sample=False,
            max_new_tokens=MAX_TOKENS, length_penalty=0.0, early_stopping="never",
            eos_token_id=stop_ids, pad_token_id=stop_ids[0],
            output_scores=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    ends = [i for i, t in enumerate(tokens) if t in stop_ids]
    return tokens[: ends[0] + 1] if ends else tokens, float(out.sequences_scores[0])


def stop_ids(default_model) -> list[int]:
    return [default_model.eos_token_id, *default_model.stop_token_ids]


@pytest.mark.parametrize("beam_width", [2, 4])
def test_top_sequence_matches_transformers(llm, hf_model, default_model, chat_prompt,
                                           beam_width):
    prompts = [*PARITY_PROMPTS, {"prompt": chat_prompt}]
    params = BeamSearchParams(beam_width=beam_width, max_tokens=MAX_TOKENS,
                              length_penalty=0.0, include_stop_str_in_output=True)
    outputs = llm.beam_search(prompts, params)
    tokenizer = llm.get_tokenizer()
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = tokenizer.encode(prompt if isinstance(prompt, str) else prompt["prompt"])
        ref, ref_score = hf_beam_search(hf_model, ids, beam_width, stop_ids(default_model))
        assert 1 <= len(out.sequences) <= beam_width
        best = out.sequences[0]
        assert best.tokens[: len(ids)] == ids
        assert best.tokens[len(ids):] == ref, f"{prompt!r}: ours differ from transformers'"
        assert best.cum_logprob == pytest.approx(ref_score, abs=1e-3)
        assert best.text == tokenizer.decode(best.tokens)
        assert len(best.logprobs) == len(ref)
        # The sequences come best first; an end-of-text one says so.
        scores = [s.cum_logprob for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for seq in out.sequences:
            if seq.finish_reason == "stop":
                assert seq.tokens[-1] == seq.stop_reason == default_model.eos_token_id
            else:
                assert seq.finish_reason == "length"
                assert len(seq.tokens) == len(ids) + MAX_TOKENS
    # The "colors" prompt's best ends on the end-of-text token: both sides saw it finish.
    assert outputs[1].sequences[0].finish_reason == "stop"


def test_end_of_text_beyond_the_top_beams(llm, hf_model, default_model):
    """At step 3, end-of-text after " Paris." is its beam's 4th candidate (within its top
    2 * 3) but only the 6th of the step's candidates by cumulative logprob (-3.57; the
    beams' continuations score -1.65 to -3.24): vLLM keeps it as a finished sequence,
    transformers drops it (not among the top 3). Ours keeps it, and it is the most likely
    sequence either side saw: transformers' best has a lower cumulative logprob, and
    transformers' own model gives ours the logprob we report."""
    prompt = "The capital of France is"
    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=0.0)
    (out,) = llm.beam_search([prompt], params)
    ids = llm.get_tokenizer().encode(prompt)
    best = out.sequences[0]
    eos = default_model.eos_token_id
    assert (best.finish_reason, best.stop_reason) == ("stop", eos)
    # Without include_stop_str_in_output the end-of-text token is in neither tokens nor text.
    assert len(best.tokens) - len(ids) == 2 and best.text == prompt + " Paris."
    tokens = [*best.tokens, eos]
    ref, ref_score = hf_beam_search(hf_model, ids, 3, stop_ids(default_model))
    assert ref != tokens[len(ids):] and ref_score < best.cum_logprob - 1.0
    with torch.inference_mode():
        logits = hf_model(torch.tensor([tokens])).logits[0].log_softmax(-1)
    hf_cum = sum(float(logits[i - 1, tokens[i]]) for i in range(len(ids), len(tokens)))
    assert best.cum_logprob == pytest.approx(hf_cum, abs=1e-3)


def test_beams_share_their_prefix_blocks(llm, chat_prompt):
    """Each step's beams run together and find their common prefix's blocks cached: the
    prompt's full blocks are held by all beam_width requests at once (ref count) and hit
    by every step after the first (the stats' prefix cache hits)."""
    beam_width, steps = 3, 4
    core = llm.llm_engine.client.engine_core
    scheduler = core.scheduler
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    most_shared = 0
    schedule = scheduler.schedule

    def schedule_and_look():  # the ref counts while the step's requests hold their blocks
        nonlocal most_shared
        out = schedule()
        most_shared = max(most_shared, max(b.ref_cnt for b in blocks))
        return out

    prompt_len = len(llm.get_tokenizer().encode(chat_prompt))
    full_block_tokens = prompt_len // 16 * 16
    assert full_block_tokens >= 16
    before = llm.get_stats()
    scheduler.schedule = schedule_and_look
    try:
        llm.beam_search([chat_prompt], BeamSearchParams(beam_width, steps))
    finally:
        del scheduler.schedule
    after = llm.get_stats()
    assert most_shared == beam_width
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= (steps - 1) * beam_width * full_block_tokens
    llm.llm_engine.client.call_utility("check_integrity")


def test_concurrency_limit_and_prompt_forms(llm):
    """Prompts as text, token ids, or dicts give the same search; `concurrency_limit`
    (prompts searched at a time) changes nothing but how they are batched."""
    ids = llm.get_tokenizer().encode("def fibonacci(n):")
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    outs = llm.beam_search(
        ["def fibonacci(n):", {"prompt_token_ids": ids}, {"prompt": "def fibonacci(n):"}],
        params, concurrency_limit=1,
    )
    assert len(outs) == 3
    assert outs[0].sequences == outs[1].sequences == outs[2].sequences
    # One prompt alone, as `generate` takes it: token ids too (not each id a prompt).
    assert [o.sequences for o in llm.beam_search(ids, params)] == [outs[0].sequences]
    assert all(s.finish_reason == "length" for s in outs[0].sequences)


def test_length_penalty_ranks_as_vllm(llm, default_model):
    """vLLM's score: cumulative logprob / length ** length_penalty, the prompt counted in the
    length and a final end-of-text token not; the sequences come best first by it."""
    eos = default_model.eos_token_id
    assert get_beam_search_score([5, 6, 7, eos], -3.0, {eos}, 1.0) == -1.0
    assert get_beam_search_score([5, 6, 7, 8], -3.0, {eos}, 2.0) == -3.0 / 16
    assert get_beam_search_score([5, 6, 7, 8], -3.0, {eos}, 0.0) == -3.0
    (out,) = llm.beam_search(["List three colors:"], BeamSearchParams(4, 8, length_penalty=2.0))
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, {eos}, 2.0) for s in out.sequences]
    assert len(scores) == 4 and scores == sorted(scores, reverse=True)


def test_beams_stop_at_max_model_len(llm):
    """A beam that fills max_model_len (256 here) can take no further token: it finishes
    with "length" there, before max_tokens, as `generate` would stop it."""
    ids = llm.get_tokenizer().encode("one two three four five six seven eight nine ten " * 30)
    prompt = {"prompt_token_ids": ids[:254]}
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=8))
    assert [len(s.tokens) for s in out.sequences] == [256, 256]
    assert all(s.finish_reason == "length" for s in out.sequences)


def test_bad_params_raise_value_error(llm):
    for kwargs, match in [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width must be an integer >= 1"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
        ({"beam_width": 2.0, "max_tokens": 4}, "beam_width"),
    ]:
        with pytest.raises(ValueError, match=match):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match=r"beam_width is 11.*22 logprobs, more than "
                                         r"max_logprobs \(20\)"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(["Hi"], params, concurrency_limit=0)
    with pytest.raises(ValueError, match="more than max_model_len"):
        llm.beam_search(["Hi", {"prompt_token_ids": [1] * 257}], params)
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search(["Hi"], params, lora_request=object())
    # A bad cache salt in a later group of concurrency_limit prompts: refused before the
    # first group runs (the prefix cache was never asked for a token).
    queries = llm.get_stats().prefix_cache_queries
    for salt in ("\ud800", 5):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.beam_search(["Hi", {"prompt": "Hi", "cache_salt": salt}], params,
                            concurrency_limit=1)
        assert llm.get_stats().prefix_cache_queries == queries
    assert not llm.llm_engine.has_unfinished_requests()  # nothing ran



EOS = 2
# Every beam's next-token logprobs in the scripted searches below.
SCRIPTED_LOGPROBS = {EOS: -0.5, 7: -0.7, 8: -2.0, 9: -3.0}


def scripted_search(prompt_ids: list[int], params: BeamSearchParams) -> list[tuple]:
    """`beam_search` on a scripted engine, whose every beam's candidates are
    SCRIPTED_LOGPROBS: the sequences as (generated tokens, cum_logprob, finish_reason)."""

    def generate(prompts, step_params):
        return [
            RequestOutput(str(i), None, p["prompt_token_ids"], [CompletionOutput(
                0, "", [7], -0.7, [{t: Logprob(lp) for t, lp in SCRIPTED_LOGPROBS.items()}],
                "length",
            )], True)
            for i, p in enumerate(prompts)
        ]

    (out,) = beam_search([{"prompt_token_ids": prompt_ids}], params, generate=generate,
                         tokenize=lambda p: p["prompt_token_ids"], eos_token_ids=[EOS],
                         max_model_len=64, decode=None)
    return [(s.tokens[len(prompt_ids):], round(s.cum_logprob, 6), s.finish_reason)
            for s in out.sequences]


def test_a_step_the_engine_aborts_ends_the_search_with_abort():
    """A pause in "abort" mode aborts a step's requests (no token): the search ends there,
    every prompt's beams finishing as they were with "abort", as an aborted request does
    (the aborted beams were dropped: the answer was another search's sequences, or none)."""
    steps = []

    def generate(prompts, step_params):
        steps.append(len(prompts))
        aborted = len(steps) == 2
        return [
            RequestOutput(str(i), None, p["prompt_token_ids"], [CompletionOutput(
                0, "", [] if aborted and i % 2 else [7], None,
                None if aborted and i % 2 else [{7: Logprob(-0.7), 8: Logprob(-2.0)}],
                "abort" if aborted and i % 2 else "length",
            )], True)
            for i, p in enumerate(prompts)
        ]

    outs = beam_search([{"prompt_token_ids": [5]}, {"prompt_token_ids": [6]}],
                       BeamSearchParams(2, 4), generate=generate,
                       tokenize=lambda p: p["prompt_token_ids"], eos_token_ids=[EOS],
                       max_model_len=64, decode=None)
    assert steps == [2, 4]  # no step after the aborted one
    for prompt, out in zip((5, 6), outs, strict=True):
        assert [(s.tokens, s.finish_reason) for s in out.sequences] == [
            ([prompt, 7], "abort"), ([prompt, 8], "abort")
        ]


@pytest.mark.parametrize("prompt_ids", [[EOS], [5, EOS], [5]])
def test_scores_count_the_prompt_not_the_finishing_end_of_text(prompt_ids):
    """A sequence's length in its score is vLLM's: the prompt's tokens (an end-of-text token
    among them too) and the generated ones but the one that finished it, whether or not
    `include_stop_str_in_output` keeps that one in `tokens`. A prompt of just end-of-text,
    finished at once, has length 1 (not 0: a division by zero)."""
    ranked = {}
    for include in (False, True):
        params = BeamSearchParams(2, 2, length_penalty=1.0, include_stop_str_in_output=include)
        ranked[include] = scripted_search(prompt_ids, params)
    assert ranked[False] == [
        (tokens[:-1] if reason == "stop" else tokens, cum, reason)
        for tokens, cum, reason in ranked[True]
    ]
    if prompt_ids == [5, EOS]:  # -0.5 / 2 beats -1.4 / 4, which beats -1.2 / 3
        assert ranked[True] == [([EOS], -0.5, "stop"), ([7, 7], -1.4, "length")]


def test_length_penalty_out_of_float_range_raises_before_searching():
    """A length (up to max_model_len + 1 = 65 here) to the power length_penalty must be a
    float: 65 ** 1e308 overflows and 65 ** -1e308 is 0 (a division by zero), which ranking
    found only after the whole search."""
    for penalty in (1e308, -1e308, 171.0):
        with pytest.raises(ValueError, match=r"length_penalty is .*<= 170"):
            scripted_search([5], BeamSearchParams(2, 2, length_penalty=penalty))
    assert scripted_search([5], BeamSearchParams(2, 2, length_penalty=-170.0))


def test_many_prompts_in_a_small_cache_leave_nothing_behind(default_model):
    """More beams than the KV cache holds at once (24 prompts x 2 beams, a block each, in 8
    blocks): the scheduler runs each step's requests a few at a time, the search completes
    every prompt, and afterwards no request is left, no block is held, and the engine
    serves."""
    with LLM(loaded_model=default_model, max_model_len=64, num_gpu_blocks=8) as llm:
        prompts = [f"Item {i}: the" for i in range(24)]
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=3))
        assert [len(o.sequences) for o in outs] == [2] * 24
        stats = llm.get_stats()
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        assert stats.kv_cache_usage == 0.0
        assert not llm.llm_engine.has_unfinished_requests()
        llm.llm_engine.client.call_utility("check_integrity")
        assert llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids


def test_completions_use_beam_search(extras_client, hf_model, hf_tokenizer, default_model):
    """vLLM's `use_beam_search` on /v1/completions, as its clients send it: the n best
    sequences, best first, the top one transformers' (length_penalty 0); the text is the
    generated tokens' without the end-of-text token that finished it. Streaming is refused,
    as vLLM refuses it."""
    import openai

    from tests.entrypoints.test_openai_server import MODEL

    prompt = PARITY_PROMPTS[1]  # its best sequence ends on the end-of-text token
    completion = extras_client.completions.create(
        model=MODEL, prompt=[prompt, prompt], n=2, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"use_beam_search": True, "length_penalty": 0.0},
    )
    ids = hf_tokenizer.encode(prompt)
    eos = default_model.eos_token_id
    ref, _ = hf_beam_search(hf_model, ids, 2, stop_ids(default_model))
    assert ref[-1] == eos
    choices = completion.choices
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert [c.text for c in choices[:2]] == [c.text for c in choices[2:]]
    best = choices[0]
    assert best.text == hf_tokenizer.decode(ref[:-1])
    assert (best.finish_reason, best.model_extra["stop_reason"]) == ("stop", eos)
    assert choices[1].text != best.text
    assert completion.usage.prompt_tokens == 2 * len(ids)
    with pytest.raises(openai.BadRequestError, match="Streaming is not currently supported"):
        extras_client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=2,
                                         stream=True, extra_body={"use_beam_search": True})


def stub_engine(started: list[str], aborted: list[str]):
    """An AsyncLLM stand-in whose requests never finish: each records its id in `started`,
    then in `aborted` when cancelled."""
    import asyncio
    from types import SimpleNamespace

    async def generate(prompt, params, request_id, priority, data_parallel_rank, lora):
        started.append(request_id)
        try:
            await asyncio.sleep(3600)
        finally:
            aborted.append(request_id)
        yield  # an async generator, as AsyncLLM.generate

    async def run_in_pool(fn, *args):
        return await asyncio.to_thread(fn, *args)

    return SimpleNamespace(generate=generate, run_in_pool=run_in_pool, processor=SimpleNamespace(
        limits=SimpleNamespace(max_logprobs=20), prompt_token_ids=lambda p: p["prompt_token_ids"],
        eos_token_id=0, extra_stop_token_ids=(), max_model_len=64,
    ))


def test_server_beam_searches_hold_no_thread_while_they_wait():
    """A search's steps are awaited on the event loop, its own work between them on the
    input pool: 40 searches all have a step in flight at once (each held a worker thread
    for its whole search: beyond the default pool's min(32, cpus + 4), they queued behind
    the first ones, however long those ran)."""
    import asyncio

    from v1.entrypoints.openai.protocol import CompletionRequest
    from v1.entrypoints.openai.serving_beam_search import run_beam_search

    started: list[str] = []
    engine = stub_engine(started, [])

    async def forty_searches() -> None:
        searches = [asyncio.ensure_future(run_beam_search(
            engine, [{"prompt_token_ids": [1, 2]}], BeamSearchParams(beam_width=2, max_tokens=5),
            f"cmpl-{i}", CompletionRequest(prompt="x"), None,
        )) for i in range(40)]
        for _ in range(500):
            if len(started) == 40:
                break
            await asyncio.sleep(0.01)
        for search in searches:
            search.cancel()
        await asyncio.wait(searches)
        assert sorted(started) == sorted(f"cmpl-{i}-0-0" for i in range(40))

    asyncio.run(forty_searches())


def test_server_beam_search_stops_when_the_client_leaves():
    """The server's search awaits its steps on the event loop: a client that leaves (the
    request's task cancelled) aborts the step in flight, and no step runs after it."""
    import asyncio

    from v1.entrypoints.openai.protocol import CompletionRequest
    from v1.entrypoints.openai.serving_beam_search import run_beam_search

    started: list[str] = []
    aborted: list[str] = []
    engine = stub_engine(started, aborted)

    async def leave_during_the_first_step() -> None:
        search = asyncio.ensure_future(run_beam_search(
            engine, [{"prompt_token_ids": [1, 2]}], BeamSearchParams(beam_width=2, max_tokens=5),
            "cmpl-x", CompletionRequest(prompt="x"), None,
        ))
        while not started:
            await asyncio.sleep(0.01)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search
        await asyncio.sleep(0.2)  # time for a next step, were one to start
        # Before the loop ends (which would cancel whatever is left by itself).
        assert started == aborted == ["cmpl-x-0-0"]

    asyncio.run(leave_during_the_first_step())


@pytest.mark.parametrize("field", [
    {"stop": ["\n"]}, {"stop_token_ids": [2]}, {"min_tokens": 3}, {"bad_words": ["no"]},
    {"logit_bias": {"5": 10.0}}, {"presence_penalty": 0.5}, {"repetition_penalty": 1.2},
    {"response_format": {"type": "json_object"}}, {"structured_outputs": {"choice": ["a", "b"]}},
    {"vllm_xargs": {"k": 1}},
])
def test_server_beam_search_refuses_what_it_would_disregard(field):
    """The search ranks the raw logprobs' candidates and stops only at end-of-text or
    max_tokens: a field that would shape a sampled answer is a 400, not silently ignored.
    Their defaults (and empty values) pass."""
    from v1.entrypoints.openai.protocol import CompletionRequest
    from v1.entrypoints.openai.serving_beam_search import beam_search_params

    (name, _), = field.items()
    request = CompletionRequest(prompt="x", use_beam_search=True, n=2, **field)
    params = request.to_sampling_params()
    with pytest.raises(ValueError, match=f"{name}.* not supported with beam search"):
        beam_search_params(request, params)
    plain = CompletionRequest(prompt="x", use_beam_search=True, n=2, stop=[],
                              presence_penalty=0.0, seed=3, top_p=0.9,
                              response_format={"type": "text"})
    assert beam_search_params(plain, plain.to_sampling_params()).beam_width == 2
