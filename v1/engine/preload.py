"""Declared prefixes (`--preload-prompts FILE`, `LLM(preload_prompts=[...])`): system prompts
computed when the engine core starts and pinned in its prefix cache (docs/prefix-cache.md).

A prompt is a string (a completion prompt), chat messages (the template without a generation
prompt, so a system message prefixes every conversation starting with it) or token ids. The
file is read with the engine arguments; prompts are pinned one at a time, full blocks only.
"""

from typing import Any

from v1.engine.processor import check_token_ids, template_message


def preload_token_ids(
    prompts: list[Any], tokenizer: Any, vocab_size: int
) -> list[list[int]]:
    """Each declared prompt's token ids (see the module docstring for the forms; the file is
    read by `EngineArgs`, see `load_preload_prompts`)."""
    token_ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list) and not all(isinstance(m, dict) for m in prompt):
            try:
                token_ids.append(check_token_ids(prompt, vocab_size))
            except ValueError as e:
                raise ValueError(f"preload_prompts[{i}]: {e}") from e
            continue
        if tokenizer is None:
            raise ValueError("preload_prompts: without a tokenizer, give token ids")
        if isinstance(prompt, str):
            token_ids.append(tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, list):
            try:  # the messages as LLM.chat and the server render them
                text = tokenizer.apply_chat_template(
                    [template_message(m) for m in prompt], tokenize=False,
                    add_generation_prompt=False,
                )
            except Exception as e:  # the template's errors, or the messages' (ValueError)
                raise ValueError(f"preload_prompts[{i}]: {type(e).__name__}: {e}") from e
            token_ids.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            raise ValueError(
                f"preload_prompts[{i}] must be a string, a list of chat messages or a list "
                f"of token ids, got {prompt!r:.80}"
            )
    return token_ids
