"""Declared prefixes (`--preload-prompts FILE`, `LLM(preload_prompts=[...])`): system prompts
known in advance, computed when the engine core starts and pinned in its prefix cache.

Each prompt is one of:
- a string: tokenized as a completion prompt is (special tokens added, as the processor's
  `encode`), so it is the prefix of completion prompts that start with it;
- a list of chat messages (`{"role": ..., "content": ...}`): rendered by the model's chat
  template without a generation prompt and tokenized as a conversation is, so a system
  message declared alone is the prefix of every conversation that starts with it;
- a list of token ids, as is.

The file is a JSON list of such prompts. Only full blocks are pinned (a partial last block
is never cached); `EngineCore.preload` computes the prompts one at a time, pinning each
before the next, so a later one never evicts an earlier one.
"""

import json
from pathlib import Path
from typing import Any


def load_preload_prompts(spec: str | list[Any]) -> list[Any]:
    """The prompts of `preload_prompts`: a list, or the path of a JSON file holding one."""
    if isinstance(spec, str):
        try:
            spec = json.loads(Path(spec).expanduser().read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"preload_prompts: cannot read {spec}: {e}") from e
    if not isinstance(spec, list):
        raise ValueError(f"preload_prompts must be a list of prompts, got {type(spec).__name__}")
    return spec


def preload_token_ids(spec: str | list[Any], tokenizer: Any) -> list[list[int]]:
    """Each declared prompt's token ids (see the module docstring for the forms)."""
    prompts = []
    for i, prompt in enumerate(load_preload_prompts(spec)):
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            prompts.append(list(prompt))
            continue
        if tokenizer is None:
            raise ValueError("preload_prompts: without a tokenizer, give token ids")
        if isinstance(prompt, str):
            prompts.append(tokenizer.encode(prompt, add_special_tokens=True))
        elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
            text = tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=False
            )
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            raise ValueError(
                f"preload_prompts[{i}] must be a string, a list of chat messages or a list "
                f"of token ids, got {prompt!r:.80}"
            )
    return prompts
