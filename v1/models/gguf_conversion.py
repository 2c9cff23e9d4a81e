"""A GGUF file (llama.cpp's format) as an HF checkpoint: config, tensor names, and the weight
changes llama.cpp's converter made, undone (llama, Mistral, qwen2, qwen3, gemma3, phi3).

Undone per architecture: tensor names (`blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`;
`ffn_norm` is Llama's post-attention norm, Gemma 3's pre-feed-forward one); llama's per-head
permutation of q/k rows and biases (for its interleaved RoPE); Gemma's stored `1 + w` norms.
Missing config keys take llama.cpp's values. `iter_hf_tensors` serves both the fp32 checkpoint
(a GPU, a float dtype) and quantization="gguf", which runs the file's mapped blocks as they
are (the row un-permutation moves whole rows of blocks).
"""

import json
import logging
import mmap
import warnings
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from v1.kernels.block_matmul import GGUF_KINDS
from v1.models.layers.quantized import QuantizedWeight

logger = logging.getLogger("v1")

_COMMON_LAYER_NAMES = {
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
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True, slots=True)
class GGUFArchitecture:
    """How one llama.cpp architecture maps onto its HF counterpart."""

    layer_names: dict[str, str]  # blk.N.<key> -> model.layers.N.<value>
    config: Callable[["_Metadata"], Any]  # the transformers config, from the metadata
    unpermute_qk: bool = False  # llama.cpp interleaved q/k rows for its RoPE
    norm_offset: float = 0.0  # llama.cpp stored norm weights as offset + w


