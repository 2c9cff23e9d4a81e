"""Draft verification keeps the target distribution: sampled through the real sampler, the
first output token is distributed as the model's p (not the draft's point mass), a draft is
accepted with probability p(draft), and the token after an accepted draft follows the next
row's distribution. Seeded, with a chi-square bound far in the tail: no flakiness."""

import numpy as np
import pytest
import torch

from v1.sampling_params import SamplingParams
from v1.worker.rejection_sampler import accept_drafts, keep_draws
from v1.worker.sampler import Sampler, SamplingMetadata

VOCAB = 8
TRIALS = 20000
DRAFT = 2
# Chi-square critical value for 7 degrees of freedom at p = 1e-4 (a fixed seed: this only
# guards against a wrong distribution, which lands orders of magnitude above it).
CHI2_CRITICAL = 29.88


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "sampled a token of probability 0"
    return float(((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def target_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    scaled = logits / params.temperature
    if params.top_k > 0:
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(-1).double().numpy()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)],
    ids=["plain", "temperature-top-k"],
)
def test_verified_drafts_keep_the_target_distribution(params):
    row0 = torch.tensor([1.0, 0.5, 0.8, -1.0, 0.2, 0.0, -0.5, 0.3])  # p(DRAFT) about 0.2
    row1 = torch.tensor([0.0, 1.2, -0.3, 0.6, 0.1, -1.0, 0.9, 0.4])
    logits = torch.stack([row0, row1]).repeat(TRIALS, 1)  # rows 2i, 2i+1: trial i
    metadata = SamplingMetadata.from_params([params] * (2 * TRIALS))
    torch.manual_seed(0)
    sampled = Sampler()(logits, metadata).sampled_token_ids.view(TRIALS, 2).tolist()
    outputs = [accept_drafts(pair, [DRAFT]) for pair in sampled]

    p0, p1 = target_probs(row0, params), target_probs(row1, params)
    first = np.bincount([out[0] for out in outputs], minlength=VOCAB)
    assert chi_square(first, p0) < CHI2_CRITICAL
    accepted = [out for out in outputs if len(out) == 2]
    assert all(out[0] == DRAFT for out in accepted)
    rate = len(accepted) / TRIALS
    assert abs(rate - p0[DRAFT]) < 5 * np.sqrt(p0[DRAFT] * (1 - p0[DRAFT]) / TRIALS)
    second = np.bincount([out[1] for out in accepted], minlength=VOCAB)
    assert chi_square(second, p1) < CHI2_CRITICAL


def test_greedy_accepts_exactly_the_argmax_prefix():
    assert accept_drafts([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert accept_drafts([5, 9, 7, 8], [5, 6, 7]) == [5, 9]
    assert accept_drafts([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_drafts([0, 1], [-1]) == [0]  # a placeholder without a draft never matches


def test_seeded_rows_draw_as_one_step_per_token():
    """A seeded request's k + 1 rows sample with its generator's next k + 1 draws, in order,
    and `keep_draws` leaves it where the kept rows do: the next step's rows continue the
    sequence that one row per step draws."""
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(1, 50_000)

    def one_step_per_token(num: int) -> list[int]:
        generator = torch.Generator().manual_seed(7)
        metadata = SamplingMetadata.from_params([params], {0: generator})
        return [int(Sampler()(logits.clone(), metadata).sampled_token_ids) for _ in range(num)]

    generator = torch.Generator().manual_seed(7)
    metadata = SamplingMetadata.from_params([params] * 4, {i: generator for i in range(4)})
    state = generator.get_state()
    rows = Sampler()(logits.repeat(4, 1), metadata).sampled_token_ids.tolist()
    assert rows == one_step_per_token(4)
    keep_draws(generator, state, 2)  # two rows kept: a draft and the token after it
    metadata = SamplingMetadata.from_params([params] * 3, {i: generator for i in range(3)})
    rows = Sampler()(logits.repeat(3, 1), metadata).sampled_token_ids.tolist()
    assert rows == one_step_per_token(5)[2:]
