"""The engine: processor, output processor, engine core and its clients (docs/architecture.md).

Importing it loads no torch: a frontend (`LLM`, the server) that only generates never does.
What runs an engine loads torch first under OpenMP's passive wait policy
(`v1.openmp.load_torch_passively`): the engine process (`launch`), an engine in this
process (`InprocClient`), a Ray actor (`dp_ray`).
"""
