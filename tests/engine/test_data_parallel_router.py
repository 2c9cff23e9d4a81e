"""The data-parallel router alone (v1/engine/dp_router.py): no model, no processes, the real
block-hash function. Balance of new prefixes, prefix affinity, the load guard, pinning, dead
cores, the bounded index."""

import random

import pytest

from v1.core.kv_cache_utils import make_block_hasher
from v1.engine.dp_router import DPRouter, LoadGuard, check_data_parallel_rank
from v1.request import Request
from v1.sampling_params import SamplingParams

BLOCK = 16
# A guard that never trips: affinity alone.
NO_GUARD = LoadGuard(ratio=1e9, slack=1e9, kv_threshold=float("inf"))


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def idle(router: DPRouter) -> None:
    """Every core reports itself idle (the requests routed so far finished)."""
    for i in range(router.num_engines):
        router.finished(i, router.loads[i].in_flight)
        router.update_stats(i, 0, 0, 0.0)


def publish(router: DPRouter, engine: int, waiting: int, running: int, kv: float) -> None:
    """A core publishes its load; it holds that many of this client's requests (the router
    ignores figures from a core that holds none: they are stale, see `finished`)."""
    load = router.loads[engine]
    load.in_flight = max(load.in_flight, waiting + running)
    router.update_stats(engine, waiting, running, kv)


def test_hashes_are_the_kv_caches() -> None:
    """The router's block hashes are the ones the engine core's KV cache computes (salt
    included), so 'which core holds this prefix' speaks of the same blocks."""
    router = DPRouter(2, BLOCK)
    prompt = tokens(1, 5 * BLOCK + 7)
    for salt in (None, "tenant-a"):
        request = Request("r", prompt, SamplingParams(), cache_salt=salt,
                          block_hasher=make_block_hasher(BLOCK))
        assert router.block_hashes(prompt, salt) == request.block_hashes
        assert len(request.block_hashes) == 5  # the partial tail is not hashed
    assert router.block_hashes(prompt, "a")[0] != router.block_hashes(prompt, "b")[0]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("burst", [False, True])
def test_balance_of_unique_prompts(n: int, burst: bool) -> None:
    """200 requests with unique prompts (3 to 300 tokens): every core gets more than
    total / (N + 1), whether they arrive one after another (each a new prefix: homes by
    footprint balance them) or all at once (the load figures grow between publications)."""
    router = DPRouter(n, BLOCK, guard=NO_GUARD if not burst else None)
    counts = [0] * n
    for i in range(200):
        counts[router.route(tokens(i, 3 + (i * 37) % 300)).engine] += 1
        if not burst:
            idle(router)
    assert min(counts) > 200 / (n + 1), counts


def test_shared_prefixes_stay_together_and_groups_spread() -> None:
    """Requests sharing a system prompt (several blocks) and differing after it go to one
    core; 16 such groups spread evenly over both cores (by footprint), each group whole."""
    router = DPRouter(2, BLOCK, guard=NO_GUARD)
    homes: dict[int, set[int]] = {}
    for i in range(16 * 10):
        group = i % 16  # interleaved arrivals
        prompt = tokens(1000 + group, 6 * BLOCK) + tokens(i, 20)
        homes.setdefault(group, set()).add(router.route(prompt).engine)
        idle(router)
    assert all(len(h) == 1 for h in homes.values()), homes
    per_core = [sum(h == {c} for h in homes.values()) for c in range(2)]
    assert per_core == [8, 8], per_core
    assert router.decisions["affinity"] == 16 * 9 and router.decisions["home"] == 16


def test_the_core_holding_the_longest_prefix_wins() -> None:
    """A prefix first run on the core its rendezvous hash does not pick (pinned there) is
    then routed to that core; a request extending a longer cached prefix goes where that
    longer prefix is; equal runs go to the prefix's home (where its first request went)."""
    router = DPRouter(2, BLOCK, guard=NO_GUARD)
    system = tokens(7, 4 * BLOCK)
    key = router.block_hashes(system)[0]
    away = router.rendezvous_order(key)[1]  # the core rendezvous would not choose
    router.route(system + tokens(1, 5), data_parallel_rank=away)
    idle(router)
    route = router.route(system + tokens(2, 5))
    assert route == (away, "affinity", 4)
    # The same system prompt plus a long shared context, cached on the other core only.
    home = 1 - away
    context = system + tokens(8, 3 * BLOCK)
    router.route(context, data_parallel_rank=home)
    idle(router)
    assert router.route(context + tokens(3, 9)) == (home, "affinity", 7)
    # 4 blocks cached on both: a tie goes to the prefix's home.
    assert router.homes[key].engine == away
    assert router.route(system + tokens(4, 2 * BLOCK)) == (away, "affinity", 4)


