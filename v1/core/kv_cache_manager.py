"""Per-request KV block bookkeeping on top of the `BlockPool`, with prefix caching.

A request's blocks, in token order (block_size 4, 10 tokens computed or scheduled):

    req_to_blocks[id] = [ b7 | b2 | b9 ]
                          0-3  4-7  8-9 (partial: never hashed, never shared)
    request.block_hashes = [h0, h1]        num_cached_block[id] = 2

The first `num_cached_block[id]` blocks are indexed in the pool's prefix cache, from the step
that fills them being scheduled (docs/design.md, "The KV cache", visibility); a block filled by
tokens not known then (drafts, async placeholders), once they are, at the latest when the
request finishes (`cache_blocks`). Hence `free()` un-hashes a request's blocks past its
computed tokens, and the scheduler never preempts a request whose unwritten blocks another
already shares (`has_shared_unwritten_blocks`).
Declared prefixes (`check_preload`, `pin_prefix`): docs/prefix-cache.md, "Preloaded prompts".
Blocks read from the disk tier become findable only once the runner reports them written.
"""

from collections import deque
from typing import NamedTuple

from v1.core.block_pool import BlockPool, KVCacheBlock
from v1.core.kv_cache_utils import hash_token_blocks, max_hit_blocks
from v1.request import BlockHash, Request

_NO_BLOCKS: list[KVCacheBlock] = []


class PrefixCacheStats(NamedTuple):
    requests: int
    queries: int  # prompt tokens looked up
    hits: int  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCacheMetrics:
    """Hit rate in tokens since start and over a rolling window of recent requests."""

    def __init__(self, window: int = 1000) -> None:
        self.requests = self.queries = self.hits = 0
        self._window: deque[tuple[int, int]] = deque()
        self._window_size = window
        self._window_queries = self._window_hits = 0

    def observe(self, queries: int, hits: int) -> None:
        self.requests += 1
        self.queries += queries
        self.hits += hits
        self._window.append((queries, hits))
        self._window_queries += queries
        self._window_hits += hits
        if len(self._window) > self._window_size:
            q, h = self._window.popleft()
            self._window_queries -= q
            self._window_hits -= h

    def total(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.requests, self.queries, self.hits)

    def recent_hit_rate(self) -> float:
        return self._window_hits / self._window_queries if self._window_queries else 0.0

    def reset(self) -> None:
        self.__init__(self._window_size)


class FreedBlocks:
    """What preempting some running requests would release, accumulated one request at a
    time (`KVCacheManager.add_to_freed`): the scheduler plans an admission before it
    preempts anyone."""

    __slots__ = ("refs", "num_freed", "unwritten")

    def __init__(self) -> None:
        self.refs: dict[KVCacheBlock, int] = {}  # references those requests hold
        self.num_freed = 0  # blocks nobody else holds: free once those requests are
        self.unwritten: set[KVCacheBlock] = set()  # un-hashed when they are freed


