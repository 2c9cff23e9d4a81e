"""The logits processors (penalties, logit_bias, allowed_token_ids, bad_words) against plain
per-row references on random logits, with the counts kept by the persistent batch."""

import dataclasses
import random

import numpy as np
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from v1.sampling_params import SamplingParams
from v1.worker.input_batch import InputBatch
from v1.worker.sampler import BadWords, Sampler, SamplingMetadata, TokenCounts, apply_penalties

# Small, so that tokens repeat, prompt and output share ids, and penalised ids are often the
# most likely ones.
VOCAB = 40


def random_logits(num_reqs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_reqs, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def batch_with(histories: list[tuple[list[int], list[int]]], params: list[SamplingParams]):
    """An InputBatch holding one request per (prompt, output) history, with holes condensed
    away so that rows move, and the TokenCounts of its rows in request order."""
    batch = InputBatch(
        max_num_reqs=2 * len(params), max_model_len=64, block_size=4, vocab_size=VOCAB
    )
    for i, ((prompt, output), p) in enumerate(zip(histories, params, strict=True)):
        batch.add_request(f"filler{i}", [1], 1, 0, [], p, None)
        batch.add_request(f"r{i}", prompt + output, len(prompt), 0, [], p, None)
        batch.remove_request(f"filler{i}")
    batch.condense()
    assert batch.prompt_token_mask is not None and batch.output_token_counts is not None
    rows = torch.tensor([batch.req_id_to_index[f"r{i}"] for i in range(len(params))])
    return batch, TokenCounts(batch.prompt_token_mask, batch.output_token_counts, rows)


def reference_penalties(
    logits: torch.Tensor, histories: list[tuple[list[int], list[int]]], params: list[SamplingParams]
) -> torch.Tensor:
    out = logits.clone()
    for row, ((prompt, output), p) in enumerate(zip(histories, params, strict=True)):
        for token in set(prompt) | set(output):
            x = out[row, token].item()
            out[row, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(output):
            out[row, token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


def penalised(num_reqs: int, rng: random.Random) -> list[SamplingParams]:
    return [
        SamplingParams(
            temperature=0.0,
            presence_penalty=rng.uniform(-2, 2),
            frequency_penalty=rng.uniform(-2, 2),
            repetition_penalty=rng.uniform(0.5, 2.0),
        )
        for _ in range(num_reqs)
    ]


def test_penalties_match_reference_with_incremental_counts() -> None:
    rng = random.Random(0)
    params = penalised(6, rng)
    params[2] = SamplingParams(temperature=0.0, repetition_penalty=1.3)  # prompt only counts
    histories = [(random_tokens(rng, 10), random_tokens(rng, rng.randrange(0, 8))) for _ in params]
    batch, counts = batch_with(histories, params)
    md = SamplingMetadata.from_params(params, token_counts=counts)
    for step in range(4):
        logits = random_logits(len(params), seed=step)
        expected = reference_penalties(logits, histories, params)
        assert not torch.equal(expected.argmax(dim=-1), logits.argmax(dim=-1))
        out = Sampler()(logits, md)
        assert torch.equal(out.sampled_token_ids, expected.argmax(dim=-1))
        # What the runner does after each step: count the sampled tokens, in place.
        batch.count_sampled(counts.rows, out.sampled_token_ids)
        for (_, output), token in zip(histories, out.sampled_token_ids.tolist(), strict=True):
            output.append(token)
    assert md.penalties is not None
    logits = random_logits(len(params), seed=99)
    torch.testing.assert_close(
        apply_penalties(logits.clone(), md.penalties),
        reference_penalties(logits, histories, params),
    )


def test_repetition_penalty_matches_transformers() -> None:
    rng = random.Random(1)
    histories = [(random_tokens(rng, 12), random_tokens(rng, 6)) for _ in range(4)]
    logits = random_logits(4)
    for penalty in (0.7, 1.8):
        params = [SamplingParams(temperature=0.0, repetition_penalty=penalty)] * 4
        _, counts = batch_with(histories, params)
        md = SamplingMetadata.from_params(params, token_counts=counts)
        assert md.penalties is not None
        ours = apply_penalties(logits.clone(), md.penalties)
        hf = RepetitionPenaltyLogitsProcessor(penalty)
        theirs = torch.cat(
            [
                hf(torch.tensor([p + o]), logits[i : i + 1].clone())
                for i, (p, o) in enumerate(histories)
            ]
        )
        torch.testing.assert_close(ours, theirs)


def test_resumed_request_recounts_its_outputs() -> None:
    """A request re-added with all its tokens (preemption, resume) gets the same counts as
    one whose outputs were counted step by step."""
    params = SamplingParams(frequency_penalty=1.0)
    prompt, output = [5, 6, 7], [7, 8, 8]
    batch = InputBatch(max_num_reqs=2, max_model_len=16, block_size=4, vocab_size=VOCAB)
    batch.add_request("a", prompt, 3, 0, [], params, None)
    batch.count_sampled(torch.tensor([0, 0, 0]), torch.tensor(output))
    batch.add_request("b", prompt + output, 3, 0, [], params, None)
    assert batch.output_token_counts is not None and batch.prompt_token_mask is not None
    assert torch.equal(batch.output_token_counts[0], batch.output_token_counts[1])
    assert torch.equal(batch.prompt_token_mask[0], batch.prompt_token_mask[1])
    assert batch.output_token_counts[1, 8] == 2 and not batch.prompt_token_mask[1, 8]


def test_logit_bias_matches_reference() -> None:
    rng = random.Random(2)
    # Greedy rows: the bias changes their argmax too.
    params = [
        SamplingParams(
            temperature=0.0,
            logit_bias={rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(5)},
        )
        for _ in range(3)
    ] + [SamplingParams(temperature=0.0)]
    # Unbounded below, as vLLM's: -inf bans the row's most likely token.
    logits = random_logits(4)
    top = int(logits[3].argmax())
    params[3] = SamplingParams(temperature=0.0, logit_bias={top: float("-inf")})
    expected = logits.clone()
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            expected[row, token] += bias
    out = Sampler()(logits, SamplingMetadata.from_params(params))
    torch.testing.assert_close(logits, expected)  # in place
    assert torch.equal(out.sampled_token_ids, expected.argmax(dim=-1))
    assert out.sampled_token_ids[3] != top


def test_allowed_token_ids_restrict_sampling() -> None:
    allowed = [[3, 17, 25], [32]]
    params = [
        SamplingParams(allowed_token_ids=allowed[0]),
        SamplingParams(temperature=0.0, allowed_token_ids=allowed[1]),
        SamplingParams(temperature=0.0),
    ]
    md = SamplingMetadata.from_params(params, vocab_size=VOCAB)
    for seed in range(20):
        logits = random_logits(3, seed)
        top = logits.argmax(dim=-1)
        sampled = Sampler()(logits, md).sampled_token_ids.tolist()
        assert sampled[0] in allowed[0] and sampled[1] == 32 and sampled[2] == top[2]


def reference_bans(
    words_by_row: dict[int, list[list[int]]], outputs: list[list[int]]
) -> set[tuple[int, int]]:
    return {
        (row, word[-1])
        for row, words in words_by_row.items()
        for word in words
        if len(outputs[row]) >= len(word) - 1
        and outputs[row][len(outputs[row]) - len(word) + 1 :] == word[:-1]
    }


@pytest.mark.parametrize("seed", range(5))
def test_bad_words_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    num_reqs, width = 6, 3
    # Tokens from a tiny range so that prefixes often match.
    prompts = [rng.integers(0, 3, rng.integers(1, 4)).tolist() for _ in range(num_reqs)]
    outputs = [rng.integers(0, 3, rng.integers(0, 5)).tolist() for _ in range(num_reqs)]
    words = {
        row: [rng.integers(0, 3, rng.integers(1, width + 2)).tolist() for _ in range(3)]
        for row in range(0, num_reqs, 2)
    }
    bad_words = BadWords.from_words(words)
    # Each row's last `width` tokens, right-aligned (what the runner reads from the batch).
    tails = np.full((num_reqs, bad_words.prefixes.shape[1]), -7, dtype=np.int64)
    for row, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        tokens = (p + o)[-tails.shape[1] :] if tails.shape[1] else []
        tails[row, tails.shape[1] - len(tokens) :] = tokens
    num_output = np.array([len(o) for o in outputs])
    rows, ids = bad_words.banned(tails, num_output)
    assert set(zip(rows.tolist(), ids.tolist(), strict=True)) == reference_bans(words, outputs)


def test_bad_word_prefix_must_be_generated() -> None:
    """As vLLM, a prompt that ends with a word's first tokens does not ban its last one."""
    bad_words = BadWords.from_words({0: [[7, 9]]})
    tails = np.array([[7]])  # the last known token: the prompt's, then the output's
    assert bad_words.banned(tails, np.array([0]))[1].tolist() == []
    assert bad_words.banned(tails, np.array([1]))[1].tolist() == [9]


def test_nothing_to_apply_when_unused() -> None:
    """The hot path: a batch without these options builds none of their tensors."""
    md = SamplingMetadata.from_params([SamplingParams(), SamplingParams(temperature=0.0)])
    assert md.penalties is None and md.logit_bias is None
    assert md.allowed_token_ids_mask is None and md.bad_words is None
    batch = InputBatch(max_num_reqs=2, max_model_len=8, block_size=4, vocab_size=VOCAB)
    batch.add_request("a", [1, 2], 2, 0, [], SamplingParams(), None)
    assert batch.output_token_counts is None and batch.prompt_token_mask is None


@pytest.mark.model
@pytest.mark.slow
def test_counts_survive_preemption_and_n(gguf_model) -> None:
    """Penalised greedy outputs are the same whether requests are preempted (and resumed
    from all their tokens) or not, and for each of n choices."""
    from tests.entrypoints.conftest import QUESTIONS, SYSTEM
    from v1 import LLM

    prompts = [f"{SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    penalised = SamplingParams(
        temperature=0.0,
        max_tokens=32,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
    )
    roomy = LLM(loaded_model=gguf_model, num_gpu_blocks=256, max_model_len=384)
    tight = LLM(loaded_model=gguf_model, num_gpu_blocks=24, max_model_len=384)
    try:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, penalised)]
        plain = roomy.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32))
        assert [o.outputs[0].token_ids for o in plain] != expected  # the penalties act
        two = roomy.generate(prompts[:2], dataclasses.replace(penalised, n=2))
        assert [[c.token_ids for c in o.outputs] for o in two] == [[e, e] for e in expected[:2]]
        assert [o.outputs[0].token_ids for o in tight.generate(prompts, penalised)] == expected
        assert tight.get_stats().num_preemptions > 0
    finally:
        roomy.shutdown()
        tight.shutdown()


@pytest.mark.model
def test_multi_token_bad_word(default_model) -> None:
    from v1 import LLM

    llm = LLM(loaded_model=default_model, num_gpu_blocks=64, max_model_len=256)
    try:
        prompt = "The capital of France is"
        params = SamplingParams(temperature=0.0, max_tokens=12)
        plain = llm.generate(prompt, params)[0].outputs[0].text
        assert "The answer" in plain
        banned = SamplingParams(temperature=0.0, max_tokens=12, bad_words=["The answer"])
        text = llm.generate(prompt, banned)[0].outputs[0].text
        # The word is banned where it would complete, its first token is not.
        assert "The answer" not in text and "The" in text, text
    finally:
        llm.shutdown()
