"""`zerotune estimate`: the per-GPU memory table of every shipped DeepSpeed configuration for a recipe, and the
fastest that fits (the arithmetic is finetune/memory/estimate.py).

    zerotune estimate --config mistral7b_lora --deepspeed zero3 --gpus 2 --gpu-memory-gib 141
    zerotune estimate --config mistral7b_full --gpus 8 --gpu-memory-gib 141 --seq-lens 8192,32768,131072,262144

It needs no weights, only the model's config.json: without one at model.path, the shipped Mistral-7B shape.
Estimates are for GPU runs wherever it runs: model.attn_implementation `auto` is counted as a GPU resolves it (flex).
With --seq-lens (by default, when data.max_seq_len is long) it adds memory against sequence length: each term of the
--deepspeed file's peak per length, and what `--deepspeed auto` would plan at each (finetune/memory/budget.py).
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
from finetune.ds_config import ds_json_path, resolve_for_model
from finetune.memory.budget import plan_memory, with_memory_choice
from finetune.memory.node import host_memory
from finetune.memory.estimate import (FIT_FRACTION, GIB, SHIPPED, SPEED_ORDER, attention_kind, display_path,
                                      estimate_run, shipped_dir)
from finetune.run import console, folder as run_folder

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
        row = dict(estimate_run(model_config, recipe, ds, gpus * nodes, cuda=True), ds_config=display_path(path))
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
    rows = [dict(r, activations=r["activations"] + r["transient"]) for r in rows]  # kept and backward's working set
    lines = ["| config | weights | grads | optimizer | activations | buffers | grads at step | peak / GPU | CPU / node | fits |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        name = r["config"] + (" *" if chosen and display_path(chosen) == r["ds_config"] else "")
        cells = " | ".join(f"{r[c] / GIB:.1f}" for c in cols)
        lines.append(f"| {name} | {cells} | {r['cpu_per_node'] / GIB:.1f} | {'yes' if r['fits'] else 'no'} |")
    return "\n".join(lines)


SWEEP = (8192, 32768, 131072, 262144)  # the default lengths, up to data.max_seq_len


def seq_lens(option: str | None, max_seq_len: int) -> list[int]:
    """--seq-lens as a list; by default SWEEP's lengths below a long data.max_seq_len, and it."""
    if option is None:
        return [n for n in SWEEP if n < max_seq_len] + [max_seq_len] if max_seq_len > SWEEP[0] else []
    if option.strip().lower() == "none":
        return []
    try:
        lengths = [int(n.replace("_", "")) for n in option.split(",") if n.strip()]
    except ValueError:
        raise ConfigError(f"--seq-lens {option!r}: give token counts separated by commas, e.g. 8192,32768") from None
    if not lengths or min(lengths) < 2:
        raise ConfigError(f"--seq-lens {option!r}: give token counts of 2 or more, separated by commas")
    return lengths