class _Metadata:
    """The GGUF header's key/values for one architecture (keys without the arch prefix)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.arch: str = self.get_global("general.architecture")
        self.tensor_names = {t.name for t in reader.tensors}
        self.tensor_shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}

    def get_global(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def get(self, key: str, default: Any = None) -> Any:
        return self.get_global(f"{self.arch}.{key}", default)

    def vocab_size(self) -> int:
        tokens = self.get_global("tokenizer.ggml.tokens")
        # GGUF shapes are (in, out): the embedding is (hidden, vocab).
        return int(
            self.get("vocab_size") or (len(tokens) if tokens else 0)
            or self.tensor_shapes["token_embd.weight"][-1]
        )

    def rope(self, theta_key: str = "rope.freq_base", default_theta: float = 10000.0) -> dict:
        """rope_parameters from `rope.freq_base` and `rope.scaling.*` (linear only)."""
        if "rope_freqs.weight" in self.tensor_names:
            # Llama 3.1 GGUFs carry their rope scaling as a tensor of per-frequency factors.
            raise ValueError(
                "GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported"
            )
        # llama.cpp writes how many dimensions of each head rotate; fewer than head_dim is a
        # partial rotary (Phi-4-mini's 0.75), which our RoPE would silently apply to all.
        rope_dims = self.get("rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != self.head_dim():
            raise ValueError(
                f"GGUF rope.dimension_count {rope_dims} is not head_dim {self.head_dim()}: "
                "partial rotary embeddings are not supported"
            )
        rope: dict[str, Any] = {
            "rope_type": "default", "rope_theta": float(self.get(theta_key, default_theta)),
        }
        scaling_type = self.get("rope.scaling.type")
        if scaling_type not in (None, "none"):
            if scaling_type != "linear":
                raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
            rope = {**rope, "rope_type": "linear", "factor": float(self.get("rope.scaling.factor"))}
        return rope

    def common(self) -> dict[str, Any]:
        """The config values every supported architecture stores the same way."""
        hidden = self.get("embedding_length")
        heads = self.get("attention.head_count")
        return dict(
            vocab_size=self.vocab_size(),
            hidden_size=hidden,
            intermediate_size=self.get("feed_forward_length"),
            num_hidden_layers=self.get("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=self.get("attention.head_count_kv", heads),
            max_position_embeddings=self.get("context_length"),
            rms_norm_eps=self.get("attention.layer_norm_rms_epsilon"),
            # No separate output matrix in the file: the LM head reuses the embedding.
            tie_word_embeddings="output.weight" not in self.tensor_names,
            bos_token_id=self.get_global("tokenizer.ggml.bos_token_id"),
            eos_token_id=self.get_global("tokenizer.ggml.eos_token_id"),
            pad_token_id=self.get_global("tokenizer.ggml.padding_token_id"),
        )

    def head_dim(self) -> int:
        return int(self.get("attention.key_length")
                   or self.get("embedding_length") // self.get("attention.head_count"))


def _llama_config(meta: _Metadata) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **meta.common(), head_dim=meta.head_dim(), rope_parameters=meta.rope(),
        attention_bias="blk.0.attn_q.bias" in meta.tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in meta.tensor_names,
        architectures=["LlamaForCausalLM"],
    )


def _qwen2_config(meta: _Metadata) -> Any:
    from transformers import Qwen2Config

    # Qwen2's head size is always hidden / heads; llama.cpp keeps no sliding window for it.
    return Qwen2Config(
        **meta.common(), rope_parameters=meta.rope(), architectures=["Qwen2ForCausalLM"]
    )


def _qwen3_config(meta: _Metadata) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **meta.common(), head_dim=meta.head_dim(), rope_parameters=meta.rope(),
        architectures=["Qwen3ForCausalLM"],
    )


def _gemma3_config(meta: _Metadata) -> Any:
    from transformers import Gemma3TextConfig

    common = meta.common()
    num_layers = common["num_hidden_layers"]
    head_dim = meta.head_dim()
    # Which layers are local: listed per layer, or every n-th global (llama.cpp: n = 6).
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ValueError(f"sliding_window_pattern lists {len(pattern)} of {num_layers} layers")
        is_sliding = [bool(p) for p in pattern]
    else:
        is_sliding = [bool((i + 1) % int(pattern)) for i in range(num_layers)]
    # llama.cpp scales scores by 1/sqrt(head_dim), except for the 27B model (62 layers),
    # whose query_pre_attn_scalar is hidden / heads.
    scalar = head_dim
    if num_layers == 62:
        scalar = common["hidden_size"] // common["num_attention_heads"]
    return Gemma3TextConfig(
        **common,
        head_dim=head_dim,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=scalar,
        sliding_window=meta.get("attention.sliding_window"),
        layer_types=["sliding_attention" if s else "full_attention" for s in is_sliding],
        rope_parameters={
            "full_attention": meta.rope(default_theta=1_000_000.0),
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0)),
            },
        },
        final_logit_softcapping=meta.get("final_logit_softcapping"),
        attn_logit_softcapping=meta.get("attn_logit_softcapping"),
        architectures=["Gemma3ForCausalLM"],
    )


def _phi3_config(meta: _Metadata) -> Any:
    from transformers import Phi3Config

    if "rope_factors_long.weight" in meta.tensor_names:
        raise ValueError("Phi-3 GGUF files with longrope factors (128k) are not supported")
    return Phi3Config(
        **meta.common(), rope_parameters=meta.rope(),
        sliding_window=meta.get("attention.sliding_window"),
        architectures=["Phi3ForCausalLM"],
    )


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture(_COMMON_LAYER_NAMES, _llama_config, unpermute_qk=True),
    "qwen2": GGUFArchitecture(_COMMON_LAYER_NAMES, _qwen2_config),
    "qwen3": GGUFArchitecture({**_COMMON_LAYER_NAMES, **_QK_NORM_NAMES}, _qwen3_config),
    "gemma3": GGUFArchitecture(
        {
            **_COMMON_LAYER_NAMES,
            **_QK_NORM_NAMES,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        _gemma3_config,
        norm_offset=1.0,
    ),
    "phi3": GGUFArchitecture(
        {
            "attn_qkv": "self_attn.qkv_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_up": "mlp.gate_up_proj",  # llama.cpp keeps Phi-3's fused gate/up as ffn_up
            "ffn_down": "mlp.down_proj",
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        _phi3_config,
    ),
}


def hf_tensor_name(arch: GGUFArchitecture, gguf_name: str) -> str | None:
    """llama.cpp tensor name -> transformers name (None: not one this architecture has)."""
    base, _, kind = gguf_name.rpartition(".")  # kind: "weight" or "bias"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in arch.layer_names:
        return f"model.layers.{int(parts[1])}.{arch.layer_names[parts[2]]}.{kind}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    return None


def unpermute_qk(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of q/k projection rows (llama only).

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


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    """A tensor of a GGUF file: `data` is a view of the file's read-only map, as gguf's reader
    shapes it (F32 / F16 values [out, in] or [n]; other types' bytes [out, row bytes])."""

    name: str
    type_name: str  # GGML's: "Q4_K", "F32", ...
    shape: tuple[int, ...]  # GGUF's order: (in, out) for a matrix
    offset: int  # of its data in the file
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True, slots=True)
class GGUFModel:
    """A GGUF file opened once: its tensors (views of `mapped`, the whole file mapped
    read-only, shared by every process mapping it), its architecture, the transformers config
    from its metadata."""

    path: Path
    mapped: np.ndarray
    tensors: tuple[GGUFTensor, ...]
    arch_name: str
    arch: GGUFArchitecture
    config: Any
    has_tokenizer: bool  # llama.cpp's files carry one; hand-written ones may not


