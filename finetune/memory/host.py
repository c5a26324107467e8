"""Whether this host's memory holds what the run's ranks put in it, checked before any rank loads a model.

    check_host_fits(recipe, model_config, ds, world)   # finetune/prepare.py, before the run folder is touched

What each rank holds in host memory, from the estimator's terms (finetune/memory/estimate.py):
- without a GPU, everything: the weights, gradients and optimizer state as the DeepSpeed JSON shards them (ZeRO-3's
  zero.Init builds only each rank's shard of the weights; ZeRO-0/1/2 hold the whole model on every rank), and what it
  offloads;
- with a GPU, the model as from_pretrained / from_config build it: all of it, on the host, on every rank, until
  deepspeed.initialize moves it to the GPU, except under ZeRO-3, whose zero.Init puts each parameter's shard on the
  GPU as it is built (transformers then loads the checkpoint file by memory map, whose pages the kernel can drop);
  afterwards only the offloaded states stay (the larger of the two moments).
Activations come on top (and are not counted): the figure is what the run needs at least. Every rank on the host
holds its own; their sum beyond the host's memory (MemTotal under its cgroup limit, or train.cpu_memory_gib) is a
ConfigError that says what to change, beyond what is free now a warning.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from finetune import dist
from finetune.config import ConfigError, Recipe
from finetune.memory.budget import cpu_memory
from finetune.memory.node import host_memory, ranks_per_node
from finetune.memory.estimate import GIB, estimate_run


def host_bytes(row: dict[str, Any], on_gpu: bool) -> int:
    """Bytes one rank holds in host memory at least, for an estimate_run row."""
    if not on_gpu:
        return row["params"] + row["grads"] + row["optimizer"] + row["cpu_states"]
    loaded = row["params"] if row["stage"] < 3 else 0
    return max(loaded, row["cpu_states"])


def check_host_fits(recipe: Recipe, model_config: dict[str, Any], ds: dict[str, Any], world: int,
                    on_gpu: bool | None = None) -> None:
    """Raise ConfigError when the ranks of this host need more memory than it has; print a warning (rank 0) when
    they need more than is free now. on_gpu: whether the ranks train on GPUs (None: this machine has one)."""
    on_gpu = bool(dist.local_gpus()) if on_gpu is None else on_gpu
    try:
        row = estimate_run(model_config, recipe, ds, world, cuda=on_gpu)
    except (ValueError, KeyError):  # LoRA targets or a config the estimator does not model: nothing to check against
        return
    ranks, per_rank = ranks_per_node(world), host_bytes(row, on_gpu)
    needed, (total, available) = ranks * per_rank, (cpu_memory(recipe), host_memory()[1])
    if total is None or needed == 0:
        return
    if needed > total:
        what = (f"{'LoRA' if recipe.lora.enabled else 'full'} fine-tuning of {model_config.get('model_type', 'the')} "
                f"model {recipe.model.path!r} ({row['parameters'] / 1e9:.2f}B parameters)")
        raise ConfigError(f"{what} {_needs(row, on_gpu, ranks, per_rank)}, but this host has {_gib(total)} GiB: "
                          f"{_advice(recipe, model_config, ds, world, row, on_gpu, total)}. If the host really has more "
                          f"(a VM that grows its memory on demand), set train.cpu_memory_gib")
    if available is not None and needed > available:
        dist.print0(f"warning: the run's {_ranks(ranks)} on this host need at least {_gib(needed)} GiB of its memory "
                    f"and only {_gib(available)} GiB is available now (of {_gib(total)}): other processes may have to "
                    f"go, or the run will swap or be killed")


def _needs(row: dict[str, Any], on_gpu: bool, ranks: int, per_rank: int) -> str:
    """`needs at least N GiB of this host's memory (R ranks x M GiB: ...)`, naming what each rank holds."""
    each = f"{_ranks(ranks)} x {_gib(per_rank)} GiB"
    if not on_gpu:
        terms = (("weights", row["params"]), ("gradients", row["grads"]), ("optimizer state", row["optimizer"]),
                 ("offloaded states", row["cpu_states"]))
        parts = [f"{name} {_gib(n)}" for name, n in terms if n]
        return (f"without a GPU needs at least {_gib(ranks * per_rank)} GiB of this host's memory ({each}: "
                f"{', '.join(parts)} GiB under {row['config']})")
    if per_rank > row["cpu_states"]:
        return (f"needs at least {_gib(ranks * per_rank)} GiB of this host's memory while loading ({each}: every rank "
                f"builds the whole model in host memory before {row['config']} moves it to its GPU)")
    return (f"needs at least {_gib(ranks * per_rank)} GiB of this host's memory ({each} of states {row['config']} "
            f"offloads)")


def _advice(recipe: Recipe, model_config: dict[str, Any], ds: dict[str, Any], world: int, row: dict[str, Any],
            on_gpu: bool, total: float) -> str:
    """What to change, the cheapest first: LoRA (with what it would need here), ZeRO-3, more hosts or GPUs."""
    ways = []
    if not recipe.lora.enabled:
        lora = dataclasses.replace(recipe, lora=dataclasses.replace(recipe.lora, enabled=True))
        try:
            need = ranks_per_node(world) * host_bytes(estimate_run(model_config, lora, ds, world, cuda=on_gpu), on_gpu)
        except ValueError:
            need = None
        if need is not None and need <= total:
            ways.append(f"train LoRA instead (lora.enabled=true: at least {_gib(need)} GiB here)")
    zero3 = "under ZeRO-3" if row["stage"] == 3 else "under ZeRO-3 (--deepspeed zero3)"
    if on_gpu and row["stage"] < 3 and not row["cpu_states"]:
        ways.append("use ZeRO-3 (--deepspeed zero3: each rank builds only its shard, on its GPU)")
    elif on_gpu:
        ways.append(f"spread the job over more hosts {zero3}: each rank holds a smaller share")
    else:
        ways.append(f"train on a machine with GPUs, or over more hosts {zero3}: each rank holds a share")
    return "; ".join(ways) + "; or use a host with more memory"


def _gib(n: float) -> str:
    """Bytes as GiB with the digits that matter: 108, 13.5, 0.25."""
    g = n / GIB
    return f"{g:.0f}" if g >= 100 else f"{g:.1f}" if g >= 0.1 else f"{g:.2f}"


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"
