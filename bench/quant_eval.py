"""Accuracy of a numerics mode against fp32: perplexity on a fixed text and greedy agreement.

Shared by `bench_quant.py` and tests/worker/test_quant_accuracy.py, so the benchmark's figures
and the test's gates come from the same code.

- A mode is a weight format (`quantization`: None for fp32, "gguf", "int8") and a KV cache
  dtype (`kv_cache_dtype`: None for fp32, "bf16", "fp16"), written "gguf+bf16". An engine
  option the engine does not take yet (or a value it refuses) makes the mode unavailable:
  `ModeUnavailable`, with the engine's reason.
- Perplexity: exp of the mean negative logprob of the text's tokens, each given the tokens
  before it in its window (the engine's `prompt_logprobs`); windows of at most `window`
  tokens, consecutive and not overlapping, so each window's first token is not scored.
  The engine must prefill in chunks of at most `PPL_CHUNK` tokens (`ACCURACY_ENGINE_ARGS`): a
  one-step prefill attends to the step's own fp32 keys and values and never reads the KV
  cache back, so a 16-bit cache would not show in the figure at all.
- Greedy agreement over `GREEDY_TOKENS` tokens of the `PROMPTS` (chat template, greedy,
  EOS ignored so every output has the full length): the share of positions whose token
  equals fp32's at the same position ("positionwise"). `prefix_agreement` is the stricter
  figure: positions equal before each output's first divergence, over all positions.
"""

import math
import resource
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import first_divergence

TEXT_PATH = Path(__file__).resolve().parent / "data" / "perplexity.txt"
GREEDY_TOKENS = 32
PPL_CHUNK = 32
# Engine options for accuracy runs: steps of at most PPL_CHUNK tokens, so that a prefill's
# tokens but its chunk's own are read from the KV cache, as decode reads them (a token budget:
# long_prefill_token_threshold does not chunk a request alone in the engine).
ACCURACY_ENGINE_ARGS = {"max_num_batched_tokens": PPL_CHUNK}
# What the benchmarks run unless told otherwise: fp32, both weight formats, 16-bit KV caches.
DEFAULT_MODES = ("fp32", "gguf", "int8", "fp32+bf16", "gguf+bf16", "gguf+fp16", "int8+bf16",
                 "int8+fp16")
# The gate (for every mode, the default included): every mode within +1% of fp32's
# perplexity. Greedy agreement is stated, not gated: every mode rounds differently somewhere
# (gguf, the default for .gguf files, runs prompt rows through int8 activations), and once a
# near-tie flips one token the rest of that output is another text.
MAX_PPL_RATIO = 1.01

PROMPTS = (
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a lighthouse in winter.",
    "What is the capital of France, and what river runs through it?",
    "Give me three tips for keeping houseplants alive.",
    "How do I reverse a list in Python?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "What is 17 multiplied by 23? Show your working.",
    "Describe the water cycle to a ten-year-old.",
    "Suggest a name for a small bakery by the sea.",
    "What are the main differences between a cat and a dog as pets?",
    "Write the opening line of a mystery novel.",
    "Why do we have leap years?",
)


class ModeUnavailable(Exception):
    """The engine refuses this mode's options (not implemented yet, or not for this model)."""


@dataclass(frozen=True, slots=True)
class Mode:
    quantization: str | None = None  # None: fp32 weights
    kv_cache_dtype: str | None = None  # None: fp32 KV cache

    @classmethod
    def parse(cls, name: str) -> "Mode":
        """A mode's name: fp32, gguf or int8, optionally +bf16 or +fp16 (the KV cache)."""
        weights, _, kv = name.partition("+")
        if weights not in ("fp32", "gguf", "int8") or kv not in ("", "bf16", "fp16"):
            raise ValueError(
                f"mode {name!r}: expected fp32|gguf|int8, optionally +bf16|+fp16"
            )
        return cls(None if weights == "fp32" else weights, kv or None)

    @property
    def name(self) -> str:
        kv = f"+{self.kv_cache_dtype}" if self.kv_cache_dtype else ""
        return f"{self.quantization or 'fp32'}{kv}"

    def engine_kwargs(self) -> dict[str, str]:
        """The weights' option ("none" for fp32: a .gguf file's default is its blocks) and
        the KV cache's when the mode changes it."""
        kwargs = {"quantization": self.quantization or "none"}
        if self.kv_cache_dtype:
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        return kwargs


