"""Turns one step's logits into sampled tokens (and their logprobs), one row per request.

Greedy rows take the argmax of the raw logits (HF's tokens). Random rows go through the logits
processors (as vLLM: allowed ids, bans, `logit_bias`, the custom processors that can change
the argmax, penalties; each one batched op, skipped when unused), temperature, the custom
argmax-invariant processors, top-k/p, min-p, then inverse-CDF sampling with one uniform per
row from the row's own generator when seeded. Logprobs are `raw_logprobs`: before any
processing.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from v1.outputs import TokenLogprobs
from v1.sample.logits_processor import BatchLogits
from v1.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5  # the same rule as SamplingParams.greedy
# Top-p first looks for the nucleus among this many most likely tokens and sorts the whole
# vocabulary only for rows whose nucleus is larger: a full sort of a 49k vocabulary costs ~5 ms
# a row on CPU, a top-256 ~0.25 ms.
_TOP_P_CANDIDATES = 256


class TokenCounts(NamedTuple):
    """The persistent batch's per-row token counts and which of their rows each sampling row
    reads."""

    prompt_mask: torch.Tensor  # bool [max_num_reqs, vocab]: the token is in the row's prompt
    output_counts: torch.Tensor  # int32 [max_num_reqs, vocab]: times the row has sampled it
    rows: torch.Tensor  # int64 [num_reqs]: sampling row i's row in the two tensors


@dataclass(slots=True)
class Penalties:
    """The penalised rows (only those: each costs full-vocabulary passes) and their values,
    as columns that broadcast over the vocabulary."""

    sample_idx: torch.Tensor  # int64 [num_penalised]: their sampling rows
    presence: torch.Tensor  # fp32 [num_penalised, 1]; 0 disables
    frequency: torch.Tensor  # fp32 [num_penalised, 1]; 0 disables
    repetition: torch.Tensor  # fp32 [num_penalised, 1]; 1 disables
    counts: TokenCounts  # its `rows` are the penalised rows' rows in the count tensors


@dataclass(slots=True)
class BadWords:
    """Every banned word of the batch, one entry a word: its last token is banned when the
    row's output ends with the tokens before it (right-aligned in `prefixes`, -1 pads)."""

    rows: np.ndarray  # int64 [num_words]: the word's sampling row
    prefixes: np.ndarray  # int64 [num_words, longest word - 1]
    prefix_lens: np.ndarray  # int64 [num_words]
    last_tokens: np.ndarray  # int64 [num_words]

    @classmethod
    def from_words(cls, words_by_row: dict[int, list[list[int]]]) -> "BadWords":
        words = [(row, w) for row, ws in words_by_row.items() for w in ws]
        width = max(len(w) for _, w in words) - 1
        prefixes = np.full((len(words), width), -1, dtype=np.int64)
        for i, (_, w) in enumerate(words):
            prefixes[i, width - len(w) + 1 :] = w[:-1]
        return cls(
            np.array([row for row, _ in words], dtype=np.int64),
            prefixes,
            np.array([len(w) - 1 for _, w in words], dtype=np.int64),
            np.array([w[-1] for _, w in words], dtype=np.int64),
        )

    def banned(self, tails: np.ndarray, num_output: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(sampling rows, token ids) that would complete a bad word now, all words at once.

        tails: int64 [num_reqs, prefixes' width], each row's last tokens (anything where the
        row has fewer); num_output: each row's generated-token count: only generated tokens
        may match a prefix, as vLLM.
        """
        match = ((tails[self.rows] == self.prefixes) | (self.prefixes < 0)).all(axis=1)
        match &= num_output[self.rows] >= self.prefix_lens
        return self.rows[match], self.last_tokens[match]


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings of one batch; a tensor is None when no row needs it."""

    temperature: torch.Tensor | None  # fp32 [num_reqs]; 0 for greedy rows; None if all greedy
    top_p: torch.Tensor | None  # fp32 [num_reqs]; 1 disables
    top_k: torch.Tensor | None  # int64 [num_reqs]; 0 disables
    min_p: torch.Tensor | None  # fp32 [num_reqs]; 0 disables
    all_greedy: bool
    all_random: bool
    # Row index -> that request's generator (on the logits' device), for rows with a seed.
    generators: dict[int, torch.Generator]
    max_num_logprobs: int | None  # the most logprobs any row asked for; None: no row did
    # Applied to greedy rows too (they change the argmax), so never neutralised as above.
    allowed_token_ids_mask: torch.Tensor | None  # bool [num_reqs, vocab]; True: not allowed
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, token ids, biases
    penalties: Penalties | None
    bad_words: BadWords | None  # matched by the runner, which has the rows' past tokens
    logitsprocs: BatchLogits | None = None  # the custom processors (vLLM's interface)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        generators: dict[int, torch.Generator] | None = None,
        device: torch.device | str = "cpu",
        vocab_size: int | None = None,
        token_counts: TokenCounts | None = None,
        logitsprocs: BatchLogits | None = None,
    ) -> "SamplingMetadata":
        """Builds the batch's tensors from its rows' params (row i is params[i]).

        vocab_size is needed when a row has `allowed_token_ids`, token_counts when one has
        a penalty; `logitsprocs`: the custom processors, run as they are.
        """
        greedy = [p.greedy for p in params]
        # Greedy rows get neutral values: their filters would never be used, and a batch
        # whose only top-k/top-p/min-p requests are greedy then skips that work entirely.
        random = [p for p, g in zip(params, greedy, strict=True) if not g]
        neutral = SamplingParams(temperature=0.0)
        rows = [neutral if g else p for p, g in zip(params, greedy, strict=True)]
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]

        def tensor(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor([p.temperature for p in rows], torch.float32) if random else None,
            top_p=tensor([p.top_p for p in rows], torch.float32)
            if any(p.top_p < 1.0 for p in random)
            else None,
            top_k=tensor([p.top_k for p in rows], torch.int64)
            if any(p.top_k > 0 for p in random)
            else None,
            min_p=tensor([p.min_p for p in rows], torch.float32)
            if any(p.min_p > 0.0 for p in random)
            else None,
            all_greedy=not random,
            all_random=len(random) == len(params),
            # A greedy row never draws: keeping its generator would only advance it.
            generators={i: g for i, g in (generators or {}).items() if not greedy[i]},
            max_num_logprobs=max(num_logprobs) if num_logprobs else None,
            allowed_token_ids_mask=_allowed_token_ids_mask(params, vocab_size, device),
            logit_bias=_logit_bias(params, device),
            penalties=_penalties(params, token_counts, device),
            bad_words=BadWords.from_words(
                {i: p.bad_words_token_ids for i, p in enumerate(params) if p.bad_words_token_ids}
            )
            if any(p.bad_words_token_ids for p in params)
            else None,
            logitsprocs=logitsprocs,
        )


