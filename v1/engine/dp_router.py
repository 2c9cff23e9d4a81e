"""Which data-parallel engine core gets a request (pure Python: no torch, no sockets).

Each core has its own KV cache, so a request goes where its prefix most likely is cached
(`mirrors[i]`: an LRU of the block hashes sent to core i, hashed as the KV cache does), a new
prefix to a home core chosen by footprint per cache block, unless `LoadGuard` finds the chosen
core too busy (score = 4 x waiting + running). The rules and their reasons:
docs/data-parallel.md, "How the router chooses a core".

Invariants: one home per prefix, set only by its key's first request; footprint[i] == the
sum of the blocks of core i's homes; the homes' blocks stay within the cluster's cache (LRU
beyond); a dead or reset core has no homes; dead cores are never chosen. `round_robin` and
`least_loaded` ignore prefixes; `data_parallel_rank` pins a core, and updates its mirror.
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
    """When affinity yields to load (docs/data-parallel.md gives the defaults' reasons)."""

    ratio: float = 2.0
    slack: float = 8.0
    kv_threshold: float = 0.95


class CoreLoad:
    """What the router knows of one core's load."""

    __slots__ = (
        "waiting", "running", "kv_usage", "sent_since_stats", "blocks_since_stats", "in_flight",
        "saturated",
    )

    def __init__(self) -> None:
        self.waiting = 0  # as the core last published
        self.running = 0
        self.kv_usage = 0.0
        self.saturated = False  # it was queueing requests (or its KV cache was full)
        self.sent_since_stats = 0  # requests routed here since that publication
        self.blocks_since_stats = 0  # the blocks they will take (their uncached ones)
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


@dataclass(slots=True)
class Home:
    """Where a prefix lives, and how many blocks it takes there (see "Homes by capacity")."""

    engine: int
    blocks: int


class Route(NamedTuple):
    engine: int
    reason: str  # "pinned" | "affinity" | "home" | "load" | "round_robin" | "least_loaded"
    cached_blocks: int  # leading blocks of the prompt the chosen core's mirror holds


class DPRouter:
    """Routes requests among `num_engines` cores. Not thread-safe: the client holds a lock."""

    # What the load guard's slack grows by per cached block a request would lose elsewhere.
    saved_block_weight: float = 1.0

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
        self.homes: OrderedDict[bytes, Home] = OrderedDict()  # by first block hash, LRU
        self.footprint = [0] * num_engines  # blocks of the homes on each core
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
        self._record(route.engine, hashes, route.cached_blocks)
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
        home = self.homes.get(key)
        if best > 0:  # the longest cached prefix; equal ones at home, then by rendezvous
            tied = [i for i in order if depths[i] == best]
            chosen = home.engine if home is not None and home.engine in tied else tied[0]
            reason = "affinity"
        else:  # its home; a new prefix's by footprint; a prompt under a block's by hash
            if home is not None:
                chosen = home.engine
            else:
                chosen = self.new_home(order, len(hashes)) if hashes else order[0]
            reason = "home"
        # The load guard.
        guard, load = self.guard, self.loads[chosen]
        least = self._least_loaded(alive, depths)
        saved = self.saved_block_weight * (depths[chosen] - depths[least])
        if load.score() > guard.ratio * self.loads[least].score() + guard.slack + saved:
            return Route(least, "load", depths[least])
        if not self._fits(chosen, hashes, depths[chosen]):
            roomy = [i for i in alive if self._fits(i, hashes, depths[i])]
            if roomy:
                least = self._least_loaded(roomy, depths)
                lost = self.saved_block_weight * (depths[chosen] - depths[least])
                if load.score() + WAITING_WEIGHT > self.loads[least].score() + lost:
                    return Route(least, "load", depths[least])
        return Route(chosen, reason, best)

    def new_home(self, order: list[int], blocks: int) -> int:
        """The home of a new prefix of `blocks` full blocks among the live cores `order`
        (in rendezvous order of its key): the least footprint for the cache's size once it
        is there, the rendezvous order among equals."""
        rank = {engine: r for r, engine in enumerate(order)}
        return min(
            order,
            key=lambda i: (
                (self.footprint[i] + min(blocks, self.capacity[i])) / self.capacity[i],
                rank[i],
            ),
        )

    def _fits(self, engine: int, hashes: list[bytes], cached: int) -> bool:
        """Whether `engine`'s KV cache stays within kv_threshold of its blocks with this
        request's uncached blocks (and one for its last partial block) added to those in use
        at its last publication and those the requests sent since will take."""
        load = self.loads[engine]
        used = load.kv_usage * self.capacity[engine] + load.blocks_since_stats
        return used + len(hashes) - cached + 1 <= self.guard.kv_threshold * self.capacity[engine]

    def _record(self, engine: int, hashes: list[bytes], cached: int) -> None:
        self.routed[engine] += 1
        load = self.loads[engine]
        load.sent_since_stats += 1
        load.blocks_since_stats += len(hashes) - cached + 1
        load.in_flight += 1
        if not hashes:
            return
        self._record_home(engine, hashes[0], len(hashes))
        mirror, capacity = self.mirrors[engine], self.capacity[engine]
        # Tail first, as the cache frees a request's blocks: the head stays longest.
        for h in reversed(hashes):
            if h in mirror:
                mirror.move_to_end(h)
            else:
                mirror[h] = None
        while len(mirror) > capacity:
            mirror.popitem(last=False)

    def _record_home(self, engine: int, key: bytes, blocks: int) -> None:
        """A prompt of `blocks` full blocks keyed `key` went to `engine`: the key's first
        request sets its home; a longer prompt at home grows its footprint."""
        blocks = min(blocks, self.capacity[engine])
        home = self.homes.get(key)
        if home is None:
            self.homes[key] = Home(engine, blocks)
            self.footprint[engine] += blocks
        else:
            self.homes.move_to_end(key)
            if home.engine == engine and blocks > home.blocks:
                self.footprint[engine] += blocks - home.blocks
                home.blocks = blocks
        # As the caches would: drop the least recently used prefixes beyond the cluster's
        # blocks (the newest one stays, whatever its size).
        budget = sum(self.capacity[i] for i in range(self.num_engines) if self.alive[i])
        while sum(self.footprint) > budget and len(self.homes) > 1:
            _, old = self.homes.popitem(last=False)
            self.footprint[old.engine] -= old.blocks

    def _forget_homes(self, engine: int | None) -> None:
        """Drop the homes on `engine` (None: all): its cache no longer holds them."""
        for key in [k for k, h in self.homes.items() if engine is None or h.engine == engine]:
            home = self.homes.pop(key)
            self.footprint[home.engine] -= home.blocks

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
        load.blocks_since_stats = 0

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
        self._forget_homes(engine)
        self.loads[engine] = CoreLoad()

    def reset_prefix_index(self, engine: int | None = None) -> None:
        """A core's prefix cache (None: every core's) was emptied: forget what it held."""
        for i, mirror in enumerate(self.mirrors):
            if engine is None or i == engine:
                mirror.clear()
        self._forget_homes(engine)


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
