"""Speculative decoding end to end on the real default model (its GGUF blocks, as `LLM()` runs
it): greedy outputs (tokens and logprobs) equal those without it, in every configuration that
changes what a step holds. Drafts are priced on a fixed table of nearly free rows
(`cheap_rows`): these tests assert that drafting happens, which measured step times would make
depend on the machine's load."""

import pytest

from tests.entrypoints.conftest import PLAIN_PROMPTS
from tests.worker.step_costs import cheap_rows
from v1 import LLM, SamplingParams

MAX_TOKENS = 24
# Prompts a model tends to continue by quoting them (drafts get accepted), and plain ones.
REPETITIVE = [
    "Repeat exactly: red, green, blue, red, green, blue, red, green, blue, red,",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return",
    "A B C D E F G H A B C D E F G H A B C D",
    "one two three four one two three four one two three",
]
PROMPTS = REPETITIVE + PLAIN_PROMPTS[:4]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def generate(
    llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY
) -> list[tuple[list[int], list]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def llm_with_drafts(spec: dict | None, **options) -> LLM:
    """An in-process engine drafting as `spec` says (None: not), priced on `cheap_rows`."""
    llm = LLM(speculative_config=spec, **options)
    if spec is not None:
        llm.llm_engine.client.engine_core.model_runner.drafter.costs = cheap_rows()
    return llm


def without_drafts(gguf_model, params: SamplingParams | list[SamplingParams]):
    """The reference: `generate` on an engine without speculative decoding."""
    with LLM(loaded_model=gguf_model, num_gpu_blocks=64, max_model_len=512) as llm:
        return generate(llm, params)


def assert_same(spec, ref) -> None:
    assert [t for t, _ in spec] == [t for t, _ in ref]
    for (_, lps), (_, ref_lps) in zip(spec, ref, strict=True):
        if ref_lps is None:
            assert lps is None
            continue
        for got, want in zip(lps, ref_lps, strict=True):
            assert got.keys() == want.keys()
            for t in want:
                assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)


def assert_drafts_accepted(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert 0 < stats.spec_decode_acceptance_rate <= 1
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == (
        stats.spec_decode_num_accepted_tokens
    )
    llm.llm_engine.client.call_utility("check_integrity")


@pytest.fixture(scope="module")
def reference(gguf_model):
    return without_drafts(gguf_model, GREEDY)


@pytest.mark.parametrize(
    "k, options",
    [
        (1, {}),
        (4, {"max_num_seqs": 3}),  # batches of up to 3
        (3, {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8}),  # chunked
        (5, {"num_gpu_blocks": 8, "max_model_len": 128}),  # preemption
        (4, {"async_scheduling": True}),
        (2, {"async_scheduling": True, "num_gpu_blocks": 8, "max_model_len": 128}),
    ],
    ids=["k1", "k4-batch3", "chunked", "preempt", "async", "async-preempt"],
)
def test_greedy_outputs_equal_without_speculation(gguf_model, reference, k, options):
    options = {"num_gpu_blocks": 64, "max_model_len": 512, **options}
    spec = {**NGRAM, "num_speculative_tokens": k}
    with llm_with_drafts(spec, loaded_model=gguf_model, **options) as llm:
        assert_same(generate(llm), reference)
        assert_drafts_accepted(llm)
        if options["num_gpu_blocks"] < 64:
            assert llm.get_stats().num_preemptions > 0


def test_n_children_and_stop_conditions_with_drafts(gguf_model, reference):
    spec = {**NGRAM, "num_speculative_tokens": 3}
    with llm_with_drafts(spec, loaded_model=gguf_model, num_gpu_blocks=64,
                         max_model_len=512) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out, (ref_tokens, _) in zip(outs, reference, strict=True):
            assert [c.token_ids for c in out.outputs] == [ref_tokens, ref_tokens]
        # max_tokens and a stop string cut a verified step's tokens where they fall.
        short = SamplingParams(temperature=0.0, max_tokens=7)
        for out, (ref_tokens, _) in zip(
            llm.generate(PROMPTS, short, use_tqdm=False), reference, strict=True
        ):
            assert out.outputs[0].token_ids == ref_tokens[:7]
        text = llm.generate(REPETITIVE[0], SamplingParams(temperature=0.0, max_tokens=24),
                            use_tqdm=False)[0].outputs[0].text
        stop = text.split(",")[2][:3]  # a string met a few tokens in
        cut = llm.generate(REPETITIVE[0], SamplingParams(temperature=0.0, max_tokens=24,
                                                         stop=[stop]), use_tqdm=False)
        assert cut[0].outputs[0].text == text[: text.index(stop)]
        # Tokens and logprobs too: up to the one that completed the stop string, as without
        # drafts, also when it is met inside what one verified step accepts.
        decode = llm.get_tokenizer().decode
        for i, string in ((0, stop), (3, "four one")):
            ref_tokens = reference[i][0]
            end = next(j for j in range(1, len(ref_tokens) + 1)
                       if string in decode(ref_tokens[:j]))
            cut = llm.generate(PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=24,
                                                          stop=[string], logprobs=1),
                               use_tqdm=False)[0].outputs[0]
            assert (cut.token_ids, len(cut.logprobs)) == (ref_tokens[:end], end)
        # Sampling with top_k=1 is greedy through the random path: still exact.
        top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=MAX_TOKENS, seed=3)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, top1, use_tqdm=False)] \
            == [t for t, _ in reference]
        assert_drafts_accepted(llm)
        # The runner timed its decode steps, those with drafts too, for the drafter to price.
        recorded = llm.llm_engine.client.engine_core.model_runner.drafter.costs.recorded
        assert all(seconds > 0 for _, seconds in recorded)
        rows = {rows for rows, _ in recorded}
        assert 4 in rows and max(rows) > 2 * len(PROMPTS)  # one request's 1 + 3; n=2 each


