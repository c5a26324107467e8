"""Fit a run into a GPU memory budget: activation checkpointing, micro-batch and (with `--deepspeed auto`) the ZeRO
configuration, chosen from the memory estimator before any model exists; and the host-memory check for offloading.

    deepspeed --num_gpus 2 finetune/main.py --deepspeed auto --config recipes/mistral7b_full.yaml train.gpu_memory_gib=24
    # prints "memory plan (...)": the budget, the DeepSpeed file, checkpointing, micro-batch, the estimated peak

The rules, fastest first:
1. configurations in estimate.SPEED_ORDER (with `--deepspeed PATH`, only that one);
2. micro-batches divide the recipe's rows per GPU per step (micro_batch_size x grad_accum), so the batch per step, the
   data order and the loss curve stay the recipe's; grad_accum takes the rest;
3. ZeRO-0/1/2 on the GPU: the least recomputation (none, selective, full) at a micro-batch of 2 or more, the largest
   first; micro-batch 1 only when nothing larger fits: its GEMMs are too small to keep a GPU busy, so it runs slower
   even than full recomputation at a larger micro-batch (docs/benchmarks/2026-11-30-h200-budget.md).
   Least recomputation: none, then selective with 1, 2, ... layers recomputed (model.recompute_layers, unless the
   recipe fixes it), then full. Each recomputed layer costs its forward GEMMs again, so the fewest that fit is the
   fastest (docs/benchmarks/2026-11-30-2xh200-vs-peer.md, call rc1).
4. ZeRO-3 and offloading pay per micro-batch (weight gathers; the CPU optimizer step is fixed per step while the GPU
   work shrinks): the largest micro-batch first, then the least recomputation; full recomputation at a larger
   micro-batch runs faster there than selective at a smaller one (docs/benchmarks/2026-11-30-h200-budget.md).
Long rows (finetune/memory/long_rows.py):
5. train.sequence_parallel auto: degree 1 with every configuration first; then the smallest degree that fits, inside
   one node first, dividing the world and the heads. The batch per step stays micro_batch_size x grad_accum rows
   per data-parallel rank (world / degree of them).
6. model.tiled_mlp auto, rows longer than a tile: the tiled MLP joins the recomputation options, ordered by the
   forward work each repeats (the tiled MLP repeats every layer's MLP forward, a recomputed layer the whole layer).
7. checkpointing `offload` (layer inputs in pinned CPU memory) only when nothing on the GPU fits at any degree; the
   fewest inputs that make it fit (model.offload_layers), and only where the node's memory holds them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from finetune import dist
from finetune.config import ConfigError, Recipe
from finetune.ds_config import load_ds_json, offloads_optimizer, resolve_for_model, zero_stage
from finetune.memory.activations import kept_inputs
from finetune.memory.estimate import (FIT_FRACTION, GIB, SHIPPED, SPEED_ORDER, display_path, estimate_run,
                                      recomputed_layers, shipped_dir, tiled_mlp_on)
from finetune.memory.node import host_memory, local_gpu_gib, ranks_per_node
from finetune.memory.long_rows import (fewest_offloaded, least_recomputation, offload_options, sequence_parallel_degrees,
                                       tiling_options, two_level_segment)


@dataclass
class MemoryPlan:
    deepspeed: str
    activation_checkpointing: str
    micro_batch_size: int
    grad_accum: int
    estimated_gib: float
    budget_gib: float
    cpu_gib_per_node: float
    passed_over: list[str] = field(default_factory=list)
    """Faster choices that did not fit, with their estimated peak."""
    recompute_layers: int | None = None
    """Under selective checkpointing: how many decoder layers are recomputed (of `layers`)."""
    recompute_segment: int | None = None
    """Under full or offload checkpointing: two-level recomputation's segment (model.recompute_segment), or None."""
    layers: int = 0
    sequence_parallel: int = 1
    """Ranks that share each row's sequence (train.sequence_parallel as chosen); data-parallel size = world / it."""
    tiled_mlp: str = "off"
    """model.tiled_mlp as chosen: `on` or `off`."""
    seq_len: int = 0
    cpu_activations_gib_per_node: float = 0.0
    """Under `offload` checkpointing: the layers' inputs in pinned CPU memory, per node (part of cpu_gib_per_node)."""
    offload_layers: int | None = None
    """Under `offload` checkpointing: how many kept layer inputs are in CPU memory (model.offload_layers); None = all."""
    reasons: list[str] = field(default_factory=list)
    """Why sequence parallelism, the tiled MLP or checkpoint offload were chosen, each with the estimate that ruled
    out the cheaper option."""

    @property
    def recompute(self) -> int | None:
        """What with_memory_choice takes: the selective layer count, or the two-level segment."""
        return self.recompute_layers or self.recompute_segment

    def checkpointing_text(self) -> str:
        text = describe_checkpointing(self.activation_checkpointing, self.recompute_layers, self.layers,
                                      self.recompute_segment)
        kept = kept_inputs(self.layers, self.recompute_segment)
        return text + (f" ({self.offload_layers} of {kept} layer inputs in CPU memory)" if self.offload_layers else "")

    def summary(self) -> str:
        lines = [f"memory plan ({self.budget_gib:g} GiB per GPU, fits at <= {FIT_FRACTION:.0%}): {self.deepspeed}, "
                 f"activation checkpointing {self.checkpointing_text()}, micro-batch {self.micro_batch_size} x "
                 f"grad_accum {self.grad_accum}; estimated peak {self.estimated_gib:.2f} GiB per GPU"
                 + (f", {self.cpu_gib_per_node:.0f} GiB CPU memory per node" if self.cpu_gib_per_node else "")]
        if self.sequence_parallel > 1 or self.tiled_mlp == "on" or self.activation_checkpointing == "offload":
            lines.append(f"  {self.seq_len:,}-token rows: sequence parallel {self.sequence_parallel}, tiled MLP "
                         f"{self.tiled_mlp}, layer inputs in CPU memory: "
                         + (f"yes ({self.cpu_activations_gib_per_node:.1f} GiB per node)"
                            if self.activation_checkpointing == "offload" else "no"))
        lines += [f"  {why}" for why in self.reasons]
        lines += [f"  passed over: {why}" for why in self.passed_over]
        return "\n".join(lines)


