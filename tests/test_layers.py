"""The package's one rule between layers (docs/design.md): imports go only down,

    entrypoints -> engine -> core | worker -> models -> attention -> kernels

and nothing imports in a circle. Read from the source (every import statement, those inside
functions included: a lazy import is still a dependency), not from what happens to load."""

import ast
from pathlib import Path

import v1

PACKAGE = Path(v1.__file__).parent

# A layer may import those below it (its own modules too); `tools` (developer tools, run as
# programs) stands beside the entrypoints. The modules at the top of the package (config,
# sampling_params, request, outputs, hub, ...) are the types every layer shares: anyone
# imports them, they import only each other.
RANK = {"entrypoints": 6, "tools": 6, "engine": 5, "core": 4, "worker": 4, "models": 3,
        "attention": 2, "kernels": 1}
SHARED = "shared"
# Besides the ranks: the entrypoints reach the worker only through the engine; the worker
# reads the core's SchedulerOutput type and nothing else of the core.
FORBIDDEN = {("entrypoints", "worker"), ("tools", "entrypoints")}
WORKER_READS_OF_CORE = {"v1.core.sched.output"}
FACADES = {"v1", "v1.__main__"}  # the package's own entry: `from v1 import LLM`, `python -m v1`
# Packages that live inside a layer: metrics (the engine's stat loggers and their reader) is
# the engine's; lora wraps the model's linear layers (its worker manager is loaded by the
# runner), except LoRARequest, a request's field that every layer shares (`v1.lora.request`:
# vLLM's path); sample (vLLM's `vllm.v1.sample` paths: custom logits processors) is the
# worker's.
PART_OF = {"metrics": "engine", "lora": "models", "sample": "worker"}
SHARED_MODULES = {"v1.lora", "v1.lora.request"}


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    if module in SHARED_MODULES or len(parts) < 2:
        return SHARED
    name = PART_OF.get(parts[1], parts[1])
    return name if name in RANK else SHARED


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The v1 modules `path` imports (`from v1.x import y` names module v1.x.y if there is
    one, else v1.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                     else node.module for a in node.names]
        else:
            continue
        found.update(n for n in names if n in known)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_imports_only_go_down() -> None:
    wrong = []
    for module, targets in graph().items():
        if module in FACADES:
            continue
        src = layer(module)
        for target in targets:
            dst = layer(target)
            if target == "v1" or dst == SHARED or dst == src and src != SHARED:
                continue
            if src == SHARED:
                wrong.append(f"{module} -> {target} (a shared type imports a layer)")
            elif (src, dst) == ("worker", "core"):
                if target not in WORKER_READS_OF_CORE:
                    wrong.append(f"{module} -> {target} (the worker reads only SchedulerOutput)")
            elif (src, dst) in FORBIDDEN or RANK[dst] >= RANK[src] and dst != src:
                wrong.append(f"{module} -> {target} ({src} -> {dst})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_import_cycles() -> None:
    """No circle of modules (the facade aside, whose `LLM` is imported lazily)."""
    edges = {m: {t for t in ts if t not in FACADES} for m, ts in graph().items()
             if m not in FACADES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_rule_is_enforced() -> None:
    """The checker itself: it sees lazy imports, and each kind of wrong edge."""
    g = graph()
    assert "v1.models.loader" in g["v1.engine.core"]
    assert layer("v1.config") == SHARED and layer("v1.kernels") == "kernels"
    assert layer("v1.core.sched.output") == "core" and layer("v1.models.loader") == "models"
    lazy = g["v1.worker.model_runner"]  # imports its attention backends in a function
    assert "v1.attention.backends.torch_attn" in lazy


def test_core_is_plain_python() -> None:
    """v1/core imports no torch or numpy when it runs (type annotations aside)."""

    def runtime_imports(body: list[ast.stmt]):
        for node in body:
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                yield from runtime_imports(node.orelse)
                continue
            if isinstance(node, ast.Import):
                yield from (a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                yield node.module or ""
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from runtime_imports(getattr(node, field, []))

    for name, path in modules().items():
        if layer(name) == "core":
            tree = ast.parse(path.read_text())
            heavy = [n for n in runtime_imports(tree.body) if n.split(".")[0] in ("torch",
                                                                               "numpy")]
            assert not heavy, (name, heavy)
