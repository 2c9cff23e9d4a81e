"""Building blocks shared by every architecture in `v1.models`, each written once.

- `linear`: `Linear` (small CPU batches through a prepacked oneDNN weight) and `PackedWeight`;
- `norm`: `RMSNorm`, Llama's `w * x` and Gemma's `(1 + w) * x` flavours;
- `rotary`: RoPE tables for the `rope_scaling` types transformers defines;
- `mlp`: the gated MLP (`act(gate) * up`, silu or gelu-tanh);
- `attention`: fused q/k/v projection, optional per-head q/k norms, RoPE, the paged attention
  call (with its sliding window) and the output projection.
"""