def make_llm(mode: Mode, model: str | None = None, loaded: Any = None, **kwargs: Any) -> Any:
    """An in-process `LLM` in `mode`: on `loaded` when given (weights loaded as the mode's,
    see `load_weights`), else loading `model` (None: the default model) with the mode's
    `quantization`. Raises `ModeUnavailable` when the engine refuses the mode's options; any
    other error propagates."""
    from v1.entrypoints.llm import LLM

    options = mode.engine_kwargs()
    if loaded is not None:
        if loaded.quantization != mode.quantization:
            raise ValueError(f"{mode.name}: the loaded weights are "
                             f"{loaded.quantization or 'fp32'}")
        options.pop("quantization", None)  # the engine takes loaded weights as they are
        source = {"loaded_model": loaded}
    else:
        source = {"model": model}
    try:
        return LLM(multiprocess=False, **source, **options, **kwargs)
    except ValueError as e:
        if any(key in str(e) for key in options):
            raise ModeUnavailable(f"{mode.name}: {e}") from e
        raise


def load_weights(quantization: str | None, model: str | None = None) -> Any:
    """The model's `LoadedModel` (fp32 compute, CPU) with `quantization`'s weights, to share
    among engines that differ only in their KV cache. ModeUnavailable when refused."""
    from v1.attention.backends.torch_attn import TorchAttentionImpl
    from v1.models.loader import load_model

    try:
        return load_model(model, torch.float32, torch.device("cpu"), TorchAttentionImpl,
                          quantization=quantization)
    except ValueError as e:
        if "quantization" in str(e):
            raise ModeUnavailable(f"quantization={quantization!r}: {e}") from e
        raise


def text_token_ids(tokenizer: Any, max_tokens: int | None = None) -> list[int]:
    ids = tokenizer.encode(TEXT_PATH.read_text(), add_special_tokens=False)
    return ids[:max_tokens] if max_tokens else ids


def perplexity(llm: Any, token_ids: Sequence[int], window: int) -> float:
    if window < 2:
        raise ValueError(f"perplexity window must be >= 2 tokens, got {window}")
    windows = [list(token_ids[i : i + window]) for i in range(0, len(token_ids), window)]
    windows = [w for w in windows if len(w) >= 2]  # a 1-token tail scores nothing
    return windows_perplexity(llm, windows, 1)


def windows_perplexity(llm: Any, windows: Sequence[Sequence[int]], first_scored: int) -> float:
    """exp of the mean negative logprob of each window's tokens from index `first_scored` on,
    each given the tokens before it in its window (the engine's `prompt_logprobs`; every
    window a prompt of its own)."""
    from v1.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": list(w)} for w in windows], params,
                           use_tqdm=False)
    logprobs = [
        entry[token].logprob
        for w, out in zip(windows, outputs)
        for token, entry in zip(w[first_scored:], out.prompt_logprobs[first_scored:])
    ]
    return math.exp(-statistics.fmean(logprobs))


def chat_prompt_ids(tokenizer: Any) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                      add_generation_prompt=True, tokenize=False)
        for p in PROMPTS
    ]
    # The template holds the special tokens: no BOS again (as LLM.chat does).
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def greedy_tokens(llm: Any, prompts: Sequence[Sequence[int]],
                  num_tokens: int = GREEDY_TOKENS) -> list[list[int]]:
    from v1.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def agreement(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Share of positions whose token equals the reference's at the same position."""
    _check_shapes(ours, ref)
    equal = sum(x == y for a, b in zip(ours, ref) for x, y in zip(a, b))
    return equal / sum(len(b) for b in ref)


def prefix_agreement(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> float:
    """Share of positions equal before each output's first divergence (none after it)."""
    _check_shapes(ours, ref)
    return sum(first_divergence(a, b) for a, b in zip(ours, ref)) / sum(len(b) for b in ref)


def _check_shapes(ours: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> None:
    if [len(a) for a in ours] != [len(b) for b in ref]:
        raise ValueError(
            f"outputs of lengths {[len(a) for a in ours]} against {[len(b) for b in ref]}"
        )


def gate_failures(mode: Mode, ppl_ratio: float) -> list[str]:
    """The accuracy gate this mode misses (empty: it passes)."""
    if ppl_ratio > MAX_PPL_RATIO:
        return [f"{mode.name}: perplexity {ppl_ratio:.4f}x fp32's > {MAX_PPL_RATIO}"]
    return []


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the tensors `model`'s modules hold: parameters, buffers (rotary tables too)
    and tensors kept in module attributes or one object down (packed or quantized copies).
    Each tensor counted once."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        key = id(t) if t.is_mkldnn else t.data_ptr()  # oneDNN's opaque tensors have no pointer
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()

    for module in model.modules():
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            add(t)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                add(value)
            for slot in getattr(type(value), "__slots__", ()):
                held = getattr(value, slot, None)
                if isinstance(held, torch.Tensor):
                    add(held)
    return total


def engine_model(llm: Any) -> torch.nn.Module:
    """The model an in-process `LLM` runs."""
    return llm.llm_engine.client.engine_core.model_runner.model


def peak_rss_bytes() -> int:
    """This process's peak resident set (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
