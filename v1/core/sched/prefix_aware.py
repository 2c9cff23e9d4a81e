"""Prefix-aware admission: the order in which the scheduler tries a window of waiting requests.

SGLang's cache-aware ("longest prefix match") policy, bounded so that nobody starves
(`SchedulerConfig.enable_prefix_aware_scheduling`):

- Ranking. A waiting request's *found* prefix is the run of its leading full blocks that are
  in the prefix cache (computed, or scheduled earlier in this step) or that a running request
  will compute in a later step (`PrefillIndex`). The scheduler takes the first
  `prefix_aware_window` waiting requests and tries the longest found prefix first, queue
  order among equals; it re-ranks after each admission, as an admitted request's blocks
  become others' prefixes. A request that does not fit stops admission, as under FCFS.
- Deferral. A request whose first block missing from the prefix cache is one a running
  request will compute waits for it, set aside without blocking anyone, instead of computing
  it a second time in parallel; once the owner has scheduled that block, it hits it.
- The bound. Each step in which a request is deferred, or a request behind it in the queue is
  admitted while it is not, counts in its `num_passed_over` (reset on admission). A window
  holding a request with `prefix_aware_max_skips` or more is tried in plain queue order with
  no deferral, so nobody behind that request is admitted before it: it waits at most
  `max_skips` such steps more than FCFS would make it wait.
- No deadlock. Only running requests own awaited blocks and the index is rebuilt every
  step, so a preempted or aborted owner is not waited for; and a deferral is a skip, so even a
  live owner is waited for at most `max_skips` steps.
"""

from v1.request import BlockHash, Request


class PrefillIndex:
    """Block hash -> a running request that will compute that block in a later step: the
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
    """The order in which to try one window of waiting requests (positions in the window).

    With `cached` None, or when a request in the window has been passed over `max_skips`
    times: queue order, no deferral (FCFS). Otherwise longest found prefix first."""

    __slots__ = ("window", "cached", "prefill", "block_size", "fcfs", "remaining", "found")

    def __init__(
        self,
        window: list[Request],
        cached: dict[BlockHash, object] | None = None,
        prefill: PrefillIndex | None = None,
        block_size: int = 0,
        max_skips: int = 0,
    ) -> None:
        self.window = window
        self.cached = cached
        self.prefill = prefill
        self.block_size = block_size
        self.fcfs = cached is None or any(r.num_passed_over >= max_skips for r in window)
        self.remaining = list(range(len(window)))
        self.found = [0] * len(window)
        if not self.fcfs:
            self.refresh()

    def _max_blocks(self, request: Request) -> int:
        # As `get_computed_blocks`: the last token is always computed.
        return min(len(request.block_hashes), (request.num_tokens - 1) // self.block_size)

    def refresh(self) -> None:
        """Extend the found prefixes (after an admission added blocks to both indexes).
        Found prefixes only grow within a step, so each resumes where it stopped."""
        if self.fcfs:
            return
        cached = self.cached
        owner = self.prefill.owner if self.prefill is not None else {}
        found, window = self.found, self.window
        for i in self.remaining:
            request = window[i]
            hashes = request.block_hashes
            n, limit = found[i], self._max_blocks(request)
            while n < limit and (hashes[n] in cached or hashes[n] in owner):
                n += 1
            found[i] = n

    def pop(self) -> int:
        """The position of the next request to try (there must be one left)."""
        remaining = self.remaining
        if self.fcfs:
            return remaining.pop(0)
        found = self.found
        best = 0
        for k in range(1, len(remaining)):
            if found[remaining[k]] > found[remaining[best]]:
                best = k
        return remaining.pop(best)

    def defers(self, request: Request) -> bool:
        """Whether `request` should wait for blocks a running request is computing: its
        first block not in the prefix cache is one (see the module docstring)."""
        if self.fcfs or self.prefill is None or not self.prefill.owner:
            return False
        if request.sampling_params.prompt_logprobs is not None:
            return False  # it uses no cache hits: waiting would gain nothing
        cached, hashes = self.cached, request.block_hashes
        assert cached is not None
        for i in range(self._max_blocks(request)):
            if hashes[i] not in cached:
                return hashes[i] in self.prefill.owner
        return False
