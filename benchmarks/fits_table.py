"""The "what fits where" table of docs/memory.md: the memory plan (`--deepspeed auto train.gpu_memory_gib=G`) of
Mistral-7B, LoRA and full, for 24/40/80/141 GB GPUs and 1-8 GPUs, from the estimator; cells measured on an H200 with
the budget enforced (docs/benchmarks/budget/runs.json) carry the measured peak. Estimates assume transformers' own
modules (the liger kernels, used by default on CUDA when installed, need less).

    python benchmarks/fits_table.py [--cpu-memory-gib 256] > table.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from finetune.memory.budget import plan_memory  # noqa: E402
from finetune.config import ConfigError, load_recipe  # noqa: E402
from finetune.memory.estimate import GIB, recomputed_layers  # noqa: E402

SHORT = {"zero0.json": "ZeRO-0", "zero1.json": "ZeRO-1", "zero2.json": "ZeRO-2", "zero3.json": "ZeRO-3",
         "zero2_offload.json": "ZeRO-2 + CPU optimizer", "zero3_offload_optimizer.json": "ZeRO-3 + CPU optimizer",
         "zero3_offload.json": "ZeRO-3 + CPU optimizer and weights"}


def cell(kind: str, gpus: int, gib: int, cpu_gib: float, measured: dict) -> str:
    recipe = load_recipe(os.path.join(ROOT, "recipes", f"mistral7b_{kind}.yaml"),
                         [f"model.path={os.path.join(ROOT, 'recipes', 'mistral7b_shape')}"])
    model_config = json.load(open(os.path.join(ROOT, "recipes", "mistral7b_shape", "config.json")))
    try:
        plan = plan_memory(recipe, model_config, "auto", gpus, gib, cpu_gib * GIB, gpus)
    except ConfigError:
        return "does not fit"
    layers = model_config["num_hidden_layers"]
    chosen = settings(plan.deepspeed, plan.activation_checkpointing, plan.micro_batch_size, layers,
                      plan.recompute_layers)
    text = f"{chosen}: est. {plan.estimated_gib:.1f}"
    m = measured.get((kind, gpus, gib))
    if m is None:
        return text
    # The runs were measured before the fused loss and MLP (model.fused_loss, fused_mlp) and the planner's last rule
    # change: say what ran, with that run's own estimate.
    ran = settings(m["deepspeed"], m["activation_checkpointing"], m["micro_batch_size"], layers)
    return text + f" (ran as {ran}: est. {m['estimated_gib']:.1f}, **measured {m['peak_allocated_gib']:.1f}**)"


def settings(deepspeed: str, checkpointing: str, micro_batch: int, layers: int,
             recompute_layers: int | None = None) -> str:
    recompute = {"none": "no", "full": "full"}.get(checkpointing) or \
        f"{len(recomputed_layers('selective', layers, recompute_layers))}/{layers}-layer"
    return f"{SHORT[os.path.basename(deepspeed)]}, {recompute} recompute, mb {micro_batch}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-memory-gib", type=float, default=256, help="CPU memory per node (default 256)")
    args = p.parse_args()
    runs = json.load(open(os.path.join(ROOT, "docs", "benchmarks", "budget", "runs.json")))["runs"]
    measured = {(r["kind"], int(r["machine"][0]), int(r["budget_gib"])): r for r in runs if "error" not in r}
    gpus_list, budgets = (1, 2, 4, 8), (24, 40, 80, 141)
    print("| fine-tune | GPU memory | " + " | ".join(f"{g} GPU{'s' if g > 1 else ''}" for g in gpus_list) + " |")
    print("|---|---|" + "---|" * len(gpus_list))
    for kind in ("lora", "full"):
        for gib in budgets:
            cells = [cell(kind, g, gib, args.cpu_memory_gib, measured) for g in gpus_list]
            print(f"| {'LoRA r16' if kind == 'lora' else 'full'} | {gib} GB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
