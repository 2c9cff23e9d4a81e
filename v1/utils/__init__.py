"""Small helpers under vLLM's module paths (`vllm.utils.*`); the two its older scripts import
from `vllm.utils` itself are here too, and `random_uuid`, which its scripts use for request
ids."""

import uuid

from v1.utils.argparse_utils import FlexibleArgumentParser
from v1.utils.network_utils import get_open_port


def random_uuid() -> str:
    """vLLM's: a fresh random id (32 hex digits), e.g. for `AsyncLLM.generate`'s request_id."""
    return uuid.uuid4().hex


__all__ = ["FlexibleArgumentParser", "get_open_port", "random_uuid"]