def _allowed_token_ids_mask(
    params: Sequence[SamplingParams], vocab_size: int | None, device: torch.device | str
) -> torch.Tensor | None:
    restricted = [(i, p.allowed_token_ids) for i, p in enumerate(params) if p.allowed_token_ids]
    if not restricted:
        return None
    assert vocab_size is not None, "allowed_token_ids needs the vocabulary size"
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool)
    mask[[i for i, _ in restricted]] = True
    rows = [i for i, ids in restricted for _ in ids]
    cols = [t for _, ids in restricted for t in ids]
    mask[rows, cols] = False
    return mask.to(device)


def _logit_bias(
    params: Sequence[SamplingParams], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    biased = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
    if not biased:
        return None
    rows, ids, biases = zip(*biased, strict=True)
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(ids, dtype=torch.int64, device=device),
        torch.tensor(biases, dtype=torch.float32, device=device),
    )


def _penalties(
    params: Sequence[SamplingParams], counts: TokenCounts | None, device: torch.device | str
) -> Penalties | None:
    penalised = [p for p in params if p.has_penalties]
    if not penalised:
        return None
    assert counts is not None, "penalties need the batch's token counts"

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(-1)

    idx = torch.tensor(
        [i for i, p in enumerate(params) if p.has_penalties], dtype=torch.int64, device=device
    )
    return Penalties(
        idx,
        column([p.presence_penalty for p in penalised]),
        column([p.frequency_penalty for p in penalised]),
        column([p.repetition_penalty for p in penalised]),
        counts._replace(rows=counts.rows[idx]),
    )


