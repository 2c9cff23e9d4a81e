"""The disk tier's files (DiskKVStore) on small random KV caches: no model."""

import os
import shutil
import stat
import threading
import time

import pytest
import torch

from v1.core.sched.output import KVLoad
from v1.worker import kv_disk_store
from v1.worker.kv_disk_store import HEADER_BYTES, DiskKVStore, open_kv_cache_dir

LAYERS, BLOCK, HEADS, HEAD = 3, 4, 2, 8
SHAPE = (LAYERS, 2, BLOCK, HEADS, HEAD)


def caches(num_blocks: int = 16, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(2, num_blocks, BLOCK, HEADS, HEAD).to(dtype) for _ in range(LAYERS)]


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_store(tmp_path, dtype=torch.float32, **kwargs) -> DiskKVStore:
    return DiskKVStore(tmp_path, {"test": str(dtype)}, SHAPE, dtype, **kwargs)


def read(store: DiskKVStore, dst: list[torch.Tensor], block_ids: list[int], hashes) -> int:
    """One load, read to its end in one call: the blocks read."""
    return store.load(dst, [KVLoad("r", block_ids, list(hashes))]).get("r", -1)


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
    assert read(store, dst, [10, 11, 12], [h(0), h(1), h(2)]) == 3
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
    assert read(store, dst, [8, 9, 10, 11], [h(0), h(1), h(2), h(3)]) == 2
    assert not path.exists()
    assert all(torch.equal(d[:, 10:], b[:, 10:]) for d, b in zip(dst, before))  # untouched
    assert read(store, dst, [8], [h(99)]) == 0  # never written
    store.path(h(3)).write_bytes(store.path(h(3)).read_bytes()[:100])  # truncated
    assert read(store, dst, [8], [h(3)]) == 0
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
    read(store, caches(), [0], [h(1)])
    assert store.scan() == [h(2), h(0), h(1)]
    store.close()


def test_a_full_write_queue_drops_the_write_without_blocking(tmp_path):
    store = make_store(tmp_path, max_queue_bytes=1)
    store.save(caches(), [(0, h(0))])
    assert store.take_stored() == [(h(0), False)]
    store.close()
    assert not list(tmp_path.glob("*/*.kv"))


def test_a_write_failing_with_a_bug_leaves_the_writer_serving(tmp_path, monkeypatch):
    """Not an OSError (a disk's failure, reported and survived since ever): anything else
    raised in a write killed the writer thread, and the next flush (a reset, shutdown)
    waited forever."""
    monkeypatch.setattr(kv_disk_store, "_MAX_BATCH_BYTES", 1)  # one block per item
    digest, calls = kv_disk_store._digest, []

    def failing_once(identity, chunks):
        calls.append(identity)
        if len(calls) == 1:
            raise ValueError("a bug")
        return digest(identity, chunks)

    monkeypatch.setattr(kv_disk_store, "_digest", failing_once)
    store = make_store(tmp_path)
    src = caches()
    store.save(src, [(0, h(0)), (1, h(1))])
    flushed = threading.Thread(target=store.flush, daemon=True)
    flushed.start()
    flushed.join(timeout=30)
    assert not flushed.is_alive(), "flush waits on a dead writer"
    assert sorted(store.take_stored()) == [(h(0), False), (h(1), True)]
    assert [p.name for p in tmp_path.glob("*/*") if p.name != "meta.json"] == [
        store.path(h(1)).name]  # no temporary left
    store.save(src, [(2, h(2))])
    store.flush()
    assert store.take_stored() == [(h(2), True)]
    store.close()


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


# ---- who may touch the files ----------------------------------------------------------------


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        root = open_kv_cache_dir(str(tmp_path / "kv"))
        store = make_store(root)
        store.save(caches(), [(0, h(0))])
        store.flush()
    finally:
        os.umask(old)
    assert mode(root) == 0o700 and mode(store.directory) == 0o700
    assert mode(store.directory / "meta.json") == 0o600
    assert mode(store.path(h(0))) == 0o600
    store.close()


@pytest.mark.parametrize("bits, owner", [(0o755, 0), (0o770, 0), (0o700, 1)])
def test_a_root_others_can_reach_is_refused_naming_path_mode_and_owner(
    tmp_path, monkeypatch, bits, owner
):
    root = tmp_path / "kv"
    root.mkdir()
    os.chmod(root, bits)
    uid = os.stat(root).st_uid
    # Another user's directory: this process is made to run as someone else.
    monkeypatch.setattr(kv_disk_store.os, "geteuid", lambda: uid + owner)
    with pytest.raises(ValueError) as e:
        open_kv_cache_dir(str(root))
    message = str(e.value)
    assert f"kv_cache_dir '{root}'" in message and f"mode {bits:04o}" in message
    assert f"owner uid {uid}" in message and "0700" in message
    # Made right, it is taken.
    os.chmod(root, 0o700)
    monkeypatch.setattr(kv_disk_store.os, "geteuid", lambda: uid)
    assert open_kv_cache_dir(str(root)) == root