def fit(recipe: Recipe, model_config: dict[str, Any], deepspeed: str, world: int,
        recipe_path: str) -> tuple[Recipe, str, MemoryPlan | None]:
    """With train.gpu_memory_gib, --deepspeed auto or model.activation_checkpointing=auto on a GPU (whose memory is
    then the budget): the recipe and DeepSpeed file the memory plan chose, and the plan (printed on rank 0); otherwise
    the inputs unchanged (auto checkpointing without a GPU: none) and None. The chosen recipe names what it chose:
    checkpointing, micro-batch, model.tiled_mlp on/off and train.sequence_parallel as a number."""
    gib = recipe.train.gpu_memory_gib
    auto_checkpointing = recipe.model.activation_checkpointing == "auto"
    # sequence_parallel auto with long rows on a GPU: its degree is planned, the recipe's other settings kept
    only_sequence = (gib is None and deepspeed != "auto" and not auto_checkpointing and world > 1
                     and recipe.train.sequence_parallel == "auto" and tiled_mlp_on("auto", recipe.data.max_seq_len))
    if gib is None and (deepspeed == "auto" or auto_checkpointing or only_sequence):
        gib = local_gpu_gib()
        if gib is None and deepspeed == "auto":
            raise ConfigError("--deepspeed auto picks the ZeRO configuration that fits a GPU memory budget, and there "
                              "is no GPU here to read it from: set train.gpu_memory_gib (GiB per GPU), or pass "
                              "--deepspeed ds_configs/zero3.json")
    if gib is None:
        if auto_checkpointing:  # no GPU memory to fit: recomputation would only cost time
            recipe = with_memory_choice(recipe, "none", recipe.train.micro_batch_size, recipe.train.grad_accum)
        return recipe, deepspeed, None
    try:
        plan = plan_memory(recipe, model_config, deepspeed, world, gib, cpu_memory(recipe), ranks_per_node(world),
                           recipe_path, keep_settings=only_sequence)
    except ConfigError as e:
        if not only_sequence:
            raise
        # not asked to fit a budget: the run goes as written
        dist.print0(f"warning: train.sequence_parallel=auto: with the recipe's checkpointing and micro-batch no degree "
                    f"fits this GPU's {gib:g} GiB, so it runs with 1 ({e})")
        return recipe, deepspeed, None
    except ValueError as e:  # the estimator does not know the model or LoRA targets
        if only_sequence:
            return recipe, deepspeed, None
        raise ConfigError(f"train.gpu_memory_gib: {e}") from None
    dist.print0(plan.summary())
    chosen = with_memory_choice(recipe, plan.activation_checkpointing, plan.micro_batch_size, plan.grad_accum,
                                plan.recompute, plan.tiled_mlp == "on", plan.sequence_parallel, plan.offload_layers)
    return chosen, plan.deepspeed, plan


