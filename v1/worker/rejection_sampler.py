"""Verifying draft tokens (speculative decoding) so that the output keeps the target model's
distribution exactly.

A request's step computes its last token and drafts d1..dk: k + 1 rows of logits, row i
conditioned on the tokens before it and d1..di. Every row is sampled as usual (same
processors, temperature, top-k/p, min-p, generator), giving s0..sk, and the step outputs

    d1..da, then s_a      where a is the first i with s_i != d_{i+1} (a = k: all accepted)

Why this is exact. Our drafts are point masses (a proposer names a token, no distribution),
for which rejection sampling (Leviathan et al.) reads: accept d with probability p(d); on a
rejection sample from p with d removed and renormalised; after k acceptances sample from p.
Sampling s ~ p and accepting iff s == d does exactly that: P(accept) = p(d), and given
s != d, s is distributed as p(t) / (1 - p(d)) over t != d. Each output token is therefore
drawn from the target distribution given the tokens before it, as without drafts. Greedy rows
sample the argmax, so a draft is accepted iff it is the argmax: the tokens equal those
without speculation. A draft of -1 (a placeholder the runner had no draft for) is never
accepted.

Seeded requests. A seeded request's rows draw their uniform numbers from its generator one
after another, in row order: row i gets the generator's next draws as output position n + i
would without drafts. Its accepted rows sampled exactly the tokens a step-by-step run
samples (same context, same draw); then `keep_draws` puts the generator back to where the
kept rows leave it, as if the rejected rows had never drawn. So a seeded request's draws do
not depend on its drafts (how many, which, accepted or not), hence neither on the proposer,
on other requests, on batch composition nor on async scheduling; its tokens are equal with
or without speculation as far as its logits are (the same bits where the attention and
matmul kernels give a row the same bits in any step; a cascade over a long shared prefix
does not, see docs/speculative.md). (vLLM draws each request's draft positions from its
generator whatever is accepted, and its recovered and bonus tokens more, so there the
generator's state after a step depends on the drafts.) Replay rather than a generator
seeded per output position from (seed, position): the request keeps its one generator
(output without drafts is unchanged), and only a step that rejects a seeded request's drafts
costs the replay (a few draws).
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