def test_temporary_files_never_follow_a_planted_link(tmp_path, monkeypatch):
    """A link planted where a temporary goes (predictable names: the pid, the block's name)
    would make the writer overwrite what it points to; the writer creates its temporaries
    with O_EXCL|O_NOFOLLOW under names with a random part instead."""
    store = make_store(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    name = store.path(h(0)).name
    for planted in (f".{name}.{os.getpid()}.tmp", f".meta.json.{os.getpid()}.tmp"):
        (store.directory / planted).symlink_to(victim)
    flags_seen = []
    real_open = os.open

    def spy(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            flags_seen.append((os.fspath(path), flags))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(kv_disk_store.os, "open", spy)
    store.save(caches(), [(0, h(0))])
    store.flush()
    assert store.take_stored() == [(h(0), True)]
    assert victim.read_bytes() == b"precious"
    assert flags_seen and all(
        flags & os.O_EXCL and flags & os.O_NOFOLLOW for _, flags in flags_seen
    )
    tmp_names = {os.path.basename(p) for p, _ in flags_seen}
    assert f".{name}.{os.getpid()}.tmp" not in tmp_names
    store.close()


def test_a_file_copied_onto_another_blocks_name_is_a_miss(tmp_path):
    """The header names the block (hash: tokens, salt, adapter) and the directory's key (the
    model and KV setting), under the checksum: a file is read only as what it was written."""
    store = make_store(tmp_path)
    src = caches()
    store.save(src, [(0, h(0)), (1, h(1))])
    store.flush()
    shutil.copyfile(store.path(h(0)), store.path(h(1)))
    dst = caches()
    before = [c.clone() for c in dst]
    assert read(store, dst, [5, 6], [h(0), h(1)]) == 1
    assert all(torch.equal(d[:, 6], b[:, 6]) for d, b in zip(dst, before))
    assert not store.path(h(1)).exists()  # removed, to be written again
    # The same file under another directory (another model or KV setting): a miss too.
    other = make_store(tmp_path, torch.float32, max_queue_bytes=1 << 20)
    other.key = bytes(16)
    assert other.directory == store.directory
    assert read(other, dst, [5], [h(0)]) == 0
    store.close()
    other.close()


def test_a_fifo_or_a_link_in_place_of_a_block_file_is_a_miss_without_blocking(tmp_path):
    """A FIFO would block a plain open() for reading until someone writes to it: the step's
    thread and every stream with it. The read opens with O_NONBLOCK|O_NOFOLLOW and reads
    regular files only. (The join's timeout only keeps a failing run from hanging.)"""
    store = make_store(tmp_path)
    store.save(caches(), [(i, h(i)) for i in range(3)])
    store.flush()
    fifo = store.path(h(1))
    fifo.unlink()
    os.mkfifo(fifo)
    result = []
    reader = threading.Thread(
        target=lambda: result.append(read(store, caches(), [4, 5, 6], [h(0), h(1), h(2)])),
        daemon=True,
    )
    reader.start()
    reader.join(30)
    if reader.is_alive():  # blocked in open(): a writer lets it go, then fail
        with open(fifo, "wb"):
            pass
        reader.join()
        pytest.fail("the read blocked on a FIFO")
    assert result == [1] and not fifo.exists()
    # A link to a file of the right size and content is not followed either.
    store.path(h(2)).rename(tmp_path / "elsewhere")
    store.path(h(2)).symlink_to(tmp_path / "elsewhere")
    assert store.scan() == [h(0)]  # not indexed at start-up either
    assert read(store, caches(), [6], [h(2)]) == 0
    store.close()


def test_reads_are_bounded_per_call_and_go_on_in_the_next(tmp_path):
    """`load` reads at most `max_read_bytes` of files per call (one block at least): a long
    read takes several steps, each reporting the loads it finished."""
    probe = make_store(tmp_path)
    file_bytes = probe.file_bytes
    probe.close()
    store = make_store(tmp_path, max_read_bytes=3 * file_bytes + 1)
    src = caches()
    store.save(src, [(i, h(i)) for i in range(8)])
    store.flush()
    opened = []
    real_read = store._read_blocks

    def counting(kv_caches, block_ids, hashes):
        opened.append(len(hashes))
        return real_read(kv_caches, block_ids, hashes)

    store._read_blocks = counting
    dst = caches()
    loads = [KVLoad("a", [8, 9, 10, 11, 12], [h(i) for i in range(5)]),
             KVLoad("b", [13, 14], [h(5), h(6)])]
    reports = []
    for step_loads in (loads, [], [], []):
        opened.clear()
        reports.append(store.load(dst, step_loads))
        assert sum(opened) <= 3
    assert reports == [{}, {"a": 5}, {"b": 2}, {}]
    for i, block in enumerate(range(8, 15)):
        assert all(torch.equal(d[:, block], s[:, i]) for d, s in zip(dst, src))
    store.close()