def read_gguf(gguf_path: Path) -> GGUFModel:
    """`gguf_path` opened: its header parsed (seconds for a large vocabulary, by gguf's
    reader), its tensors mapped, not read."""
    import gguf  # only needed on the GGUF paths

    reader = gguf.GGUFReader(gguf_path)
    meta = _Metadata(reader)
    arch = ARCHITECTURES.get(meta.arch)
    if arch is None:
        raise ValueError(
            f"{gguf_path}: GGUF architecture {meta.arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    tensors = tuple(
        GGUFTensor(t.name, t.tensor_type.name, tuple(int(n) for n in t.shape),
                   int(t.data_offset), t.data)
        for t in reader.tensors
    )
    return GGUFModel(gguf_path, reader.data, tensors, meta.arch, arch, arch.config(meta),
                     "tokenizer.ggml.model" in reader.fields)


def write_index(model: GGUFModel, path: Path, eos_token_id: int | None) -> None:
    """Where each tensor of `model` lies in its file, as JSON at `path`: what `open_indexed`
    maps the file by without parsing its header again; with the config's every field
    (`to_dict()`, defaults included) and the tokenizer's EOS id, what a load reads instead of
    importing transformers (`v1.models.gguf_cache`)."""
    tensors = [
        {"name": t.name, "type": t.type_name, "shape": t.shape, "offset": t.offset,
         "dtype": t.data.dtype.str, "array_shape": t.data.shape}
        for t in model.tensors
    ]
    path.write_text(json.dumps({
        "arch": model.arch_name, "tokenizer": model.has_tokenizer, "eos_token_id": eos_token_id,
        "config": json.loads(model.config.to_json_string(use_diff=False)), "tensors": tensors,
    }))


def open_indexed(gguf_path: Path, index: Path, config: Any) -> GGUFModel:
    """`gguf_path` mapped by the tensor index `write_index` wrote (`config`: the one its
    conversion wrote): what `read_gguf` gives, without the seconds of parsing the header."""
    recorded = json.loads(index.read_text())
    mapped = np.memmap(gguf_path, mode="r")
    tensors = tuple(
        GGUFTensor(t["name"], t["type"], tuple(t["shape"]), t["offset"],
                   np.ndarray(tuple(t["array_shape"]), np.dtype(t["dtype"]), buffer=mapped,
                              offset=t["offset"]))
        for t in recorded["tensors"]
    )
    arch_name = recorded["arch"]
    return GGUFModel(gguf_path, mapped, tensors, arch_name, ARCHITECTURES[arch_name], config,
                     recorded["tokenizer"])