def length_row(model_config: dict[str, Any], recipe, deepspeed: str, gpus: int, nodes: int, gpu_memory: float,
               cpu_memory: float | None, seq_len: int, recipe_path: str) -> dict[str, Any]:
    """The --deepspeed file's terms at rows of seq_len tokens with the recipe's settings, and the plan there."""
    world = gpus * nodes
    at = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, max_seq_len=seq_len))
    ds = resolve_for_model(deepspeed, at, world, model_config, recipe_path)
    row = estimate_run(model_config, at, ds, world, cuda=True)
    out = {k: row[k] for k in ("seq_len", "params", "grads", "optimizer", "activations", "transient", "buffers",
                               "step", "total", "cpu_activations", "attention", "tiled_mlp", "sequence_parallel",
                               "terms")}
    out["fits"] = row["total"] <= FIT_FRACTION * gpu_memory
    try:
        plan = plan_memory(at, model_config, "auto", world, gpu_memory / GIB, cpu_memory, gpus, recipe_path, cuda=True)
    except ConfigError:
        out["plan"], out["plan_text"] = None, "nothing fits"
        return out
    out["plan"] = {"deepspeed": plan.deepspeed, "sequence_parallel": plan.sequence_parallel,
                   "activation_checkpointing": plan.activation_checkpointing, "recompute_layers": plan.recompute_layers,
                   "recompute_segment": plan.recompute_segment, "offload_layers": plan.offload_layers,
                   "tiled_mlp": plan.tiled_mlp, "micro_batch_size": plan.micro_batch_size,
                   "estimated_gib": plan.estimated_gib, "reasons": plan.reasons}
    # the plan's own terms, to compare term by term with a run of that plan
    chosen = with_memory_choice(at, plan.activation_checkpointing, plan.micro_batch_size, plan.grad_accum,
                                plan.recompute, plan.tiled_mlp == "on", plan.sequence_parallel, plan.offload_layers)
    out["plan"]["terms"] = estimate_run(model_config, chosen, resolve_for_model(
        plan.deepspeed, chosen, world, model_config, recipe_path), world, cuda=True)["terms"]
    out["plan_text"] = (f"{os.path.basename(plan.deepspeed).removesuffix('.json')}, SP {plan.sequence_parallel}, "
                        f"{plan.checkpointing_text()}, tiled MLP {plan.tiled_mlp}, mb {plan.micro_batch_size}: "
                        f"{plan.estimated_gib:.1f}")
    return out


