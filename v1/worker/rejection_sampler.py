"""Verifying draft tokens (speculative decoding) so that the output keeps the target model's
distribution exactly.

A step with drafts d1..dk has k + 1 rows of logits; every row is sampled as usual, giving
s0..sk, and the step outputs

    d1..da, then s_a      where a is the first i with s_i != d_{i+1} (a = k: all accepted)

A draft of -1 (no draft) is never accepted; `keep_draws` rewinds a seeded request's generator
past the rejected rows' draws. Why this is exact rejection sampling, and the seeded replay:
docs/speculative.md.
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
