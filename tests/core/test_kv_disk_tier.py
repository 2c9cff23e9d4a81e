"""The disk tier's core half: the index (LRU by bytes) and the scheduler's read/write protocol,
with a fake runner whose "disk" is a dict of block hashes."""

import pytest

from tests.core.utils import fake_model_output, make_request
from v1.config import CacheConfig, SchedulerConfig
from v1.core.kv_disk_index import DiskBlockIndex
from v1.core.sched.output import SchedulerOutput
from v1.core.sched.scheduler import Scheduler
from v1.request import RequestStatus

B = 4  # block size


def make_tier_scheduler(num_blocks: int = 64, disk_blocks: int = 100, **kwargs) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64, **kwargs),
        CacheConfig(block_size=B),
        num_blocks,
        disk_index=DiskBlockIndex(disk_blocks * 10, 10),
    )


class FakeDisk:
    """The runner's half: `files` is the directory; loads read what is there."""

    def __init__(self) -> None:
        self.files: set[bytes] = set()
        self.block_hash: dict[int, bytes] = {}  # block id -> the hash of what it holds
        self.fail: set[bytes] = set()  # files that are corrupt

    def step(self, s: Scheduler, delay_loads: bool = False) -> SchedulerOutput:
        out = s.schedule()
        self.files.difference_update(out.kv_deletes)
        loaded = {}
        for load in out.kv_loads:
            n = 0
            for block_id, h in zip(load.block_ids, load.block_hashes):
                if h not in self.files or h in self.fail:
                    break
                self.block_hash[block_id] = h
                n += 1
            loaded[load.req_id] = n
        self.files.update(h for _, h in out.kv_stores)
        result = fake_model_output(s, out)
        result.kv_stored = [(h, True) for _, h in out.kv_stores]
        if delay_loads:
            self.pending = loaded
        else:
            result.kv_loaded = loaded
        s.update_from_output(out, result)
        s.check_integrity()
        return out


def report(s: Scheduler, out: SchedulerOutput, loaded: dict[str, int] | None = None) -> None:
    """The runner's output for a step run by hand: every store written, `loaded` read."""
    result = fake_model_output(s, out)
    result.kv_stored = [(h, True) for _, h in out.kv_stores]
    result.kv_loaded = loaded or {}
    s.update_from_output(out, result)