class LogprobsTensors(NamedTuple):
    """Logprobs of the raw model distribution for each row's sampled token and top-k tokens."""

    logprob_token_ids: torch.Tensor  # int64 [num_reqs, k + 1]; the sampled id first
    logprobs: torch.Tensor  # fp32 [num_reqs, k + 1]
    sampled_token_ranks: torch.Tensor  # int64 [num_reqs]; 1 = most likely

    def to_token_logprobs(self, num_logprobs: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """Per row, its sampled token plus its own top-`num_logprobs[i]` (None: not asked)."""
        ids = self.logprob_token_ids.tolist()
        lps = self.logprobs.tolist()
        ranks = self.sampled_token_ranks.tolist()
        return [
            None if k is None else TokenLogprobs(ids[i][: k + 1], lps[i][: k + 1], ranks[i])
            for i, k in enumerate(num_logprobs)
        ]


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # int64 [num_reqs]
    logprobs_tensors: LogprobsTensors | None  # None unless some row asked for logprobs


@dataclass(slots=True)
class StepTokens:
    """A step's new tokens per request index (`sampled`, [] where it did not sample), their
    logprobs (None: none asked for), and the drafts each rejected."""

    sampled: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None
    num_rejected: np.ndarray  # int32

    @classmethod
    def empty(cls, num_reqs: int, logprobs: bool = False) -> "StepTokens":
        return cls([[] for _ in range(num_reqs)], [None] * num_reqs if logprobs else None,
                   np.zeros(num_reqs, dtype=np.int32))


class Sampler:
    """Stateless; `sampler(logits, metadata)` is `sampler.sample(logits, metadata)`."""

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        banned_token_ids: dict[int, list[int]] | None = None,
    ) -> SamplerOutput:
        return self.sample(logits, metadata, banned_token_ids)

    def sample(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        banned_token_ids: dict[int, list[int]] | None = None,
    ) -> SamplerOutput:
        """logits: fp32 [num_reqs, vocab]; the masks and the bias change them in place.
        banned_token_ids: row -> token ids that row may not sample now (`min_tokens`' stop
        tokens, `bad_words`' completions).
        """
        # Raw, so taken before any processing; log_softmax writes a new tensor, which lets the
        # masks go in place (no copy of the logits) whether or not a row asks for logprobs.
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        if metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(metadata.allowed_token_ids_mask, float("-inf"))
        if banned_token_ids:
            _apply_bans(logits, banned_token_ids)
        if metadata.logit_bias is not None:
            rows, ids, biases = metadata.logit_bias
            logits.index_put_((rows, ids), biases, accumulate=True)
        if metadata.logitsprocs is not None:
            logits = metadata.logitsprocs.apply(logits, argmax_invariant=False)
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)

        greedy = None if metadata.all_random else argmax(logits)
        if metadata.all_greedy:
            assert greedy is not None
            sampled = greedy
        else:
            random = _sample_random(logits, metadata)
            if greedy is None:
                sampled = random
            else:
                assert metadata.temperature is not None
                sampled = torch.where(metadata.temperature < _GREEDY_EPS, greedy, random)

        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled, logprobs)


# Logits dtypes that numpy can view in place (not bfloat16).
NUMPY_FLOATS = (torch.float32, torch.float16, torch.float64)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its greatest logit, the first where several are (a NaN counts as
    greatest), int64 on the logits' device: torch's argmax, computed by numpy on the CPU,
    whose reduction over a vocabulary costs a fraction of torch's (docs/benchmarks.md,
    "Sampling")."""
    if logits.device.type == "cpu" and logits.dtype in NUMPY_FLOATS and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _apply_bans(logits: torch.Tensor, banned: dict[int, list[int]]) -> None:
    """Masks each row's banned tokens, all rows in one indexed write."""
    rows = [row for row, ids in banned.items() for _ in ids]
    cols = [t for ids in banned.values() for t in ids]
    logits[rows, cols] = float("-inf")


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """vLLM's penalties, all penalised rows at once: repetition over prompt and output
    tokens, then frequency (times the count) and presence (once) over output tokens. Writes
    the penalised rows of `logits` in place and returns it."""
    prompt_mask, output_counts, rows = penalties.counts
    output_counts = output_counts[rows]
    output_mask = output_counts > 0
    seen = prompt_mask[rows] | output_mask
    repetition = torch.where(seen, penalties.repetition, 1.0)
    penalised = logits[penalties.sample_idx]
    penalised = torch.where(penalised > 0, penalised / repetition, penalised * repetition)
    penalised -= penalties.frequency * output_counts
    penalised -= penalties.presence * output_mask
    logits[penalties.sample_idx] = penalised
    return logits


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """Each row's given token (sampled, or the next prompt token) and top-k tokens from its
    full-vocabulary logprobs."""
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    sampled_col = sampled.unsqueeze(-1)
    sampled_lp = logprobs.gather(-1, sampled_col)
    # The rank counts strictly more likely tokens, so tied tokens share the better rank.
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    return LogprobsTensors(
        torch.cat([sampled_col, top_ids], dim=-1), torch.cat([sampled_lp, top_lps], dim=-1), ranks
    )


