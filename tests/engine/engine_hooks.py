"""Hooks that engine processes started by tests run (`V1_ENGINE_CORE_HOOK=module:function`
in the environment of the process that starts the engine; see v1/engine/core.py)."""

import gc
import itertools
import json
import os
import signal
import sys
import threading
import time

from tests.worker.step_costs import cheap_rows
from v1.engine import core_proc
from v1.engine.core import EngineCore


def fail_model_on_third_step(engine_core: EngineCore) -> None:
    """The model raises from its third step on, as a bug or a device fault would."""
    runner = engine_core.model_runner
    execute_model = runner.execute_model
    steps = itertools.count(1)

    def failing(scheduler_output):
        if next(steps) >= 3:
            raise RuntimeError("injected model failure")
        return execute_model(scheduler_output)

    runner.execute_model = failing


def record_threads_per_step(engine_core: EngineCore) -> None:
    """Before each step, write the names of the engine process's other Python threads than
    the stepping one (sorted, as JSON) to the file named by V1_TEST_THREADS_FILE."""
    path = os.environ["V1_TEST_THREADS_FILE"]
    step = engine_core.step

    def recording():
        with open(path, "w") as f:
            current = threading.current_thread()
            json.dump(sorted(t.name for t in threading.enumerate() if t is not current), f)
        return step()

    engine_core.step = recording


def cheap_draft_rows(engine_core: EngineCore) -> None:
    """The drafter prices rows on `cheap_rows`, not on measured step times."""
    drafter = engine_core.model_runner.drafter
    assert drafter is not None
    drafter.costs = cheap_rows()


def record_gc_state(engine_core: EngineCore) -> None:
    """Write the collector's state once the engine is built ({"enabled", "frozen": objects
    in the permanent generation}, as JSON) to V1_TEST_GC_FILE."""
    with open(os.environ["V1_TEST_GC_FILE"], "w") as f:
        json.dump({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}, f)


def record_start_imports(engine_core: EngineCore) -> None:
    """Write, once the engine is built, whether this process has imported transformers and
    loaded the model's tokenizer ({"transformers", "tokenizer"}, as JSON) to
    V1_TEST_IMPORTS_FILE."""
    loaded = vars(engine_core.loaded)  # a cached property's value is there once computed
    with open(os.environ["V1_TEST_IMPORTS_FILE"], "w") as f:
        json.dump({"transformers": "transformers" in sys.modules,
                   "tokenizer": "tokenizer" in loaded}, f)


def lose_the_first_sigterm(engine_core: EngineCore) -> None:
    """The engine's first SIGTERM is lost (as one the busy loop misses, or a SystemExit raised
    inside a finaliser); later ones end it as usual."""
    ending = signal.getsignal(signal.SIGTERM)

    def lose_once(signum, frame):
        signal.signal(signal.SIGTERM, ending)

    signal.signal(signal.SIGTERM, lose_once)


def ignore_sigterm(engine_core: EngineCore) -> None:
    """The engine never acts on SIGTERM (as with a shutdown stuck), and waits 1 s after its
    parent's death before it exits at once."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    core_proc.PARENT_GONE_GRACE_S = 1.0


def slow_shutdown(engine_core: EngineCore) -> None:
    """The engine's shutdown takes 30 s (a disk tier's long flush, say); it writes the file
    named by V1_TEST_HOOK_FILE as it begins."""
    shutdown = engine_core.shutdown

    def slow() -> None:
        with open(os.environ["V1_TEST_HOOK_FILE"], "w"):
            pass
        time.sleep(30)
        shutdown()

    engine_core.shutdown = slow


def slow_start(engine_core: EngineCore) -> None:
    """The engine takes 30 s more to start (a large model's load); it writes the file named
    by V1_TEST_HOOK_FILE as they begin."""
    with open(os.environ["V1_TEST_HOOK_FILE"], "w"):
        pass
    time.sleep(30)
