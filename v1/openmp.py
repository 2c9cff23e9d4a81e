"""Torch loaded under OpenMP's passive wait policy, in every process of ours that loads it.

libgomp reads `OMP_WAIT_POLICY` once, as torch loads, and a forked engine keeps its parent's
runtime; spinning OpenMP threads take the CPU from the kernels' pool and the frontend. So every
place of v1 that may be first to import torch (or a library that imports it: transformers'
AutoTokenizer, xgrammar, a GGUF file's conversion) calls `load_torch_passively()` first. The
policy is in the environment only while torch loads (the caller's subprocesses do not inherit
it); a policy the caller set, or a torch already loaded, is left alone. Measurements:
docs/serving.md, "OpenMP's wait policy".
"""

import importlib
import os
import sys
import threading
from types import ModuleType

from v1.startup_gc import paused_for_import

POLICY_ENV = "OMP_WAIT_POLICY"
_lock = threading.Lock()  # threads of one process (AsyncLLM's input workers) may race here


def load_torch_passively() -> None:
    if "torch" in sys.modules:
        return
    with _lock:
        if "torch" in sys.modules or POLICY_ENV in os.environ:
            return
        os.environ[POLICY_ENV] = "PASSIVE"
        try:
            import torch  # noqa: F401
        finally:
            os.environ.pop(POLICY_ENV, None)


def import_engine_module(name: str) -> ModuleType:
    """An engine's module (`v1.engine.core`, `v1.engine.core_proc`), imported as a process
    that will run an engine must: torch loaded passively first, the collector paused over
    the first import (v1/startup_gc.py)."""
    with paused_for_import(name):
        load_torch_passively()
        return importlib.import_module(name)
