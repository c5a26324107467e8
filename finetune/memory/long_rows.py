"""The planner's choices for long rows (finetune/memory/budget.py): which sequence-parallel degrees to try and in what
order, whether to try the tiled MLP, and the order of recomputation options by the forward work they repeat.

    sequence_parallel_degrees("auto", config, world=8, ranks_per_node=8)   # [1, 2, 4, 8]
    least_recomputation(config, 131072, tilings=[False, True])             # [("none", None, False), ...]

Rules: sequence parallelism only when degree 1 does not fit (it adds two all-to-alls per layer and divides the
data-parallel ranks); degrees that divide the world and fit the attention heads (each rank takes heads / N query heads
and, for GQA, kv_heads / N key/value heads or whole copies of them), smallest first, those whose group lies inside one
node before those that span nodes. Recomputation options are ordered by the forward FLOPs they repeat per token: a
recomputed layer repeats the whole layer, the tiled MLP repeats every layer's MLP (its backward rebuilds each tile).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from finetune.config import ConfigError
from finetune.memory.activations import kept_inputs, mlp_tile_tokens
from finetune.memory.shapes import dims, heads
from finetune.parallel.degree import ATTENTION, check_heads


def sequence_parallel_degrees(setting: int | str, cfg: dict[str, Any], world: int, ranks_per_node: int,
                              attn_implementation: str = "auto", objective: str = "sft") -> list[int]:
    """The degrees to try, in order: the recipe's own when it names one; for `auto` 1, then the valid degrees inside
    one node (ascending), then across nodes (ascending). Sequence parallelism runs zerotune's attention only
    (finetune/parallel/degree.py): with another model.attn_implementation, 1; and a preference objective scores whole
    pairs on one rank (finetune/model/preference.py): 1."""
    if isinstance(setting, int):
        return [setting]
    if attn_implementation not in ATTENTION or objective != "sft":
        return [1]
    valid = [n for n in range(2, world + 1) if world % n == 0 and compatible_with_heads(cfg, n)]
    inside = [n for n in valid if n <= ranks_per_node and ranks_per_node % n == 0]
    return [1, *inside, *(n for n in valid if n not in inside)]


def compatible_with_heads(cfg: dict[str, Any], n: int) -> bool:
    """Whether n ranks can split the attention heads: every rank the same number of query heads, and key/value heads
    either split the same way or copied whole to n / kv_heads ranks each."""
    try:
        check_heads(n, *heads(cfg))
    except ConfigError:
        return False
    return True


def tiling_options(setting: str, seq_len: int) -> list[bool]:
    """Tiled MLP settings to try, untiled first: the recipe's when it says on or off; for `auto` both where rows are
    longer than a tile, else untiled (as a run's `auto` resolves it)."""
    if setting in ("on", "off"):
        return [setting == "on"]
    return [False, True] if seq_len > mlp_tile_tokens() else [False]


def forward_flops_per_token(cfg: dict[str, Any], seq_len: int) -> tuple[float, float]:
    """(one decoder layer's, its MLP's) forward FLOPs per token; attention over the keys a causal row reaches, within
    the sliding window where the model has one."""
    h, i, q, kv, _, _ = dims(cfg)
    window = min(seq_len, cfg.get("sliding_window") or seq_len)
    mlp = 2 * 3 * h * i
    attention = 2 * (2 * h * q + 2 * h * kv) + 2 * q * window  # projections, then q.k and p.v over window / 2 keys
    return attention + mlp, mlp


def two_level_segment(layers: int) -> int:
    """The segment two-level recomputation takes (finetune/model/two_level.py): about √L, which keeps the fewest
    inputs, L/k kept and k - 1 rebuilt at a time (32 layers: 6)."""
    return max(2, round(layers ** 0.5))


def least_recomputation(cfg: dict[str, Any], seq_len: int, tilings: list[bool],
                        recompute_layers: int | None = None) -> list[tuple[str, int | None, bool]]:
    """(checkpointing, recomputed layers under selective, tiled MLP) on the GPU, the least repeated forward work first:
    none, selective 1, 2, ... layers (or the recipe's count), full; tiled variants where their cost falls, untiled
    first at equal cost. (Two-level recomputation repeats more than any of them and more than a second GPU per row
    costs: the planner tries it after every degree, before the layer inputs go to CPU memory.)"""
    layers = cfg["num_hidden_layers"]
    layer, mlp = forward_flops_per_token(cfg, seq_len)
    counts = [recompute_layers] if recompute_layers else list(range(1, layers))
    base = [("none", None, 0), *(("selective", k, k) for k in counts), ("full", None, layers)]
    options = [(c, k, tiled, n * layer + (layers * mlp if tiled else 0)) for tiled in tilings for c, k, n in base]
    options.sort(key=lambda o: (o[3], o[2]))  # stable: at equal cost the order above
    return [(c, k, tiled) for c, k, tiled, _ in options]


def offload_options(tilings: list[bool], layers: int) -> list[tuple[str, int | None, bool]]:
    """Checkpointing with the layers' inputs in CPU memory: only when nothing on the GPU fits; then with two-level
    recomputation, one input per segment in CPU memory, where the node's memory holds no more."""
    return [("offload", segment, tiled) for segment in (None, two_level_segment(layers)) for tiled in tilings]


def fewest_offloaded(trial, estimate: Callable[[Any], dict[str, Any]], layers: int, limit: float) -> tuple[Any, dict]:
    """Under `offload` checkpointing: the trial recipe with the fewest kept layer inputs in CPU memory
    (model.offload_layers, the first layers') whose estimated peak fits `limit`, and its estimate; the trial as given
    (all of them) where only that fits, or nothing does. Every input in CPU memory costs a copy out and one back per
    step; the GPU's estimate falls with each one moved there, so a bisection finds the fewest."""
    row = estimate(trial)
    inputs = kept_inputs(layers, trial.model.recompute_segment)
    if row["total"] > limit:
        return trial, row
    fewest, most = 1, inputs  # `most` fits
    while fewest < most:
        middle = (fewest + most) // 2
        if estimate(with_offloaded(trial, middle))["total"] <= limit:
            most = middle
        else:
            fewest = middle + 1
    if most == inputs:
        return trial, row
    chosen = with_offloaded(trial, most)
    return chosen, estimate(chosen)


def with_offloaded(recipe, count: int | None):
    """The recipe with model.offload_layers = count."""
    return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, offload_layers=count))
