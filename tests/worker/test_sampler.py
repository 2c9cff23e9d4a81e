"""Sampler: greedy exactness, filters, seeded reproducibility and logprobs."""

import pytest
import torch

from v1.sample.logits_processor import (
    BatchLogits,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessors,
    load_logits_processors,
)
from v1.sampling_params import SamplingParams
from v1.worker.sampler import Sampler, SamplingMetadata, argmax

VOCAB = 1000


def make_logits(num_reqs: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_reqs, VOCAB, generator=gen) * scale


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: dict[int, torch.Generator] | None = None,
):
    return Sampler()(logits, SamplingMetadata.from_params(params, generators))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax() -> None:
    logits = make_logits(8)
    out = sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs_tensors is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_argmax_is_torchs(dtype, monkeypatch) -> None:
    """Ties go to the first index, a NaN counts as greatest, an all -inf row gives 0: as
    torch's argmax, computed by numpy where it can read the dtype (not bfloat16)."""
    nan, inf = float("nan"), float("inf")
    logits = make_logits(6).to(dtype)
    logits[0, 3] = logits[0, 7] = 100.0
    logits[1, 5] = logits[1, 9] = nan
    logits[2] = -inf
    logits[3, 2] = logits[3, 4] = inf
    want = logits.argmax(dim=-1)
    assert want[:4].tolist() == [3, 5, 0, 2]
    if dtype is not torch.bfloat16:  # numpy reads these: torch's argmax is not called
        monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("torch's"))
    got = argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got, want)


def test_metadata_skips_unused_filters() -> None:
    md = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1), SamplingParams()]
    )
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert not md.all_greedy and not md.all_random
    assert md.temperature is not None and md.temperature.tolist() == [0.0, 1.0]
    md = SamplingMetadata.from_params([SamplingParams(temperature=0.0, logprobs=3)] * 2)
    assert md.all_greedy and md.temperature is None and md.max_num_logprobs == 3


