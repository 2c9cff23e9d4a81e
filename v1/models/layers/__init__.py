"""Building blocks shared by every architecture in `v1.models`, each written once.

- `linear`: `Linear` and `VocabEmbedding`, each holding one copy of its weight: oneDNN-packed
  fp32 (`PackedWeight`), GGUF blocks (`QuantizedWeight`), or plain;
- `quantized`: `QuantizedWeight`, Q4_1 / Q8_0 blocks and the paths (C kernels, torch) that
  multiply with them, and `MatmulPolicy`, the rule that gives each row its path;
- `ops`: the step's elementwise ops (RMSNorm, RoPE, SiLU-and-mul), torch or C;
- `norm`: `RMSNorm`, Llama's `w * x` and Gemma's `(1 + w) * x` flavours;
- `rotary`: RoPE tables for the `rope_scaling` types transformers defines;
- `mlp`: the gated MLP (`act(gate) * up`, silu or gelu-tanh);
- `attention`: fused q/k/v projection, optional per-head q/k norms, RoPE, the paged attention
  call (with its sliding window) and the output projection.
"""
