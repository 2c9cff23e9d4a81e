"""vLLM's `use_beam_search` on /v1/completions: `v1.beam_search` over AsyncLLM.

The search itself is `LLM.beam_search`'s (`v1.beam_search.beam_search_steps`): its work
between steps runs on the input pool, and each step's beams' one-token requests run on the
event loop, batched by the scheduler with every other client's; no thread is held while a
step waits for the engine, so searches do not queue behind each other. A client that leaves
cancels the step in flight (aborting its requests in the engine) and no further step starts.
"""

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

from v1.beam_search import BeamSearchOutput, Step, beam_search_steps, eos_token_ids
from v1.engine.async_llm import AsyncLLM
from v1.engine.processor import PromptType
from v1.entrypoints.openai.protocol import CompletionChoice, CompletionRequest
from v1.lora.request import LoRARequest
from v1.outputs import RequestOutput
from v1.sampling_params import BeamSearchParams, SamplingParams

# What shapes a sampled answer but not the search (its candidates are the raw logprobs'
# top tokens, vLLM's too, and it stops only at end-of-text or max_tokens): given, a 400, not
# an answer that silently disregards it.
_NOT_SEARCHED = (
    "stop", "stop_token_ids", "min_tokens", "bad_words", "allowed_token_ids", "logit_bias",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "vllm_xargs",
)


def beam_search_params(request: CompletionRequest, params: SamplingParams) -> BeamSearchParams:
    """The search a completion request asks for (its n beams, as vLLM), from its sampling
    parameters with the model's defaults applied; ValueError for what the search cannot give
    (a stream, logprobs, an echoed prompt) or would disregard (`_NOT_SEARCHED`, structured
    output)."""
    if request.stream:
        raise ValueError("Streaming is not currently supported with beam search")  # vLLM's
    for name in ("logprobs", "prompt_logprobs", "echo"):
        if getattr(request, name) not in (None, False):
            raise ValueError(f"{name} is not supported with beam search by this server")
    for name in _NOT_SEARCHED:
        value = getattr(request, name)
        if value != type(request).model_fields[name].default and value not in ("", [], {}):
            raise ValueError(f"{name} is not supported with beam search by this server "
                             f"(got {value!r}): leave it out")
    if params.structured_outputs is not None:  # response_format "text" asks for none
        raise ValueError("structured output (response_format or structured_outputs) is not "
                         "supported with beam search by this server")
    assert params.max_tokens is not None  # a completion's max_tokens has a default
    return BeamSearchParams(
        beam_width=params.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
        temperature=params.temperature, length_penalty=request.length_penalty,
        include_stop_str_in_output=params.include_stop_str_in_output,
    )


async def run_beam_search(
    engine: AsyncLLM,
    prompts: Sequence[PromptType],
    params: BeamSearchParams,
    request_id: str,
    request: CompletionRequest,
    lora: LoRARequest | None,
) -> list[BeamSearchOutput]:
    """Each prompt's best sequences (tokens only: no text), in prompt order."""
    params.check_limits(engine.processor.limits)
    processor = engine.processor
    search = beam_search_steps(
        prompts, params, tokenize=processor.prompt_token_ids,
        eos_token_ids=eos_token_ids(processor), max_model_len=processor.max_model_len,
        decode=None,
    )

    def advance(outputs: list[RequestOutput] | None) -> tuple[Step | None, Any]:
        # The search's own work up to its next step, on the input pool (ranking a step's
        # candidates copies every beam's tokens): the next step, or None and the result.
        try:
            return search.send(outputs), None  # type: ignore[arg-type]  # None starts it
        except StopIteration as done:
            return None, done.value

    async def one(prompt: PromptType, step_params: SamplingParams, rid: str) -> RequestOutput:
        last = None
        async for out in engine.generate(prompt, step_params, rid, request.priority,
                                         request.data_parallel_rank, lora):
            last = out
        if last is None:
            raise ValueError(f"beam search step request {rid} was aborted")
        return last

    steps = itertools.count()
    step, result = await engine.run_in_pool(advance, None)
    while step is not None:
        (batch, step_params), n = step, next(steps)
        tasks = [asyncio.ensure_future(one(p, step_params, f"{request_id}-{n}-{i}"))
                 for i, p in enumerate(batch)]
        try:
            outputs = list(await asyncio.gather(*tasks))
        finally:  # one failed, or the client left: the others end too (aborted)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
        step, result = await engine.run_in_pool(advance, outputs)
    return result


def beam_choices(
    outputs: list[BeamSearchOutput],
    prompt_lens: list[int],
    n: int,
    decode: Any,
    skip_special_tokens: bool,
) -> tuple[list[CompletionChoice], int]:
    """The choices (prompt i's sequence j is choice i * n + j, best first) and how many
    tokens they generated. A choice's text is its generated tokens' without a final
    end-of-text token (as vLLM's); its token count has that token when the sequence kept it
    (`include_stop_str_in_output`)."""
    choices = []
    num_generated = 0
    for i, (output, prompt_len) in enumerate(zip(outputs, prompt_lens, strict=True)):
        for j, seq in enumerate(output.sequences):
            generated = seq.tokens[prompt_len:]
            num_generated += len(generated)
            if generated and generated[-1] == seq.stop_reason:
                generated = generated[:-1]
            choices.append(CompletionChoice(
                index=i * n + j, text=decode(generated, skip_special_tokens=skip_special_tokens),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            ))
    return choices, num_generated