def test_top_k_one_is_greedy() -> None:
    logits = make_logits(16)
    out = sample(logits, [SamplingParams(temperature=1.5, top_k=1)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_keeps_only_the_max() -> None:
    logits = make_logits(16, scale=0.5)  # a flat distribution: the nucleus is large
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_p_stays_in_the_nucleus() -> None:
    # Flat logits (scale 0.1): the 0.9 nucleus is much wider than the top-p candidate set,
    # which exercises the full-sort fallback too.
    for scale in (0.1, 3.0):
        logits = make_logits(4, seed=1, scale=scale)
        probs = logits.softmax(dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        num_kept = ((sorted_probs.cumsum(-1) - sorted_probs) < 0.9).sum(-1)
        for _ in range(20):
            out = sample(logits, [SamplingParams(top_p=0.9)] * 4)
            for row in range(4):
                nucleus = set(order[row, : num_kept[row]].tolist())
                assert out.sampled_token_ids[row].item() in nucleus


def test_top_k_stays_in_the_top_k() -> None:
    logits = make_logits(2)
    top5 = logits.topk(5, dim=-1).indices
    params = [SamplingParams(top_k=5), SamplingParams()]  # row 1: top-k disabled
    seen = set()
    for _ in range(50):
        out = sample(logits, params)
        assert out.sampled_token_ids[0].item() in set(top5[0].tolist())
        seen.add(out.sampled_token_ids[1].item())
    assert len(seen) > 5


def test_min_p_filters_unlikely_tokens() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, :4] = torch.tensor([5.0, 4.5, 4.0, 1.0])  # p / p_max: 1, 0.61, 0.37, 0.018
    seen = set()
    for _ in range(200):
        seen.add(sample(logits, [SamplingParams(min_p=0.3)]).sampled_token_ids.item())
    assert seen == {0, 1, 2}


def test_seeded_rows_reproduce_independent_of_batch() -> None:
    logits = make_logits(6)
    params = [SamplingParams(seed=7)] + [SamplingParams(temperature=0.0)] + [SamplingParams()] * 4

    def run(rows: list[int]) -> list[int]:
        # The batch holds the requests `rows` in that order; request 0 is the seeded one.
        gen = seeded(7)
        tokens = []
        for _ in range(10):
            batch_logits = logits[rows]
            batch_params = [params[r] for r in rows]
            out = sample(batch_logits, batch_params, {rows.index(0): gen})
            tokens.append(out.sampled_token_ids[rows.index(0)].item())
        return tokens

    alone = run([0])
    assert run([0]) == alone
    assert run([2, 3, 0, 1]) == alone
    assert run([5, 1, 4, 0]) == alone
    assert len(set(alone)) > 1  # a seeded row still samples, it does not collapse


def test_unseeded_random_rows_vary() -> None:
    logits = make_logits(1, scale=0.5)
    tokens = {sample(logits, [SamplingParams()]).sampled_token_ids.item() for _ in range(20)}
    assert len(tokens) > 10


def test_sampling_follows_the_distribution() -> None:
    logits = torch.full((4000, 4), 0.0)
    logits[:, :3] = torch.tensor([1.0, 0.0, -1.0])
    logits[:, 3] = float("-inf")
    out = sample(logits, [SamplingParams(temperature=0.5)] * 4000)
    counts = torch.bincount(out.sampled_token_ids, minlength=4).float() / 4000
    expected = (logits[0] / 0.5).softmax(-1)
    assert counts[3] == 0
    assert torch.allclose(counts, expected, atol=0.03)


def test_logprobs_and_rank() -> None:
    logits = make_logits(3)
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, logprobs=4),
        SamplingParams(temperature=1.0),
    ]
    out = sample(logits, params, {1: seeded(3)})
    lt = out.logprobs_tensors
    assert lt is not None
    expected = logits.log_softmax(dim=-1)
    sampled = out.sampled_token_ids
    assert lt.logprob_token_ids.shape == (3, 5) and lt.logprobs.shape == (3, 5)
    assert torch.equal(lt.logprob_token_ids[:, 0], sampled)
    assert torch.equal(lt.logprob_token_ids[:, 1:], expected.topk(4, dim=-1).indices)
    assert torch.allclose(lt.logprobs, expected.gather(-1, lt.logprob_token_ids))
    for row in range(3):
        lp = expected[row, sampled[row]]
        assert lt.sampled_token_ranks[row].item() == int((expected[row] > lp).sum()) + 1
    assert lt.sampled_token_ranks[0].item() == 1  # greedy picks the top token

    per_row = lt.to_token_logprobs([p.logprobs for p in params])
    assert per_row[2] is None
    assert per_row[0] is not None and per_row[1] is not None
    assert len(per_row[0].token_ids) == 3 and len(per_row[1].token_ids) == 5
    assert per_row[0].token_ids[0] == sampled[0].item() == per_row[0].token_ids[1]


def test_min_tokens_mask_comes_after_raw_logprobs() -> None:
    logits = make_logits(3)
    raw = logits.log_softmax(dim=-1)
    top = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0.0, logprobs=1)] * 2 + [SamplingParams(top_k=1)]
    banned = {0: [int(top[0])], 2: [int(top[2])]}
    out = Sampler()(logits.clone(), SamplingMetadata.from_params(params), banned)
    sampled = out.sampled_token_ids
    # Rows 0 (greedy) and 2 (random) cannot sample their masked top token; row 1 is untouched.
    assert sampled[0] != top[0] and sampled[1] == top[1] and sampled[2] != top[2]
    lt = out.logprobs_tensors
    assert lt is not None
    # Logprobs and ranks are those of the raw logits: the masked token is still the top-1.
    assert torch.equal(lt.logprob_token_ids[:, 1], top)
    assert torch.equal(lt.logprobs, raw.gather(-1, lt.logprob_token_ids))
    assert lt.sampled_token_ranks[:2].tolist() == [2, 1]


