"""Declared prefixes (`--preload-prompts FILE`, `LLM(preload_prompts=[...])`): system prompts
known in advance, computed when the engine core starts and pinned in its prefix cache.

Each prompt is one of:
- a string: tokenized as a completion prompt is (special tokens added, as the processor's
  `encode`), so it is the prefix of completion prompts that start with it;
- a list of chat messages (`{"role": ..., "content": ...}`): rendered by the model's chat
  template without a generation prompt and tokenized as a conversation is, so a system
  message declared alone is the prefix of every conversation that starts with it;
- a list of token ids, as is (each checked against the vocabulary, as the processor does).

The file is a JSON list of such prompts, read when the engine arguments are made
(`v1.config.load_preload_prompts`), before the model loads. Only full blocks are pinned (a
partial last block is never cached); `EngineCore.preload` computes the prompts one at a
time, pinning each before the next, so a later one never evicts an earlier one.
"""

from typing import Any

from v1.engine.processor import check_token_ids


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
            text = tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=False
            )
            token_ids.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            raise ValueError(
                f"preload_prompts[{i}] must be a string, a list of chat messages or a list "
                f"of token ids, got {prompt!r:.80}"
            )
    return token_ids
