"""The decoder-only transformer every supported architecture is an instance of, over the paged
KV cache.

One forward runs every scheduled token of the step, packed into one flat [T] batch; only
attention knows which token sees which context (`AttentionMetadata`). An architecture
(`v1/models/<arch>.py`) subclasses `DecoderForCausalLM` with its `layer_spec` and, where its
block is not the usual pre-norm one, its `layer_cls`; embedding, final norm, LM head, RoPE and
weight loading live here. Layout differences from transformers: docs/models.md, "Architectures".
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata, AttentionType
from v1.attention.backends.torch_attn import TorchAttentionImpl
from v1.kernels.fused_step import LayerWeights, Projection
from v1.models.fused_decode import FusedDecode
from v1.models.layers.attention import Attention
from v1.models.layers.linear import Linear, VocabEmbedding
from v1.models.layers.mlp import GatedMLP
from v1.models.layers.norm import RMSNorm
from v1.models.layers.quantized import MatmulRows, QuantizedWeight, block_weights
from v1.models.layers.rotary import RotaryEmbedding, rope_parameters
from v1.models.step_plan import StepPlan, StepPlanner

DEFAULT_ROPE = "default"


def head_dim_of(config: Any) -> int:
    """The attention head size: explicit in the config where the architecture has it (Qwen 3,
    Gemma 3: not hidden_size / num_heads), else derived."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    """The K/V head count: the config's where it has one (GQA), else one per query head (BERT
    family configs name none)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one decoder layer is made of, read from the HF config by its architecture."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str  # transformers' activation name: "silu" or "gelu_pytorch_tanh"
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE
    norm_unit_offset: bool  # Gemma's (1 + w) norms (all of the layer's, q/k included)
    scale: float  # of the attention scores
    sliding_window: int | None  # a token sees itself and the window - 1 tokens before it
    rope_key: str  # which RoPE table (`DecoderForCausalLM.rope_parameters_for`)


def build_attention(
    spec: LayerSpec, attn_impl_cls: type[AttentionImpl], device: torch.device, dtype: torch.dtype
) -> Attention:
    return Attention(
        hidden_size=spec.hidden_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        scale=spec.scale,
        qkv_bias=spec.qkv_bias,
        o_bias=spec.o_bias,
        qk_norm_eps=spec.rms_norm_eps if spec.qk_norm else None,
        qk_norm_unit_offset=spec.norm_unit_offset,
        sliding_window=spec.sliding_window,
        attn_impl_cls=attn_impl_cls,
        device=device,
        dtype=dtype,
    )


def build_mlp(spec: LayerSpec, device: torch.device, dtype: torch.dtype) -> GatedMLP:
    return GatedMLP(
        spec.hidden_size, spec.intermediate_size, spec.hidden_act, spec.mlp_bias, device, dtype
    )


def build_norm(spec: LayerSpec, device: torch.device, dtype: torch.dtype) -> RMSNorm:
    return RMSNorm(
        spec.hidden_size, spec.rms_norm_eps, device, dtype, unit_offset=spec.norm_unit_offset
    )


class PreNormDecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)): the block of Llama, Qwen, Mistral, Phi-3."""

    def __init__(
        self,
        spec: LayerSpec,
        attn_impl_cls: type[AttentionImpl],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.rope_key = spec.rope_key
        self.input_layernorm = build_norm(spec, device, dtype)
        self.self_attn = build_attention(spec, attn_impl_cls, device, dtype)
        self.post_attention_layernorm = build_norm(spec, device, dtype)
        self.mlp = build_mlp(spec, device, dtype)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        step: StepPlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Takes and returns (block output, residual stream before that output is added), each
        residual add moved into the norm after it; the first layer gets residual None."""
        x, residual = self.input_layernorm(hidden_states, residual, step.ops)
        x = self.self_attn(rope, x, kv_cache, step)
        x, residual = self.post_attention_layernorm(x, residual, step.ops)
        return self.mlp(x, step), residual

    def fused_weights(self) -> LayerWeights | None:
        """This layer as the fused decode step runs it (`v1.models.fused_decode`), or None
        where that would not compute what `forward` does: a subclass (its own forward),
        unit-offset or q/k norms, an activation other than silu, a projection that is not
        GGUF blocks in a plain `Linear` (LoRA wraps them), another attention backend or
        type."""
        if type(self) is not PreNormDecoderLayer:
            return None
        attn, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        impl = attn.attn
        if (
            any(norm.unit_offset for norm in norms) or attn.q_norm is not None
            or mlp.hidden_act != "silu" or type(impl) is not TorchAttentionImpl
            or impl.attn_type != AttentionType.DECODER
        ):
            return None
        projections = []
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            shards = block_weights(linear.kernel) if type(linear) is Linear else []
            if not shards:
                return None
            projections.append(Projection(tuple(w.kernel_blocks() for w in shards),
                                          linear.bias))
        return LayerWeights(norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps,
                            impl.scale, *projections)


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm; RoPE tables shared by the layers that use them."""

    def __init__(
        self,
        config: Any,
        layers: list[nn.Module],
        rotary_embs: dict[str, RotaryEmbedding],
        embed_scale: float | None,
        final_norm: RMSNorm,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(
            config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        # Gemma multiplies embeddings by sqrt(hidden) rounded to the model dtype (as HF does).
        self.embed_scale: torch.Tensor | None
        self.register_buffer(
            "embed_scale",
            None if embed_scale is None
            else torch.tensor(embed_scale, dtype=torch.float32).to(device, dtype),
            persistent=False,
        )
        self.layers = nn.ModuleList(layers)
        self.norm = final_norm
        self.rotary_embs = nn.ModuleDict(rotary_embs)
        self.fused_decode = FusedDecode(self.layers, self.rotary_embs, final_norm,
                                        self.embed_tokens if embed_scale is None else None)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        return hidden_states if self.embed_scale is None else hidden_states * self.embed_scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        step: StepPlan,
    ) -> torch.Tensor:
        if step.fused is not None:  # the final norm's output (and the logits), one C call
            fd = self.fused_decode
            assert fd.layers is not None
            embeddings = None if fd.layers.embeds else self._embed(input_ids)
            hidden_states, step.logits = fd.run(input_ids, embeddings, positions, kv_caches,
                                                step.fused)
            return hidden_states
        hidden_states = self._embed(input_ids)
        # One table per RoPE kind per step: positions are the same in every layer.
        ropes = {
            key: emb.cos_sin(positions, hidden_states.dtype)
            for key, emb in self.rotary_embs.items()
        }
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(
                ropes[layer.rope_key], hidden_states, residual, kv_cache, step
            )
        return self.norm(hidden_states, residual, step.ops)[0]


class DecoderForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states for every token; the runner
    picks the rows it samples from and calls `compute_logits` on just those.

    Subclasses define `layer_spec` and may override `layer_cls`, `check_config`,
    `rope_parameters_for`, `embed_scale` and `final_logit_softcapping`.
    """

    layer_cls: ClassVar[type[nn.Module]] = PreNormDecoderLayer
    # False for a base-model checkpoint (transformers' `LlamaModel`: `v1.models.adapters`),
    # which has no LM head: only pooling runs it.
    has_lm_head: ClassVar[bool] = True
    # Pooling (v1.models.pooler): decoders attend causally and have no classification head.
    is_causal: ClassVar[bool] = True
    num_labels: ClassVar[int | None] = None

    def __init__(
        self,
        config: Any,
        attn_impl_cls: type[AttentionImpl],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        max_position: int | None = None,
    ) -> None:
        super().__init__()
        self.check_config(config)
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # `max_position`: the longest sequence an engine will run (its max_model_len), where
        # shorter than the model's context: the RoPE tables go that far only (131072
        # positions of a Llama 3.2 are 128 MB of tables and 0.15 s of a start).
        context = config.max_position_embeddings
        self.max_position = min(max_position or context, context)
        specs = [self.layer_spec(config, i) for i in range(config.num_hidden_layers)]
        self.layer_specs = specs
        layers = [self.layer_cls(spec, attn_impl_cls, device, dtype) for spec in specs]
        rotary_embs = {
            key: RotaryEmbedding(
                self.rope_parameters_for(config, key), head_dim_of(config),
                config.max_position_embeddings, self.max_position, device,
            )
            for key in dict.fromkeys(spec.rope_key for spec in specs)
        }
        final_norm = build_norm(specs[0], device, dtype)
        self.model = DecoderModel(
            config, layers, rotary_embs, self.embed_scale(config), final_norm, device, dtype
        )
        # Tied: the LM head is the embedding matrix itself (compute_logits reads it there).
        self.lm_head: Linear | None = None
        if not self.tie_word_embeddings and self.has_lm_head:
            self.lm_head = Linear(
                config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype
            )
        # Inference only: no autograd bookkeeping on any parameter.
        self.requires_grad_(False)

    # ---- what an architecture says about itself ----------------------------------------------

    def layer_spec(self, config: Any, layer_idx: int) -> LayerSpec:
        raise NotImplementedError

    def check_config(self, config: Any) -> None:
        """Raise ValueError for settings this implementation would silently get wrong."""

    def rope_parameters_for(self, config: Any, rope_key: str) -> dict[str, Any]:
        """The rope parameters of the table `rope_key` (a `LayerSpec.rope_key`)."""
        return rope_parameters(config, None if rope_key == DEFAULT_ROPE else rope_key)

    def embed_scale(self, config: Any) -> float | None:
        """A factor on the token embeddings (None: none)."""
        return None

    @property
    def final_logit_softcapping(self) -> float | None:
        """logits = cap * tanh(logits / cap) when set."""
        return None

    # ---- running --------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[torch.Tensor],  # one per layer, kv_cache_shape(...)
        attn_metadata: AttentionMetadata,
        step: StepPlan | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        """`step`: the step's plan, for `attn_metadata` (None: planned here with the default
        options, as for a caller without a runner)."""
        if step is None:
            step = self.default_planner().plan(attn_metadata, kv_caches)
        assert step.metadata is attn_metadata
        return self.model(input_ids, positions, kv_caches, step)

    def default_planner(self) -> StepPlanner:
        """A planner with the default options, for callers without a runner."""
        params = next(self.parameters())
        return StepPlanner(self, params.dtype, params.device)

    def replan(self) -> None:
        """Decide again whether the layers run as the fused decode step: after changing
        their modules or weights (LoRA's wrappers)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        self.model.fused_decode.replan(
            head if self.has_lm_head and self.final_logit_softcapping is None else None)

    def compute_logits(
        self, hidden_states: torch.Tensor, rows: MatmulRows | None = None
    ) -> torch.Tensor:  # fp32 [N, vocab]
        """`rows`: the matmul rule for GGUF head rows (the runner's; None: the default)."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = head.linear(hidden_states, rows)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits if logits.dtype == torch.float32 else logits.float()

    # ---- weight loading -------------------------------------------------------------------

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        """HF projection name -> (our fused projection, first row, end row) in that weight."""
        attn = self.model.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        inter = self.model.layers[0].mlp.intermediate_size
        return {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, q + kv),
            "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, 2 * inter),
        }

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        quantize: str | None = None,
    ) -> None:
        """Copy HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...) into the
        parameters, each q/k/v and gate/up tensor into its slice of the fused weight (tensors
        already fused in the checkpoint, as Phi-3's, go in whole). Converts dtype on the way
        (a bf16 checkpoint into an fp32 model). A `QuantizedWeight` (GGUF blocks) goes into
        its layer as blocks (a fused weight's shards of several types kept apart:
        `QuantizedShards`). Each weight matrix takes its final form as soon as its last row
        is in (`Linear.finish_loading`: packed, or quantized to `quantize`, e.g. "q8_0"), so
        loading never holds more than one layer's matrices twice. Raises if a parameter was
        never written, since parameters start uninitialised."""
        params = dict(self.named_parameters())
        shards = self._fused_shards()
        # Rows still unwritten per parameter: fused ones arrive in pieces.
        pending: dict[str, int] = {name: p.shape[0] for name, p in params.items()}
        for hf_name, tensor in weights:
            name = hf_name
            if "rotary_emb.inv_freq" in name:
                continue  # old checkpoints saved this derived buffer; we build our own
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints store the shared matrix twice
            # e.g. model.layers.3.self_attn.k_proj.weight -> ...qkv_proj.weight, rows [q, q+kv)
            parts = name.split(".")
            rows: tuple[int, int] | None = None
            if len(parts) >= 2 and parts[-2] in shards:
                fused, start, end = shards[parts[-2]]
                name = ".".join([*parts[:-2], fused, parts[-1]])
                rows = (start, end)
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
            param = params[name]
            start, end = rows or (0, param.shape[0])
            expected = (end - start, *param.shape[1:])
            shape = (
                (tensor.out_features, tensor.in_features)
                if isinstance(tensor, QuantizedWeight) else tuple(tensor.shape)
            )
            if shape != expected:
                raise ValueError(
                    f"weight {hf_name!r} has shape {shape}, expected {expected}"
                )
            layer = self.get_submodule(name.rpartition(".")[0])
            # A fused weight's shards may come in different types: the layer joins them when
            # its last rows are in (`Linear.finish_loading`).
            if isinstance(tensor, QuantizedWeight):
                if not isinstance(layer, Linear) or not name.endswith(".weight"):
                    raise ValueError(f"weight {hf_name!r} cannot be kept quantized")
                layer.load_blocks((start, end), tensor, hf_name)
            else:
                param.data[start:end].copy_(tensor)
            pending[name] -= end - start
            if pending[name] == 0 and isinstance(layer, Linear) and name.endswith(".weight"):
                layer.finish_loading(quantize)
        missing = sorted(name for name, rows_left in pending.items() if rows_left != 0)
        if missing:
            raise ValueError(f"checkpoint lacks (or repeats) weights for: {missing}")
        self.replan()
