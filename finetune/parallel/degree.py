"""The sequence-parallel degree of a run: `train.sequence_parallel` resolved and checked against the world size and
the model's heads, before any rank starts work; and where a rank sits (data-parallel rank, sequence-parallel rank).

    degree = resolve_degree(recipe, world=4, model_config=config)   # 2: two groups of 2 ranks share rows
    dp_rank, sp_rank = layout(rank=3, degree=2)                     # (1, 1)

No torch here: the launcher imports it (finetune/multinode/launcher.py checks the degree before it starts a rank).
"""

from __future__ import annotations

from typing import Any

from finetune.config import ConfigError, Recipe
from finetune.model import folder as model_folder

KEY = "train.sequence_parallel"
ATTENTION = ("auto", "flex")
"""model.attn_implementation values sequence parallelism runs with: its core attention is zerotune's
(finetune/perf/attention.py), which finds the packed samples and the sliding window from the gathered position_ids."""


def check_world(degree: int, world: int) -> None:
    """ConfigError unless `degree` ranks divide the `world` ranks into whole groups."""
    if degree < 1 or world % degree:
        fits = [n for n in range(1, world + 1) if world % n == 0]
        raise ConfigError(f"{KEY}={degree} does not divide the {world} rank(s) of this run into groups: set it to one "
                          f"of {', '.join(map(str, fits))}, or launch a multiple of {degree} ranks")


def check_heads(degree: int, heads: int, kv_heads: int) -> None:
    """ConfigError unless the attention heads split evenly over `degree` ranks (the all-to-all hands each rank
    heads / degree of them) and the key/value heads either split evenly or are a divisor of degree (then each rank
    gets a copy of one)."""
    if heads % degree:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ConfigError(f"{KEY}={degree} does not divide the model's {heads} attention heads (each rank of a "
                          f"sequence-parallel group computes heads / {KEY} of them): use one of {', '.join(map(str, fits))}")
    if kv_heads % degree and degree % kv_heads:
        raise ConfigError(f"{KEY}={degree} and the model's {kv_heads} key/value heads: one must divide the other "
                          f"(each rank needs whole key/value heads); use a divisor or a multiple of {kv_heads}")


def resolve_degree(recipe: Recipe, world: int, planned: int | None = None,
                   model_config: dict[str, Any] | None = None) -> int:
    """train.sequence_parallel as this run uses it: an int as given; `auto` = `planned` (the memory planner's
    choice, finetune/memory/budget.py) or 1. Checked against the world size, the model's heads (model_config, else
    model.path's config.json) and model.attn_implementation; a ConfigError says what to change."""
    value = recipe.train.sequence_parallel
    degree = (planned or 1) if value == "auto" else int(value)
    check_world(degree, world)
    if degree == 1:
        return 1
    attn = recipe.model.attn_implementation
    if attn not in ATTENTION:
        raise ConfigError(f"{KEY}={degree} runs zerotune's attention (it finds the packed samples and the sliding "
                          f"window in the whole row's position_ids); model.attn_implementation={attn} cannot: set "
                          f"model.attn_implementation=flex (or auto), or {KEY}=1")
    config = model_config if model_config is not None else _model_config(recipe.model.path)
    heads = int(config["num_attention_heads"])
    check_heads(degree, heads, int(config.get("num_key_value_heads") or heads))
    return degree


def degree_of(recipe: Recipe) -> int:
    """The recipe's sequence-parallel degree as prepare resolved it (`auto` not yet resolved counts as 1)."""
    value = recipe.train.sequence_parallel
    return 1 if value == "auto" else int(value)


def data_parallel_size(recipe: Recipe, world: int) -> int:
    """The ranks that take different rows: world / sequence_parallel."""
    return world // degree_of(recipe)


def layout(rank: int, degree: int) -> tuple[int, int]:
    """(data-parallel rank, sequence-parallel rank) of a global rank: the ranks of a group are consecutive, so a group
    stays inside one node where it can (the all-to-all of every layer is its heaviest traffic)."""
    return rank // degree, rank % degree


def _model_config(path: str) -> dict[str, Any]:
    return model_folder.read_config(path, KEY + "'s model.path")
