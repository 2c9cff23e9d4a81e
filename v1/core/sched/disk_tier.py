"""The scheduler's side of the disk tier: starting reads, handing out writes and deletes,
taking the runner's reports. Pure bookkeeping over `DiskBlockIndex` and `KVCacheManager`.

    start_load   a WAITING request with h RAM hits, then n blocks on disk: takes the hits and
                 n fresh blocks, num_computed_tokens = h * B, WAITING_FOR_REMOTE_KVS; a
                 `KVLoad` goes out with the step
    update       the runner read the first k <= n: those are indexed, all its blocks
                 released, num_computed_tokens = 0, WAITING: admission finds them as hits

A request aborted meanwhile keeps its blocks until its read is reported (`aborted_loads`).
Every block a step indexes that is neither on disk nor being written goes out as a store.
"""

from v1.core.kv_cache_manager import KVCacheManager
from v1.core.kv_disk_index import DiskBlockIndex
from v1.core.sched.output import KVLoad, SchedulerOutput
from v1.outputs import ModelRunnerOutput, SchedulerStats
from v1.request import Request, RequestStatus


class DiskTierScheduling:
    def __init__(self, index: DiskBlockIndex, kv: KVCacheManager) -> None:
        self.index = index
        self.kv = kv
        self.block_size = kv.block_size
        self._loads: list[KVLoad] = []  # started since the last SchedulerOutput
        self.aborted_loads: dict[str, Request] = {}
        self.num_hit_tokens = 0  # prompt tokens read from disk (new requests only read)

    def start_load(self, request: Request) -> bool:
        """Start reading a new request's next blocks from disk, if its RAM hits stop short
        of blocks on disk and the pool has room for them; True: it waits in
        WAITING_FOR_REMOTE_KVS."""
        if (
            request.status != RequestStatus.WAITING or request.num_computed_tokens
            or request.sampling_params.prompt_logprobs is not None
        ):
            return False
        kv = self.kv
        hit_blocks, num_hit_tokens = kv.get_computed_blocks(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        num_load = self.index.count_prefix(request.block_hashes, len(hit_blocks), max_blocks)
        if not num_load:
            return False
        blocks = kv.allocate_for_load(request, hit_blocks, num_load)
        if blocks is None:
            return False  # no room for all of it now: admitted (or not) as without the tier
        hashes = request.block_hashes[len(hit_blocks) : len(hit_blocks) + num_load]
        self.index.touch(hashes)
        self._loads.append(KVLoad(request.request_id, [b.block_id for b in blocks], hashes))
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        return True

    def add_work(self, output: SchedulerOutput) -> None:
        """Put the step's reads, writes and deletes on its output."""
        if self._loads:
            output.kv_loads, self._loads = self._loads, []
        new_cached = self.kv.take_new_cached()
        if new_cached:
            want = self.index.want_store
            output.kv_stores = [(b.block_id, h) for b, h in new_cached if want(h)]
        output.kv_deletes = self.index.take_deletes()

    def update(self, model_output: ModelRunnerOutput, requests: dict[str, Request]) -> None:
        """Take the runner's reports: files written, reads done."""
        index = self.index
        for block_hash, ok in model_output.kv_stored:
            index.stored(block_hash, ok)
        kv = self.kv
        block_size = self.block_size
        for req_id, num_loaded in (model_output.kv_loaded or {}).items():
            aborted = self.aborted_loads.pop(req_id, None)
            if aborted is not None:
                kv.free(aborted)
                continue
            request = requests[req_id]
            first = request.num_computed_tokens // block_size
            if num_loaded < len(kv.req_to_blocks[req_id]) - first:
                # That file vanished (another process evicted it) or was corrupt.
                index.drop(request.block_hashes[first + num_loaded])
            kv.finish_load(request, num_loaded)
            index.num_loaded += num_loaded
            request.num_computed_tokens = 0
            self.num_hit_tokens += num_loaded * block_size
            request.status = RequestStatus.WAITING

    def add_stats(self, stats: SchedulerStats) -> None:
        stats.disk_cache_hits = self.num_hit_tokens
        stats.disk_cache_stored_blocks = self.index.num_stored
        stats.disk_cache_blocks = len(self.index)
