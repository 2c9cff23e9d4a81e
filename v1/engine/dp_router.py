"""Which data-parallel engine core gets a request (pure Python: no torch, no sockets).

Each engine core has its own KV cache, so a prompt's prefix is cached only on the cores that
ran it. vLLM balances its DP cores by load alone, so a shared system prompt gets recomputed
on every core, and the cores together cache no more distinct prefixes than one. This router
sends a request where its prefix most likely is, unless that core is too busy.

Affinity. The router hashes the prompt's full blocks exactly as the KV cache does
(`v1.core.kv_cache_utils.hash_block_tokens`: chained xxh3-128, `cache_salt` mixed into the
first block, the cores' block size), and keeps, per core, an approximate mirror of that
core's cache: an LRU of the block hashes it sent there, as large as the core's KV cache in
blocks (so memory is bounded by the cluster's blocks, 16-byte keys), touched tail first as
the cache frees a request's blocks, so that a prefix's head outlives its tail in both. The
prefix a core holds is the run of the prompt's leading hashes found in its mirror (a chained
hash stands for its whole prefix). The request goes to the core with the longest run; among
equal runs, and for a prefix no core has seen, to the rendezvous-hashing winner of the first
block (highest xxh3-64 of block hash + core index): a stable home per prefix that moves only
1/N of the prefixes when a core dies. A prompt shorter than a block is keyed by all its
tokens (and salt). The mirror is approximate: it does not see generated tokens' blocks, other
frontends' requests, or evictions the core makes sooner; a wrong guess costs only a prefix
recomputation.

The load guard. Cores publish their waiting/running counts and KV usage with every output
(`EngineCoreOutputs.scheduler_stats`). A core's load score is 4 x waiting + running, vLLM's
DP balancing score: a waiting request delays everything behind it by its whole prefill,
while one more running request costs the others a share of each batched step. Between two
publications the router adds the requests it sent since (never fewer than its own requests
there that the figures do not show), so that a burst does not all land on one core before
the first figures come back: as running if the core had room when it last published (no
queue, KV usage under the threshold: the scheduler admits them at its next step, chunked
prefill sharing the token budget), as waiting if it was already queueing. (vLLM counts
them all as waiting; on a CPU core whose prefill steps take a second, a closed loop's next
few arrivals then look like a queue that never forms, and break affinity for nothing.) The
affinity choice yields to the least-loaded core when

- score(chosen) > ratio x score(least) + slack, defaults ratio 2 and slack 8. A cache hit
  saves recomputing the prefix: worth making a request wait for a core that is up to twice
  as loaded as the idlest, not more (past 2x, the idle core's spare compute, here a whole
  core's, is worth more than the saved prefill). The slack (two waiting requests, or eight
  running) keeps small absolute differences, normal in any stream of arrivals, from
  breaking affinity: 9 vs 0 running breaks it; 6 vs 0 does not.
- or the chosen core's KV usage (blocks held by its live requests) is >= kv_threshold
  (default 0.95) while some core's is below it (the least loaded of those gets it):
  admitting more there means preempting (recomputing) running requests, dearer than
  recomputing one prefix elsewhere.

A prefix the guard sends elsewhere is then in two mirrors; ties go to the rendezvous winner,
not to the less loaded of the two, so a prefix keeps one home and the cores' caches stay
partitioned instead of converging on the same hot prefixes.

`round_robin` and `least_loaded` (lowest score, ties rotating) ignore prefixes: the
baselines of bench/bench_dp.py. A request may pin a core (`data_parallel_rank`, as vLLM);
a pinned request updates that core's mirror too. Dead cores are never chosen.
"""

import numbers
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import xxhash

from v1.config import DP_ROUTING_POLICIES
from v1.core.kv_cache_utils import NONE_HASH, hash_block_tokens

# vLLM's DP load-balancing weight of a waiting request against a running one.
WAITING_WEIGHT = 4


@dataclass(slots=True)
class LoadGuard:
    """When affinity yields to load (see the module docstring for the defaults' reasons)."""

    ratio: float = 2.0
    slack: float = 8.0
    kv_threshold: float = 0.95