def drain(s: Scheduler, disk: FakeDisk, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not s.has_requests():
            return
        disk.step(s)
    raise AssertionError("did not finish")


# ---- the index ------------------------------------------------------------------------


def test_index_is_lru_bounded_by_bytes():
    index = DiskBlockIndex(capacity_bytes=35, block_bytes=10, present=[b"a", b"b"])
    assert index.max_blocks == 3 and index.num_bytes == 20
    assert index.want_store(b"c") and not index.want_store(b"c")  # being written
    assert not index.want_store(b"a")  # on disk
    index.stored(b"c", True)
    index.touch([b"a"])  # b is the oldest now
    assert index.want_store(b"d")
    index.stored(b"d", True)
    assert index.take_deletes() == [b"b"] and index.take_deletes() == []
    assert b"b" not in index and len(index) == 3
    assert index.count_prefix([b"a", b"c", b"x", b"d"], 0, 4) == 2
    assert index.count_prefix([b"a", b"c", b"x", b"d"], 3, 4) == 1
    assert index.want_store(b"e")
    index.stored(b"e", False)  # not written: not indexed, may be tried again
    assert b"e" not in index and index.want_store(b"e")
    index.check_integrity()


def test_index_trims_a_larger_directory_to_its_bound_oldest_first():
    index = DiskBlockIndex(20, 10, present=[b"old", b"mid", b"new"])
    assert index.take_deletes() == [b"old"] and len(index) == 2


@pytest.mark.parametrize("capacity", [-1, 0, 9])
def test_a_bound_below_one_block_is_refused_naming_both(capacity):
    with pytest.raises(ValueError, match=rf"kv_cache_disk_bytes \({capacity}\).*10 bytes"):
        DiskBlockIndex(capacity, 10)


# ---- the scheduler's protocol -----------------------------------------------------------


def test_computed_blocks_are_written_once_and_read_back_after_the_ram_cache_is_gone():
    s, disk = make_tier_scheduler(), FakeDisk()
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    s.add_request(make_request(prompt, block_size=B, max_tokens=2))
    out = disk.step(s)
    assert len(out.kv_stores) == 4  # the prompt's full blocks, in the step computing them
    drain(s, disk)
    assert len(disk.files) == 4 and s.make_stats().disk_cache_stored_blocks == 4
    assert s.reset_prefix_cache()  # the RAM tier only: the disk keeps its files
    assert s.make_stats().disk_cache_blocks == 4

    # The same prefix again, and an unrelated request beside it.
    again = make_request(prompt[:16] + [5, 6, 7], block_size=B, max_tokens=2)
    other = make_request(9, block_size=B, max_tokens=2)
    s.add_request(again)
    s.add_request(other)
    out = s.schedule()
    load_block_ids = out.kv_loads[0].block_ids
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [load.req_id for load in out.kv_loads] == [again.request_id]
    assert out.kv_loads[0].block_hashes == again.block_hashes[:4]
    # The read holds nobody up: the other request is scheduled in the same step.
    assert list(out.num_scheduled_tokens) == [other.request_id]
    # Until the runner reports it, the blocks being read are nobody's hit.
    probe = make_request(prompt[:16] + [9], block_size=B)
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 0
    report(s, out, {again.request_id: 4})
    # Read: back to WAITING holding nothing, its blocks findable (admitted as a hit).
    assert again.status == RequestStatus.WAITING and again.num_computed_tokens == 0
    assert again.request_id not in s.kv_cache_manager.req_to_blocks
    out = s.schedule()
    assert again.status == RequestStatus.RUNNING
    assert out.num_scheduled_tokens[again.request_id] == 3  # only the tail is computed
    new = next(r for r in out.scheduled_new_reqs if r.req_id == again.request_id)
    assert new.num_computed_tokens == 16 and len(new.block_ids) == 5
    assert new.block_ids[:4] == load_block_ids
    assert s.kv_cache_manager.get_computed_blocks(probe)[1] == 16  # indexed now
    report(s, out)
    drain(s, disk)
    stats = s.make_stats()
    assert again.num_cached_tokens == 16
    assert stats.disk_cache_hits == 16 and stats.prefix_cache_hits == 16
    # The read blocks were not written again: 4 + the other's 2 + the block of `again`'s
    # first output.
    assert stats.disk_cache_stored_blocks == 7


def test_ram_hits_then_disk_blocks_then_computed():
    s, disk = make_tier_scheduler(), FakeDisk()
    prompt = list(range(200, 221))  # 5 full blocks and 1 token
    s.add_request(make_request(prompt, block_size=B, max_tokens=1))
    drain(s, disk)
    s.reset_prefix_cache()
    # Blocks 0-1 back in RAM (read from disk by a shorter prompt).
    s.add_request(make_request(prompt[:8] + [1], block_size=B, max_tokens=1))
    drain(s, disk)
    r = make_request(prompt, block_size=B, max_tokens=1)
    s.add_request(r)
    out = disk.step(s)
    assert out.kv_loads[0].block_hashes == r.block_hashes[2:5]
    drain(s, disk)
    assert r.num_cached_tokens == 20  # 2 RAM blocks + 3 read; the last token computed


def test_a_corrupt_file_ends_the_read_there_and_leaves_the_index():
    s, disk = make_tier_scheduler(), FakeDisk()
    prompt = list(range(300, 317))
    s.add_request(make_request(prompt, block_size=B, max_tokens=1))
    drain(s, disk)
    s.reset_prefix_cache()
    hashes = make_request(prompt, block_size=B).block_hashes
    disk.fail.add(hashes[2])
    r = make_request(prompt, block_size=B, max_tokens=1)
    s.add_request(r)
    drain(s, disk)
    assert r.num_cached_tokens == 8  # blocks 0-1 read; 2-3 and the tail computed
    # Dropped from the index, so written again by the request that computed it (the corrupt
    # file replaced); block 3, still indexed, was not.
    assert s.make_stats().disk_cache_stored_blocks == 5


def test_an_abort_during_the_read_keeps_the_blocks_until_the_read_is_reported():
    s, disk = make_tier_scheduler(num_blocks=16), FakeDisk()
    prompt = list(range(400, 417))
    s.add_request(make_request(prompt, block_size=B, max_tokens=1))
    drain(s, disk)
    s.reset_prefix_cache()
    r = make_request(prompt, block_size=B, max_tokens=1)
    s.add_request(r)
    out = s.schedule()
    assert out.kv_loads
    s.finish_requests(r.request_id)
    assert s.has_requests()  # the read's report is still due
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.check_integrity()
    report(s, out, {r.request_id: 4})
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before + 4
    assert not s.has_requests()
    s.check_integrity()


def test_a_read_reported_steps_later_async_style():
    s, disk = make_tier_scheduler(), FakeDisk()
    prompt = list(range(500, 517))
    s.add_request(make_request(prompt, block_size=B, max_tokens=1))
    drain(s, disk)
    s.reset_prefix_cache()
    r = make_request(prompt, block_size=B, max_tokens=1)
    s.add_request(r)
    disk.step(s, delay_loads=True)
    for _ in range(3):  # it waits, blocking nothing, and is not read twice
        out = disk.step(s)
        assert not out.kv_loads and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    report(s, s.schedule(), disk.pending)
    drain(s, disk)
    assert r.num_cached_tokens == 16


def test_cache_salt_isolates_on_disk_too():
    s, disk = make_tier_scheduler(), FakeDisk()
    prompt = list(range(600, 617))
    s.add_request(make_request(prompt, block_size=B, max_tokens=1, cache_salt="a"))
    drain(s, disk)
    s.reset_prefix_cache()
    r = make_request(prompt, block_size=B, max_tokens=1, cache_salt="b")
    s.add_request(r)
    out = disk.step(s)
    assert not out.kv_loads
    drain(s, disk)
    assert r.num_cached_tokens == 0


def test_the_byte_bound_turns_old_files_into_deletes():
    s, disk = make_tier_scheduler(disk_blocks=6), FakeDisk()
    for base in (700, 800, 900):
        s.add_request(make_request(list(range(base, base + 13)), block_size=B, max_tokens=1))
        drain(s, disk)
    # The last writes' deletes go out with the next step (or the engine's shutdown).
    assert len(disk.files) == 9
    disk.step(s)
    assert len(disk.files) == 6 and len(s.disk_tier.index) == 6
    assert disk.files == set(s.disk_tier.index._lru)
    # The first request's blocks went first.
    assert not disk.files & set(make_request(list(range(700, 713)), block_size=B).block_hashes)


def test_reset_prefix_cache_keeps_the_disk_unless_asked():
    s, disk = make_tier_scheduler(), FakeDisk()
    s.add_request(make_request(list(range(1000, 1013)), block_size=B, max_tokens=1))
    drain(s, disk)
    assert s.reset_prefix_cache() and len(s.disk_tier.index) == 3
    assert s.reset_prefix_cache(reset_connector=True) and len(s.disk_tier.index) == 0


def test_without_a_tier_nothing_is_handed_out():
    from tests.core.utils import make_scheduler

    s = make_scheduler()
    s.add_request(make_request(list(range(1100, 1113)), max_tokens=1))
    out = s.schedule()
    assert s.disk_tier is None and s.kv_cache_manager.new_cached is None
    assert out.kv_loads == out.kv_stores == out.kv_deletes == ()  # shared, not allocated
    s.update_from_output(out, fake_model_output(s, out))


# ---- the options -------------------------------------------------------------------------


def test_a_directory_that_cannot_be_written_is_refused(tmp_path):
    from v1.config import EngineArgs
    from v1.worker.kv_disk_store import open_kv_cache_dir

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for bad in (a_file, a_file / "below"):  # (root may write anywhere: no chmod here)
        with pytest.raises(ValueError, match=f"kv_cache_dir '{bad}' cannot be created"):
            open_kv_cache_dir(str(bad))
    assert open_kv_cache_dir(str(tmp_path / "new" / "dir")) == tmp_path / "new" / "dir"
    assert (tmp_path / "new" / "dir").is_dir()
    with pytest.raises(ValueError, match="kv_cache_disk_bytes needs kv_cache_dir"):
        EngineArgs(kv_cache_disk_bytes=1 << 30)
    with pytest.raises(ValueError, match="kv_cache_disk_bytes must be an integer >= 1, got 0"):
        EngineArgs(kv_cache_dir=str(tmp_path), kv_cache_disk_bytes=0)
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        EngineArgs(kv_cache_dir=str(tmp_path), enable_prefix_caching=False)
