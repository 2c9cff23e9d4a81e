"""vLLM's `vllm.utils.serial_utils`: pooled vectors as bytes, in vLLM's wire formats. Each
vector is rounded to an `embed_dtype`, flattened, put in a byte order (`endianness`), then
base64'd into the JSON answer or sent raw (`encoding_format` "bytes", described by a
`metadata` header, or "bytes_only"). The pooling endpoints encode with it; clients decode
with it (`binary2tensor`; `v1.entrypoints.pooling.utils` is vLLM's path for the rest).

bfloat16 travels as its 16 bits (read back as float32's high half), fp8 as one byte per value:
numpy has neither type, so both cross numpy as integers of their width. "native" is the
server's byte order, as vLLM's.
"""

import math
import sys
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch

EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]


@dataclass(frozen=True, slots=True)
class DTypeInfo:
    """An embed dtype: the torch type a vector is rounded to, and the same-width types it is
    viewed as to cross numpy."""

    torch_dtype: torch.dtype
    view_dtype: torch.dtype
    numpy_dtype: type[np.generic]

    @property
    def nbytes(self) -> int:
        return self.torch_dtype.itemsize


EMBED_DTYPES: dict[str, DTypeInfo] = {
    "float32": DTypeInfo(torch.float32, torch.float32, np.float32),
    "float16": DTypeInfo(torch.float16, torch.float16, np.float16),
    "bfloat16": DTypeInfo(torch.bfloat16, torch.int16, np.int16),
    "fp8_e4m3": DTypeInfo(torch.float8_e4m3fn, torch.uint8, np.uint8),
    "fp8_e5m2": DTypeInfo(torch.float8_e5m2, torch.uint8, np.uint8),
}
ENDIANNESS: tuple[str, ...] = get_args(Endianness)


def _swaps(endianness: str) -> bool:
    return endianness not in ("native", sys.byteorder)


def tensor2binary(tensor: torch.Tensor, embed_dtype: str, endianness: str) -> bytes:
    """`tensor`'s values rounded to `embed_dtype`, flattened, in `endianness` byte order."""
    info = EMBED_DTYPES[embed_dtype]
    array = tensor.to(info.torch_dtype).flatten().contiguous().view(info.view_dtype).numpy()
    return (array.byteswap() if _swaps(endianness) else array).tobytes()


def binary2tensor(
    binary: bytes, shape: tuple[int, ...], embed_dtype: str, endianness: str
) -> torch.Tensor:
    """The inverse of `tensor2binary`: the tensor of `shape` (in `embed_dtype`) `binary` holds."""
    info = EMBED_DTYPES[embed_dtype]
    array = np.frombuffer(binary, dtype=info.numpy_dtype)
    if _swaps(endianness):
        array = array.byteswap()
    return torch.from_numpy(array.reshape(shape).copy()).view(info.torch_dtype)


@dataclass(slots=True)
class MetadataItem:
    """Where one vector lies in a "bytes" answer's body (`body[start:end]`) and how to read it:
    an element of the `metadata` header's `data`."""

    index: int
    embed_dtype: str
    endianness: str
    start: int
    end: int
    shape: tuple[int, ...]


def encode_vectors(
    tensors: list[torch.Tensor], embed_dtype: str, endianness: str
) -> tuple[bytes, list[MetadataItem]]:
    """The tensors back to back as one body, and where each one is in it."""
    chunks: list[bytes] = []
    items: list[MetadataItem] = []
    offset = 0
    for i, tensor in enumerate(tensors):
        chunk = tensor2binary(tensor, embed_dtype, endianness)
        items.append(MetadataItem(i, embed_dtype, endianness, offset, offset + len(chunk),
                                  tuple(tensor.shape)))
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks), items


def build_metadata_items(
    embed_dtype: str, endianness: str, shape: tuple[int, ...], n_request: int
) -> list[MetadataItem]:
    """A "bytes_only" body's layout, which its client knows: `n_request` vectors of `shape`."""
    size = math.prod(shape) * EMBED_DTYPES[embed_dtype].nbytes
    return [MetadataItem(i, embed_dtype, endianness, i * size, (i + 1) * size, shape)
            for i in range(n_request)]


def decode_pooling_output(items: list[MetadataItem], body: bytes) -> list[torch.Tensor]:
    """A "bytes" answer's vectors, in index order (a client's side of `encode_vectors`)."""
    return [
        binary2tensor(body[item.start:item.end], tuple(item.shape), item.embed_dtype,
                      item.endianness)
        for item in sorted(items, key=lambda item: item.index)
    ]
