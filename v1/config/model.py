"""The model's group: which model, on which device, in which dtype and quantization, what the
engine does with it (generate or pool) and where requests' default sampling parameters come
from. Names only: the worker and model loader turn them into torch devices and dtypes."""

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from v1.config.checks import check_choice

logger = logging.getLogger("v1")

# dtype's accepted spellings (vLLM's: "half", "float") -> the torch dtype's name. A
# torch.dtype is taken too (`LLM(dtype=torch.float16)`), by that name.
DTYPES = {
    "auto": "auto",
    "bfloat16": "bfloat16",
    "float16": "float16", "half": "float16",
    "float32": "float32", "float": "float32",
}

# device's accepted values ("cuda:N" too).
DEVICES = ("auto", "cpu", "cuda")

# quantization's choices (v1.models.loader): "gguf" runs a GGUF file's Q4_1 / Q8_0 blocks as
# stored, "int8" quantizes a float checkpoint's weight matrices to Q8_0 at load.
QUANTIZATION_METHODS = ("gguf", "int8")
# quantization's value for float weights, a GGUF file's too (its dequantized copy).
NO_QUANTIZATION = "none"

# vLLM's `hf_overrides`: keys set on the model's HF config (a nested config, such as a
# `text_config`, is updated key by key from a dict), or a function of the config returning it.
HfOverrides = dict[str, Any] | Callable[[Any], Any]

# runner's choices (vLLM's): "generate" samples tokens; "pooling" returns one vector per
# prompt (embeddings, classification, scores: v1/models/pooler.py); "auto" is "pooling" for
# checkpoints that have no LM head (an encoder, a base `*Model`, a
# `*ForSequenceClassification`), else "generate".
RUNNER_TYPES = ("auto", "generate", "pooling")

# generation_config.json's keys that become default sampling parameters (vLLM's list), and
# the SamplingParams field each sets.
GENERATION_CONFIG_DEFAULTS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def dtype_name(dtype: Any) -> str:
    """The canonical name of a dtype spelling ("half" -> "float16", torch.float32 ->
    "float32"); ValueError for others."""
    spelling = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    name = DTYPES.get(spelling)
    if name is None:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


def check_device(device: Any) -> None:
    if not isinstance(device, str) or (
        device not in DEVICES and not (device.startswith("cuda:") and device[5:].isdigit())
    ):
        raise ValueError(f"device must be one of {', '.join(DEVICES)} or 'cuda:N', got {device!r}")


@dataclass(slots=True)
class PoolerConfig:
    """vLLM's `pooler_config` (`--pooler-config '{"pooling_type": "MEAN"}'`): overrides the
    pooler the model's files give (v1/models/pooler.py); None keeps theirs."""

    pooling_type: str | None = None  # "LAST" | "CLS" | "MEAN"
    normalize: bool | None = None

    @classmethod
    def from_dict(cls, config: "dict[str, Any] | PoolerConfig") -> "PoolerConfig":
        if isinstance(config, PoolerConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"pooler_config must be a dict, got {config!r}")
        unknown = set(config) - {"pooling_type", "normalize"}
        if unknown:
            raise ValueError(
                f"unknown pooler_config keys {sorted(unknown)} (known: normalize, pooling_type)"
            )
        pooling_type = config.get("pooling_type")
        if pooling_type is not None and pooling_type not in ("LAST", "CLS", "MEAN"):
            raise ValueError(
                f"pooler_config pooling_type must be LAST, CLS or MEAN, got {pooling_type!r}"
            )
        normalize = config.get("normalize")
        if normalize is not None and not isinstance(normalize, bool):
            raise ValueError(f"pooler_config normalize must be a bool, got {normalize!r}")
        return cls(pooling_type, normalize)


@dataclass(slots=True)
class ModelConfig:
    """The model and how it runs; `dtype` and `pooler_config` are kept canonical (a dtype's
    name, a PoolerConfig). `generation_config`: "auto" (the model's generation_config.json),
    "vllm" (SamplingParams' own defaults) or a directory holding a generation_config.json,
    which must exist (a user's input, checked before the model loads). `hf_overrides`
    (vLLM's): applied to the HF config before the model is built from it."""

    model: str | None = None
    revision: str | None = None
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    device: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None  # None: chosen by the loader for the model's files
    seed: int = 0
    runner: str = "generate"
    pooler_config: PoolerConfig | dict[str, Any] | None = None  # a dict: made a PoolerConfig
    hf_overrides: HfOverrides | None = None

    def __post_init__(self) -> None:
        check_device(self.device)
        if self.hf_overrides is not None and not (
            isinstance(self.hf_overrides, dict) or callable(self.hf_overrides)
        ):
            raise ValueError(
                f"hf_overrides must be a dict or a function of the HF config, got "
                f"{self.hf_overrides!r}"
            )
        self.dtype = dtype_name(self.dtype)
        check_choice("runner", self.runner, RUNNER_TYPES)
        if self.pooler_config is not None:
            self.pooler_config = PoolerConfig.from_dict(self.pooler_config)
            if self.runner == "generate":
                raise ValueError("pooler_config needs runner='pooling' (or 'auto')")
        if self.quantization not in (None, NO_QUANTIZATION, *QUANTIZATION_METHODS):
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, "
                f"{NO_QUANTIZATION!r} or None, got {self.quantization!r}"
            )
        gen = self.generation_config
        if gen not in ("auto", "vllm") and not Path(gen).expanduser().is_dir():
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a directory holding a "
                f"generation_config.json, got {gen!r}"
            )
        override = self.override_generation_config
        if override is not None and not (
            isinstance(override, dict) and override.keys() <= GENERATION_CONFIG_DEFAULTS.keys()
        ):
            raise ValueError(
                f"override_generation_config must be a dict of "
                f"{', '.join(GENERATION_CONFIG_DEFAULTS)}, got {override!r}"
            )

    def get_diff_sampling_param(self, model_dir: str | os.PathLike[str]) -> dict[str, Any]:
        """vLLM's: the default sampling parameters the model's creator recommends, for
        requests that do not set them: generation_config.json's temperature, top_p, top_k,
        min_p, repetition_penalty and max_new_tokens (as max_tokens), as SamplingParams
        keywords. Read from `model_dir` (the loaded model's HF directory) under "auto", from
        the given directory under a path; nothing under "vllm" or without the file; then
        `override_generation_config`'s keys over them, as vLLM's."""
        config: Any = {}
        if self.generation_config != "vllm":
            folder = model_dir if self.generation_config == "auto" else self.generation_config
            file = Path(folder).expanduser() / "generation_config.json"
            try:
                config = json.loads(file.read_text())
            except FileNotFoundError:
                pass
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read {file}: {e}") from e
        if not isinstance(config, dict):
            config = {}
        config = {**config, **(self.override_generation_config or {})}
        defaults = {
            ours: config[key]
            for key, ours in GENERATION_CONFIG_DEFAULTS.items()
            if config.get(key) is not None
        }
        from v1.sampling_params import SamplingParams  # (it imports this package)

        try:  # now, not as each request's 400, which would blame its client
            SamplingParams(**defaults)
        except ValueError as e:
            raise ValueError(
                f"the default sampling parameters from generation_config={self.generation_config!r}"
                f" and override_generation_config={self.override_generation_config!r} are not "
                f"valid: {e}"
            ) from e
        if defaults:
            logger.info(
                "default sampling parameters (generation_config=%r, override_generation_config"
                "=%r), for requests that do not set them: %s", self.generation_config,
                self.override_generation_config, defaults,
            )
        return defaults
