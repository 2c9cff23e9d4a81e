"""Beam search, as vLLM's `LLM.beam_search`: the `beam_width` most likely sequences per prompt.

Each search step extends every live beam by one token, each beam one request (`max_tokens=1`,
`logprobs=2 * beam_width`), up to `concurrency_limit` prompts at once; the best beam_width
candidates by cumulative logprob go on, end-of-text candidates finish with "stop", and beams
alive after `max_tokens` or at `max_model_len` with "length"; finished sequences are ranked by
`get_beam_search_score`. The rules in full: docs/serving.md, "Beam search".
"""

import math
import sys
from collections.abc import Callable, Collection, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from v1.outputs import Logprob, RequestOutput
from v1.sampling_params import BeamSearchParams, SamplingParams

# One search step: its requests' prompts (dicts), each run with the sampling parameters.
Step = tuple[list[dict[str, Any]], SamplingParams]
# Runs one step's requests to completion; outputs in the order given.
GenerateFn = Callable[[list[dict[str, Any]], SamplingParams], list[RequestOutput]]


@dataclass(slots=True)
class BeamSearchSequence:
    """One sequence of the search, as vLLM's.

    `tokens`: the prompt's and then the generated ones (as vLLM's `LLM`); an end-of-text token
    that finished the sequence only with `include_stop_str_in_output`. `logprobs`: per
    generation step (the finishing end-of-text token's step too) the candidates' logprobs at
    that step. `cum_logprob`: the sum of the generated tokens' logprobs (the end-of-text
    token's included). `text`: set on the returned sequences: `tokens` decoded, the prompt's
    included (as vLLM's `LLM`). `finish_reason`: "stop" when an end-of-text token ended it
    (`stop_reason`: that token's id), "length" when max_tokens or max_model_len did, "abort"
    when the engine aborted the search's step.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """One prompt's result: its best sequences by `get_beam_search_score`, best first, at
    most beam_width of them."""

    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class BeamSearchInstance:
    """One prompt's search: its live beams (at most beam_width, all of one length, best
    first) and its finished sequences."""

    beams: list[BeamSearchSequence]
    cache_salt: str | None = None
    completed: list[BeamSearchSequence] = field(default_factory=list)


def get_beam_search_score(
    tokens: Sequence[int],
    cumulative_logprob: float,
    eos_token_ids: Collection[int],
    length_penalty: float = 1.0,
) -> float:
    """vLLM's rank of a finished sequence: `cumulative_logprob / length ** length_penalty`,
    where the length counts the prompt's tokens (transformers counts the generated ones only)
    but not a final end-of-text token. At length_penalty 0 it is the cumulative logprob."""
    seq_len = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def eos_token_ids(processor: Any) -> list[int]:
    """The tokens that end a beam: a `Processor`'s end-of-text token and its extra stop
    tokens (generation_config.json's)."""
    return [t for t in (processor.eos_token_id, *processor.extra_stop_token_ids) if t is not None]


def beam_search(
    prompts: Sequence[Any], params: BeamSearchParams, *, generate: GenerateFn, **options: Any
) -> list[BeamSearchOutput]:
    """Beam search for each prompt, each step's requests run by `generate`; outputs in the
    order of `prompts` (see the module). `options`: `beam_search_steps`'."""
    search = beam_search_steps(prompts, params, **options)
    try:
        step = next(search)
        while True:
            step = search.send(generate(*step))
    except StopIteration as done:
        return done.value


def beam_search_steps(
    prompts: Sequence[Any],
    params: BeamSearchParams,
    *,
    tokenize: Callable[[Any], list[int]],
    eos_token_ids: Collection[int],
    max_model_len: int,
    decode: Callable[[list[int]], str] | None,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> Generator[Step, list[RequestOutput], list[BeamSearchOutput]]:
    """The search as a generator: it yields each step (its requests' prompts and sampling
    parameters), is sent their outputs in order, and returns the outputs `beam_search`
    does. So its caller decides how a step waits for the engine (the server awaits it,
    holding no thread meanwhile).

    `tokenize` turns one prompt (text, token ids, or a dict with "prompt" or
    "prompt_token_ids", and maybe "cache_salt") into its validated token ids; all prompts are
    tokenized before any step runs, so a bad one raises before the engine does any work.
    `concurrency_limit` bounds how many prompts are searched at once (all of them if None).
    """
    if concurrency_limit is not None and (
        isinstance(concurrency_limit, bool)
        or not isinstance(concurrency_limit, int)
        or concurrency_limit < 1
    ):
        raise ValueError(f"concurrency_limit must be an integer >= 1 or None, "
                         f"got {concurrency_limit!r}")
    # A score divides by a length (1 to max_model_len + 1 tokens) to the power length_penalty:
    # that power must be a finite, nonzero float for every length.
    bound = math.floor(math.log(sys.float_info.max) / math.log(max_model_len + 1))
    if abs(params.length_penalty) > bound:
        raise ValueError(
            f"length_penalty is {params.length_penalty}: a sequence's length (up to "
            f"max_model_len + 1 = {max_model_len + 1} tokens) to that power is out of a "
            f"float's range; use |length_penalty| <= {bound}"
        )
    instances = [
        BeamSearchInstance(
            [BeamSearchSequence(tokenize(prompt), [])],
            prompt.get("cache_salt") if isinstance(prompt, Mapping) else None,
        )
        for prompt in prompts
    ]
    eos = frozenset(() if params.ignore_eos else eos_token_ids)
    step_params = SamplingParams(
        temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width
    )
    group = concurrency_limit or max(len(instances), 1)
    groups = [instances[i : i + group] for i in range(0, len(instances), group)]
    with tqdm(total=len(groups) * params.max_tokens, desc="Beam search steps",
              disable=not use_tqdm) as bar:
        for batch in groups:
            for _ in range(params.max_tokens):
                live = [(inst, beam) for inst in batch for beam in inst.beams]
                if not live:
                    break
                outputs = yield [_beam_prompt(b, i.cache_salt) for i, b in live], step_params
                # `live` lists each instance's beams together: consume the outputs in turn.
                results = iter(outputs)
                for inst in batch:
                    _step(inst, [next(results) for _ in inst.beams], params, eos, max_model_len)
                bar.update(1)
            for inst in batch:  # what is still live ran out of max_tokens
                for beam in inst.beams:
                    beam.finish_reason = "length"
                inst.completed += inst.beams
                inst.beams = []

    def score(seq: BeamSearchSequence) -> float:
        # As vLLM's, whose tokens always end with the end-of-text token that finished them:
        # its length is then that of the rest (the prompt's own tokens all counted, an
        # end-of-text one too), never 0.
        tokens = seq.tokens
        if isinstance(seq.stop_reason, int) and not params.include_stop_str_in_output:
            tokens = [*tokens, seq.stop_reason]
        return get_beam_search_score(tokens, seq.cum_logprob, eos, params.length_penalty)

    searched = []
    for inst in instances:
        best = sorted(inst.completed, key=score, reverse=True)[: params.beam_width]
        for seq in best:
            seq.text = None if decode is None else decode(seq.tokens)
        searched.append(BeamSearchOutput(best))
    return searched


def _beam_prompt(beam: BeamSearchSequence, cache_salt: str | None) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": beam.tokens}
    if cache_salt is not None:  # the salt keys the cached blocks: the beams must carry it
        prompt["cache_salt"] = cache_salt
    return prompt


def _step(
    inst: BeamSearchInstance,
    outputs: list[RequestOutput],
    params: BeamSearchParams,
    eos: frozenset[int],
    max_model_len: int,
) -> None:
    """Extends `inst`'s beams by their step's outputs (one per beam, in order). A step the
    engine aborted (a pause in "abort" mode) ends the search: its beams finish as they were,
    with "abort", as an aborted request does (dropping the aborted beams would answer with
    another search's sequences, or none)."""
    if any(out.outputs[0].finish_reason == "abort" for out in outputs):
        for beam in inst.beams:
            beam.finish_reason = "abort"
        inst.completed += inst.beams
        inst.beams = []
        return
    candidates: list[BeamSearchSequence] = []
    for beam, out in zip(inst.beams, outputs, strict=True):
        completion = out.outputs[0]
        assert completion.logprobs  # asked for, and the step was not aborted
        step_logprobs = completion.logprobs[0]
        for token_id, logprob in step_logprobs.items():
            cum = beam.cum_logprob + logprob.logprob
            if token_id in eos:
                kept = [token_id] if params.include_stop_str_in_output else []
                inst.completed.append(BeamSearchSequence(
                    beam.tokens + kept, beam.logprobs + [step_logprobs], cum,
                    finish_reason="stop", stop_reason=token_id,
                ))
            else:
                candidates.append(BeamSearchSequence(
                    beam.tokens + [token_id], beam.logprobs + [step_logprobs], cum
                ))
    candidates.sort(key=lambda seq: seq.cum_logprob, reverse=True)
    inst.beams = candidates[: params.beam_width]
    if inst.beams and len(inst.beams[0].tokens) >= max_model_len:
        # No room for another token (a step's prompt may not be longer than max_model_len,
        # and `generate` stops a sequence there too).
        for beam in inst.beams:
            beam.finish_reason = "length"
        inst.completed += inst.beams
        inst.beams = []
