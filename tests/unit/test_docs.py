"""The README and docs/ against the code: every recipe key of docs/configuration.md is a field of the dataclasses in
finetune/config.py, with its type and default, and back; the page's tables are generated from those dataclasses; links
lead to files and headings; code blocks carry well-formed marks; the README stays a front page. Its integration half,
tests/integration/test_docs_commands.py, runs the runnable blocks.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest
import yaml

from finetune.commands.estimate import main as estimate_main
from tests.docs_pages import (CONFIG_PAGE, MARK, ROOT, all_blocks, blocks, config_keys, documented_keys, generated_part,
                              pages, render_tables)
from tests.fixtures.quickstart_install import install_block, quickstart_install_commands, readme_install_commands

REGENERATE = "run `python -m tests.docs_pages` to regenerate docs/configuration.md's tables"
NEEDS = {"gpu", "weights", "nodes", "slurm", "network"}  # what a CPU machine after the quickstart may lack
README_SECTIONS = ["Install", "Quickstart", "The commands at a glance", "Your own data", "Mistral-7B for real",
                   "Save, resume, export", "Configuration", "Links"]
# Words about how the work on zerotune was organised, which mean nothing to a user.
NOT_FOR_USERS = re.compile(r"the issue's|\bnot lent\b|\bwere lent\b|\bthis session\b|\bthe lead\b", re.I)


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


@pytest.fixture(scope="module")
def documented():
    return documented_keys(_read(CONFIG_PAGE))


def test_every_recipe_key_is_documented_and_every_documented_key_exists(documented):
    fields = {k.key for k in config_keys()}
    assert sorted(fields - documented.keys()) == [], f"recipe keys missing from docs/configuration.md; {REGENERATE}"
    assert sorted(documented.keys() - fields) == [], f"docs/configuration.md lists keys config.py lacks; {REGENERATE}"


def test_documented_types_and_defaults_equal_the_dataclasses(documented):
    for key in config_keys():
        row = documented[key.key]
        assert yaml.safe_load(row["default"]) == key.default, f"{key.key}: default {row['default']}; {REGENERATE}"
        assert row["type"] == key.type, f"{key.key}: type {row['type']}; {REGENERATE}"


def test_every_key_says_what_it_does():
    missing = [k.key for k in config_keys() if not k.doc]
    assert missing == [], f"give these fields a docstring in finetune/config.py, then {REGENERATE}"


def test_configuration_tables_are_generated_from_config_py():
    assert generated_part(_read(CONFIG_PAGE)) == render_tables(), REGENERATE


def test_the_key_tables_parse_back():
    """The page's parser against a table with a pipe in a cell and a list default, so that a key can never hide."""
    text = ("| `data.mix` | list of str | `[a.jsonl:0.5, b.jsonl]` | x \\| y |\n"
            "| `model.kernels` | one of `auto`, `liger`, `none` | `auto` | z |\n| `not a key` | - | - | - |")
    assert documented_keys(text) == {
        "data.mix": {"type": "list of str", "default": "[a.jsonl:0.5, b.jsonl]", "doc": "x \\| y"},
        "model.kernels": {"type": "one of `auto`, `liger`, `none`", "default": "auto", "doc": "z"}}


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: str) -> set[str]:
    text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def test_relative_links_lead_to_files_and_headings():
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", _read(page), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, resolved)):
                broken.append(f"{page}: {target} (no {resolved})")
            elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
                broken.append(f"{page}: {target} (no heading #{anchor} in {resolved})")
    assert broken == []


def test_code_block_marks_are_well_formed():
    problems = []
    for page in pages():
        lines = _read(page).split("\n")
        for i, line in enumerate(lines):
            if line.startswith("<!--") and re.match(r"<!--\s*(needs|not-run)\b", line):
                if not MARK.match(line.strip()):
                    problems.append(f"{page}:{i + 1}: not `<!-- needs: WHAT -->` or `<!-- not-run: why -->`")
                elif i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
                    problems.append(f"{page}:{i + 1}: a mark must be the line just before a code fence")
    for block in all_blocks():
        if block.mark and block.mark.startswith("needs:"):
            unknown = {w.strip() for w in block.mark[len("needs:"):].split(",")} - NEEDS
            if unknown:
                problems.append(f"{block.id}: needs {sorted(unknown)}; known: {sorted(NEEDS)}")
        if block.lang == "bash" and re.search(r"^\$ ", block.text, re.M):
            problems.append(f"{block.id}: a bash block holds commands as typed, without `$ ` prompts")
        if block.runnable and re.search(r"\bpip3? install\b|-m pip\b", block.text):
            problems.append(f"{block.id}: installs packages: mark it `<!-- not-run: installs packages -->`")
    assert problems == []


def test_readme_is_a_front_page():
    text = _read("README.md")
    assert len(text.encode()) <= 16384 and text.count("\n") <= 215, (len(text.encode()), text.count("\n"))
    assert re.findall(r"^## (.+)$", text, re.M) == README_SECTIONS
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", text))
    assert sorted(set(pages()[1:]) - linked) == [], "every page of docs/ is linked from the README"


def test_pages_speak_to_users():
    found = [f"{page}: {m.group()!r}" for page in pages() for m in NOT_FOR_USERS.finditer(_read(page))]
    assert found == []


def _estimate_excerpts() -> list[tuple[str, list[str], list[str]]]:
    """(block id, the command's arguments, the output lines shown) for each ```bash block that is one `zerotune
    estimate` command followed by a plain ``` block, its output."""
    found = []
    for page in pages():
        page_blocks = blocks(page)
        for block, after in zip(page_blocks, page_blocks[1:]):
            command = block.text.replace("\\\n", " ").strip()
            closing = block.line + block.text.count("\n") + 1  # the line of its closing fence
            if (block.lang == "bash" and command.startswith("zerotune estimate ") and "\n" not in command
                    and after.lang == "" and after.line == closing + 2):
                found.append((block.id, shlex.split(command)[2:], after.text.rstrip("\n").split("\n")))
    return found


def test_estimate_outputs_on_the_pages_are_what_the_command_prints(capsys):
    """Each page's `zerotune estimate` output is an excerpt, line for line, of what that command prints now."""
    excerpts = _estimate_excerpts()
    assert "docs/memory.md" in {block_id.split(":")[0] for block_id, _, _ in excerpts}
    for block_id, argv, shown in excerpts:
        assert estimate_main(argv) == 0, block_id
        printed = capsys.readouterr().out.rstrip("\n").split("\n")
        starts = [i for i in range(len(printed)) if printed[i:i + len(shown)] == shown]
        assert starts, (f"{block_id}: the output shown is not what `zerotune estimate {shlex.join(argv)}` prints now; "
                        f"paste the matching lines of:\n" + "\n".join(printed))


def test_the_install_lines_are_one():
    """README's install block is docs/install.md's, and the quickstart runs the same pip commands (with -q)."""
    readme = readme_install_commands()
    assert len(readme) == 4 and ["install", "torch==2.13.0"] in readme, readme
    assert install_block("docs/install.md") == install_block("README.md")
    assert quickstart_install_commands() == readme