def format_sweep(rows: list[dict[str, Any]]) -> str:
    """Markdown table in GiB, one row per sequence length."""
    lines = ["| tokens per row | states | activations | transient | buffers | peak / GPU | CPU activations | fits | "
             "--deepspeed auto plans (est. GiB) |", "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        states = (r["params"] + r["grads"] + r["optimizer"]) / GIB
        cells = " | ".join(f"{r[c] / GIB:.1f}" for c in ("activations", "transient", "buffers", "total"))
        lines.append(f"| {r['seq_len']:,} | {states:.1f} | {cells} | {r['cpu_activations'] / GIB:.1f} | "
                     f"{'yes' if r['fits'] else 'no'} | {r['plan_text']} |")
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


def cpu_memory_line(cpu_memory: float | None, given: bool) -> str:
    """What CPU memory per node the offloading rows were held to, and where that figure came from: by default this
    machine's, which may not be the nodes' that will train."""
    if cpu_memory is None:
        return ("CPU memory per node: unknown (this machine's could not be read; pass --cpu-memory-gib): offloading "
                "configurations are not checked against it")
    source = ("--cpu-memory-gib" if given else
              "this machine's: MemTotal, capped by its cgroup limit; --cpu-memory-gib sets another")
    return (f"CPU memory {cpu_memory / GIB:.1f} GiB per node ({source}): an offloading configuration fits only when "
            f"its CPU / node is at most that")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotune estimate", description="Per-GPU memory of every ZeRO stage, and the fastest that fits.")
    p.add_argument("--config", metavar="PATH", default=None,
                   help="YAML recipe or a shipped name such as mistral7b_full (default mistral7b_lora)")
    p.add_argument("--deepspeed", metavar="PATH", default="ds_configs/zero3.json",
                   help="DeepSpeed JSON or a shipped name such as zero3: precision and buckets; its row is marked *")
    p.add_argument("--gpus", type=int, default=None, help="GPUs per node (default: this machine's, or 1)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU (default: this machine's GPU)")
    p.add_argument("--cpu-memory-gib", type=float, default=None, help="CPU memory of one node, for offloading (default: this machine's; the table says which it used)")
    p.add_argument("--seq-lens", metavar="N,N,...", default=None,
                   help="memory against sequence length: the peak per GPU of the --deepspeed file and the plan at each "
                        "(default: a sweep up to data.max_seq_len when it is longer than 8192; `none` for no sweep)")
    p.add_argument("--json", action="store_true",
                   help="print the rows as JSON instead of a table ({configs, seq_lens} with a sweep)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    local_gpus, local_memory = _local_gpus() if args.gpus is None or args.gpu_memory_gib is None else (None, None)
    gpus = args.gpus if args.gpus is not None else local_gpus
    gpu_memory = args.gpu_memory_gib * GIB if args.gpu_memory_gib else local_memory
    if gpus < 1 or args.nodes < 1 or gpu_memory is None:
        console.error("no GPU here to read the memory of: pass --gpu-memory-gib (e.g. 80 or 141)"
                      if gpu_memory is None else "--gpus and --nodes must be >= 1")
        return 2
    # what a run on this machine is held to (finetune/memory/budget.py), unless the nodes' memory is given
    cpu_memory = args.cpu_memory_gib * GIB if args.cpu_memory_gib else host_memory()[0]
    try:
        recipe = load_recipe(args.config, args.overrides)
        if recipe.model.activation_checkpointing == "auto":  # the table shows the settings; a run plans its own
            recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, activation_checkpointing="full"))
            print("model.activation_checkpointing=auto: the table assumes full; a run on a GPU picks the least "
                  f"recomputation that fits it (see {run_folder.MEMORY_PLAN}, or pass --gpu-memory-gib to a run as "
                  "train.gpu_memory_gib)", file=sys.stderr)
        model_config, model = model_shape(recipe.model)
        deepspeed = ds_json_path(args.deepspeed)
        configs = {path: resolve_for_model(path, recipe, gpus * args.nodes, model_config,
                                           args.config or "recipes/mistral7b_lora.yaml")
                   for path in config_files(deepspeed)}
        rows = estimate_table(model_config, recipe, configs, gpus, args.nodes, gpu_memory, cpu_memory)
        lengths = seq_lens(args.seq_lens, recipe.data.max_seq_len)
        sweep = [length_row(model_config, recipe, deepspeed, gpus, args.nodes, gpu_memory, cpu_memory, n,
                            args.config or "recipes/mistral7b_lora.yaml") for n in lengths]
    except (ConfigError, ValueError) as e:
        console.error(e)
        return 2
    if args.json:
        print(json.dumps({"configs": rows, "seq_lens": sweep} if sweep else rows, indent=2))
        return 0
    r, first = recipe, rows[0]
    kind = (f"LoRA r{r.lora.rank} on {','.join(r.lora.target_modules)}" if r.lora.enabled else "full fine-tuning")
    print(f"model: {model} ({first['parameters']:,} parameters; {kind}: {first['trained_parameters']:,} trained)")
    attn = r.model.attn_implementation
    print(f"per GPU: micro-batch {r.train.micro_batch_size} x {r.data.max_seq_len} tokens, activation checkpointing "
          f"{r.model.activation_checkpointing}, {attn}" + (f" ({attention_kind(attn, cuda=True)} on a GPU)"
                                                            if attn == "auto" else "")
          + f", tiled MLP {r.model.tiled_mlp}, sequence parallel {r.train.sequence_parallel}; {gpus} GPU(s) x "
          f"{args.nodes} node(s)")
    print(f"GPU memory {gpu_memory / GIB:.1f} GiB: a configuration fits when its peak is <= {FIT_FRACTION:.0%} of it. "
          f"GiB per GPU; peak = the larger of backward (weights + grads + optimizer + activations + buffers) and the "
          f"optimizer step (weights + optimizer + buffers + grads at step); * = {args.deepspeed}")
    print(cpu_memory_line(cpu_memory, bool(args.cpu_memory_gib)) + "\n")
    print(format_table(rows, deepspeed))
    print("\n" + recommend(rows))
    if sweep:
        print(f"\nmemory against sequence length: {display_path(deepspeed)} with the recipe's settings (GiB per GPU; "
              f"states = weights + grads + optimizer), and what `--deepspeed auto` plans for {gpu_memory / GIB:g} GiB "
              f"GPUs at each length (micro-batch x grad_accum kept at {r.train.micro_batch_size * r.train.grad_accum}"
              f" rows)\n")
        print(format_sweep(sweep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
