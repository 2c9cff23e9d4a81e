"""Model architectures over the paged KV cache, the registry that picks one per checkpoint
(`registry.get_model_cls`), and loading them (`loader`, `gguf_conversion`). `decoder.py` is the
decoder they all are, `layers/` the pieces they share, each `<arch>.py` only what its
architecture changes. Nothing here imports `v1.worker`: the runner hands a model its step's
plan (`step_plan.StepPlan`), never itself. This file imports nothing: a frontend reads a
model's files (`model_files`, `gguf_cache`) without loading torch.
"""
