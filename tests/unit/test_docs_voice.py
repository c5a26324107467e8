"""README.md, docs/ and benchmarks/ speak to users, stay small, and the pages under docs/benchmarks/ are results pages.

The voice: words about how the work on zerotune was organised (a session, an issue and its acceptance, a machine
being lent) mean nothing to a user. Every text file of README.md, docs/ and benchmarks/ is searched, the way
`grep -rniE "\\b(session|issue|lent|acceptance)\\b" docs benchmarks README.md` would; a hit fails unless ALLOWED lists
that exact phrase with the reason it is the word's ordinary meaning.

The size: docs/ and benchmarks/ together stay under 1,000,000 bytes, so that raw artifacts (per-step logs, full
outputs, duplicates) do not pile up: a page keeps one JSON per table.

The results pages: each docs/benchmarks/YYYY-MM-DD-<hardware>-<topic>.md states its date in its heading, its hardware
and software, the command (a ```bash block), and links the raw JSON its tables come from; every other file under
docs/benchmarks/ is linked or shown by some page.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

from tests.helpers import ROOT

WORK_WORDS = re.compile(r"\b(session|issue|lent|acceptance)\b|the issue's|\bthe lead\b", re.I)
# (file relative to the repository root, the exact phrase around the hit) -> why it is the word's ordinary meaning.
ALLOWED = {
    ("docs/testing.md", "its own pid, session, environment"):
        "a POSIX process session (setsid): a forked rank has its own, as a fresh process has",
}
SCANNED = ("README.md", "docs", "benchmarks")
TEXT = (".md", ".py", ".sh", ".json", ".jsonl", ".yaml", ".yml", ".txt", ".csv", ".log", ".toml", ".cfg")
SIZE_LIMIT = 1_000_000
BENCH = os.path.join("docs", "benchmarks")
PAGE = re.compile(r"^(\d{4}-\d{2}-\d{2})-[a-z0-9]+(-[a-z0-9]+)+\.md$")


def _files(*tops: str) -> list[str]:
    """The files under `tops` that git tracks or would track (untracked, not ignored), relative to the root; without
    git, every file but __pycache__'s."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *tops],
                             cwd=ROOT, capture_output=True, check=True, timeout=60).stdout.decode()
        found = sorted({p for p in out.split("\0") if p})
    except (OSError, subprocess.SubprocessError):
        found = []
        for top in tops:
            if os.path.isfile(os.path.join(ROOT, top)):
                found.append(top)
            for here, dirs, files in os.walk(os.path.join(ROOT, top)):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                found += [os.path.relpath(os.path.join(here, f), ROOT) for f in files]
    return [p for p in found if os.path.isfile(os.path.join(ROOT, p)) and "__pycache__" not in p.split("/")]


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def work_words(path: str, text: str) -> list[str]:
    """`path:line: 'hit' in "context"` for each work word of `text` that ALLOWED does not list."""
    found = []
    for m in WORK_WORDS.finditer(text):
        allowed = any(p == path and phrase in text and text.find(phrase) <= m.start() < text.find(phrase) + len(phrase)
                      for p, phrase in ALLOWED)
        if not allowed:
            line = text.count("\n", 0, m.start()) + 1
            context = text[max(0, m.start() - 40):m.end() + 40].replace("\n", " ")
            found.append(f"{path}:{line}: {m.group()!r} in \"...{context}...\"")
    return found


def test_docs_and_benchmarks_speak_to_users():
    found = []
    for path in _files(*SCANNED):
        if path.endswith(TEXT):
            found += work_words(path, _read(path))
    assert found == [], ("words about how the work was organised; say what a user needs instead (or, for an ordinary "
                         "meaning, add the phrase and the reason to ALLOWED):\n" + "\n".join(found))


def test_allowed_phrases_are_still_there():
    stale = [f"{path}: {phrase!r}" for path, phrase in ALLOWED
             if not os.path.isfile(os.path.join(ROOT, path)) or phrase not in _read(path)]
    assert stale == [], "remove these from ALLOWED: the text no longer holds them"


def test_the_voice_check_finds_work_words_and_passes_ordinary_text():
    text = "Against the acceptance (this session): not lent.\nSee issue 7. Sessions of tmux; an excellent issuer."
    assert [h.split(": ", 1)[1].split(" in ")[0] for h in work_words("x.md", text)] == \
        ["'acceptance'", "'session'", "'lent'", "'issue'"]
    assert work_words("docs/testing.md", "a real process with its own pid, session, environment") == []
    assert len(work_words("docs/other.md", "a real process with its own pid, session, environment")) == 1


def test_docs_and_benchmarks_stay_under_a_megabyte():
    sizes = {p: os.path.getsize(os.path.join(ROOT, p)) for p in _files("docs", "benchmarks")}
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    assert total < SIZE_LIMIT, (f"docs/ + benchmarks/ hold {total:,} bytes (limit {SIZE_LIMIT:,}); keep one JSON per "
                                f"table and drop logs and per-step files; the largest: {largest}")


def _pages() -> list[str]:
    return sorted(n for n in os.listdir(os.path.join(ROOT, BENCH)) if n.endswith(".md"))


def _targets(text: str) -> list[str]:
    """Relative link and image targets of a page, code blocks left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [t.partition("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def test_benchmark_pages_are_results_pages():
    problems = []
    for name in _pages():
        page = os.path.join(BENCH, name)
        text = _read(page)
        date = PAGE.match(name)
        if not date:
            problems.append(f"{name}: not named YYYY-MM-DD-<hardware>-<topic>.md")
            continue
        heading = text.split("\n", 1)[0]
        if not heading.startswith("# ") or date.group(1) not in heading:
            problems.append(f"{name}: the first line is not a heading with the page's date {date.group(1)}")
        for field in ("**Hardware:**", "**Software:**"):
            if field not in text:
                problems.append(f"{name}: no {field} line")
        if "```bash\n" not in text:
            problems.append(f"{name}: no ```bash block with the command")
        targets = [os.path.normpath(os.path.join(BENCH, t)) for t in _targets(text) if t]
        problems += [f"{name}: links {t}, which does not exist" for t in targets
                     if not os.path.exists(os.path.join(ROOT, t))]
        if not any(t.startswith(BENCH + os.sep) and t.endswith(".json") for t in targets):
            problems.append(f"{name}: links no raw JSON under {BENCH}/")
    assert problems == []


def test_every_raw_file_is_linked_by_a_page_and_every_json_parses():
    linked = {os.path.normpath(os.path.join(BENCH, t)) for name in _pages()
              for t in _targets(_read(os.path.join(BENCH, name))) if t}
    raw = [p for p in _files(BENCH) if not (os.path.dirname(p) == BENCH and p.endswith(".md"))]
    assert sorted(set(raw) - linked) == [], "raw files no page links or shows: link them from a page, or remove them"
    for path in raw:
        if path.endswith(".json"):
            json.loads(_read(path))
