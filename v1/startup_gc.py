"""Python's cyclic garbage collector during a start.

Importing torch and transformers and loading a model make ~1M objects that live as long as
the process. Each full collection scans all of them: a 1B GGUF's start (process start to its
first answer) ran 3 full collections during `from v1 import LLM` and one more in `LLM()`,
~0.6 s of a ~5.5 s start on a 2-core EPYC (docs/models.md, "What a start costs"), when the
frontend still imported torch.
`paused_gc()` runs a start with the collector off and then moves what is alive at its end
into the permanent generation (`gc.freeze()`, as vLLM's engine core and API server
do after their start), where no collection scans it again.

A freeze is bounded: once per module whose first import is paused (`paused_for_import`: v1's
lazy names, `from v1 import LLM`; transformers at a frontend's first tokenizer; the engine's
modules, torch with them, in an engine process or an in-process engine), and once in an
engine process after its model is built (the garbage the build made collected first: only
the young generation's objects are scanned then). Never per `LLM()`: a process that makes
engines one after another (a test suite) would freeze each dropped engine still waiting in a
reference cycle, and never free it.
"""

import contextlib
import gc
import sys
from collections.abc import Iterator
from contextlib import AbstractContextManager


@contextlib.contextmanager
def paused_gc(collect_young: bool = False) -> Iterator[None]:
    """The body with the collector off; after it, the youngest generation collected
    (`collect_young`: the body's garbage, which nothing would free once frozen), what is
    alive frozen, and the collector as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collect_young:
            gc.collect(0)
        gc.freeze()
        if was_enabled:
            gc.enable()


def paused_for_import(module: str) -> AbstractContextManager[None]:
    """`paused_gc()` while `module` is not imported yet (its first import is in the body),
    else nothing: at most one freeze per module."""
    return paused_gc() if module not in sys.modules else contextlib.nullcontext()
