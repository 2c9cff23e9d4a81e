"""vLLM's engine options that mean nothing in this engine: the one table of them.

Scripts written for vLLM pass them (`LLM(enforce_eager=True, trust_remote_code=True)`,
`serve --enforce-eager`), so `EngineArgs` has each as a field, under vLLM's name and default,
and accepts it as vLLM's CPU backend does: a value other than the default is logged once, with
the reason it changes nothing here. A value that would change the results, which this engine
cannot honour (`tensor_parallel_size=2`), is a ValueError naming the option and what it
accepts. Options this engine does implement are ordinary `EngineArgs` fields, not listed here.
"""

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("v1")


@dataclass(frozen=True, slots=True)
class IgnoredOption:
    """Why the option changes nothing here; `only`: the values accepted (None: any), and
    `refused`: why others are not; `same_as`: another option whose value is accepted too."""

    why: str
    only: tuple[Any, ...] | None = None
    refused: str = ""
    same_as: str | None = None


_NO_DOWNLOADS = (
    "nothing is downloaded: a model is a local path or a hub id already in the local Hugging "
    "Face cache"
)
_ONE_DEVICE = "an engine core runs its model on one device"
_NO_REQUEST_LOG = (
    "no request's prompt or parameters are logged (the server's access log, one line per "
    "HTTP request, follows --uvicorn-log-level)"
)

IGNORED_OPTIONS: dict[str, IgnoredOption] = {
    "enforce_eager": IgnoredOption(
        "no CUDA graphs are captured: every step runs eagerly already"
    ),
    "trust_remote_code": IgnoredOption(
        "no model repository's code is ever run: every architecture loaded is this engine's "
        "own (v1/models)"
    ),
    "tensor_parallel_size": IgnoredOption(
        _ONE_DEVICE, only=(1,), refused="for more engine cores, use data_parallel_size"
    ),
    "pipeline_parallel_size": IgnoredOption(
        _ONE_DEVICE, only=(1,), refused="for more engine cores, use data_parallel_size"
    ),
    "swap_space": IgnoredOption(
        "a preempted request is recomputed (as in vLLM V1): no KV cache is swapped to CPU "
        "memory"
    ),
    "compilation_config": IgnoredOption(
        "the model is not compiled with torch.compile (the kernels are built with the "
        "package): compilation would change speed, not results"
    ),
    "hf_token": IgnoredOption(_NO_DOWNLOADS),
    "download_dir": IgnoredOption(_NO_DOWNLOADS),
    "tokenizer": IgnoredOption(
        "the tokenizer is always the model's own (its directory's or its GGUF file's)",
        only=(None,), same_as="model",
        refused="a tokenizer other than the model's is not supported",
    ),
    "enable_expert_parallel": IgnoredOption("no mixture-of-experts model runs here"),
    "tokenizer_mode": IgnoredOption(
        "the tokenizer is the model's fast (Rust) tokenizer, vLLM's 'auto'", only=("auto",),
        refused="no slow or model-specific tokenizer is loaded",
    ),
    "distributed_executor_backend": IgnoredOption(
        _ONE_DEVICE + ", in its own process: there is no executor to choose (engine cores "
        "are placed by data_parallel_backend)"
    ),
    "disable_custom_all_reduce": IgnoredOption(
        _ONE_DEVICE + ": there is no all-reduce"
    ),
    "max_seq_len_to_capture": IgnoredOption("no CUDA graphs are captured"),
    "task": IgnoredOption(
        "vLLM's older name for what `runner` says", only=("auto", "generate"),
        refused="embedding, scoring and classification take runner='pooling'",
    ),
    "load_format": IgnoredOption(
        "the weights are read from the model's own files (safetensors or GGUF)",
        only=("auto", "safetensors", "gguf"),
        refused="other formats (and 'dummy' random weights) are not loaded",
    ),
    "tokenizer_revision": IgnoredOption(
        "the tokenizer is always the model's own, at the model's revision", only=(None,),
        same_as="revision", refused="a tokenizer revision other than the model's is not supported",
    ),
    "logprobs_mode": IgnoredOption(
        "logprobs are the model's raw ones, before any sampling parameter changes them "
        "(vLLM's default)", only=("raw_logprobs",),
        refused="processed logprobs and logits are not returned",
    ),
    "skip_tokenizer_init": IgnoredOption(
        "the tokenizer is loaded when a request needs it (text in or out, a grammar)",
        only=(False,), refused="outputs always have their text",
    ),
    # vLLM's serve flag and its older, still common, opposite.
    "enable_log_requests": IgnoredOption(_NO_REQUEST_LOG),
    "disable_log_requests": IgnoredOption(_NO_REQUEST_LOG),
}


def ignored_help(name: str) -> str:
    """The command-line help of an ignored option."""
    option = IGNORED_OPTIONS[name]
    accepted = "" if option.only is None else (
        f" (accepted: {', '.join(map(str, option.only))}"
        + (f" or the {option.same_as}" if option.same_as else "") + ")"
    )
    return f"accepted as in vLLM, and ignored: {option.why}{accepted}"


def check_ignored_option(name: str, value: Any, default: Any, options: Any) -> None:
    """Log that `value` (other than the default) is ignored, or raise ValueError if it is not
    one of the accepted values. `options`: the EngineArgs, for `same_as`."""
    if value == default:
        return
    option = IGNORED_OPTIONS[name]
    same = option.same_as is not None and value == getattr(options, option.same_as)
    if option.only is not None and value not in option.only and not same:
        accepted = ", ".join(map(repr, option.only))
        if option.same_as:
            accepted += f" or the {option.same_as} itself"
        raise ValueError(
            f"{name}={value!r} is not supported: {option.why}; {option.refused} "
            f"(accepted: {accepted})"
        )
    # The value is not logged: hf_token's is a secret.
    logger.info("%s is accepted and ignored: %s", name, option.why)