def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Samples every row as if random (greedy rows' results are discarded by the caller)."""
    assert metadata.temperature is not None
    temperature = metadata.temperature
    # Greedy rows have temperature 0: divide them by 1 instead so nothing turns into inf/nan.
    temperature = torch.where(temperature < _GREEDY_EPS, torch.ones_like(temperature), temperature)
    logits = logits / temperature.unsqueeze(-1)
    if metadata.logitsprocs is not None:
        logits = metadata.logitsprocs.apply(logits, argmax_invariant=True)
    if metadata.top_k is not None:
        logits = _apply_top_k(logits, metadata.top_k)
    if metadata.top_p is not None:
        logits = _apply_top_p(logits, metadata.top_p)
    if metadata.min_p is not None:
        logits = _apply_min_p(logits, metadata.min_p)
    probs = logits.softmax(dim=-1)

    uniform = torch.rand(logits.shape[0], 1, dtype=torch.float64, device=logits.device)
    for row, generator in metadata.generators.items():
        uniform[row] = draw_uniform(generator, logits.device)
    # fp64 so that late, tiny probabilities still move the running sum (fp32 would drop them).
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    # right=True: the first index whose cdf exceeds the target, so zero-probability tokens
    # (equal cdf to their left neighbour) are never picked.
    sampled = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(-1)
    return sampled.clamp_(max=logits.shape[-1] - 1)


def draw_uniform(generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """A seeded row's uniform number: one draw from its request's generator. The only way a
    seeded row draws, so that replaying n calls leaves a generator exactly where n sampled
    rows leave it (`v1.worker.rejection_sampler.keep_draws`)."""
    return torch.rand(1, dtype=torch.float64, device=device, generator=generator)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keeps each row's k largest logits (and any tied with the k-th); k == 0 keeps all."""
    vocab_size = logits.shape[-1]
    k = top_k.clamp(max=vocab_size)
    max_k = int(k.max())  # rows with top-k disabled have 0 and do not widen the topk
    kth_value = logits.topk(max_k, dim=-1).values.gather(-1, (k - 1).clamp(min=0).unsqueeze(-1))
    kth_value = kth_value.masked_fill((k == 0).unsqueeze(-1), float("-inf"))
    return logits.masked_fill(logits < kth_value, float("-inf"))


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose probability reaches top_p."""
    probs = logits.softmax(dim=-1)
    p = top_p.unsqueeze(-1)
    num_candidates = min(_TOP_P_CANDIDATES, logits.shape[-1])
    sorted_probs = probs.topk(num_candidates, dim=-1).values  # descending
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # exactly 0 at position 0
    # A row's nucleus lies among the candidates when the mass before the last one reaches p.
    if num_candidates < logits.shape[-1] and bool(((mass_before[:, -1:] < p) & (p < 1)).any()):
        sorted_probs = probs.sort(dim=-1, descending=True).values
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    num_kept = (mass_before < p).sum(dim=-1, keepdim=True)  # >= 1: position 0 always stays
    threshold = sorted_probs.gather(-1, num_kept - 1)
    # p == 1 means disabled: rounding in the cumsum must not cut such a row's tail.
    drop = (probs < threshold) & (p < 1)
    return logits.masked_fill(drop, float("-inf"))


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens less likely than min_p times the most likely one.

    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax is needed;
    min_p == 0 gives log(0) = -inf and keeps everything.
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(-1)
    return logits.masked_fill(logits < threshold, float("-inf"))
