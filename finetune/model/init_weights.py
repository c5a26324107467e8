"""The random init of a model built from config.json alone: the same weights under ZeRO-0/1/2/3 and any world size.

    model = AutoModelForCausalLM.from_config(config)   # under ZeRO-3: inside zero.Init, partitioned
    init_weights.initialize(model, model_cfg.init_seed)

transformers draws a plain build's weights from the global RNG module by module, and under ZeRO-3 gathers each module
and draws on rank 0, in another order: the same seed gives other weights on another stage. Here every parameter is
re-drawn from the seed and its name alone. Its flattened elements are cut into blocks of BLOCK elements, each drawn
on the CPU by its own generator, seeded by a hash of (seed, name, block index); a ZeRO-3 rank draws only the blocks
that overlap its partition and writes its slice, so no rank holds a whole parameter, let alone the model (a
parameter whose partition lives on NVMe is the exception: gathered, written and partitioned again, one at a time).

The distributions are those of transformers' PreTrainedModel._init_weights, which Mistral uses as is (RULES); a
parameter no rule covers, or a model class with its own _init_weights, is an error rather than a guess.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from finetune.config import ConfigError

BLOCK = 1 << 20  # elements per generator: a rank draws at most two blocks it does not keep per parameter


@dataclass(frozen=True)
class Rule:
    """How one kind of parameter is drawn."""
    module: str  # what the rule matches, for messages
    matches: Callable[[nn.Module], bool]
    attr: str  # the parameter's name in its module
    kind: str  # "normal" (mean 0, std config.initializer_range), "zeros" or "ones"


RULES = (
    Rule("torch.nn.Linear", lambda m: isinstance(m, nn.Linear), "weight", "normal"),
    Rule("torch.nn.Linear", lambda m: isinstance(m, nn.Linear), "bias", "zeros"),
    Rule("torch.nn.Embedding", lambda m: isinstance(m, nn.Embedding), "weight", "normal"),  # padding_idx row: zeros
    # transformers recognises norms by class name (MistralRMSNorm, LlamaRMSNorm, ...), as here
    Rule("*RMSNorm", lambda m: "RMSNorm" in type(m).__name__, "weight", "ones"),
)


def rule_for(name: str, module: nn.Module) -> Rule:
    """The rule for parameter `name` (its owner is `module`), or a ConfigError naming it."""
    attr = name.rpartition(".")[2]
    for rule in RULES:
        if rule.attr == attr and rule.matches(module):
            return rule
    known = ", ".join(f"{r.module}.{r.attr}" for r in RULES)
    raise ConfigError(f"random init: no rule for parameter {name!r} ({type(module).__name__}.{attr}); "
                      f"finetune/model/init_weights.py draws {known}. Point model.path at a folder with weights, or add a "
                      f"rule to RULES")


def block_seed(seed: int, name: str, block: int) -> int:
    """The seed of one block's generator: stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256(f"{seed}\0{name}\0{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: any torch.Generator accepts it


def _normal_block(seed: int, name: str, block: int, size: int, std: float) -> torch.Tensor:
    return torch.empty(size, dtype=torch.float32).normal_(0.0, std, generator=torch.Generator().manual_seed(
        block_seed(seed, name, block)))