def check_offload_fits_host(recipe: Recipe, model_config: dict[str, Any], ds: dict[str, Any], world: int) -> None:
    """Refuse an offloading run (optimizer, or the layers' inputs under `offload` checkpointing) whose CPU memory
    cannot fit the node's RAM; warn (rank 0) when it exceeds what is free."""
    if not offloads_optimizer(ds) and recipe.model.activation_checkpointing != "offload":
        return
    try:
        row = estimate_run(model_config, recipe, ds, world)
    except ValueError:  # LoRA targets the estimator does not model: nothing to check against
        return
    warning = check_host_memory(row, ranks_per_node(world), cpu_memory(recipe), host_memory()[1])
    if warning:
        dist.print0(warning)


def cpu_memory(recipe: Recipe) -> float | None:
    """Bytes of CPU memory per node for offloading: train.cpu_memory_gib, else what the node reports."""
    gib = recipe.train.cpu_memory_gib
    return gib * GIB if gib else host_memory()[0]


def candidate_configs(deepspeed: str) -> list[str]:
    """`auto`: every shipped configuration, fastest first; else the one file."""
    if deepspeed != "auto":
        return [deepspeed]
    return [os.path.join(shipped_dir(), SHIPPED[key]) for key in SPEED_ORDER]


def plan_memory(recipe: Recipe, model_config: dict[str, Any], deepspeed: str, world: int, budget_gib: float,
                cpu_bytes_per_node: float | None, ranks_per_node: int, recipe_path: str = "the recipe",
                cuda: bool | None = None, keep_settings: bool = False) -> MemoryPlan:
    """The fastest (sequence-parallel degree, configuration, checkpointing, tiling, micro-batch) whose estimated peak
    fits FIT_FRACTION of the budget and whose offloaded states and layer inputs fit the node's memory; a ConfigError
    naming the smallest option when nothing fits. Checkpoint offload comes last, after every degree on the GPU.

    cuda: whether the run is on CUDA (resolves attention `auto`; None = this machine). keep_settings: choose only the
    sequence-parallel degree, with the recipe's checkpointing, micro-batch and tiling."""
    rows_per_step = recipe.train.micro_batch_size * recipe.train.grad_accum
    micro_batches = [m for m in range(rows_per_step, 0, -1) if rows_per_step % m == 0]
    layers, seq_len = model_config["num_hidden_layers"], recipe.data.max_seq_len
    limit = FIT_FRACTION * budget_gib * GIB
    tilings = tiling_options(recipe.model.tiled_mlp, seq_len)
    degrees = sequence_parallel_degrees(recipe.train.sequence_parallel, model_config, world, ranks_per_node,
                                        recipe.model.attn_implementation, recipe.train.objective)
    passed_over, smallest, lowest_per_degree, refused = [], None, {}, set()
    for phase in ("gpu", "two_level", "offload"):  # two-level recomputation only where no degree fits otherwise
        offload = phase == "offload"
        for sp in degrees:
            for path in candidate_configs(deepspeed):
                name = display_path(path)
                if name in refused:
                    continue
                estimate = lambda r: _estimate(model_config, r, path, world, recipe_path, cuda)  # noqa: E731
                lowest = None
                for checkpointing, mbs, recompute, tiled in _options(recipe, path, micro_batches, model_config,
                                                                     tilings, phase, keep_settings):
                    trial = with_memory_choice(recipe, checkpointing, mbs, rows_per_step // mbs, recompute, tiled, sp)
                    if offload:  # the fewest layer inputs in CPU memory that fit the GPU
                        trial, row = fewest_offloaded(trial, estimate, layers, limit)
                    else:
                        row = estimate(trial)
                    if cpu_bytes_per_node is not None and row["cpu_states"] * ranks_per_node > cpu_bytes_per_node:
                        # Offloaded states do not depend on checkpointing or micro-batch: no option of this file fits.
                        passed_over.append(f"{name}: offloads {row['cpu_states'] * ranks_per_node / GIB:.0f} GiB per "
                                           f"node, the node has {cpu_bytes_per_node / GIB:.0f} GiB")
                        refused.add(name)
                        break
                    if cpu_bytes_per_node is not None and row["cpu"] * ranks_per_node > cpu_bytes_per_node:
                        continue  # the offloaded layer inputs do not fit the node
                    described = (describe_checkpointing(checkpointing, recompute, layers, recompute), mbs, sp, tiled)
                    if lowest is None or row["total"] < lowest[0]:
                        lowest = (row["total"], *described)
                    if smallest is None or row["total"] < smallest[0]:
                        smallest = (row["total"], name, *described)
                    if row["total"] <= limit:
                        whole = checkpointing in ("full", "offload")  # `recompute` is then the two-level segment
                        plan = MemoryPlan(name, checkpointing, mbs, rows_per_step // mbs, row["total"] / GIB, budget_gib,
                                          row["cpu"] * ranks_per_node / GIB, passed_over, None if whole else recompute,
                                          recompute if whole else None, layers, sp, "on" if tiled else "off", seq_len,
                                          row["cpu_activations"] * ranks_per_node / GIB, trial.model.offload_layers)
                        plan.reasons = _reasons(plan, recipe, row, lowest_per_degree, smallest, limit, estimate)
                        return plan
                if lowest is not None and phase != "two_level":  # (the smallest that keeps every layer's input)
                    key = (offload, sp)
                    lowest_per_degree[key] = min(lowest_per_degree.get(key, lowest[0]), lowest[0])
                    if phase == "gpu" and sp == degrees[0]:
                        passed_over.append(f"{name}: {lowest[0] / GIB:.2f} GiB at its smallest ("
                                           f"{_option_text(*lowest[1:])})")
    advice = ("Lower data.max_seq_len, use LoRA, add GPUs, or offload to NVMe (ds_configs/zero3_nvme.json with "
              "train.nvme_path)" + ("" if deepspeed == "auto" else ", or pass --deepspeed auto to let zerotune choose"))
    if smallest is None:
        raise ConfigError(f"train.gpu_memory_gib={budget_gib:g}: {'; '.join(passed_over)}. {advice}")
    total, name, *described = smallest
    host = [why for why in passed_over if " offloads " in why]
    raise ConfigError(
        f"train.gpu_memory_gib={budget_gib:g}: nothing fits {FIT_FRACTION:.0%} of it; the smallest is {name} with "
        f"{_option_text(*described, sentence=True)} at {total / GIB:.2f} GiB per GPU"
        + (f" (CPU memory rules out {'; '.join(host)})" if host else "")
        + (f"; CPU memory for offloading: {cpu_bytes_per_node / GIB:,.0f} GiB per node" if cpu_bytes_per_node else "")
        + f". {advice}")


def _estimate(model_config: dict[str, Any], trial: Recipe, path: str, world: int, recipe_path: str,
              cuda: bool | None) -> dict[str, Any]:
    ds = resolve_for_model(path, trial, world, model_config, recipe_path)
    return estimate_run(model_config, trial, ds, world, cuda)


def _option_text(checkpointing: str, mbs: int, sp: int, tiled: bool, sentence: bool = False) -> str:
    """`checkpointing full, micro-batch 1` (+ sequence parallel, tiled MLP); `checkpointing full and micro-batch 1`."""
    extra = (f", sequence parallel {sp}" if sp > 1 else "") + (", tiled MLP" if tiled else "")
    return f"checkpointing {checkpointing}{' and' if sentence else ','} micro-batch {mbs}{extra}"


def _reasons(plan: MemoryPlan, recipe: Recipe, row: dict[str, Any], lowest_per_degree: dict, smallest: tuple,
             limit: float, estimate) -> list[str]:
    """Why the plan takes sequence parallelism, the tiled MLP, checkpoint offload: the estimate each rules out."""
    out, on_gpu = [], plan.activation_checkpointing != "offload"
    gib = lambda b: f"{b / GIB:,.0f} GiB"  # noqa: E731
    if plan.sequence_parallel > 1 and recipe.train.sequence_parallel == "auto":
        one = lowest_per_degree.get((not on_gpu, 1), lowest_per_degree.get((False, 1)))
        tried = [f"sequence parallel {n}: est. {gib(b)}" for (off, n), b in sorted(lowest_per_degree.items())
                 if n not in (1, plan.sequence_parallel) and off == (not on_gpu)]
        out.append(f"sequence parallel {plan.sequence_parallel}: {plan.seq_len:,} tokens per row do not fit one GPU "
                   + (f"(est. {gib(one)} > {gib(limit)})" if one is not None else "") +
                   (f"; nor with {', '.join(tried)}" if tried else ""))
    if plan.tiled_mlp == "on" and recipe.model.tiled_mlp == "auto":
        untiled = estimate(with_memory_choice(recipe, plan.activation_checkpointing, plan.micro_batch_size,
                                              plan.grad_accum, plan.recompute, False, plan.sequence_parallel))
        out.append(f"tiled MLP on: {plan.seq_len:,}-token rows; untiled, this plan needs est. {gib(untiled['total'])}"
                   f" > {gib(limit)}" if untiled["total"] > limit else
                   f"tiled MLP on: {plan.seq_len:,}-token rows; it repeats less forward work than the recomputation "
                   f"untiled rows would need here")
    if on_gpu and plan.recompute_segment:
        best_gpu = min((b for (off, _), b in lowest_per_degree.items() if not off), default=None)
        out.append(f"two-level recomputation (segments of {plan.recompute_segment} layers): nothing that keeps every "
                   f"layer's input fits" + (f" (smallest est. {gib(best_gpu)} > {gib(limit)})" if best_gpu else ""))
    if not on_gpu:
        best_gpu = min((b for (off, _), b in lowest_per_degree.items() if not off), default=None)
        out.append("layer inputs in CPU memory (checkpointing offload): nothing fits on the GPU"
                   + (f" (smallest est. {gib(best_gpu)} > {gib(limit)})" if best_gpu is not None else "")
                   + f"; they take {plan.cpu_activations_gib_per_node:.1f} GiB of pinned CPU memory per node")
    return out


def _options(recipe: Recipe, path: str, micro_batches: list[int], model_config: dict[str, Any], tilings: list[bool],
             phase: str, keep_settings: bool) -> list[tuple[str, int, int | None, bool]]:
    """One pass's (checkpointing, micro-batch, recomputed layers or two-level segment, tiled MLP) options of one file,
    best first. Phases: on the GPU; two-level recomputation on the GPU; the layer inputs in CPU memory."""
    if keep_settings:
        if phase != "gpu":
            return []
        m = recipe.model
        tiled = tiled_mlp_on(m.tiled_mlp, recipe.data.max_seq_len)
        return [(m.activation_checkpointing, recipe.train.micro_batch_size, m.recompute_layers or m.recompute_segment,
                 tiled)]
    layers = model_config["num_hidden_layers"]
    if phase == "offload":
        return _by_micro_batch(path, micro_batches, offload_options(tilings, layers))
    if phase == "two_level":
        return _by_micro_batch(path, micro_batches, [("full", two_level_segment(layers), t) for t in tilings])
    least_first = least_recomputation(model_config, recipe.data.max_seq_len, tilings, recipe.model.recompute_layers)
    return _by_micro_batch(path, micro_batches, least_first)


def _by_micro_batch(path: str, micro_batches: list[int],
                    least_first: list[tuple[str, int | None, bool]]) -> list[tuple[str, int, int | None, bool]]:
    """Recomputation options (least first) crossed with micro-batches, per the module's rules: ZeRO-3 and offloading
    the largest micro-batch first; ZeRO-0/1/2 the least recomputation at a micro-batch of 2 or more, then 1. Selective
    comes as every layer count from 1 up (or the recipe's), so the first that fits recomputes the fewest."""
    raw = load_ds_json(path)
    if zero_stage(raw) == 3 or offloads_optimizer(raw):  # they pay per micro-batch
        return [(c, m, k, t) for m in micro_batches for c, k, t in least_first]
    options = [(c, m, k, t) for c, k, t in least_first for m in micro_batches if m > 1 or len(micro_batches) == 1]
    return options + [(c, 1, k, t) for c, k, t in least_first if len(micro_batches) > 1]


def with_memory_choice(recipe: Recipe, checkpointing: str, micro_batch_size: int, grad_accum: int,
                       recompute_layers: int | None = None, tiled_mlp: bool | None = None,
                       sequence_parallel: int | None = None, offload_layers: int | None = None) -> Recipe:
    """The recipe with the plan's choices; tiled_mlp / sequence_parallel None keep the recipe's. offload_layers:
    under `offload`, the kept layer inputs in CPU memory (None: all)."""
    whole = checkpointing in ("full", "offload")  # recompute_layers is then two-level's segment, or the recipe's
    tiled = recipe.model.tiled_mlp if tiled_mlp is None else "on" if tiled_mlp else "off"
    model = dataclasses.replace(recipe.model, activation_checkpointing=checkpointing, tiled_mlp=tiled,
                                recompute_layers=recompute_layers if checkpointing == "selective" else None,
                                recompute_segment=(recompute_layers or recipe.model.recompute_segment) if whole else None,
                                offload_layers=offload_layers if checkpointing == "offload" else None)
    train = dataclasses.replace(recipe.train, micro_batch_size=micro_batch_size, grad_accum=grad_accum)
    train = train if sequence_parallel is None else dataclasses.replace(train, sequence_parallel=sequence_parallel)
    return dataclasses.replace(recipe, model=model, train=train)


def describe_checkpointing(checkpointing: str, recompute_layers: int | None, layers: int,
                           segment: int | None = None) -> str:
    """`selective (4 of 32 layers recomputed)`, `full, two-level (segments of 6 layers)`; none and full as they are."""
    if checkpointing in ("full", "offload") and segment:
        return f"{checkpointing}, two-level (segments of {segment} layers)"
    if checkpointing != "selective" or not layers:
        return checkpointing
    return f"selective ({len(recomputed_layers('selective', layers, recompute_layers))} of {layers} layers recomputed)"


def check_host_memory(row: dict[str, Any], ranks_per_node: int, total: float | None,
                      available: float | None) -> str | None:
    """Offloaded states live in the node's RAM (pinned): refuse when they exceed its `total` bytes, warn (the returned
    text) when they exceed what is `available` now. A full fine-tune offloads 16 bytes per parameter, shared by all
    ranks (fp32 master, Adam's two moments, fp32 gradients): all of it on one node when every rank is there."""
    needed = row["cpu"] * ranks_per_node
    if needed == 0 or total is None:
        return None
    if needed > total:
        raise ConfigError(
            f"{row['config']} offloads {_gib(needed)} GiB per node to CPU memory ({ranks_per_node} rank(s) x "
            f"{row['cpu'] / GIB:.1f} GiB) but this node has {_gib(total)} GiB: use more nodes or GPUs (each holds a "
            f"smaller share), LoRA, or ds_configs/zero3_nvme.json with train.nvme_path. If the node really has more "
            f"(a VM that grows its memory on demand), set train.cpu_memory_gib")
    if available is not None and needed > available:
        return (f"warning: {row['config']} offloads {_gib(needed)} GiB per node to CPU memory and only "
                f"{_gib(available)} GiB is available now (of {_gib(total)}): other processes may have to go, "
                f"or the run will swap or be killed")
    return None


def enforce(budget_gib: float) -> float | None:
    """Cap this process's CUDA caching allocator at the budget, so a smaller card can be simulated on a larger one.
    Returns the fraction set, or None (no CUDA, or the budget is the whole GPU or more)."""
    import deepspeed  # lazy: `zerotune compare` imports this module; planning needs no torch
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = budget_gib * GIB / total
    if fraction >= 1.0:
        return None
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    # DeepSpeed sizes some steps by the card's free memory (ZeRO-1/2 flatten the 16-bit weights on the GPU when it
    # sees room for a second copy, else on the CPU). Under the cap alone it saw the whole card's free memory and ran
    # out of the budget there, which a real card of that size would not (docs/benchmarks/2026-11-30-h200-budget.md).
    # Show it the card it simulates.
    accelerator, cap = deepspeed.get_accelerator(), int(budget_gib * GIB)
    free_on_card = accelerator.available_memory
    accelerator.total_memory = lambda device_index=None: cap
    accelerator.available_memory = lambda device_index=None: max(
        0, min(free_on_card(device_index), cap - torch.cuda.memory_reserved(device_index)))
    return fraction


def _gib(n: float) -> str:
    """Bytes as GiB with the digits that matter: 135, 2.5, 0.001."""
    g = n / GIB
    return f"{g:.0f}" if g >= 10 else f"{g:.1f}" if g >= 0.1 else f"{g:.3f}"