def iter_hf_tensors(
    model: GGUFModel, block_kinds: Collection[str] = ()
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The file's tensors under HF names and in HF layout. A weight matrix whose type
    (lower-case GGUF name) is in `block_kinds` comes as a `QuantizedWeight` whose blocks are
    the file's mapped bytes themselves (read-only: never written; q/k rows un-permuted as whole
    rows of blocks make a new tensor); with any `block_kinds`, so does an untied embedding of
    any type `QuantizedWeight` holds (its rows are only looked up). Everything else comes as
    fp32: F32 tensors copied, other types dequantized, with one INFO line per quantized type
    saying what that costs (a type without kernels must not make the file unusable)."""
    arch, config = model.arch, model.config
    dequantized: dict[str, list[int]] = {}  # type -> [tensors, bytes stored, fp32 bytes]
    layer, layer_start = "", 0  # the current layer's name prefix ("blk.3."), its first byte
    for tensor in model.tensors:
        prefix = tensor.name[:tensor.name.index(".", 4) + 1] if tensor.name.startswith(
            "blk.") else tensor.name
        start = tensor.data.ctypes.data - model.mapped.ctypes.data  # in the map
        if prefix != layer:
            layer, layer_start = prefix, start
        hf_name = hf_tensor_name(arch, tensor.name)
        if hf_name is None:
            raise ValueError(f"{model.path}: unsupported GGUF tensor {tensor.name!r}")
        type_name = tensor.type_name
        kind = type_name.lower()
        keep = bool(block_kinds) and len(tensor.shape) == 2 and kind in GGUF_KINDS and (
            kind in block_kinds
            or hf_name == "model.embed_tokens.weight" and not config.tie_word_embeddings
        )
        if keep:
            # Rows of blocks: uint8 [out, in / block values * block bytes] (F16's float16
            # [out, in] seen as its bytes). A view of the map, not a copy.
            data = tensor.data.view(np.uint8).reshape(int(tensor.shape[1]), -1)
        elif type_name == "F32":
            # The map's values copied, as gguf's dequantize would give them, without importing
            # gguf (its tables' set-up: 0.05-0.2 s here) where the rest is kept as blocks.
            data = np.array(tensor.data.view(np.float32), order="C")
        else:
            import gguf

            stats = dequantized.setdefault(type_name, [0, 0, 0])
            stats[0] += 1
            stats[1] += tensor.data.nbytes
            stats[2] += 4 * tensor.n_elements
            # dequantize returns [out, in] in numpy order, the layout of a torch Linear weight.
            data = gguf.quants.dequantize(
                tensor.data, gguf.GGMLQuantizationType[type_name]
            ).astype(np.float32, copy=False)
            if not data.flags.writeable or not data.flags.c_contiguous:
                data = np.array(data, order="C")
        if arch.unpermute_qk and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_qk(data, config.num_attention_heads)
        elif arch.unpermute_qk and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_qk(data, config.num_key_value_heads)
        if arch.norm_offset and hf_name.endswith("norm.weight"):
            data -= np.float32(arch.norm_offset)
        if not keep:
            yield hf_name, torch.from_numpy(data)
        else:
            # GGUF shapes are (in, out).
            in_features, out_features = (int(n) for n in tensor.shape)
            yield hf_name, QuantizedWeight(kind, _mapped(data), out_features, in_features)
        # With its layer's tensors before it: a fused projection's shards are read again
        # when joined, at its last one.
        _release_pages(model.mapped, model.mapped[min(layer_start, start):
                                                  start + tensor.data.nbytes])
    # And any page read again since.
    _release_pages(model.mapped, model.mapped)
    if block_kinds:
        for type_name, (count, stored, fp32) in dequantized.items():
            logger.info(
                "%s: %d %s tensor(s) dequantized to fp32: %.2f MB instead of %.2f MB stored "
                "(this kernel library has no %s kernels)",
                model.path.name, count, type_name, fp32 / 1e6, stored / 1e6, type_name.lower(),
            )


def _mapped(data: np.ndarray) -> torch.Tensor:
    """`data` as a tensor on the same memory: the file's read-only map, or a new array."""
    if data.flags.writeable:
        return torch.from_numpy(data)
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; nothing writes into blocks.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def _release_pages(mapped: np.ndarray, data: np.ndarray) -> None:
    """Drop this process's pages of `data`, a part of the file's read-only map `mapped`, once
    the tensor was taken: what was copied (repacked, joined, dequantized) is not read again, and
    what is kept reads its pages back from the page cache when used. So a load's RSS never
    holds the whole file beside the copies it makes (file-backed pages: nothing is lost)."""
    mm = getattr(mapped, "_mmap", None)  # np.memmap's own mmap.mmap
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = (data.ctypes.data - mapped.ctypes.data) // page * page
    end = min(data.ctypes.data - mapped.ctypes.data + data.nbytes, len(mm))
    if end > start:
        mm.madvise(mmap.MADV_DONTNEED, start, end - start)


def write_hf_checkpoint(model: GGUFModel, out_dir: Path) -> None:
    """Write config.json and model.safetensors (fp32, HF names and layout) for `model` into
    `out_dir`. The tokenizer is the caller's business."""
    tensors = dict(iter_hf_tensors(model))
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out_dir)
