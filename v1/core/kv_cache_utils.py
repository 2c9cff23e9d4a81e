"""Chained hashing of full KV blocks, for prefix caching.

    block i's hash = H(block i-1's hash, token ids of block i, extra keys of block i)

H is xxh3-128, so a hit is trusted without comparing tokens; extra keys (`cache_salt`, the
LoRA adapter's id and how many times that id was removed) go into the first block only. Only
full blocks are hashed. Why: docs/design.md, "The KV cache".
"""

from array import array
from collections.abc import Mapping

import xxhash

from v1.request import BlockHash, BlockHasher, Request

# The parent of a request's first block.
NONE_HASH: BlockHash = xxhash.xxh3_128_digest(b"v1 prefix cache")


def hash_block_tokens(
    parent_hash: BlockHash,
    token_ids: list[int],
    extra_key: str | None = None,
    lora_int_id: int | None = None,
    lora_generation: int = 0,
) -> BlockHash:
    h = xxhash.xxh3_128()
    h.update(parent_hash)
    h.update(array("q", token_ids).tobytes())
    # Tagged fields after the fixed-size token bytes: no salt can read as an adapter id.
    if lora_int_id is not None:
        h.update(b"\x00lora")
        h.update(lora_int_id.to_bytes(8, "little"))
        if lora_generation:  # 0 hashes as before: the DP router's hashes stay the cores'
            h.update(b"\x00gen")
            h.update(lora_generation.to_bytes(8, "little"))
    if extra_key is not None:
        h.update(b"\x00salt")
        h.update(extra_key.encode())
    return h.digest()


_NONE: list[BlockHash] = []  # shared and never mutated: the common case allocates nothing


class _FullBlockHasher:
    """`BlockHasher`: the hashes of a request's full blocks not hashed yet. `Request` calls
    it only once a block may be full (it reads `block_size`)."""

    __slots__ = ("block_size", "lora_generations")

    def __init__(self, block_size: int, lora_generations: Mapping[int, int]) -> None:
        self.block_size = block_size
        self.lora_generations = lora_generations

    def __call__(self, request: Request) -> list[BlockHash]:
        block_size = self.block_size
        hashes = request.block_hashes
        start = len(hashes) * block_size
        tokens = request.all_token_ids
        if start + block_size > len(tokens):
            return _NONE
        new_hashes: list[BlockHash] = []
        parent = hashes[-1] if hashes else NONE_HASH
        lora = request.lora_request
        while start + block_size <= len(tokens):
            if start == 0:
                lora_id = None if lora is None else lora.lora_int_id
                parent = hash_block_tokens(
                    parent, tokens[:block_size], request.cache_salt, lora_id,
                    0 if lora_id is None else self.lora_generations.get(lora_id, 0),
                )
            else:
                parent = hash_block_tokens(parent, tokens[start : start + block_size])
            new_hashes.append(parent)
            start += block_size
        return new_hashes


def hash_token_blocks(token_ids: list[int], block_size: int) -> list[BlockHash]:
    """The chained hashes of the full blocks of unsalted token ids (a declared prefix):
    those of a request with this prompt."""
    hashes: list[BlockHash] = []
    parent = NONE_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def max_hit_blocks(request: Request, block_size: int) -> int:
    """How many leading full blocks a prefix-cache hit may cover: never the last token,
    which is always computed (its logits are needed)."""
    return min(len(request.block_hashes), (request.num_tokens - 1) // block_size)


def make_block_hasher(
    block_size: int, lora_generations: Mapping[int, int] | None = None
) -> BlockHasher:
    """A hasher for `Request`s' blocks of `block_size` tokens. `lora_generations`: how many
    times each adapter id was removed (read at each hash; missing: 0)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return _FullBlockHasher(block_size, {} if lora_generations is None else lora_generations)
