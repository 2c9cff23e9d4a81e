"""Building blocks shared by every architecture in `v1.models`, each written once: `linear`
(`Linear`, `VocabEmbedding`: one copy of each weight, packed fp32 or quantized blocks),
`quantized` (the quantized blocks, their matmul paths and `MatmulPolicy`), `ops` (the step's
elementwise ops), `norm` (RMSNorm), `rotary` (RoPE tables), `mlp` (the gated MLP) and
`attention` (projections, q/k norms, RoPE, the paged attention call).
"""