class CoreLoad:
    """What the router knows of one core's load."""

    __slots__ = ("waiting", "running", "kv_usage", "sent_since_stats", "in_flight", "saturated")

    def __init__(self) -> None:
        self.waiting = 0  # as the core last published
        self.running = 0
        self.kv_usage = 0.0
        self.saturated = False  # it was queueing requests (or its KV cache was full)
        self.sent_since_stats = 0  # requests routed here since that publication
        self.in_flight = 0  # this client's requests there, not finished yet

    def estimate(self) -> tuple[int, int]:
        """(waiting, running) now: the published figures plus the requests sent since,
        which will run at the core's next step if it had room, else wait; and never fewer
        than this client's own requests there."""
        waiting, running = self.waiting, self.running
        unseen = max(self.sent_since_stats, self.in_flight - waiting - running)
        if self.saturated:
            waiting += unseen
        else:
            running += unseen
        return waiting, running

    def score(self) -> int:
        waiting, running = self.estimate()
        return WAITING_WEIGHT * waiting + running


class Route(NamedTuple):
    engine: int
    reason: str  # "pinned" | "affinity" | "rendezvous" | "load" | "round_robin" | "least_loaded"
    cached_blocks: int  # leading blocks of the prompt the chosen core's mirror holds


class DPRouter:
    """Routes requests among `num_engines` cores. Not thread-safe: the client holds a lock."""

    def __init__(
        self,
        num_engines: int,
        block_size: int,
        policy: str = "affinity",
        *,
        cache_blocks: Sequence[int] | None = None,
        guard: LoadGuard | None = None,
    ) -> None:
        if policy not in DP_ROUTING_POLICIES:
            raise ValueError(
                f"routing policy must be one of {', '.join(DP_ROUTING_POLICIES)}, got {policy!r}"
            )
        if num_engines < 1 or block_size < 1:
            raise ValueError("need at least one engine and a block size >= 1")
        self.num_engines = num_engines
        self.block_size = block_size
        self.policy = policy
        self.guard = guard or LoadGuard()
        capacity = list(cache_blocks) if cache_blocks is not None else [4096] * num_engines
        if len(capacity) != num_engines:
            raise ValueError(f"cache_blocks has {len(capacity)} entries for {num_engines} cores")
        self.capacity = [max(1, c) for c in capacity]
        self.mirrors: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in capacity]
        self.loads = [CoreLoad() for _ in range(num_engines)]
        self.alive = [True] * num_engines
        self.decisions: Counter[str] = Counter()  # how many requests each reason routed
        self.routed = [0] * num_engines  # how many requests each core was sent
        self._next = 0  # round robin's pointer, least_loaded's tie rotation

    # -- hashing -------------------------------------------------------------------------

    def block_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None,
        lora_int_id: int | None = None,
    ) -> list[bytes]:
        """The prompt's full blocks' chained hashes, as the cores' KV caches compute them
        (salt and LoRA adapter id in the first block's)."""
        size, hashes, parent = self.block_size, [], NONE_HASH
        tokens = list(token_ids)
        for start in range(0, len(tokens) - size + 1, size):
            first = start == 0
            parent = hash_block_tokens(
                parent, tokens[start : start + size], cache_salt if first else None,
                lora_int_id if first else None,
            )
            hashes.append(parent)
        return hashes

    def rendezvous_order(self, key: bytes) -> list[int]:
        """Cores by decreasing rendezvous weight for `key` (highest random weight first)."""
        weights = [
            xxhash.xxh3_64_intdigest(key + i.to_bytes(4, "little"))
            for i in range(self.num_engines)
        ]
        return sorted(range(self.num_engines), key=lambda i: -weights[i])

    # -- routing -------------------------------------------------------------------------

    def route(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        data_parallel_rank: int | None = None,
        lora_int_id: int | None = None,
    ) -> Route:
        """Choose a core for a request and record it as sent there. Raises ValueError for a
        rank out of range, RuntimeError when no core is alive (the caller's to report)."""
        alive = [i for i in range(self.num_engines) if self.alive[i]]
        if data_parallel_rank is not None:
            if not 0 <= data_parallel_rank < self.num_engines:
                raise ValueError(
                    f"data_parallel_rank {data_parallel_rank} is out of range: "
                    f"data_parallel_size is {self.num_engines}"
                )
            if not self.alive[data_parallel_rank]:
                raise RuntimeError(f"engine core {data_parallel_rank} is dead")
        elif not alive:
            raise RuntimeError("no engine core is alive")
        hashes: list[bytes] = []
        if self.policy == "affinity" or data_parallel_rank is not None:
            hashes = self.block_hashes(token_ids, cache_salt, lora_int_id)
        if data_parallel_rank is not None:
            route = Route(data_parallel_rank, "pinned", self._depth(data_parallel_rank, hashes))
        elif self.policy == "round_robin":
            route = self._round_robin(alive)
        elif self.policy == "least_loaded":
            route = Route(self._least_loaded(alive), "least_loaded", 0)
        else:
            route = self._affinity(alive, hashes, token_ids, cache_salt)
        self._record(route.engine, hashes)
        self.decisions[route.reason] += 1
        return route

    def _round_robin(self, alive: list[int]) -> Route:
        for _ in range(self.num_engines):
            engine = self._next % self.num_engines
            self._next += 1
            if self.alive[engine]:
                return Route(engine, "round_robin", 0)
        raise AssertionError("unreachable: some core is alive")

    def _least_loaded(self, alive: list[int], depths: dict[int, int] | None = None) -> int:
        """Lowest score; then (with depths) the longest cached prefix; then rotating."""
        n, start = self.num_engines, self._next
        self._next += 1
        return min(
            alive,
            key=lambda i: (
                self.loads[i].score(), -(depths or {}).get(i, 0), (i - start) % n
            ),
        )

    def _depth(self, engine: int, hashes: list[bytes]) -> int:
        mirror, depth = self.mirrors[engine], 0
        for h in hashes:
            if h not in mirror:
                break
            depth += 1
        return depth

    def _affinity(
        self, alive: list[int], hashes: list[bytes], token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> Route:
        depths = {i: self._depth(i, hashes) for i in alive}
        best = max(depths.values())
        if hashes:
            key = hashes[0]
        else:  # shorter than a block: key by the whole prompt (and salt)
            h = xxhash.xxh3_128(NONE_HASH)
            h.update(repr((list(token_ids), cache_salt)).encode())
            key = h.digest()
        order = [i for i in self.rendezvous_order(key) if i in depths]
        # The longest cached prefix; equal ones (and new prefixes) by rendezvous order.
        chosen = next(i for i in order if depths[i] == best)
        reason = "affinity" if best > 0 else "rendezvous"
        # The load guard.
        guard, load = self.guard, self.loads[chosen]
        least = self._least_loaded(alive, depths)
        if load.score() > guard.ratio * self.loads[least].score() + guard.slack:
            return Route(least, "load", depths[least])
        if load.kv_usage >= guard.kv_threshold:
            roomy = [i for i in alive if self.loads[i].kv_usage < guard.kv_threshold]
            if roomy:
                least = self._least_loaded(roomy, depths)
                return Route(least, "load", depths[least])
        return Route(chosen, reason, best)

    def _record(self, engine: int, hashes: list[bytes]) -> None:
        self.routed[engine] += 1
        load = self.loads[engine]
        load.sent_since_stats += 1
        load.in_flight += 1
        if not hashes:
            return
        mirror, capacity = self.mirrors[engine], self.capacity[engine]
        # Tail first, as the cache frees a request's blocks: the head stays longest.
        for h in reversed(hashes):
            if h in mirror:
                mirror.move_to_end(h)
            else:
                mirror[h] = None
        while len(mirror) > capacity:
            mirror.popitem(last=False)

    # -- what the cores tell -------------------------------------------------------------

    def update_stats(
        self, engine: int, num_waiting: int, num_running: int, kv_usage: float
    ) -> None:
        load = self.loads[engine]
        if load.in_flight == 0:  # figures of requests all gone since (see `finished`)
            return
        load.waiting, load.running, load.kv_usage = num_waiting, num_running, kv_usage
        load.saturated = num_waiting > 0 or kv_usage >= self.guard.kv_threshold
        load.sent_since_stats = 0

    def finished(self, engine: int, count: int = 1) -> None:
        """`count` of this client's requests on `engine` finished or were aborted. With none
        left, the core is idle (this client is its only one): its figures, published or
        still arriving, are stale, and an idle core publishes nothing more (an abort gets
        no answer), so kept they would steer requests away from it for good."""
        load = self.loads[engine]
        load.in_flight = max(0, load.in_flight - count)
        if load.in_flight == 0:
            self.loads[engine] = CoreLoad()

    def mark_dead(self, engine: int) -> None:
        self.alive[engine] = False
        self.mirrors[engine].clear()
        self.loads[engine] = CoreLoad()

    def reset_prefix_index(self, engine: int | None = None) -> None:
        """A core's prefix cache (None: every core's) was emptied: forget what it held."""
        for i, mirror in enumerate(self.mirrors):
            if engine is None or i == engine:
                mirror.clear()


def check_data_parallel_rank(rank: int | None, data_parallel_size: int) -> None:
    """A request's `data_parallel_rank` must name one of the cores (or be None)."""
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, numbers.Integral)
        or not 0 <= rank < data_parallel_size
    ):
        raise ValueError(
            f"data_parallel_rank must be an integer in [0, {data_parallel_size}) (the "
            f"engine has data_parallel_size {data_parallel_size}), got {rank!r}"
        )
