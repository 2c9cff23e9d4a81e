"""Load a model: its weights into one of our architectures, beside its config and tokenizer
(`v1.models.model_files` finds them).

Sources: an HF model directory (config.json + *.safetensors, sharded or not, any float
dtype), or a GGUF file. A GGUF file's config and tokenizer are converted once into an HF
directory in the cache (`v1.models.gguf_cache`); its weights are read from the file itself,
mapped, in their stored types, except where float weights are asked for (a GPU, a float
dtype, quantization "none" or "int8"): those come from an fp32 checkpoint converted once
beside it (`fp32_checkpoint`).
`quantization` (`QUANTIZATION_METHODS`): "gguf" runs a GGUF's blocks as stored, "int8"
quantizes a float checkpoint to Q8_0 at load, None keeps float weights;
`resolve_quantization` picks "gguf" for a .gguf file, as vLLM does.

transformers is imported where it is needed, not here: a converted GGUF file loads without it
(its config and EOS as `gguf_cache` recorded them), and the tokenizer loads at first use
(`LoadedModel.tokenizer`).
"""

import functools
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from v1 import hub
from v1.attention.backends.abstract import AttentionImpl
from v1.config import NO_QUANTIZATION, QUANTIZATION_METHODS
from v1.config.model import HfOverrides
from v1.kernels.block_matmul import GGUF_KINDS
from v1.kernels.block_matmul import kernels as quant_kernels
from v1.models import gguf_conversion
from v1.models.bert import BertModel
from v1.models.decoder import DecoderForCausalLM
from v1.models.gguf_cache import (
    TENSOR_INDEX,
    convert_gguf,
    fp32_checkpoint,
    is_gguf_conversion,
    recorded_eos,
)
from v1.models.model_files import eos_ids, load_config, load_tokenizer, resolve_model
from v1.models.registry import get_model_cls

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger("v1")

# quantization -> the block kind weight matrices are quantized to at load.
_QUANTIZE_AT_LOAD = {"int8": "q8_0"}


@dataclass(frozen=True)
class LoadedModel:
    model: DecoderForCausalLM | BertModel  # the class `config.json`'s `architectures` names
    # transformers' PretrainedConfig; a converted GGUF file's `recorded_config` (attributes)
    hf_config: Any
    eos_token_id: int | None
    # Further ids that end generation (generation_config's eos list minus `eos_token_id`).
    stop_token_ids: tuple[int, ...]
    model_name: str  # short display name, e.g. "SmolLM2-135M-Instruct.Q4_1"
    model_path: Path  # what was resolved: the .gguf file or the HF directory
    model_dir: Path  # the HF-format directory of the config and tokenizer (cache for GGUF)
    # The longest sequence it serves: the model's context length (max_position_embeddings),
    # or the engine's max_model_len it was loaded for where shorter.
    max_model_len: int
    quantization: str | None = None  # what the weights were loaded as (None: float)

    @functools.cached_property
    def tokenizer(self) -> "PreTrainedTokenizerFast | None":
        """The model's tokenizer, loaded at first use (None: a directory without tokenizer
        files): an engine process that serves no grammar never loads one."""
        return load_tokenizer(self.model_dir)


