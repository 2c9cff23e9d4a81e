"""The collector during a start (v1/startup_gc.py): off while v1's engine imports and an
engine process builds its model, their objects frozen after."""

import gc
import json
import subprocess
import sys
import weakref

import pytest

from tests.engine.mp_utils import SMALL_ENGINE
from v1 import LLM
from v1.startup_gc import paused_gc


class _Node:
    """A weak-referenceable object, to see a cycle of them freed (or not)."""


def test_paused_gc_restores_the_collector_and_collects_before_it_freezes():
    gc.disable()
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # as it was
    finally:
        gc.enable()
    frozen = gc.get_freeze_count()
    kept = [[] for _ in range(1000)]
    with paused_gc(collect_young=True):
        assert not gc.isenabled()
        kept.append([])
        dropped = _Node()
        dropped.cycle = dropped  # garbage once the name is gone, freed only by a collection
        gone = weakref.ref(dropped)
        del dropped
    # The kept lists frozen, the cycle collected before (never freed once frozen).
    assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(kept)
    assert gone() is None


def test_importing_the_engine_runs_no_full_collection():
    """`from v1 import LLM` imports v1's frontend (~70k objects; when it imported torch and
    transformers, ~1M, three full collections without the pause: ~0.4 s on a 2-core EPYC).
    Only the first import freezes: what the program made after it stays the collector's."""
    code = ("import gc\nfrom v1 import LLM\nimport json\n"
            "frozen = gc.get_freeze_count()\nmade = [[] for _ in range(10_000)]\n"
            "from v1 import LLM\n"
            "print(json.dumps([gc.isenabled(), gc.get_stats()[2]['collections'], frozen, "
            "gc.get_freeze_count() - frozen]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    enabled, full_collections, frozen, frozen_again = json.loads(out.splitlines()[-1])
    assert enabled and full_collections == 0 and frozen > 20_000 and frozen_again == 0


@pytest.mark.parametrize("parent_collector", [True, False])
def test_the_engine_process_starts_with_its_heap_frozen(default_model_path, monkeypatch,
                                                         tmp_path, parent_collector):
    """The engine process freezes what its build made (beside what it inherited frozen from
    this process) and runs with the collector on, even forked while this process's was off
    (another thread's start had paused it)."""
    gc_file = tmp_path / "gc.json"
    monkeypatch.setenv("V1_ENGINE_CORE_HOOK", "tests.engine.engine_hooks:record_gc_state")
    monkeypatch.setenv("V1_TEST_GC_FILE", str(gc_file))
    if not parent_collector:
        gc.disable()
    inherited = gc.get_freeze_count()  # this process may freeze more after the fork
    try:
        with LLM(**SMALL_ENGINE):
            state = json.loads(gc_file.read_text())
    finally:
        gc.enable()
    assert state["enabled"] and state["frozen"] > inherited + 1000
