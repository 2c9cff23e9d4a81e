"""Hooks that engine processes started by tests run (`V1_ENGINE_CORE_HOOK=module:function`
in the environment of the process that starts the engine; see v1/engine/core.py)."""

import itertools

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
