"""vLLM's `vllm.utils.network_utils`: re-exported from `v1.compat.utils`."""

from v1.compat.utils import get_open_port

__all__ = ["get_open_port"]
