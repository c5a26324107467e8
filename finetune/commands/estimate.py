"""`zerotune estimate`: the per-GPU memory table of every shipped DeepSpeed configuration for a recipe, and the
fastest that fits (the arithmetic is finetune/memory/estimate.py).

    zerotune estimate --config mistral7b_lora --deepspeed zero3 --gpus 2 --gpu-memory-gib 141

It needs no weights, only the model's config.json: without one at model.path, the shipped Mistral-7B shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from finetune import dist, shipped
from finetune.config import ConfigError, load_recipe
from finetune.ds_config import ds_json_path, resolve_ds_config
from finetune.memory.estimate import FIT_FRACTION, GIB, SHIPPED, SPEED_ORDER, display_path, estimate_run, shipped_dir

MISTRAL_SHAPE = os.path.join("recipes", "mistral7b_shape", "config.json")  # under shipped.ROOT


def config_files(deepspeed: str) -> list[str]:
    """The shipped configurations (SHIPPED, in ZeRO-stage order) from the folder of `deepspeed`, else ds_configs/,
    plus `deepspeed` itself when it is none of them."""
    files = []
    for key in sorted(SHIPPED):
        local = os.path.join(os.path.dirname(deepspeed), SHIPPED[key])
        files.append(local if os.path.isfile(local) else os.path.join(shipped_dir(), SHIPPED[key]))
    same = [f for f in files if os.path.abspath(f) == os.path.abspath(deepspeed)]
    return files if same else files + [deepspeed]


def estimate_table(model_config: dict[str, Any], recipe, configs: dict[str, dict[str, Any]], gpus: int, nodes: int,
                   gpu_memory: float, cpu_memory: float | None) -> list[dict[str, Any]]:
    """One row per resolved DeepSpeed config ({path: config}), with whether it fits `gpu_memory` bytes per GPU and
    `cpu_memory` bytes per node."""
    rows = []
    shipped = set(SHIPPED.values())
    for path, ds in configs.items():
        row = dict(estimate_run(model_config, recipe, ds, gpus * nodes), ds_config=display_path(path))
        if os.path.basename(path) not in shipped:
            row["config"] += f" ({os.path.basename(path)})"
        row["cpu_per_node"] = row["cpu"] * gpus
        row["fits"] = row["total"] <= FIT_FRACTION * gpu_memory and (cpu_memory is None or row["cpu_per_node"] <= cpu_memory)
        rows.append(row)
    return rows


def recommend(rows: list[dict[str, Any]]) -> str:
    """The fastest configuration that fits (SPEED_ORDER), or what to change when none does."""
    rank = {config: k for k, config in enumerate(SPEED_ORDER)}
    for row in sorted(rows, key=lambda r: rank.get((r["stage"], r["offload_optimizer"], r["offload_params"]), len(rank))):
        if row["fits"]:
            return (f"recommendation: {row['config']} (--deepspeed {row['ds_config']}), the fastest that fits: "
                    f"{row['total'] / GIB:.1f} GiB per GPU")
    smallest = min(rows, key=lambda r: r["total"])
    return (f"recommendation: nothing fits; the smallest is {smallest['config']} at {smallest['total'] / GIB:.1f} GiB per GPU. "
            f"Lower train.micro_batch_size or data.max_seq_len, set model.activation_checkpointing=full, "
            f"use LoRA, or add GPUs")


def format_table(rows: list[dict[str, Any]], chosen: str | None = None) -> str:
    """Markdown table in GiB; the row of the `chosen` DeepSpeed file is marked with *."""
    cols = ["params", "grads", "optimizer", "activations", "buffers", "step", "total"]
    lines = ["| config | weights | grads | optimizer | activations | buffers | grads at step | peak / GPU | CPU / node | fits |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = r["config"] + (" *" if chosen and display_path(chosen) == r["ds_config"] else "")
        cells = " | ".join(f"{r[c] / GIB:.1f}" for c in cols)
        lines.append(f"| {name} | {cells} | {r['cpu_per_node'] / GIB:.1f} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


def model_shape(model_cfg) -> tuple[dict[str, Any], str]:
    """(config, where it came from): model.path's config.json, or where it has none (weights not downloaded yet), the
    shipped Mistral-7B shape, saying so on stderr: an estimate needs the shape, not the weights."""
    path = os.path.join(model_cfg.path, "config.json")
    if os.path.isfile(path):
        shown = model_cfg.path
    else:
        path = os.path.join(shipped.ROOT, MISTRAL_SHAPE)
        shown = display_path(path)
        print(f"model.path {model_cfg.path!r} has no config.json (an estimate needs no weights): using the shipped "
              f"Mistral-7B shape, {shown}", file=sys.stderr)
    with open(path) as f:
        return json.load(f), shown


def _local_gpus() -> tuple[int, float | None]:
    """(GPUs on this machine, or 1; bytes of memory of the first, or None without a GPU)."""
    gpus = dist.local_gpus()
    return (len(gpus), gpus[0]) if gpus else (1, None)


def _local_cpu_memory() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotune estimate", description="Per-GPU memory of every ZeRO stage, and the fastest that fits.")
    p.add_argument("--config", metavar="PATH", default=None,
                   help="YAML recipe or a shipped name such as mistral7b_full (default mistral7b_lora)")
    p.add_argument("--deepspeed", metavar="PATH", default="ds_configs/zero3.json",
                   help="DeepSpeed JSON or a shipped name such as zero3: precision and buckets; its row is marked *")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: this machine's, or 1)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU (default: this machine's GPU)")
    p.add_argument("--cpu-memory-gib", type=float, default=None, help="memory of one node, for offloading (default: this machine's)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    local_gpus, local_memory = _local_gpus() if args.gpus is None or args.gpu_memory_gib is None else (None, None)
    gpus = args.gpus if args.gpus is not None else local_gpus
    gpu_memory = args.gpu_memory_gib * GIB if args.gpu_memory_gib else local_memory
    if gpus < 1 or args.nodes < 1 or gpu_memory is None:
        print("zerotune estimate: error: " + ("no GPU here to read the memory of: pass --gpu-memory-gib (e.g. 80 or 141)"
              if gpu_memory is None else "--gpus and --nodes must be >= 1"), file=sys.stderr)
        return 2
    cpu_memory = args.cpu_memory_gib * GIB if args.cpu_memory_gib else _local_cpu_memory()
    try:
        recipe = load_recipe(args.config, args.overrides)
        if recipe.model.activation_checkpointing == "auto":  # the table shows the settings; a run plans its own
            recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, activation_checkpointing="full"))
            print("model.activation_checkpointing=auto: the table assumes full; a run on a GPU picks the least "
                  "recomputation that fits it (see memory_plan.json, or pass --gpu-memory-gib to a run as "
                  "train.gpu_memory_gib)", file=sys.stderr)
        model_config, model = model_shape(recipe.model)
        deepspeed = ds_json_path(args.deepspeed)
        configs = {path: resolve_ds_config(path, recipe, gpus * args.nodes, model_config["hidden_size"],
                                           recipe_path=args.config or "recipes/mistral7b_lora.yaml",
                                           vocab_size=model_config["vocab_size"])
                   for path in config_files(deepspeed)}
        rows = estimate_table(model_config, recipe, configs, gpus, args.nodes, gpu_memory, cpu_memory)
    except (ConfigError, ValueError) as e:
        print(f"zerotune estimate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    r, first = recipe, rows[0]
    kind = (f"LoRA r{r.lora.rank} on {','.join(r.lora.target_modules)}" if r.lora.enabled else "full fine-tuning")
    print(f"model: {model} ({first['parameters']:,} parameters; {kind}: {first['trained_parameters']:,} trained)")
    print(f"per GPU: micro-batch {r.train.micro_batch_size} x {r.data.max_seq_len} tokens, activation checkpointing "
          f"{r.model.activation_checkpointing}, {r.model.attn_implementation}; {gpus} GPU(s) x {args.nodes} node(s)")
    print(f"GPU memory {gpu_memory / GIB:.1f} GiB: a configuration fits when its peak is <= {FIT_FRACTION:.0%} of it. "
          f"GiB per GPU; peak = the larger of backward (weights + grads + optimizer + activations + buffers) and the "
          f"optimizer step (weights + optimizer + buffers + grads at step); * = {args.deepspeed}\n")
    print(format_table(rows, deepspeed))
    print("\n" + recommend(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