def test_salt_separates() -> None:
    router = DPRouter(2, BLOCK, guard=NO_GUARD)
    prompt = tokens(3, 4 * BLOCK)
    router.route(prompt, "a", data_parallel_rank=0)
    assert router.route(prompt, "a").reason == "affinity"
    assert router.route(prompt, "b").reason == "home"


def test_load_guard() -> None:
    """Affinity yields to the least-loaded core when its core's score (4 x waiting +
    running) exceeds 2 x the least's + 8 + the cached blocks the request would lose there,
    or its KV cache cannot take the request while the least's can; a smaller imbalance
    keeps affinity."""
    router = DPRouter(2, BLOCK)
    prompt = tokens(5, 4 * BLOCK)
    home = router.route(prompt).engine
    other = 1 - home
    idle(router)
    publish(router, home, 0, 8, 0.5)  # score 8 vs 0: within the slack
    assert router.route(prompt + [1]) == (home, "affinity", 4)
    publish(router, home, 1, 8, 0.5)  # score 12 <= 2 x 0 + 8 + 4 blocks it would lose
    assert router.route(prompt + [2]) == (home, "affinity", 4)
    publish(router, home, 2, 8, 0.5)  # score 16 > 12
    assert router.route(prompt + [3]) == (other, "load", 0)
    publish(router, home, 10, 8, 0.5)
    publish(router, other, 6, 8, 0.5)  # 48 vs 32: 48 <= 2 x 32 + 8
    assert router.route(prompt + [3]).engine == home
    idle(router)
    publish(router, home, 0, 1, 0.96)  # nearly full KV cache, the other's is not
    publish(router, other, 0, 3, 0.50)
    assert router.route(prompt + [4]) == (other, "load", 4)  # the prefix is there now
    # Switched off, affinity always wins.
    off = DPRouter(2, BLOCK, guard=NO_GUARD)
    home = off.route(prompt).engine
    publish(off, home, 50, 50, 0.99)
    assert off.route(prompt + [5]).engine == home


def test_burst_counts_requests_sent_since_the_last_figures() -> None:
    """Between two publications, requests routed to a core count as running there (as
    waiting once it reported a queue): a burst of one hot prefix overflows to the other core
    instead of piling up on one, at the guard's ratio."""
    router = DPRouter(2, BLOCK)
    prompt = tokens(6, 4 * BLOCK)
    engines = [router.route(prompt + [i]).engine for i in range(30)]
    home = engines[0]
    assert engines[:9] == [home] * 9  # 9 > 2 x 0 + 8: the 10th goes elsewhere
    other = engines.count(1 - home)
    assert 30 - other <= 2 * other + 8 + 1 and other == 7, engines
    load = router.loads[home]
    publish(router, home, 0, 20, 0.5)  # it published, with room: the rest will run
    assert load.estimate() == (0, 23) and load.score() == 23
    publish(router, home, 5, 18, 0.5)  # queueing: what is sent now waits
    router.route(prompt, data_parallel_rank=home)
    assert load.estimate() == (6, 18) and load.score() == 42


def test_prefix_keeps_one_home_after_overflow() -> None:
    """Once the guard has sent a prefix to a second core too, equal matches go to its
    rendezvous home, not to whichever is less loaded: the caches stay partitioned."""
    router = DPRouter(2, BLOCK)
    prompt = tokens(9, 4 * BLOCK)
    home = router.route(prompt).engine
    router.route(prompt, data_parallel_rank=1 - home)  # now cached on both
    idle(router)
    publish(router, home, 0, 4, 0.1)  # busier, within the guard
    assert router.route(prompt + [1]).engine == home


def test_pinning_and_dead_cores() -> None:
    router = DPRouter(3, BLOCK)
    assert router.route(tokens(1, 40), data_parallel_rank=2) == (2, "pinned", 0)
    with pytest.raises(ValueError, match="out of range"):
        router.route(tokens(1, 40), data_parallel_rank=3)
    router.mark_dead(1)
    with pytest.raises(RuntimeError, match="engine core 1 is dead"):
        router.route(tokens(1, 40), data_parallel_rank=1)
    for policy in ("affinity", "round_robin", "least_loaded"):
        r = DPRouter(3, BLOCK, policy)
        r.mark_dead(1)
        assert 1 not in {r.route(tokens(i, 40)).engine for i in range(60)}
    router.mark_dead(0)
    router.mark_dead(2)
    with pytest.raises(RuntimeError, match="no engine core is alive"):
        router.route(tokens(1, 40))
    check_data_parallel_rank(None, 1)
    for bad in (1, -1, True, "0"):
        with pytest.raises(ValueError, match="data_parallel_rank"):
            check_data_parallel_rank(bad, 1)


