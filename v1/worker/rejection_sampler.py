"""Verifying draft tokens (speculative decoding) so that the output keeps the target model's
distribution exactly.

A request's step computes its last token and drafts d1..dk: k + 1 rows of logits, row i
conditioned on the tokens before it and d1..di. Every row is sampled as usual (same
processors, temperature, top-k/p, min-p, generator), giving s0..sk, and the step outputs

    d1..da, then s_a      where a is the first i with s_i != d_{i+1} (a = k: all accepted)

For point-mass drafts this is exactly rejection sampling, so each token is drawn from the
target distribution; greedy rows accept a draft iff it is the argmax. A draft of -1 (no draft)
is never accepted. A seeded request's rows draw from its generator in row order, and
`keep_draws` rewinds it past the rejected rows' draws, so its draws do not depend on its
drafts. docs/speculative.md has the proof and the seeded-replay reasoning.
"""

import torch

from v1.worker.sampler import draw_uniform


def accept_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The step's output tokens: `sampled` (k + 1 tokens, one per row) checked against the k
    `drafts`: the accepted drafts, then the first sample that disagrees or the bonus one."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[: i + 1]
    return sampled[: len(drafts) + 1]


def keep_draws(generator: torch.Generator, state: torch.Tensor, num_kept: int) -> None:
    """Leaves `generator`, whose state before the step's sampling was `state`, where only
    its first `num_kept` rows' draws leave it (the sampler's own call, replayed)."""
    generator.set_state(state)
    for _ in range(num_kept):
        draw_uniform(generator, generator.device)
