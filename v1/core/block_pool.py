"""Physical KV blocks, the free list threaded through them, and the prefix-cache index.

The free list is a doubly linked list of `KVCacheBlock`s in eviction order:

    head <-> [next to hand out] <-> ... <-> [most recently freed, cached] <-> tail

Freed hashed blocks go to the tail (LRU), unhashed ones to the head; a free block stays
findable in `cached_block_hash_to_block` until `get_new_blocks` hands it out (lazy eviction); a
hit on a free block unlinks it in O(1). A pinned block (a declared prefix) holds one extra
reference for the pool's life. Invariants (`check_integrity`): a block is in the free list iff
`ref_cnt == 0`; every hashed block is in the index under its hash and vice versa; a pinned
block is hashed and referenced.
"""

from collections.abc import Iterable

from v1.request import BlockHash


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """O(1) append / appendleft / remove, O(n) popleft_n, linked through the blocks themselves."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels: the list is never empty of links, so no operation branches on None.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Unlink the first `n` blocks in one splice."""
        out = []
        block = self._head
        for _ in range(n):
            block = block.next_free_block
            if block is self._tail or block is None:
                raise ValueError(f"cannot take {n} blocks: only {len(out)} are free")
            out.append(block)
        nxt = block.next_free_block
        assert nxt is not None
        self._head.next_free_block = nxt
        nxt.prev_free_block = self._head
        for block in out:
            block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self._insert_after(self._tail.prev_free_block, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        assert prev is not None
        nxt = prev.next_free_block
        assert nxt is not None
        block.prev_free_block = prev
        block.next_free_block = nxt
        prev.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out = []
        block = self._head.next_free_block
        while block is not self._tail and block is not None:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.pinned: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free list, evicting their cached content."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        out = self.free_block_queue.popleft_n(num_blocks)
        for block in out:
            if block.block_hash is not None:
                self._unhash(block)
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache hits; a hit on a free block removes it from the list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int
    ) -> None:
        """Index blocks[start:end] under their hashes (they are full of known tokens)."""
        index = self.cached_block_hash_to_block
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None:  # a hit: indexed already
                continue
            block_hash = block_hashes[i]
            # Another request may have computed the same block in parallel: keep the first
            # copy indexed and leave this one unhashed, so it is reused first once freed.
            if block_hash not in index:
                block.block_hash = block_hash
                index[block_hash] = block

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Make blocks unfindable: their K/V will not hold what their hashes say."""
        for block in blocks:
            self._unhash(block)

    def _unhash(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        if block_hash is not None and self.cached_block_hash_to_block.get(block_hash) is block:
            del self.cached_block_hash_to_block[block_hash]
        block.block_hash = None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero go back to the free list in order."""
        queue = self.free_block_queue
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block)

    def pin(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Keep these cached blocks out of eviction for good (one extra reference each)."""
        for block in blocks:
            block_hash = block.block_hash
            assert block_hash is not None, f"{block} is not cached: it cannot be pinned"
            if block_hash not in self.pinned:
                self.pinned[block_hash] = block
                self.touch((block,))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block but the pinned ones; refused (False) while a request
        holds any block."""
        if self.get_num_free_blocks() + len(self.pinned) != self.num_blocks:
            return False
        for block in self.blocks:
            if block.ref_cnt == 0:
                block.block_hash = None
        self.cached_block_hash_to_block = dict(self.pinned)
        return True

    def check_integrity(self) -> None:
        free = self.free_block_queue.get_all_free_blocks()
        assert len(free) == self.free_block_queue.num_free_blocks, "free count drifted"
        assert len({b.block_id for b in free}) == len(free), "a block is in the free list twice"
        assert all(b.ref_cnt == 0 for b in free), "a referenced block is in the free list"
        num_zero = sum(1 for b in self.blocks if b.ref_cnt == 0)
        assert num_zero == len(free), "a block with ref_cnt 0 is missing from the free list"
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref_cnt"
        for block_hash, block in self.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash, f"index points at {block} with another hash"
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert num_hashed == len(self.cached_block_hash_to_block), "hashed block not indexed"
        for block_hash, block in self.pinned.items():
            assert self.cached_block_hash_to_block.get(block_hash) is block, f"{block} unpinned"
            assert block.ref_cnt >= 1, f"pinned {block} has no reference"