# ---- resolving ----------------------------------------------------------------------------


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device_and_dtype(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """The torch device and dtype of ModelConfig's names (checked there): "auto" is CUDA when
    there is one, and float32 on CPU (bf16 matmuls are many times slower there), bfloat16 on
    a GPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, _DTYPES[dtype]


# ---- loading ------------------------------------------------------------------------------


def load_model(
    model: str | os.PathLike[str] | None,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_impl_cls: type[AttentionImpl],
    revision: str | None = None,
    quantization: str | None = None,
    hf_overrides: HfOverrides | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """`hf_overrides` (vLLM's): changes the HF config before the model is built from it
    (`apply_hf_overrides`). `max_model_len`: the engine's, where given; the model then serves
    no longer sequences (`LoadedModel.max_model_len`). A converted GGUF file's config and EOS
    are read as recorded, and its tokenizer is left to its first use: no transformers import
    (an HF directory's config and tokenizer load here, through transformers)."""
    start = time.perf_counter()
    path = resolve_model(model, revision)
    check_quantization(quantization, path, torch.device(device), dtype)
    # A GGUF file's header is parsed at most once per load (seconds for a large vocabulary).
    opened = functools.cache(lambda: gguf_conversion.read_gguf(path))
    model_dir = convert_gguf(path, opened) if path.is_file() else path

    file_config = hf_config = load_config(model_dir)
    if hf_overrides is not None:
        # Overrides go to a copy by the config's own class: it checks their types, and a
        # function of the config gets the class it would get from vLLM.
        hf_config = apply_hf_overrides(load_config(model_dir, by_class=True), hf_overrides)
    try:
        model_cls = get_model_cls(hf_config)
    except ValueError as e:
        raise ValueError(f"model {str(path)!r}: {e}") from None
    llm = model_cls(hf_config, attn_impl_cls, dtype=dtype, device=device,
                    max_position=max_model_len)
    if quantization == "gguf":
        mapped = gguf_conversion.open_indexed(path, model_dir / TENSOR_INDEX, file_config)
        weights = gguf_conversion.iter_hf_tensors(mapped, gguf_block_kinds())
    else:
        weights = _iter_safetensors(fp32_checkpoint(path, opened) if path.is_file()
                                    else model_dir)
    llm.load_weights(weights, quantize=_QUANTIZE_AT_LOAD.get(quantization or ""))
    llm.eval()

    loaded_now: dict[str, Any] = {}  # `LoadedModel.tokenizer`, where it is loaded here
    if is_gguf_conversion(model_dir):
        tokenizer_eos = recorded_eos(model_dir)
    else:
        tokenizer = loaded_now["tokenizer"] = load_tokenizer(model_dir)
        tokenizer_eos = tokenizer.eos_token_id if tokenizer is not None else None
    eos_token_id, stop_token_ids = eos_ids(model_dir, hf_config, tokenizer_eos)
    loaded = LoadedModel(
        model=llm,
        hf_config=hf_config,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids,
        model_name=hub.repo_id_of_snapshot(path) or (path.stem if path.is_file() else path.name),
        model_path=path,
        model_dir=model_dir,
        max_model_len=int(llm.max_position),
        quantization=quantization,
    )
    loaded.__dict__.update(loaded_now)  # the cached property's value, not loaded again
    if isinstance(llm, BertModel) and loaded.tokenizer is not None:
        llm.sep_token_id = loaded.tokenizer.sep_token_id  # where a text pair's second begins
    logger.info(
        "loaded %s (%s, %s, quantization %s) in %.2f s",
        path, dtype, device, quantization, time.perf_counter() - start,
    )
    return loaded


def apply_hf_overrides(hf_config: "PretrainedConfig", overrides: HfOverrides) -> Any:
    """The config with vLLM's `hf_overrides` applied: a function's result, or the config
    with a dict's keys set on it, where a nested config (`text_config`) given a dict is
    updated key by key rather than replaced."""
    if callable(overrides):
        return overrides(hf_config)
    _set_keys(hf_config, overrides)
    logger.info("HF config overridden: %s", overrides)
    return hf_config


def _set_keys(target: Any, overrides: dict[str, Any]) -> None:
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        nested = getattr(target, key, None)
        if isinstance(value, dict) and isinstance(nested, PretrainedConfig):
            _set_keys(nested, value)
        else:
            setattr(target, key, value)


def gguf_block_kinds() -> frozenset[str]:
    """The GGUF types quantization="gguf" keeps as blocks: those this process's kernel library
    runs (`QuantKernels.runs`); without a library, every type `QuantizedWeight` holds (the torch
    reference runs them)."""
    q = quant_kernels()
    return frozenset(k for k in GGUF_KINDS if q is None or q.runs(k))


def resolve_quantization(
    quantization: str | None, path: Path, device: torch.device, dtype: torch.dtype
) -> str | None:
    """What `EngineArgs.quantization` loads `path` as (None: float weights). Unset: "gguf"
    for a .gguf file on CPU in float32 when this machine has the native kernels (without
    them the blocks would run through the slow torch reference), else float weights."""
    if quantization == NO_QUANTIZATION:
        return None
    if quantization is not None:
        return quantization
    runs_blocks = (
        path.is_file() and path.suffix == ".gguf" and device.type == "cpu"
        and dtype == torch.float32 and quant_kernels() is not None
    )
    return "gguf" if runs_blocks else None


def check_quantization(
    quantization: str | None, path: Path, device: torch.device, dtype: torch.dtype
) -> None:
    """ValueError for a quantization this model, device or dtype cannot have."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), "
            f"got {quantization!r}"
        )
    if quantization == "gguf" and not (path.is_file() and path.suffix == ".gguf"):
        raise ValueError(f"quantization='gguf' needs a .gguf model file, got {str(path)!r}")
    # The block kernels are CPU C code with fp32 activations.
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization!r} runs on CPU only, not on {device.type}: "
            "leave quantization unset there"
        )
    if dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} computes in float32, got dtype {dtype}"
        )


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: the shards `model.safetensors.index.json` lists when
    there is one (some repos also hold a `consolidated.safetensors` in another layout, which
    must not be read too), else `model.safetensors`, else every *.safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    return sorted(model_dir.glob("*.safetensors"))


def _iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(model_dir):
        with safe_open(file, framework="pt") as f:
            names = list(f.keys())
        for name in names:
            # A map of the file per tensor: the pages read are unmapped at once, so a load's
            # peak RSS does not hold the whole file's pages beside the weights loaded.
            with safe_open(file, framework="pt") as f:
                tensor = f.get_tensor(name)
            yield name, tensor


