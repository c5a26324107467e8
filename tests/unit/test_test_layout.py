"""The tests' own layout: no module under tests/ or benchmarks/ imports a test module (a file named test_*.py).

What two test modules share (constants, helpers, recipes of test runs) lives in tests/fixtures/, and a pytest fixture
that several modules of a tier use in that tier's conftest.py. So each test module can be read, run and moved on its
own, and importing one never runs another's module-level set-up. Imports are read with ast, anywhere in a file (module
level and inside functions), absolute and relative.
"""

from __future__ import annotations

import ast
import os

from tests.helpers import ROOT

SCANNED = ("tests", "benchmarks")


def _module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _is_test_module(name: str) -> bool:
    return name.rpartition(".")[2].startswith("test_")


def _is_module(root: str, name: str) -> bool:
    path = os.path.join(root, *name.split("."))
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def _imported(root: str, name: str, path: str, tree: ast.AST) -> set[str]:
    """Every module the file imports: `import a.b`, `from a.b import c` (a.b, and a.b.c where that is a module of
    `root`), relative imports resolved against the file's package."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if _is_module(root, f"{base}.{a.name}"))
    return out


def find_test_module_imports(root: str, folders=SCANNED) -> list[str]:
    """`path: imports module` for each import of a test module by a file under `folders` of `root`."""
    found = []
    for folder in folders:
        for here, dirs, files in os.walk(os.path.join(root, folder)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for file in sorted(files):
                if not file.endswith(".py"):
                    continue
                path = os.path.join(here, file)
                with open(path) as f:
                    tree = ast.parse(f.read(), path)
                rel = os.path.relpath(path, root)
                name = _module_name(root, path)
                found += [f"{rel}: imports {target}" for target in sorted(_imported(root, name, path, tree))
                          if _is_test_module(target) and target != name]
    return found


def test_no_module_imports_a_test_module():
    found = find_test_module_imports(ROOT)
    assert found == [], ("move what these share into tests/fixtures/ (a pytest fixture: into a conftest.py) and "
                         "import it from there:\n" + "\n".join(found))


def test_the_finder_finds_absolute_relative_and_lazy_imports(tmp_path):
    files = {
        "tests/__init__.py": "",
        "tests/unit/__init__.py": "",
        "tests/unit/test_a.py": "from tests.unit.test_b import CASES\n",
        "tests/unit/test_b.py": "CASES = []\n",
        "tests/unit/test_c.py": "def test_x():\n    from . import test_b\n",
        "tests/fixtures/cases.py": "import tests.integration.test_d as d\nfrom ..unit.test_b import CASES\n",
        "tests/drivers/clean.py": "from tests.fixtures.cases import d, test_names\nimport os\n",
        "benchmarks/probe.py": "from tests.unit import test_a\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert find_test_module_imports(str(tmp_path)) == [
        "tests/fixtures/cases.py: imports tests.integration.test_d",
        "tests/fixtures/cases.py: imports tests.unit.test_b",
        "tests/unit/test_a.py: imports tests.unit.test_b",
        "tests/unit/test_c.py: imports tests.unit.test_b",
        "benchmarks/probe.py: imports tests.unit.test_a",
    ]
