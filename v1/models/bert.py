"""The BERT family as pooling models: `BertModel`, `XLMRobertaModel` (and RoBERTa), and their
`...ForSequenceClassification` (cross-encoders, classifiers such as bge-reranker).

An encoder (ENCODER_ONLY attention, no KV cache; learned positions, RoBERTa's from
pad_token_id + 1; post-norm GELU layers). `forward` returns the last hidden states; `classify`
maps the pooled CLS state through the pooler and classifier. Token types are derived from the
ids: 1 from the token after the first [SEP] of a pair on, since requests carry ids only.
"""

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from v1.attention.backends.abstract import AttentionImpl, AttentionMetadata, AttentionType
from v1.models.layers.linear import Linear, VocabEmbedding
from v1.models.layers.quantized import MatmulRows, QuantizedWeight
from v1.models.step_plan import StepPlan

# transformers' activation names -> the function.
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}

# HF name pieces -> ours, in order (the longer ones first).
_RENAMES = (
    ("attention.output.dense.", "attn_out."),
    ("attention.output.LayerNorm.", "attn_norm."),
    ("intermediate.dense.", "intermediate."),
    ("output.dense.", "output."),
    ("output.LayerNorm.", "output_norm."),
)
_QKV = {"attention.self.query.": 0, "attention.self.key.": 1, "attention.self.value.": 2}
# Buffers some checkpoints saved, which we derive.
_SKIPPED = ("embeddings.position_ids", "embeddings.token_type_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, position_offset: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.position_offset = position_offset
        self.word_embeddings = VocabEmbedding(config.vocab_size, hidden, device, dtype)
        self.position_embeddings = VocabEmbedding(
            config.max_position_embeddings, hidden, device, dtype
        )
        self.token_type_embeddings = VocabEmbedding(
            config.type_vocab_size, hidden, device, dtype
        )
        self.LayerNorm = nn.LayerNorm(hidden, config.layer_norm_eps, device=device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_types: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        x = x + self.position_embeddings(positions + self.position_offset)
        x = x + self.token_type_embeddings(token_types)
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    """Post-norm: LayerNorm(x + attention(x)), then LayerNorm(x + output(act(intermediate)))."""

    def __init__(self, config: Any, attn_impl_cls: type[AttentionImpl], device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads, self.head_dim = heads, hidden // heads
        eps = config.layer_norm_eps
        self.qkv_proj = Linear(hidden, 3 * hidden, device=device, dtype=dtype)
        self.attn = attn_impl_cls(heads, self.head_dim, heads, self.head_dim**-0.5,
                                  attn_type=AttentionType.ENCODER_ONLY)
        self.attn_out = Linear(hidden, hidden, device=device, dtype=dtype)
        self.attn_norm = nn.LayerNorm(hidden, eps, device=device, dtype=dtype)
        self.intermediate = Linear(hidden, config.intermediate_size, device=device, dtype=dtype)
        self.output = Linear(config.intermediate_size, hidden, device=device, dtype=dtype)
        self.output_norm = nn.LayerNorm(hidden, eps, device=device, dtype=dtype)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, rows: MatmulRows | None) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, rows)
        q, k, v = qkv.view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        a = self.attn.forward(q, k, v, kv_cache, attn_metadata)
        x = self.attn_norm(x + self.attn_out(a.reshape(num_tokens, -1), rows))
        return self.output_norm(x + self.output(self.act(self.intermediate(x, rows)), rows))


class BertEncoder(nn.Module):
    def __init__(self, config: Any, attn_impl_cls: type[AttentionImpl], device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(
            BertLayer(config, attn_impl_cls, device, dtype)
            for _ in range(config.num_hidden_layers)
        )


class BertModel(nn.Module):
    """BERT's encoder (transformers' `BertModel`); see the module docstring."""

    # What the engine reads of a model (as of `DecoderForCausalLM`).
    has_lm_head: ClassVar[bool] = False
    is_causal: ClassVar[bool] = False
    num_labels: int | None = None
    # Positions start here in the position table (RoBERTa: after the padding id).
    position_offset: ClassVar[int] = 0
    # Whether the checkpoint's `pooler.*` tensors are used (by a classification head).
    _uses_pooler: ClassVar[bool] = False

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
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported "
                             f"(supported: {', '.join(_ACTIVATIONS)})")
        kind = getattr(config, "position_embedding_type", "absolute") or "absolute"
        if kind != "absolute":
            raise ValueError(f"position_embedding_type {kind!r} is not supported (absolute)")
        device = torch.device(device if device is not None else "cpu")
        self.config = config
        offset = self.offset_of(config)
        context = config.max_position_embeddings - offset
        self.max_position = min(max_position or context, context)  # as the decoder's
        self.embeddings = BertEmbeddings(config, offset, device, dtype)
        self.encoder = BertEncoder(config, attn_impl_cls, device, dtype)
        # The [SEP] id that starts a pair's second segment (type 1); None: every token type 0.
        self.sep_token_id: int | None = None
        self.requires_grad_(False)

    def offset_of(self, config: Any) -> int:
        return self.position_offset

    def token_types(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """0 up to and including a sequence's first [SEP], 1 after it (each sequence is whole
        in the step and starts at position 0)."""
        if self.sep_token_id is None or self.config.type_vocab_size < 2:
            return torch.zeros_like(input_ids)
        is_sep = (input_ids == self.sep_token_id).long()
        seps_before = torch.cumsum(is_sep, 0) - is_sep  # [SEP]s before each token, step-wide
        seq_start = torch.nonzero(positions == 0).squeeze(1)  # one per sequence
        seq_id = torch.cumsum((positions == 0).long(), 0) - 1
        before_seq = seps_before[seq_start][seq_id]  # [SEP]s of earlier sequences
        return ((seps_before - before_seq) > 0).long()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        step: StepPlan | None = None,
    ) -> torch.Tensor:
        """`step`: the runner's plan of the step (its matmul rows; None: the defaults)."""
        rows = None if step is None else step.rows
        x = self.embeddings(input_ids, positions, self.token_types(input_ids, positions))
        for layer, kv_cache in zip(self.encoder.layer, kv_caches, strict=True):
            x = layer(x, kv_cache, attn_metadata, rows)
        return x

    # ---- weight loading -------------------------------------------------------------------

    def _our_name(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        """Our parameter's name for an HF tensor and, for a q/k/v shard, its rows in the
        fused weight; None for a tensor this model does not use."""
        for prefix in ("bert.", "roberta."):
            hf_name = hf_name.removeprefix(prefix)
        if hf_name.startswith(_SKIPPED) or (
            hf_name.startswith("pooler.") and not self._uses_pooler
        ):
            return None
        hidden = self.config.hidden_size
        for piece, i in _QKV.items():
            if piece in hf_name:
                return hf_name.replace(piece, "qkv_proj."), (i * hidden, (i + 1) * hidden)
        for piece, ours in _RENAMES:
            if piece in hf_name:
                return hf_name.replace(piece, ours), None
        return hf_name, None

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]],
        quantize: str | None = None,
    ) -> None:
        """Copy HF-named tensors into the parameters (q/k/v into their rows of `qkv_proj`);
        each weight matrix packed (or quantized to `quantize`) once complete. Raises for an
        unexpected tensor, a wrong shape, or a parameter never written."""
        params = dict(self.named_parameters())
        pending = {name: p.shape[0] for name, p in params.items()}
        for hf_name, tensor in weights:
            if isinstance(tensor, QuantizedWeight):
                raise ValueError(f"{hf_name}: quantized checkpoints are for decoders")
            mapped = self._our_name(hf_name)
            if mapped is None:
                continue
            name, rows = mapped
            if name not in params:
                raise ValueError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
            param = params[name]
            start, end = rows or (0, param.shape[0])
            if tuple(tensor.shape) != (end - start, *param.shape[1:]):
                raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {(end - start, *param.shape[1:])}")
            param.data[start:end].copy_(tensor)
            pending[name] -= end - start
            layer = self.get_submodule(name.rpartition(".")[0])
            if pending[name] == 0 and isinstance(layer, Linear) and name.endswith(".weight"):
                layer.finish_loading(None if isinstance(layer, VocabEmbedding) else quantize)
        missing = sorted(name for name, left in pending.items() if left != 0)
        if missing:
            raise ValueError(f"checkpoint lacks (or repeats) weights for: {missing}")

    def _head_linear(self, n_in: int, n_out: int) -> Linear:
        """A classification head's layer, on the encoder's device and dtype (frozen)."""
        weight = self.embeddings.LayerNorm.weight
        return Linear(n_in, n_out, device=weight.device, dtype=weight.dtype).requires_grad_(False)


class XLMRobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa: BERT with positions counted from pad_token_id + 1."""

    def offset_of(self, config: Any) -> int:
        return int(config.pad_token_id) + 1


class RobertaModel(XLMRobertaModel):
    pass


class BertForSequenceClassification(BertModel):
    """BERT with its pooler (dense + tanh on the [CLS] state) and a classifier: `classify`
    gives `num_labels` logits (one: a cross-encoder's relevance score)."""

    _uses_pooler: ClassVar[bool] = True

    def __init__(self, config: Any, attn_impl_cls: type[AttentionImpl], **kwargs: Any) -> None:
        super().__init__(config, attn_impl_cls, **kwargs)
        hidden, self.num_labels = config.hidden_size, int(config.num_labels)
        self.pooler = nn.Module()
        self.pooler.dense = self._head_linear(hidden, hidden)
        self.classifier = self._head_linear(hidden, self.num_labels)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, labels]
        return self.classifier(torch.tanh(self.pooler.dense(cls_states)))


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """XLM-RoBERTa with RoBERTa's classification head on the <s> state (dense + tanh, then
    out_proj to `num_labels` logits); no BERT pooler."""

    def __init__(self, config: Any, attn_impl_cls: type[AttentionImpl], **kwargs: Any) -> None:
        super().__init__(config, attn_impl_cls, **kwargs)
        hidden, self.num_labels = config.hidden_size, int(config.num_labels)
        self.classifier = nn.Module()
        self.classifier.dense = self._head_linear(hidden, hidden)
        self.classifier.out_proj = self._head_linear(hidden, self.num_labels)

    def classify(self, cls_states: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, labels]
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(cls_states)))
