"""No measured figures in the package's comments and docstrings.

A figure measured on some machine (tok/s, GiB, a percentage, "measured on 2xH200", a date) drifts from the code the
moment either changes, and nothing checks it. Comments and docstrings say what holds and why; measurements live in
dated pages, `docs/benchmarks/YYYY-MM-DD-<hardware>-<topic>.md`, which a comment may link to.

What is scanned in every .py file under finetune/: comments (the tokenize module's COMMENT tokens, consecutive ones
read as one text so that a figure broken over two lines is still seen), and docstrings (ast.get_docstring of the
module, classes and functions) plus field docstrings (string-expression statements in class bodies). Code, f-strings
included, is not scanned: a unit in a message the code prints is no measurement.

A line whose comment ends with the marker `# arithmetic` (or a docstring line ending with `(arithmetic)`) is allowed
to carry a figure: it is for facts that hold by construction (bytes = elements x width), never for results of a run.
There is none today.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

from tests.helpers import ROOT

PACKAGE = os.path.join(ROOT, "finetune")

_NUM = r"\d[\d,.]*\s*[KkMB]?"
FIGURES = {
    "throughput": re.compile(rf"{_NUM}\s*(tok/s|tokens/s|tokens per second)", re.I),
    "TFLOP/s": re.compile(rf"{_NUM}\s*(TFLOP|TFLOPS|TFLOP/s)\b", re.I),
    "memory": re.compile(r"\d[\d,.]*\s*(GiB|GB|MiB|MB|KiB|KB|TiB|TB)\b"),
    "percentage": re.compile(r"\d[\d,.]*\s*%"),
    "measured": re.compile(r"\bmeasured\b", re.I),
    "GPUs": re.compile(r"\d\s*[x×]\s*[HA]\d00\b", re.I),
    "speed-up": re.compile(r"\d[\d.]*(\s*-\s*\d[\d.]*)?\s*[x×]\s*(slower|faster)", re.I),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}
# A link to a dated benchmark page is where figures belong: blanked out before the search.
DATED_PAGE = re.compile(r"docs/benchmarks/20\d\d-[01]\d-[0-3]\d-[\w.-]+(/[\w./-]*)?")
ALLOW_COMMENT = "# arithmetic"
ALLOW_DOCSTRING = "(arithmetic)"


def _findings(text: str, first_line: int, allow: str) -> list[tuple[int, str, str]]:
    """(line, kind, line's text) for each figure in `text`, whose first line is `first_line` of the file. The lines
    are joined with spaces for the search, so a figure split over two lines is found; it is reported at its start."""
    lines = text.split("\n")
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line) + 1
    joined = DATED_PAGE.sub(lambda m: "_" * len(m.group()), " ".join(lines))
    out = []
    for kind, pattern in FIGURES.items():
        for match in pattern.finditer(joined):
            index = max(i for i, start in enumerate(starts) if start <= match.start())
            line = lines[index]
            if line.rstrip().endswith(allow):
                continue
            out.append((first_line + index, kind, line.strip()))
    return out


def _comment_blocks(source: str):
    """(first line, text) of each run of comments on consecutive lines, '#' and surrounding spaces removed."""
    block, first, last = [], None, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0]
        text = tok.string.lstrip("#").strip()  # a trailing "# arithmetic" marker stays at the end
        if block and row == last + 1:
            block.append(text)
        else:
            if block:
                yield first, "\n".join(block)
            block, first = [text], row
        last = row
    if block:
        yield first, "\n".join(block)


def _docstrings(source: str):
    """(first line, raw text) of every docstring: module, classes, functions, and string statements in class bodies."""
    tree = ast.parse(source)
    seen = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if ast.get_docstring(node, clean=False) is not None:
            seen.add(id(node.body[0]))
            yield node.body[0].lineno, node.body[0].value.value
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if (id(stmt) not in seen and isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                        and isinstance(stmt.value.value, str)):
                    yield stmt.lineno, stmt.value.value


def scan_source(source: str) -> list[tuple[int, str, str]]:
    """Every measured figure in the comments and docstrings of one file's source: (line, kind, text)."""
    found = []
    for first, text in _comment_blocks(source):
        found += _findings(text, first, ALLOW_COMMENT)
    for first, text in _docstrings(source):
        found += _findings(text, first, ALLOW_DOCSTRING)
    return sorted(set(found))


def _package_files() -> list[str]:
    return sorted(os.path.join(folder, name) for folder, _, names in os.walk(PACKAGE)
                  for name in names if name.endswith(".py"))


def test_scanner_catches_planted_figures():
    planted = '''"""A module. LoRA ZeRO-2 ran 15,370 tok/s on one GPU."""

# measured on 2xH200: 20 GiB less
x = 1  # 4-8% faster

class Config:
    """Fields."""

    size: int = 1
    """Peak 83.0 GiB, 10-100x slower
    than fp32 (689 TFLOP/s on 2026-11-30)."""

def f():
    """Runs at 10.5K
    tok/s/GPU."""
    # see docs/benchmarks/2026-11-30-2xh200-vs-peer.md (a link: allowed)
    y = "12 GiB and 50% in code are not scanned"
    return y  # bytes = 32,000 x 2,048 x 4 x 2 = 0.5 GB  # arithmetic
'''
    found = {(line, kind) for line, kind, _ in scan_source(planted)}
    assert found == {(1, "throughput"), (3, "measured"), (3, "GPUs"), (3, "memory"), (4, "percentage"),
                     (10, "memory"), (10, "speed-up"), (11, "TFLOP/s"), (11, "date"), (14, "throughput")}, found


def test_no_measured_figures_in_comments_or_docstrings():
    problems = []
    for path in _package_files():
        with open(path, encoding="utf-8") as f:
            source = f.read()
        for line, kind, text in scan_source(source):
            problems.append(f"{os.path.relpath(path, ROOT)}:{line}: {kind}: {text}")
    assert not problems, ("measured figures in comments or docstrings; say what holds and why, and put the figure on "
                          "a dated page docs/benchmarks/YYYY-MM-DD-<hardware>-<topic>.md that the comment links:\n"
                          + "\n".join(problems))
