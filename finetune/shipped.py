"""Where the files zerotune ships live, and the names `--config` and `--deepspeed` accept for them.

    shipped.recipe_path("tiny")         # .../recipes/tiny.yaml
    shipped.ds_config_path("zero3")     # .../ds_configs/zero3.json (so is "zero3.json")
    shipped.find("recipes/tiny_model")  # itself from the checkout; the shipped copy from any other folder
    shipped.closest("zer3", ["zero2", "zero3"])  # 'zero3': zerotune's one "did you mean" (recipe keys use it too)

A name or path that is not found raises NotShipped listing the shipped names, and the nearest name or file when one is
near (`zero3.jsn`, `ds_configs/zer3.json`). In a checkout, ds_configs/ and recipes/ are the repository's folders
beside the package; a non-editable install carries them inside the package as finetune/_shipped/ (setup.py's build_py
copies them there). This module imports nothing from the package: config.py, ds_config.py, the planner and the
launcher all read it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable

PACKAGE = os.path.dirname(os.path.abspath(__file__))
"""The `finetune` package folder (finetune/main.py is what `deepspeed` launches)."""
IMPORT_ROOT = os.path.dirname(PACKAGE)
"""The folder that holds this `finetune` package: what ranks put on PYTHONPATH to import this same copy."""
FOLDERS = ("ds_configs", "recipes")


def _root() -> str:
    if all(os.path.isdir(os.path.join(IMPORT_ROOT, folder)) for folder in FOLDERS):
        return IMPORT_ROOT  # a checkout (or an editable install of one)
    return os.path.join(PACKAGE, "_shipped")


ROOT = _root()
"""The folder holding ds_configs/ and recipes/."""
DEFAULT_RECIPE = "mistral7b_lora"


class NotShipped(LookupError):
    """A --config or --deepspeed value that is neither a file nor a shipped name; the message lists the names."""


def _names(folder: str, suffix: str) -> list[str]:
    path = os.path.join(ROOT, folder)
    files = os.listdir(path) if os.path.isdir(path) else []
    return sorted(name[: -len(suffix)] for name in files if name.endswith(suffix))


def recipe_names() -> list[str]:
    """The shipped recipes, by the name `--config` accepts (recipes/<name>.yaml)."""
    return _names("recipes", ".yaml")


def ds_config_names() -> list[str]:
    """The shipped DeepSpeed files, by the name `--deepspeed` accepts (ds_configs/<name>.json)."""
    return _names("ds_configs", ".json")


def find(path: str) -> str:
    """`path` when it exists (or is absolute); a relative recipes/... or ds_configs/... path that does not exist from
    this folder but does under ROOT, as the shipped file, so a shipped recipe's `model.path: recipes/tiny_model` works
    from any folder; otherwise `path` unchanged, for the caller to report."""
    if not path or os.path.isabs(path) or os.path.exists(path):
        return path
    rel = os.path.normpath(path)
    if rel.split(os.sep, 1)[0] in FOLDERS and os.path.exists(os.path.join(ROOT, rel)):
        return os.path.join(ROOT, rel)
    return path


def recipe_path(name_or_path: str | None) -> str:
    """The YAML file behind `--config`: an existing path wins, then a shipped name (`tiny`, `tiny.yaml`); None is the
    default Mistral-7B LoRA recipe. Raises NotShipped listing the names."""
    if name_or_path is None:
        name_or_path = DEFAULT_RECIPE
    return _resolve(name_or_path, "recipes", ".yaml", "recipe", "--config PATH to a YAML file",
                    recipe_names())


def ds_config_path(name_or_path: str) -> str:
    """The JSON file behind `--deepspeed`: an existing path wins, then a shipped name (`zero3`, `zero3.json`).
    Raises NotShipped listing the names. (`--deepspeed auto` is the memory planner's: finetune/memory/budget.py.)"""
    return _resolve(name_or_path, "ds_configs", ".json", "DeepSpeed config",
                    "--deepspeed ds_configs/zero3.json (a path to a JSON file)", ds_config_names())


def closest(word: str, names: Iterable[str]) -> str | None:
    """The name of `names` nearest to `word` by difflib's similarity (a typo or a dropped letter is near, an unrelated
    name is not), or None when none is near enough to suggest."""
    close = difflib.get_close_matches(word, list(names), n=1)
    return close[0] if close else None


def _resolve(value: str, folder: str, suffix: str, what: str, how: str, names: list[str]) -> str:
    if os.path.isfile(value):
        return value
    found = find(value)
    if found != value and os.path.isfile(found):
        return found
    if "/" not in value and os.sep not in value:
        name = value[: -len(suffix)] if value.endswith(suffix) else value
        if name in names:
            return os.path.join(ROOT, folder, name + suffix)
    near = _near_miss(value, suffix, names)
    hint = f" (did you mean {near!r}?)" if near else ""
    raise NotShipped(f"{what} {value!r} not found{hint}: pass {how}, or a shipped name: {', '.join(names)} "
                     f"(`zerotune recipes` lists them)")


def _near_miss(value: str, suffix: str, names: list[str]) -> str | None:
    """What `value` most likely meant, spelled as the user would pass it: a bare word is compared with the shipped
    names (`zer3` -> 'zero3'), or, written with an extension, with the shipped files and the `suffix` files of this
    folder (`zero3.jsn` -> 'zero3.json'); a path with a folder, with the `suffix` files of that folder, a shipped one
    (ds_configs/, recipes/) found from any folder (`ds_configs/zer3.json` -> 'ds_configs/zero3.json')."""
    head, tail = os.path.split(value)
    if not tail:
        return None
    if not head:
        if "." not in tail:
            return closest(tail, names)
        return closest(tail, {*(n + suffix for n in names), *_files(".", suffix)})
    files = _files(find(head), suffix)
    match = closest(tail, files if "." in tail else [f[: -len(suffix)] for f in files])
    if match is None:
        return None
    return os.path.join(head, match if match.endswith(suffix) else match + suffix)


def _files(folder: str, suffix: str) -> list[str]:
    """The names of the `suffix` files in `folder` ([] when it is not a folder)."""
    if not os.path.isdir(folder):
        return []
    return sorted(name for name in os.listdir(folder) if name.endswith(suffix) and
                  os.path.isfile(os.path.join(folder, name)))


def shipped_name(path: str) -> str | None:
    """`ds_configs/zero3.json` for a file under ROOT's ds_configs/ or recipes/ (a path `find` resolves from any
    folder), else None."""
    rel = os.path.relpath(os.path.abspath(path), ROOT)
    if rel.split(os.sep, 1)[0] in FOLDERS:
        return rel
    return None
