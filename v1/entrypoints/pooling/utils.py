"""vLLM's `vllm.entrypoints.pooling.utils`: reading an `encoding_format` "bytes" (or
"bytes_only") answer, re-exported from `v1.utils.serial_utils`."""

from v1.utils.serial_utils import MetadataItem, build_metadata_items, decode_pooling_output

__all__ = ["MetadataItem", "build_metadata_items", "decode_pooling_output"]