def test_engine_process_with_async_scheduling(reference, monkeypatch):
    spec = {**NGRAM, "num_speculative_tokens": 4}
    monkeypatch.setenv("V1_ENGINE_CORE_HOOK", "tests.engine.engine_hooks:cheap_draft_rows")
    with LLM(num_gpu_blocks=64, max_model_len=512, async_scheduling=True,
             speculative_config=spec) as llm:
        assert_same(generate(llm), reference)
        assert_drafts_accepted(llm)


def test_mixed_batch_of_drafted_and_undrafted_requests(gguf_model):
    """Penalised, min_tokens, bad-words, biased and sampled requests in one batch with drafted
    ones: the sampling rows of a verified step stay each request's own."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.2,
                       frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, bad_words=[" blue"]),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={28: -3.0}),
        SamplingParams(temperature=0.9, top_k=1, max_tokens=MAX_TOKENS, seed=1),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, presence_penalty=1.0),
    ]
    results = []
    for spec in (None, {**NGRAM, "num_speculative_tokens": 3}):
        with llm_with_drafts(spec, loaded_model=gguf_model, num_gpu_blocks=64,
                             max_model_len=512) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
            results.append([o.outputs[0].token_ids for o in outs])
            if spec is not None:
                assert_drafts_accepted(llm)
    assert results[0] == results[1]


def test_suffix_drafts_an_earlier_answer(gguf_model, reference):
    """method "suffix": a question asked again gets the earlier answer as its draft (the
    shared tree), so nearly every draft of the second round is accepted; tokens equal."""
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    with llm_with_drafts(spec, loaded_model=gguf_model, num_gpu_blocks=64,
                         max_model_len=512) as llm:
        first = generate(llm)
        before = llm.get_stats()
        again = generate(llm)
        after = llm.get_stats()
        assert_same(first, reference)
        assert_same(again, reference)
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = (after.spec_decode_num_accepted_tokens
                    - before.spec_decode_num_accepted_tokens)
        # Each repeated answer is drafted from its first decode step (MAX_TOKENS - 1 tokens
        # after the first); only the plain prompts' first rounds drafted without it.
        assert accepted >= 0.9 * drafted and accepted >= len(PROMPTS) * (MAX_TOKENS // 2)
        assert_drafts_accepted(llm)


def test_suffix_drafts_never_cross_cache_salts(gguf_model, reference):
    """The shared tree is keyed by cache_salt (and adapter), as the prefix cache is: another
    tenant's round of the same questions is drafted from its own text only, as a first round
    is (its stream's pace tells nothing of them), while the first tenant's second round drafts
    its answers. (The counts of drafted tokens may differ between the first two rounds: the
    drafter's acceptance prior is the workload's, learnt in the first.)"""
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    rounds = []
    with llm_with_drafts(spec, loaded_model=gguf_model, num_gpu_blocks=64,
                         max_model_len=512) as llm:
        for salt in ("tenant-a", "tenant-b", "tenant-a"):
            before = llm.get_stats()
            outs = llm.generate([{"prompt": p, "cache_salt": salt} for p in PROMPTS], GREEDY,
                                use_tqdm=False)
            assert_same([(c.token_ids, c.logprobs) for o in outs for c in o.outputs], reference)
            after = llm.get_stats()
            rounds.append((
                after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
                after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens,
            ))
    first, other_tenant, again = rounds
    assert again[1] >= len(PROMPTS) * (MAX_TOKENS // 2) > max(first[1], other_tenant[1])


SEEDED = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=MAX_TOKENS, seed=seed, logprobs=1)
          for seed in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def seeded_reference(gguf_model):
    return without_drafts(gguf_model, SEEDED)


@pytest.mark.parametrize(
    "spec, options",
    [
        ({**NGRAM, "num_speculative_tokens": 4}, {}),
        ({**NGRAM, "num_speculative_tokens": 3}, {"async_scheduling": True, "max_num_seqs": 3}),
        ({**NGRAM, "num_speculative_tokens": 2},
         {"async_scheduling": True, "num_gpu_blocks": 8, "max_model_len": 128}),
        ({"method": "suffix", "num_speculative_tokens": 4}, {}),
    ],
    ids=["ngram", "ngram-async-batch3", "ngram-async-preempt", "suffix"],
)
def test_seeded_sampling_does_not_depend_on_drafts(gguf_model, seeded_reference, spec,
                                                   options):
    """A seeded request samples its i-th output token with the generator's i-th draw,
    whatever was drafted: with drafts, its tokens (and logprobs) equal those without, and
    every run gives them again; with suffix drafts also once the index holds the earlier
    answers (other drafts, same tokens)."""
    ref = seeded_reference
    options = {"num_gpu_blocks": 64, "max_model_len": 512, **options}
    with llm_with_drafts(spec, loaded_model=gguf_model, **options) as llm:
        first = generate(llm, SEEDED)
        again = generate(llm, SEEDED)
        stats = llm.get_stats()
        assert_drafts_accepted(llm)
        # Drafts were rejected too, so the generator had rows to give back.
        assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
        if options["num_gpu_blocks"] < 64:
            assert stats.num_preemptions > 0
    assert_same(first, ref)
    assert_same(again, ref)


def stop_strings(tokenizer, reference) -> list[list[str]]:
    """Per prompt, a stop string met within MAX_TOKENS (from this machine's reference output,
    whose tokens depend on the kernels the CPU runs): the text of 2 or 3 of its tokens from a
    position late enough that drafts were accepted before it (the repetitive prompts' answers
    are drafted from their own words) and that differs between prompts, moved back where the
    text would be blank or a split character; each beside one that is never met."""
    stops = []
    for i, (tokens, _) in enumerate(reference):
        span = 2 + i % 2
        # Without special tokens: an output that ends at EOS holds its id, whose text no
        # output's text holds.
        texts = (tokenizer.decode(tokens[start:start + span], skip_special_tokens=True)
                 for start in range(min(8 + 2 * i, len(tokens) - span), -1, -1))
        text = next((t for t in texts if t.strip() and "\ufffd" not in t), None)
        assert text is not None, f"prompt {i}: no stop string in its output {tokens}"
        stops.append([text, "never met"])
    return stops


@pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
def test_stop_strings_with_drafts_cut_tokens_and_logprobs(gguf_model, reference, include):
    """A stop string met inside a verified step ends the output at the token that completes
    it: token ids, logprobs, text and finish reason equal those without drafts."""
    stops = stop_strings(gguf_model.tokenizer, reference)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, stop=stop,
                             include_stop_str_in_output=include) for stop in stops]
    results = []
    for spec in (None, {**NGRAM, "num_speculative_tokens": 4}):
        with llm_with_drafts(spec, loaded_model=gguf_model, num_gpu_blocks=64,
                             max_model_len=512) as llm:
            outs = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            results.append(outs)
            if spec is not None:
                assert_drafts_accepted(llm)
    ref, got = results
    assert all(c.stop_reason == stop[0] for c, stop in zip(ref, stops, strict=True))
    assert_same([(c.token_ids, c.logprobs) for c in got], [(c.token_ids, c.logprobs) for c in ref])
    assert [(c.text, c.finish_reason, c.stop_reason) for c in got] == [
        (c.text, c.finish_reason, c.stop_reason) for c in ref
    ]
    assert [c.cumulative_logprob for c in got] == pytest.approx(
        [c.cumulative_logprob for c in ref], abs=1e-3
    )