_NOTHING_FREED = FreedBlocks()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        preload_max_fraction: float = 0.5,
        max_model_len: int = 1,
        record_new_cached: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.preload_max_fraction = preload_max_fraction
        self.max_model_len = max_model_len
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # Per request with blocks: up to how many tokens (computed + scheduled) it needs no
        # `allocate_slots` call, as there is no block to add nor a full one to index yet
        # (`_quiet_limit`). Most decode steps stay below it: the scheduler skips the call.
        self.num_quiet_tokens: dict[str, int] = {}
        self.prefix_cache_metrics = PrefixCacheMetrics()
        # With a disk tier: every (block, hash) `allocate_slots` indexes, i.e. computed in a
        # step being scheduled, until the scheduler takes them (`take_new_cached`).
        self.new_cached: list[tuple[KVCacheBlock, BlockHash]] | None = (
            [] if record_new_cached else None
        )

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """The fraction of blocks not free: held by requests, or pinned (as vLLM's usage,
        which counts every block that cannot be handed out; cached free blocks are free)."""
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request, and its length
        in tokens. At most `num_tokens - 1` tokens: the last one is always computed, since
        its logits are needed."""
        if not self.enable_caching:
            return _NO_BLOCKS, 0
        get_cached = self.block_pool.get_cached_block
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks(request, self.block_size)]:
            block = get_cached(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        """Count a scheduled request's lookup in the hit-rate metrics (once, on admission:
        a request may be looked up in several steps before it is admitted)."""
        # A resumed request mostly hits its own blocks: counting it would inflate the rate.
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_cache_metrics.observe(request.num_tokens, num_hit_tokens)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = _NO_BLOCKS,
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are the prefix-cache hits of a request being scheduled from
        the waiting queue. Returns the newly allocated blocks (not the hits), or None, with
        nothing changed, when the pool cannot supply them. A call within the request's
        `num_quiet_tokens` does nothing: callers skip it.
        """
        req_id = request.request_id
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        req_blocks = self.req_to_blocks.get(req_id, _NO_BLOCKS)
        num_new_blocks = self._num_new_blocks(req_blocks, new_computed_blocks, num_tokens_after)
        new_blocks = _NO_BLOCKS
        if num_new_blocks > 0 or new_computed_blocks:
            if not self._fits(num_new_blocks, new_computed_blocks, _NOTHING_FREED):
                return None
            if req_blocks is _NO_BLOCKS:
                req_blocks = self.req_to_blocks[req_id] = []
                self.num_cached_block[req_id] = 0
            if new_computed_blocks:
                self.block_pool.touch(new_computed_blocks)
                req_blocks.extend(new_computed_blocks)
            if num_new_blocks > 0:
                new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
                req_blocks.extend(new_blocks)
        elif req_blocks is _NO_BLOCKS:
            return _NO_BLOCKS  # no tokens for a request without blocks: nothing to track
        # Blocks this step fills become findable now (see the module docstring).
        self.cache_blocks(request, num_tokens_after)
        self.num_quiet_tokens[req_id] = self._quiet_limit(
            len(req_blocks), self.num_cached_block[req_id]
        )
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks within its first `num_tokens` tokens, those whose
        tokens are known (hashed: a draft or, under async scheduling, a placeholder is not
        when its step is scheduled). Also for blocks its last step completed with tokens not
        known when scheduled, before a request that finishes frees them."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_cached = self.num_cached_block[req_id]
        block_hashes = request.block_hashes
        num_full = num_tokens // self.block_size
        if num_full > len(block_hashes):
            num_full = len(block_hashes)
        if num_full <= num_cached:
            return
        req_blocks = self.req_to_blocks[req_id]
        self.block_pool.cache_full_blocks(req_blocks, block_hashes, num_cached, num_full)
        if self.new_cached is not None:
            self.new_cached.extend(
                zip(req_blocks[num_cached:num_full], block_hashes[num_cached:num_full])
            )
        self.num_cached_block[req_id] = num_full

    def take_new_cached(self) -> list[tuple[KVCacheBlock, BlockHash]]:
        """The blocks indexed since the last call that still hold their hash (a block
        un-hashed since, by a preemption in the same `schedule()`, is left out)."""
        assert self.new_cached is not None
        out = [(b, h) for b, h in self.new_cached if b.block_hash == h]
        self.new_cached.clear()
        return out

    def allocate_for_load(
        self, request: Request, hit_blocks: list[KVCacheBlock], num_load_blocks: int
    ) -> list[KVCacheBlock] | None:
        """Give a waiting request (holding no blocks) its prefix-cache hits and
        `num_load_blocks` new blocks to read its next blocks into from disk; None, with
        nothing changed, unless the pool could then also hold the rest of its prompt (so the
        read is not wasted on a request that cannot be admitted). The new blocks are not
        indexed (`finish_load` does it)."""
        assert request.request_id not in self.req_to_blocks
        num_rest = -(-request.num_tokens // self.block_size) - len(hit_blocks) - num_load_blocks
        if not self._fits(num_load_blocks + num_rest, hit_blocks, _NOTHING_FREED):
            return None
        req_id = request.request_id
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_load_blocks)
        self.req_to_blocks[req_id] = [*hit_blocks, *new_blocks]
        self.num_cached_block[req_id] = len(hit_blocks)
        self.num_quiet_tokens[req_id] = self._quiet_limit(
            len(hit_blocks) + num_load_blocks, len(hit_blocks)
        )
        return new_blocks

    def finish_load(self, request: Request, num_loaded: int) -> None:
        """The runner read the first `num_loaded` of the blocks `allocate_for_load` gave:
        index them, then release all the request's blocks (tail first, as `free`): the read
        ones stay findable, the unread ones (failed reads) were never indexed."""
        req_id = request.request_id
        blocks = self.req_to_blocks.pop(req_id)
        first = self.num_cached_block.pop(req_id)
        self.num_quiet_tokens.pop(req_id)
        self.block_pool.cache_full_blocks(blocks, request.block_hashes, first, first + num_loaded)
        self.block_pool.free_blocks(reversed(blocks))

    def _quiet_limit(self, num_blocks: int, num_cached: int) -> int:
        """See `num_quiet_tokens`: the end of the last block, and with caching, one token
        short of filling the first block not indexed yet."""
        limit = num_blocks * self.block_size
        if self.enable_caching:
            next_full = (num_cached + 1) * self.block_size
            if next_full <= limit:
                return next_full - 1
        return limit

    def _num_new_blocks(
        self, req_blocks: list[KVCacheBlock], hits: list[KVCacheBlock], num_tokens: int
    ) -> int:
        return -(-num_tokens // self.block_size) - len(req_blocks) - len(hits)

    def add_to_freed(self, freed: FreedBlocks, request: Request) -> None:
        """Account for preempting `request` too (nothing is freed yet)."""
        refs = freed.refs
        for block in self.req_to_blocks.get(request.request_id, _NO_BLOCKS):
            n = refs[block] = refs.get(block, 0) + 1
            if n == block.ref_cnt:
                freed.num_freed += 1
        freed.unwritten.update(self.unwritten_cached_blocks(request))

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock],
        num_new_computed_tokens: int,
        freed: FreedBlocks,
    ) -> bool:
        """Whether `allocate_slots` would succeed once the requests in `freed` are freed.
        Changes nothing."""
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = self._num_new_blocks(
            self.req_to_blocks.get(request.request_id, _NO_BLOCKS), new_computed_blocks,
            num_tokens_after,
        )
        return self._fits(num_new_blocks, new_computed_blocks, freed)

    def _fits(
        self, num_new_blocks: int, hits: list[KVCacheBlock], freed: FreedBlocks
    ) -> bool:
        # Touching a free hit takes it off the free list: it cannot also be handed out.
        num_free = self.block_pool.free_block_queue.num_free_blocks + freed.num_freed
        if hits:
            refs = freed.refs
            num_free -= sum(1 for b in hits if b.ref_cnt == refs.get(b, 0))
        return num_new_blocks <= num_free

    def unwritten_cached_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Indexed blocks past the request's computed tokens: inside `schedule()`, those a
        step scheduled in that call is to write; outside it, none."""
        blocks = self.req_to_blocks.get(request.request_id, _NO_BLOCKS)
        first = request.num_computed_tokens // self.block_size
        return blocks[first:self.num_cached_block.get(request.request_id, 0)]

    def has_shared_unwritten_blocks(self, request: Request) -> bool:
        return any(b.ref_cnt > 1 for b in self.unwritten_cached_blocks(request))

    def uncache_computed(self, request: Request) -> None:
        """Make the blocks the request computed itself (past its first admission's prefix
        hits) unfindable: the runner found its rows non-finite, so their K/V is not what
        their hashes promise. They stay the request's; blocks it fills later are indexed
        as usual (and un-indexed again if its rows stay non-finite)."""
        blocks = self.req_to_blocks.get(request.request_id, _NO_BLOCKS)
        self.block_pool.uncache_blocks(blocks[request.num_cached_tokens // self.block_size :])

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so its tail is evicted before its head.
        Blocks it cached past its computed tokens are un-hashed first (their step was
        undone: see the module docstring)."""
        unwritten = self.unwritten_cached_blocks(request)
        if unwritten:
            self.block_pool.uncache_blocks(unwritten)
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        self.num_quiet_tokens.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, _NO_BLOCKS)]

    # -- declared prefixes ------------------------------------------------------------

    def check_preload(self, prompts: list[list[int]]) -> None:
        """Refuse declared prefixes (ValueError) before any is computed: prefix caching off,
        a prompt empty or not shorter than max_model_len, or pins over the cap."""
        if not self.enable_caching:
            raise ValueError("preload_prompts need enable_prefix_caching")
        hashes = set(self.block_pool.pinned)
        for ids in prompts:
            if not 0 < len(ids) < self.max_model_len:
                raise ValueError(
                    f"a preload prompt of {len(ids)} tokens: it must have 1 to "
                    f"max_model_len - 1 = {self.max_model_len - 1}"
                )
            hashes.update(hash_token_blocks(ids, self.block_size))
        self._check_pins(len(hashes))

    def _check_pins(self, num_pinned: int) -> None:
        """ValueError unless `num_pinned` pinned blocks are within the cap (module docstring)."""
        num_blocks, block_size = self.num_blocks, self.block_size
        limit = int(self.preload_max_fraction * num_blocks)
        if num_pinned > limit:
            raise ValueError(
                f"preload_prompts would pin {num_pinned} blocks of {block_size} tokens, over "
                f"the limit of {limit} (preload_max_fraction {self.preload_max_fraction:.3g} "
                f"of {num_blocks} blocks)"
            )
        num_needed = -(-self.max_model_len // block_size)
        if num_blocks - num_pinned < num_needed:
            raise ValueError(
                f"preload_prompts would pin {num_pinned} of {num_blocks} blocks of "
                f"{block_size} tokens, leaving {num_blocks - num_pinned}: a request of "
                f"max_model_len {self.max_model_len} tokens needs {num_needed} (pin less, "
                "lower max_model_len, or give the KV cache more blocks)"
            )

    def pin_prefix(self, prompt_token_ids: list[int]) -> int:
        """Pin the full blocks of a prompt its request has just computed; returns how many.
        ValueError if one is not cached (its request did not run) or over the cap. The
        preload's lookups leave the hit-rate metrics: they are not traffic."""
        hashes = hash_token_blocks(prompt_token_ids, self.block_size)
        pool = self.block_pool
        blocks = [pool.get_cached_block(h) for h in hashes]
        missing = sum(b is None for b in blocks)
        if missing:
            raise ValueError(
                f"a preload prompt of {len(prompt_token_ids)} tokens was not computed: "
                f"{missing} of its {len(hashes)} full blocks are not cached"
            )
        self._check_pins(len(pool.pinned.keys() | set(hashes)))
        pool.pin(b for b in blocks if b is not None)
        self.prefix_cache_metrics.reset()
        return len(blocks)

    def num_pinned_prefix_blocks(self, request: Request) -> int:
        """How many of the request's leading blocks are pinned: hits it never allocates."""
        pinned = self.block_pool.pinned
        hashes = request.block_hashes
        n, limit = 0, (max_hit_blocks(request, self.block_size) if pinned else 0)
        while n < limit and hashes[n] in pinned:
            n += 1
        return n

    def reset_prefix_cache(self) -> bool:
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_metrics.reset()
        return True

    def check_integrity(self) -> None:
        """Assert the accounting: ref counts equal the references requests hold, and when
        no request holds blocks, every block is free."""
        self.block_pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.block_pool.pinned.values():  # the pin's own reference
            refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block}: {refs.get(block.block_id, 0)} references held"
            )
        assert self.num_cached_block.keys() == self.req_to_blocks.keys()
        assert self.num_quiet_tokens.keys() == self.req_to_blocks.keys()
        for req_id, limit in self.num_quiet_tokens.items():
            expected = self._quiet_limit(
                len(self.req_to_blocks[req_id]), self.num_cached_block[req_id]
            )
            assert limit == expected, f"{req_id}: quiet limit {limit}, should be {expected}"
        pool = self.block_pool
        if pool.pinned:
            self._check_pins(len(pool.pinned))
        if not self.req_to_blocks:
            assert pool.get_num_free_blocks() + len(pool.pinned) == self.num_blocks
