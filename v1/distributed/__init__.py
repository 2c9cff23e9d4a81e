"""vLLM's `vllm.distributed`: re-exported from `v1.compat.distributed`."""

from v1.compat.distributed import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