def draw(name: str, kind: str, shape: tuple[int, ...], start: int, end: int, seed: int, std: float,
         zero_rows: tuple[int, ...] = (), pool: ThreadPoolExecutor | None = None) -> torch.Tensor:
    """Flattened elements [start, end) of parameter `name` (of `shape`), in float32: the same values whichever range
    they are drawn in. Every block is drawn whole, so a range's values do not depend on where it starts or ends."""
    numel = int(torch.Size(shape).numel())
    if not 0 <= start <= end <= numel:
        raise ValueError(f"{name}: elements [{start}, {end}) are outside its {numel}")
    if kind in ("zeros", "ones"):
        out = torch.full((end - start,), 0.0 if kind == "zeros" else 1.0)
    elif kind == "normal":
        out = torch.empty(end - start)
        blocks = range(start // BLOCK, -(-end // BLOCK))
        fn = lambda b: _normal_block(seed, name, b, min(BLOCK, numel - b * BLOCK), std)
        for b, values in zip(blocks, pool.map(fn, blocks) if pool else map(fn, blocks)):
            lo, hi = max(b * BLOCK, start), min((b + 1) * BLOCK, end)  # the part of block b inside [start, end)
            out[lo - start:hi - start] = values[lo - b * BLOCK:hi - b * BLOCK]
    else:
        raise ValueError(f"{name}: unknown init kind {kind!r}")
    width = numel // shape[0] if shape else 1
    for row in zero_rows:  # an embedding's padding row; the part of it inside [start, end)
        lo, hi = max(row * width, start), min((row + 1) * width, end)
        if lo < hi:
            out[lo - start:hi - start] = 0.0
    return out


def partition_range(numel: int, world: int, rank: int) -> tuple[int, int]:
    """The flattened elements a ZeRO-3 rank holds, as DeepSpeed's zero.Init cuts them: `world` equal partitions of
    the parameter padded to a multiple of `world`; the padding (in the last ranks) is no element of it."""
    size = -(-numel // world)
    return min(rank * size, numel), min((rank + 1) * size, numel)


def check_init_weights(model: nn.Module) -> None:
    """RULES mirror PreTrainedModel._init_weights: a model class that draws its weights its own way is refused."""
    from transformers import PreTrainedModel  # lazy: slow to import, and only random-init runs need it

    init = getattr(type(model), "_init_weights", None)
    if init is not PreTrainedModel._init_weights:
        raise ConfigError(f"random init: {type(model).__name__} initialises its weights its own way, which "
                          f"finetune/model/init_weights.py does not reproduce; point model.path at a folder with weights")


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """Re-draw every parameter of `model` (built by transformers, any ZeRO stage) from `seed` and its name."""
    check_init_weights(model)
    std = getattr(model.config, "initializer_range", None) or 0.02  # as PreTrainedModel._init_weights reads it
    plan = []
    for name, p in model.named_parameters():  # tied weights once, under their first name
        module = model.get_submodule(name.rpartition(".")[0])
        rule = rule_for(name, module)
        pad = getattr(module, "padding_idx", None) if isinstance(module, nn.Embedding) else None
        plan.append((name, p, rule.kind, () if pad is None else (pad,)))
    # blocks are independent: drawn in threads (torch releases the GIL), the cores shared among this machine's ranks
    threads = min(torch.get_num_threads(), (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for name, p, kind, zero_rows in plan:
            _write(p, lambda start, end: draw(name, kind, _shape(p), start, end, seed, std, zero_rows, pool))


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)


def _write(p: torch.Tensor, values: Callable[[int, int], torch.Tensor]) -> None:
    """Writes the elements this rank holds: all of them, or under ZeRO-3 its partition (p.ds_tensor)."""
    if not hasattr(p, "ds_tensor"):
        p.copy_(values(0, p.numel()).view(p.shape))
        return
    import deepspeed  # lazy: only a ZeRO-3 model has partitioned parameters
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    part, group = p.ds_tensor, p.ds_process_group
    world, rank = deepspeed.comm.get_world_size(group=group), deepspeed.comm.get_rank(group=group)
    plain = (p.ds_status == ZeroParamStatus.NOT_AVAILABLE and getattr(part, "final_location", None) is None
             and getattr(p, "ds_secondary_tensor", None) is None and part.numel() == -(-p.ds_numel // world))
    if plain:
        start, end = partition_range(p.ds_numel, world, rank)
        part.narrow(0, 0, end - start).copy_(values(start, end))
        return
    # A partition on NVMe, a secondary (hpZ) copy or a gathered parameter: writing one slice would leave other
    # copies stale, so this parameter is gathered whole, written on the group's rank 0 and partitioned again.
    with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
        if rank == 0:
            p.data.copy_(values(0, p.ds_numel).view(p.ds_shape))
