"""The layers that hold a weight matrix, `Linear` and `VocabEmbedding`, each keeping exactly one
copy of its weight, in the form its matmul reads: oneDNN-packed fp32 on CPU (`PackedWeight`),
`QuantizedWeight` blocks when quantized, else the plain weight (the vocabulary matrix too, its
tied LM head going through oneDNN). Checkpoint rows are written into `weight`, then
`finish_loading` makes the final form and frees the plain one; GGUF blocks: `load_blocks`
(per shard of a fused projection), then `finish_loading` joins the shards (one block tensor
where they share a type, else `QuantizedShards`) and moves them into the layout this process's
kernels run fastest (`QuantizedWeight.repack_for`).
"""

import torch
import torch.nn.functional as F
from torch import nn

from v1.kernels.block_matmul import BLOCK_SIZES, kernels
from v1.models.layers.onednn import ONEDNN_LINEAR, onednn_linear
from v1.models.layers.quantized import MatmulRows, QuantizedShards, QuantizedWeight


class PackedWeight:
    """A [out, in] fp32 CPU weight held only as oneDNN's packed copy (same size, its own
    blocked layout)."""

    __slots__ = ("packed", "out_features", "in_features")

    BATCH_HINT = 64  # the batch oneDNN picks its blocking for; it serves any batch size

    def __init__(self, weight: torch.Tensor) -> None:
        if not self.supports(weight):
            raise ValueError(
                f"PackedWeight takes fp32 CPU weights with oneDNN, got {weight.dtype} on "
                f"{weight.device} (oneDNN: {ONEDNN_LINEAR})"
            )
        self.out_features, self.in_features = weight.shape
        with torch.inference_mode(False), torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                weight.detach(), self.BATCH_HINT
            )

    @staticmethod
    def supports(weight: torch.Tensor) -> bool:
        return ONEDNN_LINEAR and weight.device.type == "cpu" and weight.dtype == torch.float32

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight.T (+ bias) -> [..., out]; x fp32 on CPU."""
        return onednn_linear(x, self.packed, bias, self.out_features)

    def unpack(self) -> torch.Tensor:
        """The plain fp32 weight [out, in] (a copy), for inspection: the engine never needs it."""
        return self.packed.to_dense()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()


class Linear(nn.Module):
    """y = x @ W.T + b, W in one of the forms of the module docstring (`weight_form`)."""

    # Whether finish_loading may pack the fp32 weight: not where its rows are read directly.
    packable = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        # The plain weight, until finish_loading / load_blocks replace it (then None).
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        )
        self.kernel: PackedWeight | QuantizedWeight | QuantizedShards | None = None
        # GGUF blocks loaded so far, by first row, until finish_loading joins them.
        self._blocks: list[tuple[int, QuantizedWeight]] = []

    def forward(self, x: torch.Tensor, rows: MatmulRows | None = None) -> torch.Tensor:
        return self.linear(x, rows)

    def linear(self, x: torch.Tensor, rows: MatmulRows | None = None) -> torch.Tensor:
        """`rows`: the step's matmul path per row, for GGUF blocks (None: by the row count
        under the default policy); other forms have one path."""
        if isinstance(self.kernel, QuantizedWeight) and rows is not None:
            return rows.linear(self.kernel, x, self.bias)
        if isinstance(self.kernel, QuantizedShards):
            return self.kernel.linear(x, self.bias, rows)
        if self.kernel is not None:
            return self.kernel.linear(x, self.bias)
        assert self.weight is not None
        if PackedWeight.supports(self.weight) and x.dtype == torch.float32:
            return onednn_linear(x, self.weight, self.bias, self.out_features)
        return F.linear(x, self.weight, self.bias)

    # ---- loading ------------------------------------------------------------------------

    def finish_loading(self, quantize: str | None = None) -> None:
        """All rows of `weight` (or of the blocks) are written: make the final form. GGUF
        blocks (`load_blocks`) covering every row become the kernel (shards of one type joined
        into one block tensor, of several types a `QuantizedShards`); where some rows came as
        fp32 the blocks are dequantized into `weight`, which then takes the fp32 forms.
        `quantize`: a block kind ("q8_0") to quantize the fp32 weight to, or None to keep it
        fp32 (packed on CPU). Rows that are no whole number of blocks (in_features not a
        multiple of the kind's block) stay fp32, as llama.cpp's quantizer keeps such tensors
        unquantized. Blocks are laid out for this process's kernels
        (`QuantizedWeight.repack_for`)."""
        if self._blocks:
            self._join_blocks()
        if self.kernel is None:
            assert self.weight is not None
            if quantize is not None and self.in_features % BLOCK_SIZES[quantize][0] == 0:
                self.kernel = QuantizedWeight.quantize(self.weight.detach().float(), quantize)
            elif self.packable and PackedWeight.supports(self.weight):
                self.kernel = PackedWeight(self.weight)
            else:
                return
            self.weight = None
        if isinstance(self.kernel, QuantizedWeight | QuantizedShards):
            self.kernel.repack_for(kernels())

    def load_blocks(self, rows: tuple[int, int], blocks: QuantizedWeight, name: str) -> None:
        """GGUF blocks for weight rows [start, end) (a fused projection's shard, or all),
        held as they are (the file's mapping: never written) until `finish_loading`."""
        if self.weight is not None and self.weight.device.type != "cpu":
            raise ValueError(f"{name}: quantized weights run on CPU only")
        if rows[1] - rows[0] != blocks.out_features:
            raise ValueError(f"{name}: {blocks.out_features} rows of blocks for rows {rows}")
        self._blocks.append((rows[0], blocks))

    def _join_blocks(self) -> None:
        placed = sorted(self._blocks, key=lambda part: part[0])
        self._blocks = []
        parts = [w for _, w in placed]
        kinds = {w.kind for w in parts}
        if sum(w.out_features for w in parts) < self.out_features:
            # Other rows came as fp32 (a type this library runs as fp32): one fp32 matrix.
            assert self.weight is not None
            for start, w in placed:
                self.weight.data[start:start + w.out_features].copy_(w.dequantize())
            return
        if len(parts) == 1:
            self.kernel = parts[0]
        elif len(kinds) == 1:
            # Shards of one type: one block tensor (a copy), so a fused matmul reads it whole.
            self.kernel = QuantizedWeight.stacked(parts, kernels())
        else:
            self.kernel = QuantizedShards(parts)
        self.weight = None

    # ---- inspection ---------------------------------------------------------------------

    @property
    def weight_form(self) -> str:
        """"fp32" (plain), "packed", or the GGUF block kind ("q4_1", "q6_k"), whatever the
        blocks' layout ("q4_k+q4_k+q6_k": a fused projection's shards of several types)."""
        if isinstance(self.kernel, QuantizedWeight | QuantizedShards):
            return self.kernel.gguf_kind
        return "packed" if self.kernel is not None else "fp32"

    @property
    def weight_nbytes(self) -> int:
        """Bytes held for the weight (bias not counted)."""
        if self.kernel is not None:
            return self.kernel.nbytes
        assert self.weight is not None
        return self.weight.numel() * self.weight.element_size()

    def float_weight(self) -> torch.Tensor:
        """The weight as a plain fp32 [out, in] matrix, whatever its form (a copy)."""
        if isinstance(self.kernel, PackedWeight):
            return self.kernel.unpack()
        if isinstance(self.kernel, QuantizedWeight | QuantizedShards):
            return self.kernel.dequantize()
        assert self.weight is not None
        return self.weight.detach().float().clone()


class VocabEmbedding(Linear):
    """The token embedding [vocab, hidden]: `forward` looks rows up. With tied embeddings it is
    also the LM head (`linear`), so one matrix serves both; never packed, as lookups read its
    rows (oneDNN's packed layout has no rows to read)."""

    packable = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(embedding_dim, num_embeddings, bias=False, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.kernel, QuantizedWeight):
            return self.kernel.embedding(ids)
        return F.embedding(ids, self.weight)