def test_mixed_greedy_and_random_batch() -> None:
    logits = make_logits(8, scale=0.5)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=50) for i in range(8)]
    greedy = logits.argmax(dim=-1)
    random_differs = False
    for _ in range(5):
        out = sample(logits, params)
        assert torch.equal(out.sampled_token_ids[1::2], greedy[1::2])
        random_differs |= not torch.equal(out.sampled_token_ids[0::2], greedy[0::2])
    assert random_differs


def test_greedy_row_does_not_consume_its_generator() -> None:
    gen = seeded(1)
    state = gen.get_state()
    md = SamplingMetadata.from_params(
        [SamplingParams(temperature=0.0, seed=1), SamplingParams()], {0: gen}
    )
    assert md.generators == {}
    Sampler()(make_logits(2), md)
    assert torch.equal(gen.get_state(), state)


class _BanArgmax(LogitsProcessor):
    """Bans, in batch row `row`, the token with the largest logit (so it changes greedy
    rows: not argmax-invariant), or with `invariant`, records the rows it was handed."""

    def __init__(self, row: int, invariant: bool = False) -> None:
        self.row, self.invariant, self.batches = row, invariant, []

    def is_argmax_invariant(self) -> bool:
        return self.invariant

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.batches.append(logits.clone())
        if not self.invariant:
            logits[self.row, logits[self.row].argmax()] = float("-inf")
        return logits


def test_custom_processors_see_batch_rows() -> None:
    """The sampler holds only the rows that sample; a custom processor indexes the batch:
    logits row i is batch row rows[i]. One that can change the argmax runs for greedy rows
    too; an argmax-invariant one only when some row samples, after the temperature."""
    logits = make_logits(2)
    ban, seen = _BanArgmax(row=2), _BanArgmax(row=0, invariant=True)
    procs = BatchLogits(LogitsProcessors([ban, seen]), torch.tensor([2, 0]), batch_size=3)
    greedy = [SamplingParams(temperature=0.0)] * 2
    out = Sampler()(logits.clone(), SamplingMetadata.from_params(greedy, logitsprocs=procs))
    second = logits[0].topk(2).indices[1]
    assert out.sampled_token_ids.tolist() == [second, logits[1].argmax()]
    assert torch.equal(ban.batches[0][[2, 0]], logits) and not seen.batches
    hot = [SamplingParams(temperature=2.0)] * 2
    Sampler()(logits.clone(), SamplingMetadata.from_params(hot, logitsprocs=procs))
    assert torch.allclose(seen.batches[0][0], logits[1] / 2)


class _Reshaping(_BanArgmax):
    """Returns `shape(logits)` instead of the logits: a processor's bug."""

    def __init__(self, shape) -> None:
        super().__init__(row=0)
        self.shape = shape

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return self.shape(logits)


@pytest.mark.parametrize("shape", [lambda x: x[:, :10], lambda x: x[:1], lambda x: x[0],
                                   lambda x: None])
@pytest.mark.parametrize("rows", [None, torch.tensor([1, 0])])
def test_a_processor_answering_another_shape_is_an_error(shape, rows) -> None:
    """Logits of another shape would be sampled from anyway (broadcast, or over a cut
    vocabulary): every row's tokens wrong without a word. A RuntimeError naming it."""
    procs = BatchLogits(LogitsProcessors([_Reshaping(shape)]), rows, batch_size=2)
    with pytest.raises(RuntimeError, match=r"_Reshaping.apply returned .* same shape"):
        procs.apply(make_logits(2), argmax_invariant=False)


def test_logits_processors_load_by_name_or_class() -> None:
    name = f"{__name__}:_BanArgmax"
    assert load_logits_processors([name, _BanArgmax]) == [_BanArgmax, _BanArgmax]
    for spec, match in [("no_colon", "must be a class or 'module:Class'"),
                        (f"{__name__}:Nothing", "cannot load logits processor"),
                        ("no.such.module:X", "cannot load logits processor"),
                        (f"{__name__}:make_logits", "is not a subclass"), (dict, "not a sub")]:
        with pytest.raises(ValueError, match=match):
            load_logits_processors([spec])
