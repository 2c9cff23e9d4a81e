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
"""


def accept_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The step's output tokens: `sampled` (k + 1 tokens, one per row) checked against the k
    `drafts`: the accepted drafts, then the first sample that disagrees or the bonus one."""
    for i, draft in enumerate(drafts):
        if sampled[i] != draft:
            return sampled[: i + 1]
    return sampled[: len(drafts) + 1]
