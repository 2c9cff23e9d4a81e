"""The disk tier's files (DiskKVStore) on small random KV caches: no model."""

import os
import time

import pytest
import torch

from v1.worker import kv_disk_store
from v1.worker.kv_disk_store import HEADER_BYTES, DiskKVStore

LAYERS, BLOCK, HEADS, HEAD = 3, 4, 2, 8
SHAPE = (LAYERS, 2, BLOCK, HEADS, HEAD)


def caches(num_blocks: int = 16, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, BLOCK, HEADS, HEAD).to(dtype) for _ in range(LAYERS)]


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_store(tmp_path, dtype=torch.float32, **kwargs) -> DiskKVStore:
    return DiskKVStore(tmp_path, {"test": str(dtype)}, SHAPE, dtype, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_in_batches(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(kv_disk_store, "_MAX_BATCH_BYTES", 1)  # one block per batch
    store = make_store(tmp_path, dtype)
    src = caches(dtype=dtype)
    store.save(src, [(3, h(0)), (7, h(1)), (1, h(2))])
    store.flush()
    assert sorted(store.take_stored()) == [(h(i), True) for i in range(3)]
    assert all(p.stat().st_size == store.file_bytes for p in tmp_path.glob("*/*.kv"))
    dst = caches(dtype=dtype)
    assert store.load(dst, [10, 11, 12], [h(0), h(1), h(2)]) == 3
    for s, d in zip(src, dst):
        assert torch.equal(d[:, 10], s[:, 3]) and torch.equal(d[:, 11], s[:, 7])
        assert torch.equal(d[:, 12], s[:, 1])
    store.close()


def test_a_read_stops_at_a_missing_or_corrupt_file_and_removes_the_corrupt(tmp_path):
    store = make_store(tmp_path)
    src = caches()
    store.save(src, [(i, h(i)) for i in range(4)])
    store.flush()
    path = store.path(h(2))
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 5] ^= 1  # one bit of the payload
    path.write_bytes(data)
    dst = caches()
    before = [c.clone() for c in dst]
    assert store.load(dst, [8, 9, 10, 11], [h(0), h(1), h(2), h(3)]) == 2
    assert not path.exists()
    assert all(torch.equal(d[:, 10:], b[:, 10:]) for d, b in zip(dst, before))  # untouched
    assert store.load(dst, [8], [h(99)]) == 0  # never written
    store.path(h(3)).write_bytes(store.path(h(3)).read_bytes()[:100])  # truncated
    assert store.load(dst, [8], [h(3)]) == 0
    store.close()


def test_scan_lists_complete_files_oldest_first_and_drops_stale_temporaries(tmp_path):
    store = make_store(tmp_path)
    store.save(caches(), [(i, h(i)) for i in range(3)])
    store.flush()
    now = time.time()
    for age, i in ((30, 1), (20, 2), (10, 0)):
        os.utime(store.path(h(i)), (now - age, now - age))
    store.path(h(9)).write_bytes(b"short")
    stale = store.directory / ".x.kv.1.tmp"
    stale.write_bytes(b"")
    os.utime(stale, (now - 3600, now - 3600))
    fresh = store.directory / ".y.kv.1.tmp"  # another process's write under way
    fresh.write_bytes(b"")
    assert store.scan() == [h(1), h(2), h(0)]
    assert not stale.exists() and fresh.exists()
    # A read makes a file the most recent.
    store.load(caches(), [0], [h(1)])
    assert store.scan() == [h(2), h(0), h(1)]
    store.close()


def test_a_full_write_queue_drops_the_write_without_blocking(tmp_path):
    store = make_store(tmp_path, max_queue_bytes=1)
    store.save(caches(), [(0, h(0))])
    assert store.take_stored() == [(h(0), False)]
    store.close()
    assert not list(tmp_path.glob("*/*.kv"))


def test_another_key_is_another_directory_and_clear_removes_only_its_files(tmp_path):
    a = make_store(tmp_path, torch.float32)
    b = make_store(tmp_path, torch.bfloat16)
    assert a.directory != b.directory
    a.save(caches(), [(0, h(0))])
    b.save(caches(dtype=torch.bfloat16), [(0, h(0))])
    a.clear()
    b.flush()
    assert a.scan() == [] and b.scan() == [h(0)]
    a.close()
    b.close()
