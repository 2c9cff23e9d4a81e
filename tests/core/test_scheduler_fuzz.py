"""The scheduler core under `scheduler_fuzz`'s random workloads: a few seeds here (the
module's command runs thousands: 2,200 seeds, ~4.2M steps passed at its writing)."""

from collections import Counter

from tests.core.scheduler_fuzz import Fuzzer


def test_random_workloads_keep_every_invariant_and_leave_nothing() -> None:
    events: Counter[str] = Counter()
    for seed in range(20):
        fuzzer = Fuzzer(seed, steps=200)
        try:
            fuzzer.run()
        except AssertionError as e:
            raise AssertionError(f"seed {seed} ({fuzzer.cfg}): {e}") from e
        events.update(fuzzer.stats)
    # The seeds reach what they are there for: preemption and resumption, prefix hits,
    # drafts, disk loads, refused prompts, aborts, resets, grammars that end requests.
    assert all(events[k] > 0 for k in ("preempted", "resumed", "hits", "drafts", "loads",
                                       "ignored", "aborts", "resets", "grammar_done")), events
