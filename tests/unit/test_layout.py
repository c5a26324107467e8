"""The package's shape: which room may import which, no import cycles, no module past 400 lines.

The rules (docs/architecture.md): nothing but the `zerotune` dispatcher imports `commands/`; `multinode/` imports
no training module (a launcher host may lack the GPU stack's state, and a launch must never train in-process);
`data/` never imports the model or the speed-ups; every speed-up is applied only by `perf/__init__.py`.
"""

from __future__ import annotations

import ast
import os
import re


from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "finetune")
MAX_LINES = 400

# What each room may import from the package, besides itself (prefix match on dotted module names).
# torch-free, as finetune/parallel/__init__.py, finetune/run/__init__.py and finetune/model/__init__.py are
MULTINODE_MAY_IMPORT = ("finetune.config", "finetune.dist", "finetune.shipped", "finetune.multinode",
                        "finetune.parallel.degree", "finetune.run.console", "finetune.run.folder",
                        "finetune.model.folder")
DATA_MAY_NOT_IMPORT = ("finetune.model", "finetune.perf", "finetune.train", "finetune.checkpoint", "finetune.export",
                       "finetune.memory", "finetune.multinode", "finetune.commands")
# The top level keeps the main path; everything else lives in a room.
TOP_LEVEL = {"__init__", "main", "cli", "config", "ds_config", "prepare", "train", "step", "dist", "shipped"}
MAX_TOP_LEVEL = 10
ARCHITECTURE = os.path.join(ROOT, "docs", "architecture.md")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[_module_name(path)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
    """Package modules `name` imports anywhere in its file (module level, in functions, under TYPE_CHECKING)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            # `from finetune.data import registry` imports the submodule; `from finetune.data import build_datasets`
            # imports the package.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in MODULES and t != name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_rooms_exist():
    for room in ("data", "perf", "memory", "multinode", "commands"):
        assert f"finetune.{room}" in MODULES, f"finetune/{room}/__init__.py is missing"
    assert os.path.isfile(os.path.join(PACKAGE, "perf", "README.md"))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a path (first node repeated at the end), or None: depth-first search for a back edge."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def _violations(rule) -> list[str]:
    return sorted(f"{a} imports {b}" for a, targets in GRAPH.items() for b in targets if rule(a, b))


def test_only_the_dispatcher_imports_commands():
    bad = _violations(lambda a, b: b.startswith("finetune.commands") and a != "finetune.cli"
                      and not a.startswith("finetune.commands"))
    assert not bad, bad


def test_multinode_imports_no_training_module():
    bad = _violations(lambda a, b: a.startswith("finetune.multinode") and not b.startswith(MULTINODE_MAY_IMPORT)
                      and b != "finetune")
    assert not bad, bad


def test_data_never_imports_the_model():
    bad = _violations(lambda a, b: a.startswith("finetune.data") and b.startswith(DATA_MAY_NOT_IMPORT))
    assert not bad, bad


def test_no_module_over_400_lines():
    long = {name: n for name, path in MODULES.items() if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, f"split these along a seam (at most {MAX_LINES} lines): {long}"


def test_the_top_level_keeps_the_main_path_only():
    top = sorted(name[:-3] for name in os.listdir(PACKAGE) if name.endswith(".py"))
    assert len(top) <= MAX_TOP_LEVEL, f"finetune/ holds {len(top)} modules (at most {MAX_TOP_LEVEL}): {top}"
    assert set(top) <= TOP_LEVEL, f"give these a room (run/, model/, ...): {sorted(set(top) - TOP_LEVEL)}"


def test_architecture_page_names_every_module():
    """docs/architecture.md names every module by its path under finetune/, and no module that is gone."""
    with open(ARCHITECTURE) as f:
        page = f.read()
    files = {os.path.relpath(path, ROOT) for path in MODULES.values()}
    named = set(re.findall(r"`(finetune/[\w/]+\.py)`", page))
    assert sorted(files - named) == [], "docs/architecture.md does not name these modules"
    assert sorted(named - files) == [], "docs/architecture.md names modules that do not exist"
