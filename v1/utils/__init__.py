"""vLLM's `vllm.utils`: re-exported from `v1.compat.utils`."""

from v1.compat.utils import FlexibleArgumentParser, get_open_port, random_uuid

__all__ = ["FlexibleArgumentParser", "get_open_port", "random_uuid"]
