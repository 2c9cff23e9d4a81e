"""Small helpers under vLLM's module paths (`vllm.utils.*`); the two its older scripts import
from `vllm.utils` itself are here too."""

from v1.utils.argparse_utils import FlexibleArgumentParser
from v1.utils.network_utils import get_open_port

__all__ = ["FlexibleArgumentParser", "get_open_port"]
