"""The OpenAI-compatible server (`python -m v1 serve`).

Importing it loads torch under OpenMP's passive wait policy (`v1.openmp`): the server's
pooling encodings and LoRA checks use it, and the engine processes it forks inherit its
runtime, so it must be the passive one.
"""

from v1.openmp import load_torch_passively

load_torch_passively()
