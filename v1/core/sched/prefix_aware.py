"""Prefix-aware admission: the order in which the scheduler tries a window of waiting requests
(`SchedulerConfig.enable_prefix_aware_scheduling`; the loop is `WaitingAdmission`'s).

Of the first `prefix_aware_window` waiting requests, the longest cached prefix goes first
(queue order among equals); a request whose first uncached block a running request will
compute (`PrefillIndex`) waits for it; the earliest request that does not fit stops
admission; after `prefix_aware_max_skips` passed-over steps the window goes in queue order.
O(window + admitted) per step, no deadlock. Each rule and why: docs/prefix-cache.md,
"The admission rules, and why".
"""

from v1.core.kv_cache_utils import max_hit_blocks
from v1.request import BlockHash, Request


class PrefillIndex:
    """Block hash -> the running request that will compute that block in a later step: the
    full blocks of running requests past those already indexed in the prefix cache (a
    decoding request has none). Built once per step, only when waiting requests are tried."""

    __slots__ = ("owner",)

    def __init__(self, running: list[Request], num_cached_block: dict[str, int]) -> None:
        self.owner: dict[BlockHash, Request] = {}
        for request in running:
            self.add(request, num_cached_block.get(request.request_id, 0))

    def add(self, request: Request, num_cached: int) -> None:
        """`request` runs with its first `num_cached` blocks in the prefix cache."""
        hashes = request.block_hashes
        if num_cached < len(hashes):
            setdefault = self.owner.setdefault
            for block_hash in hashes[num_cached:]:
                setdefault(block_hash, request)


class WindowOrder:
    """The order in which to try one window of waiting requests (positions in the window):
    `fcfs` (queue order, no deferral) or `ranked` (see the module docstring)."""

    __slots__ = ("window", "remaining", "cached", "prefill", "block_size", "ranking",
                 "num_cached")

    def __init__(
        self,
        window: list[Request],
        cached: dict[BlockHash, object] | None,
        prefill: PrefillIndex | None,
        block_size: int,
    ) -> None:
        self.window = window
        self.remaining = list(range(len(window)))  # in queue order
        self.cached = cached  # None: queue order, no deferral
        self.prefill = prefill
        self.block_size = block_size
        self.ranking = cached is not None
        self.num_cached = [0] * len(window)  # each one's cached prefix as far as walked
        if self.ranking:
            self.refresh()

    @classmethod
    def fcfs(cls, window: list[Request]) -> "WindowOrder":
        return cls(window, None, None, 0)

    @classmethod
    def ranked(
        cls,
        window: list[Request],
        cached: dict[BlockHash, object],
        prefill: PrefillIndex,
        block_size: int,
        max_skips: int,
    ) -> "WindowOrder":
        """Longest cached prefix first, with deferral; queue order with no deferral once
        one of the window has been passed over `max_skips` times (the bound)."""
        if any(r.num_passed_over >= max_skips for r in window):
            return cls.fcfs(window)
        return cls(window, cached, prefill, block_size)

    def _walk(self, i: int) -> int:
        """Extend request i's cached prefix from where its last walk stopped. Within a step
        it mostly grows (admissions index blocks); an admission's allocation may also evict
        a free cached block, which leaves it stale-high: that affects the ranking only, as
        the admission plan reads the cache again."""
        cached = self.cached
        assert cached is not None
        request = self.window[i]
        hashes = request.block_hashes
        n, limit = self.num_cached[i], max_hit_blocks(request, self.block_size)
        while n < limit and hashes[n] in cached:
            n += 1
        self.num_cached[i] = n
        return n

    def refresh(self) -> None:
        """Re-rank (after an admission added blocks to the prefix cache)."""
        if self.ranking:
            for i in self.remaining:
                self._walk(i)

    def to_queue_order(self) -> None:
        """Try the rest in queue order (deferral stays): a request tried out of order did
        not fit, and nobody ahead of it may wait behind it."""
        self.ranking = False

    def pop(self) -> tuple[int, bool]:
        """The position of the next request to try (there must be one left), and whether it
        is the earliest one left in queue order."""
        remaining = self.remaining
        if not self.ranking:
            return remaining.pop(0), True
        num_cached = self.num_cached
        best = 0
        for k in range(1, len(remaining)):
            if num_cached[remaining[k]] > num_cached[remaining[best]]:
                best = k
        return remaining.pop(best), best == 0

    def awaited_owner(self, i: int) -> Request | None:
        """The running request that computes request i's first block missing from the
        prefix cache, when it should wait for it; None when it should not wait."""
        prefill = self.prefill
        if self.cached is None or prefill is None or not prefill.owner:
            return None
        request = self.window[i]
        if request.sampling_params.prompt_logprobs is not None:
            return None  # it uses no cache hits: waiting would gain nothing
        n = self._walk(i)
        if n >= max_hit_blocks(request, self.block_size):
            return None
        return prefill.owner.get(request.block_hashes[n])
