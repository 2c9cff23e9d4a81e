"""vLLM's `vllm.platforms`: re-exported from `v1.compat.platforms` (its module `__getattr__`
detects `current_platform` at first use)."""

from v1.compat.platforms import Platform, __getattr__  # noqa: F401
