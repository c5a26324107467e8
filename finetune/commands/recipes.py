"""`zerotune recipes`: list the shipped recipes and DeepSpeed files, or copy one out to edit.

    zerotune recipes                       # name, file and what it is, for --config NAME and --deepspeed NAME
    zerotune recipes cp tiny my_tiny.yaml  # then: --config my_tiny.yaml

Names resolve through finetune/shipped.py, the same as --config and --deepspeed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Any

from finetune import shipped
from finetune.run import console


def recipe_summary(path: str) -> str:
    """The first sentence of a YAML recipe's opening comment."""
    words = []
    with open(path) as f:
        for line in f:
            if not line.startswith("#"):
                break
            words.append(line.lstrip("#").strip())
    text = " ".join(w for w in words if w)
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0]


def ds_summary(path: str) -> str:
    """One line from a DeepSpeed JSON's settings: ZeRO stage, precision, what is offloaded where."""
    try:
        with open(path) as f:
            cfg: dict[str, Any] = json.load(f)
    except json.JSONDecodeError as e:
        return f"not valid JSON: {e.msg} at line {e.lineno}"
    zero = cfg.get("zero_optimization", {})
    if cfg.get("bf16", {}).get("enabled"):
        precision = "bf16"
    elif cfg.get("torch_autocast", {}).get("enabled"):
        precision = f"{cfg['torch_autocast'].get('dtype', 'bf16')} autocast, fp32 weights"
    else:
        precision = "fp32"
    parts = [f"ZeRO-{zero.get('stage', 0)}", precision]
    offloaded = {}
    for block, what in (("offload_optimizer", "optimizer states"), ("offload_param", "parameters")):
        device = zero.get(block, {}).get("device", "none")
        if device != "none":
            offloaded.setdefault(device, []).append(what)
    parts += [f"{' and '.join(whats)} offloaded to {'NVMe (train.nvme_path)' if device == 'nvme' else device.upper()}"
              for device, whats in offloaded.items()]
    return ", ".join(parts)


def listing() -> str:
    """The text `zerotune recipes` prints."""
    lines = []
    for folder, suffix, flag, names, summary in (
        ("recipes", ".yaml", "--config", shipped.recipe_names(), recipe_summary),
        ("ds_configs", ".json", "--deepspeed", shipped.ds_config_names(), ds_summary),
    ):
        where = os.path.join(shipped.ROOT, folder)
        lines.append(f"{'recipes' if folder == 'recipes' else 'DeepSpeed configs'} ({flag} NAME), in {where}:")
        width = max((len(n) for n in names), default=0)
        lines += [f"  {name:<{width}}  {name + suffix:<{width + len(suffix)}}  {summary(os.path.join(where, name + suffix))}"
                  for name in names]
        lines.append("")
    lines.append("Copy one out to edit: zerotune recipes cp NAME DEST (e.g. zerotune recipes cp tiny my_tiny.yaml)")
    return "\n".join(lines)


def source_of(name: str) -> str:
    """The shipped file of a recipe or DeepSpeed name (`tiny`, `tiny.yaml`, `zero3`, `zero3.json`)."""
    found = []
    for folder, suffix, names in (("recipes", ".yaml", shipped.recipe_names()),
                                  ("ds_configs", ".json", shipped.ds_config_names())):
        stem = name[: -len(suffix)] if name.endswith(suffix) else name
        if stem in names:
            found.append(os.path.join(shipped.ROOT, folder, stem + suffix))
    if len(found) != 1:
        raise LookupError(
            (f"{name!r} is both {found[0]} and {found[1]}: add .yaml or .json" if found else f"no shipped recipe or "
             f"DeepSpeed config named {name!r}; recipes: {', '.join(shipped.recipe_names())}; DeepSpeed configs: "
             f"{', '.join(shipped.ds_config_names())}"))
    return found[0]


def copy_out(name: str, dest: str) -> str:
    """Copy the shipped file `name` to `dest` (a file, or a folder to copy into); refuses to overwrite. Returns the
    path written."""
    source = source_of(name)
    if os.path.isdir(dest) or dest.endswith(("/", os.sep)):
        dest = os.path.join(dest, os.path.basename(source))
    if os.path.exists(dest):
        raise FileExistsError(f"{dest} already exists: not overwriting it; choose another DEST or remove it first")
    if os.path.dirname(dest):
        os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(source, "rb") as src, open(dest, "xb") as out:
        shutil.copyfileobj(src, out)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotune recipes",
                                description="List the shipped recipes (--config NAME) and DeepSpeed configs "
                                            "(--deepspeed NAME), or copy one out to edit.")
    sub = p.add_subparsers(dest="action")
    cp = sub.add_parser("cp", help="copy a shipped recipe or DeepSpeed config to DEST (never overwrites)")
    cp.add_argument("name", metavar="NAME", help="e.g. tiny, mistral7b_lora, zero3 (or tiny.yaml, zero3.json)")
    cp.add_argument("dest", metavar="DEST", help="file to write, or an existing folder to copy into")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.action is None:
        print(listing())
        return 0
    try:
        dest = copy_out(args.name, args.dest)
    except (LookupError, OSError) as e:
        console.error(f"recipes cp: {e}")
        return 2
    flag = "--config" if source_of(args.name).endswith(".yaml") else "--deepspeed"
    print(f"copied {args.name} to {dest}: edit it, then pass {flag} {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