def test_baseline_policies() -> None:
    rr = DPRouter(3, BLOCK, "round_robin")
    prompt = tokens(1, 64)
    assert [rr.route(prompt).engine for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = DPRouter(2, BLOCK, "least_loaded")
    publish(ll, 0, 3, 10, 0.2)
    assert [ll.route(prompt).engine for _ in range(3)] == [1, 1, 1]
    ll.finished(1, 3)
    publish(ll, 1, 5, 10, 0.2)
    assert ll.route(prompt).engine == 0


def test_index_is_bounded_and_keeps_heads() -> None:
    """Each core's index holds at most its KV cache's blocks; like the cache, it drops a
    request's tail blocks before its head."""
    router = DPRouter(2, BLOCK, cache_blocks=[8, 8], guard=NO_GUARD)
    for i in range(50):
        router.route(tokens(i, 6 * BLOCK), data_parallel_rank=0)
    assert len(router.mirrors[0]) == 8
    last = tokens(49, 6 * BLOCK)
    head, *_ = router.block_hashes(last)
    assert head in router.mirrors[0]
    router.route(tokens(50, 6 * BLOCK), data_parallel_rank=0)
    assert router.route(last).cached_blocks >= 1  # its head survived the next request
    router.reset_prefix_index()
    assert not any(router.mirrors)


def test_an_idle_core_does_not_keep_its_last_load() -> None:
    """A core whose requests were all aborted publishes nothing more (it does not step): its
    last figures must not keep the load guard sending everything elsewhere."""
    router = DPRouter(2, BLOCK, cache_blocks=[256, 256])
    publish(router, 0, 0, 3, 0.97)  # core 0's last publication: nearly full
    router.finished(0, 3)  # then its three requests are aborted
    router.update_stats(0, 0, 3, 0.97)  # and a step's figures still arrive after the abort
    per_core = [0, 0]
    for i in range(100):  # one request at a time, unique prompts
        route = router.route(list(range(i * 1000, i * 1000 + 40)))
        per_core[route.engine] += 1
        router.finished(route.engine)
        router.update_stats(route.engine, 0, 0, 0.01)
    assert min(per_core) > 100 / 3, per_core


def test_rank_check_takes_any_integer_and_names_bad_values() -> None:
    import numpy as np

    check_data_parallel_rank(np.int64(1), 2)  # an integer, if not an int
    for bad in (1.0, "0", True, -1, 2):
        with pytest.raises(ValueError, match=r"data_parallel_rank must be an integer in \[0, 2\)"):
            check_data_parallel_rank(bad, 2)


def same_winner_prefixes(router: DPRouter, count: int, winner: int, blocks: int) -> list[list[int]]:
    """`count` prompts of `blocks` full blocks whose first block's rendezvous winner is
    `winner`: rendezvous hashing alone would home them all on one core."""
    found, seed = [], 0
    while len(found) < count:
        prompt = tokens(5000 + seed, blocks * BLOCK)
        seed += 1
        if router.rendezvous_order(router.block_hashes(prompt)[0])[0] == winner:
            found.append(prompt)
    return found


def test_new_prefixes_split_by_capacity() -> None:
    """Four equal prefixes that rendezvous hashing would all home on core 0 (4/0: one core
    thrashes) get 2/2: each new prefix goes where it leaves the least footprint per block of
    cache. With caches of 100 and 300 blocks, eight 20-block prefixes split 2/6."""
    router = DPRouter(2, BLOCK, cache_blocks=[96, 96], guard=NO_GUARD)
    systems = same_winner_prefixes(router, 4, winner=0, blocks=36)
    homes = []
    for i, system in enumerate(systems):  # arriving at once: nobody has finished
        route = router.route(system + tokens(i, 10))
        assert route.reason == "home"
        homes.append(route.engine)
    assert sorted(homes) == [0, 0, 1, 1] and homes[0] == 0  # the first: its rendezvous winner
    assert router.footprint == [72, 72]
    for i in range(40):  # then each group stays whole on its home
        route = router.route(systems[i % 4] + tokens(100 + i, 10))
        assert route == (homes[i % 4], "affinity", 36)
    assert router.footprint == [72, 72] and len(router.homes) == 4

    uneven = DPRouter(2, BLOCK, cache_blocks=[100, 300], guard=NO_GUARD)
    split = [uneven.route(tokens(900 + i, 20 * BLOCK)).engine for i in range(8)]
    assert split.count(0) == 2 and split.count(1) == 6, split
    assert uneven.footprint == [40, 120]


def test_one_home_per_prefix_through_overflow() -> None:
    """A request the load guard sends away caches its prefix on a second core; the prefix's
    home and footprint stay put, and once the load evens out, equal matches go home."""
    router = DPRouter(2, BLOCK, cache_blocks=[64, 64])
    system = tokens(11, 8 * BLOCK)
    key = router.block_hashes(system)[0]
    home = router.route(system + tokens(1, 5)).engine
    other = 1 - home
    idle(router)
    publish(router, home, 6, 8, 0.3)  # score 32 > 2 x 0 + 8 + 8 blocks
    assert router.route(system + tokens(2, 5)) == (other, "load", 0)
    assert router.homes[key].engine == home and router.footprint[other] == 0
    idle(router)
    assert router._depth(other, router.block_hashes(system)) == 8  # cached on both now
    for i in range(5):
        assert router.route(system + tokens(3 + i, 5)) == (home, "affinity", 8)
    # A pinned request elsewhere does not move the home either.
    router.route(system + tokens(9, 5), data_parallel_rank=other)
    assert router.homes[key].engine == home and router.route(system).engine == home


def test_dead_cores_lose_their_homes() -> None:
    """A dead core's homes and footprint are dropped; its prefixes and all new ones get homes
    on the live cores, still by footprint."""
    router = DPRouter(3, BLOCK, cache_blocks=[64, 64, 64], guard=NO_GUARD)
    systems = [tokens(40 + g, 10 * BLOCK) for g in range(6)]
    first = [router.route(s).engine for s in systems]
    assert sorted(first) == [0, 0, 1, 1, 2, 2]
    router.mark_dead(1)
    assert router.footprint[1] == 0 and all(h.engine != 1 for h in router.homes.values())
    again = [router.route(s + [7]).engine for s in systems]
    assert 1 not in again
    assert [a for a, f in zip(again, first) if f != 1] == [f for f in first if f != 1]
    assert router.footprint[0] == router.footprint[2] == 30  # the two orphans split 1/1
    router.reset_prefix_index(0)
    assert router.footprint[0] == 0 and all(h.engine == 2 for h in router.homes.values())


def test_homes_are_bounded_by_the_cluster_cache() -> None:
    """Homes are an LRU bounded by the cluster's blocks: any number of distinct prefixes
    leaves at most that many blocks of footprint (the newest entry always kept), and the
    footprints are always the sums of the homes' blocks."""
    router = DPRouter(2, BLOCK, cache_blocks=[24, 40], guard=NO_GUARD)
    for i in range(600):
        router.route(tokens(i, (1 + i % 7) * BLOCK + 3))
        assert sum(router.footprint) <= 64 or len(router.homes) == 1
        assert len(router.homes) <= 64
    for engine in range(2):
        assert router.footprint[engine] == sum(
            h.blocks for h in router.homes.values() if h.engine == engine)
    assert all(len(m) <= c for m, c in zip(router.mirrors, router.capacity))
    newest = router.block_hashes(tokens(599, (1 + 599 % 7) * BLOCK + 3))[0]
    assert newest in router.homes
    # A prompt larger than its core's cache counts as that cache, not more.
    big = DPRouter(2, BLOCK, cache_blocks=[8, 8], guard=NO_GUARD)
    big.route(tokens(1, 20 * BLOCK))
    assert sorted(big.footprint) == [0, 8]


def test_a_full_core_keeps_requests_whose_prefix_it_holds() -> None:
    """A core whose KV cache is nearly full still takes a request whose prefix it holds (it
    needs one block there, 9 elsewhere) unless it is busier by more than those 8 blocks; a
    request with nothing cached there goes where it fits."""
    router = DPRouter(2, BLOCK, cache_blocks=[100, 100])
    system = tokens(21, 8 * BLOCK)
    home = router.route(system + [1]).engine
    other = 1 - home
    idle(router)
    publish(router, home, 0, 6, 0.99)
    publish(router, other, 0, 6, 0.30)
    assert router.route(system + [2]) == (home, "affinity", 8)
    publish(router, home, 0, 11, 0.99)  # 11 + 4 (it would wait) > 6 + 8 blocks lost
    assert router.route(system + [3]) == (other, "load", 0)
    # Plenty of room by usage, but the requests sent since took it: no room.
    idle(router)
    publish(router, home, 0, 1, 0.5)
    publish(router, other, 0, 1, 0.5)
    for i in range(5):
        router.route(tokens(70 + i, 8 * BLOCK), data_parallel_rank=home)
    assert router.loads[home].blocks_since_stats == 45
    assert not router._fits(home, router.block_hashes(tokens(99, 8 * BLOCK)), 0)
