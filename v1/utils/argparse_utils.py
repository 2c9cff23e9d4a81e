"""vLLM's `vllm.utils.argparse_utils`: re-exported from `v1.compat.utils`."""

from v1.compat.utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
