"""The disk tier's index, as the scheduler keeps it: which block hashes are on disk, in LRU
order, bounded by bytes (`max_blocks = capacity_bytes // block_bytes`). Pure bookkeeping: the
files are the worker's (`v1.worker.kv_disk_store`), which scans them at start-up and reports
every write. The protocol (messages ride on SchedulerOutput / ModelRunnerOutput):

    scheduler                                   worker
    want_store(h) -> True: h is `storing`   ->  copies the block after the forward, writes it
    stored(h, ok)                           <-  ok: h indexed, most recent; the oldest
                                                beyond `max_blocks` become deletes
    take_deletes()                          ->  unlinks those files (FIFO after the writes)
    drop(h)                                 <-  h's file was missing or corrupt

Invariants: `storing` and the index are disjoint; len(index) <= max_blocks; a hash handed out
in `take_deletes` is no longer indexed.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from v1.request import BlockHash


class DiskBlockIndex:
    def __init__(
        self, capacity_bytes: int, block_bytes: int, present: Iterable[BlockHash] = ()
    ) -> None:
        """`present`: the hashes on disk at start-up, least recently used first."""
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if capacity_bytes < block_bytes:
            raise ValueError(
                f"kv_cache_disk_bytes ({capacity_bytes}) is less than one KV block on disk "
                f"({block_bytes} bytes)"
            )
        self.block_bytes = block_bytes
        self.max_blocks = capacity_bytes // block_bytes
        self._lru: OrderedDict[BlockHash, None] = OrderedDict.fromkeys(present)
        self._storing: set[BlockHash] = set()
        self._deletes: list[BlockHash] = []
        self._evict()  # a smaller bound than the last run's: the oldest go
        self.num_stored = 0  # blocks written since start
        self.num_loaded = 0  # blocks read back since start

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    @property
    def num_bytes(self) -> int:
        return len(self._lru) * self.block_bytes

    def count_prefix(self, block_hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        """How many of block_hashes[start:stop], in a row from `start`, are on disk."""
        lru = self._lru
        n = 0
        for i in range(start, stop):
            if block_hashes[i] not in lru:
                break
            n += 1
        return n

    def touch(self, block_hashes: Iterable[BlockHash]) -> None:
        """Mark as just used (those on disk; others are ignored)."""
        lru = self._lru
        for block_hash in block_hashes:
            if block_hash in lru:
                lru.move_to_end(block_hash)

    def want_store(self, block_hash: BlockHash) -> bool:
        """Whether to write this block: not on disk nor being written. True marks it
        `storing` until `stored` reports it."""
        if block_hash in self._lru or block_hash in self._storing:
            return False
        self._storing.add(block_hash)
        return True

    def stored(self, block_hash: BlockHash, ok: bool) -> None:
        self._storing.discard(block_hash)
        if ok:
            self._lru[block_hash] = None
            self._lru.move_to_end(block_hash)
            self.num_stored += 1
            self._evict()

    def drop(self, block_hash: BlockHash) -> None:
        """Forget a hash whose file turned out missing or corrupt (the worker removed it)."""
        self._lru.pop(block_hash, None)

    def _evict(self) -> None:
        lru = self._lru
        while len(lru) > self.max_blocks:
            self._deletes.append(lru.popitem(last=False)[0])

    def take_deletes(self) -> list[BlockHash]:
        """The files to remove since the last call (oldest first)."""
        deletes, self._deletes = self._deletes, []
        return deletes

    def clear(self) -> None:
        """Forget everything (the worker removes the files)."""
        self._lru.clear()
        self._storing.clear()
        self._deletes.clear()

    def check_integrity(self) -> None:
        assert len(self._lru) <= self.max_blocks, "over the byte bound"
        assert not (self._storing & self._lru.keys()), "a hash both stored and being stored"
