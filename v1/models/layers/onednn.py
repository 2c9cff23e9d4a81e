"""fp32 matmuls on CPU through oneDNN, against a plain or a prepacked weight.

MKL (behind F.linear) repacks the weight on every call and takes slower code paths on this AMD
CPU; oneDNN's linear takes either the plain [out, in] weight or a copy packed once (see
`linear.PackedWeight`), and both layers and dequantized GGUF blocks go through it.
"""

import torch


def _available() -> bool:
    try:
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        )
    except (AttributeError, RuntimeError):
        return False


ONEDNN_LINEAR = _available()


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """x [..., in] @ weight.T (+ bias) by oneDNN; `weight` plain or packed, fp32 on CPU."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)
