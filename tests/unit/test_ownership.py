"""One owner each: the run folder's file names live in finetune/run/folder.py, the error line in
finetune/run/console.py. Every other module names a run file by its constant and reports an error through
console.error, so a renamed file or a reworded prefix changes in one place and no module can drift from it.
"""

from __future__ import annotations

import ast
import os
import re

from finetune.run import folder
from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "finetune")
FOLDER_OWNER = os.path.join("finetune", "run", "folder.py")
ERROR_OWNER = os.path.join("finetune", "run", "console.py")
RUN_FILES = (folder.RECIPE, folder.DS_CONFIG, folder.MEMORY_PLAN, folder.METRICS, folder.SAMPLES, folder.SPEEDUPS,
             folder.LOCK, folder.STALL_SUMMARY)
ERROR_LINE = re.compile(r"\berror: ")
# A pattern that reads another program's error lines is not an error zerotune prints.
READS_OTHERS = {os.path.join("finetune", "multinode", "jobwatch.py"): ["srun: error: "]}


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
        # attribute docstrings: a string expression right after an assignment
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for stmt in body:
                if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                    ids.add(id(stmt.value))
    return ids


def string_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string constant of `source` that is not a docstring, f-strings' literal parts included."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def _package_files() -> list[str]:
    out = []
    for dirpath, dirnames, names in os.walk(PACKAGE):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "_shipped")]
        out += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in names if n.endswith(".py")]
    return sorted(out)


def run_file_literals(rel: str, source: str) -> list[str]:
    names = "|".join(re.escape(n) for n in RUN_FILES)
    pattern = re.compile(rf"(?<![\w.-])({names})(?![\w.])")
    return [f"{rel}:{line}: {text!r}" for line, text in string_literals(source) if pattern.search(text)]


def error_literals(rel: str, source: str) -> list[str]:
    allowed = READS_OTHERS.get(rel, [])
    return [f"{rel}:{line}: {text!r}" for line, text in string_literals(source)
            if ERROR_LINE.search(text) and not any(a in text for a in allowed)]


def _scan(check, owner: str) -> list[str]:
    found = []
    for rel in _package_files():
        if rel != owner:
            with open(os.path.join(ROOT, rel)) as f:
                found += check(rel, f.read())
    return found


def test_run_folder_file_names_appear_only_in_their_owner():
    found = _scan(run_file_literals, FOLDER_OWNER)
    assert found == [], "name these files by finetune/run/folder.py's constants:\n" + "\n".join(found)


def test_error_lines_are_printed_only_by_the_console():
    found = _scan(error_literals, ERROR_OWNER)
    assert found == [], "report these through finetune.run.console.error:\n" + "\n".join(found)


def test_the_scans_find_what_they_look_for():
    """The scanners against code that breaks each rule, and code that does not."""
    bad = 'def f(out):\n    """Writes recipe.yaml."""\n    open(os.path.join(out, "recipe.yaml"), "w")\n'
    assert run_file_literals("m.py", bad) == ["m.py:3: 'recipe.yaml'"]
    good = 'def f(out):\n    """Writes recipe.yaml."""\n    open(folder.path(out, folder.RECIPE), "w")\n'
    assert run_file_literals("m.py", good) == []
    assert run_file_literals("m.py", 'x = f"{run}/old_metrics.jsonl.bak"\n') == []
    printed = 'print(f"zerotune: error: {e}", file=sys.stderr)\n'
    assert error_literals("m.py", printed) == ["m.py:1: 'zerotune: error: '"]
    assert error_literals(os.path.join("finetune", "multinode", "jobwatch.py"), 'R = r"srun: error: (\\S+)"\n') == []
