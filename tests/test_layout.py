"""The shape of the code base itself: what DESIGN.md and the house rules promise of it.

- The import graph has no circle, between modules or between the package's units (a top-level
  module or a subpackage such as ``executor/``), function-level imports included: every arrow
  runs down, so each floor can be read and tested without the ones above it.
- The bookkeeping floor imports no torch.
- Environment variables are read for secrets, paths and addresses only, all in
  ``kvserve/environment.py``; everything that changes what the engine computes is in EngineArgs.
- No source file is too long to read (1,500 lines), and benchmarks/results holds results only.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "kvserve"
MAX_LINES = 1500
# Torch-free by design: they are unit-tested alone and could run in a process without torch.
TORCH_FREE = ("kvserve.block_pool", "kvserve.prefix_index", "kvserve.kv_manager", "kvserve.scheduler", "kvserve.batch",
              "kvserve.request", "kvserve.stopping", "kvserve.errors", "kvserve.environment",
              "kvserve.cpu_features", "kvserve.config", "kvserve.speculative.ngram",
              "kvserve.speculative.speculator", "kvserve.speculative.verify")


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the kvserve modules it imports anywhere in its body (a package's own
    submodules importing their package's __init__ are not arrows)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_circle_between_modules():
    graph = _imports(_modules())
    assert _cycles(graph) == []


def test_no_arrow_runs_back_up_between_units():
    units: dict[str, set[str]] = defaultdict(set)
    for module, targets in _imports(_modules()).items():
        if module == "kvserve":
            continue  # the package's own __init__ re-exports the top floor
        for target in targets:
            if _unit(module) != _unit(target):
                units[_unit(module)].add(_unit(target))
    assert _cycles(units) == []


def test_the_bookkeeping_floor_imports_no_torch():
    modules = _modules()
    graph = _imports(modules)
    for name in TORCH_FREE:
        seen, todo = set(), [name]
        while todo:  # everything it imports, transitively, stays torch-free too
            module = todo.pop()
            if module in seen:
                continue
            seen.add(module)
            tree = ast.parse(modules[module].read_text())
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{name} -> {module} imports torch"
            todo.extend(graph.get(module, ()))


def test_the_environment_is_read_in_one_place_for_at_most_four_names():
    reads = re.compile(r"(?:environ(?:\.get)?\s*[\[(]|getenv\s*\()\s*[\"'](KVSERVE_\w+)")
    named: dict[str, set[str]] = defaultdict(set)
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h"),
                 *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]:
        for variable in reads.findall(path.read_text()):
            named[variable].add(str(path.relative_to(ROOT)))
    environment = PACKAGE / "environment.py"
    declared = set(re.findall(r'^\w+ = "(KVSERVE_\w+)"$', environment.read_text(), re.M))
    assert not named, f"read outside kvserve/environment.py: {dict(named)}"
    assert 1 <= len(declared) <= 4, declared


def test_no_source_file_is_too_long_to_read():
    long = {str(p.relative_to(ROOT)): n for p in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_benchmark_results_hold_results_only():
    scripts = [str(p.relative_to(ROOT)) for p in (ROOT / "benchmarks" / "results").rglob("*")
               if p.suffix in (".py", ".c", ".cpp", ".h", ".patch", ".sh")]
    assert scripts == []
