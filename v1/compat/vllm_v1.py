"""vLLM's `vllm.v1.*` module paths (`from vllm.v1.engine.async_llm import AsyncLLM`): with
`vllm` read as `v1`, `v1.v1.<path>` is `v1.<path>` itself, the same module object, not a copy.
`install()` (run as `v1.v1` is imported) puts a finder for `v1.v1.*` on `sys.meta_path` once;
a `<path>` that `v1` lacks is a ModuleNotFoundError.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

_PREFIX = "v1.v1."
_TARGET = "v1."


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `v1.v1.<path>` as the module `v1.<path>`."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        if importlib.util.find_spec(_TARGET + fullname.removeprefix(_PREFIX)) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def __init__(self) -> None:
        # The real modules' own specs, kept while an alias is being imported.
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(_TARGET + spec.name.removeprefix(_PREFIX))
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the alias's spec on the real module: give it its own back.
        module.__spec__ = self._specs.pop(module.__name__)


def install() -> None:
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
