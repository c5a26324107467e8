"""Resolve a DeepSpeed JSON against the recipe: fill the fields the recipe owns, refuse leftovers and contradictions.

    ds = resolve_ds_config("ds_configs/zero3.json", recipe, world_size=2, hidden_size=4096)

The JSON says how the engine shards (ZeRO stage, bf16, offload, buckets); the recipe says what to train.
Fields the recipe owns are "auto" in our shipped JSONs; a user may also write the same value as the recipe,
but a different value is an error naming both files, and an "auto" we do not know how to fill is an error too.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
from typing import Any

from finetune import shipped
from finetune.config import ConfigError, Recipe
from finetune.memory import shapes

AUTO = "auto"


def ds_json_path(path: str) -> str:
    """The file behind `--deepspeed`: a path (an existing one wins) or a shipped name such as `zero3` or `zero3.json`."""
    try:
        return shipped.ds_config_path(path)
    except shipped.NotShipped as e:
        raise ConfigError(str(e)) from None


def load_ds_json(path: str) -> dict[str, Any]:
    """The DeepSpeed JSON at `path` (or of a shipped name), as written."""
    path = ds_json_path(path)
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None


def resolve_ds_config(
    path: str, recipe: Recipe, world_size: int, hidden_size: int, recipe_path: str = "the recipe",
    vocab_size: int = 32000, layer_parameters: int = 0,
) -> dict[str, Any]:
    """The DeepSpeed config to hand to the engine, with every "auto" filled from the recipe (and, for NVMe offload's
    buffers, the model's width and vocabulary; for ZeRO-3's prefetch under lora.zero3_layer_gather, one decoder
    layer's weight count, finetune/memory/shapes.py layer_parameters)."""
    raw = load_ds_json(path)
    ds = copy.deepcopy(raw)
    t, o = recipe.train, recipe.optim
    owned: list[tuple[tuple[str, ...], Any, str]] = [
        (("train_micro_batch_size_per_gpu",), t.micro_batch_size, "train.micro_batch_size"),
        (("gradient_accumulation_steps",), t.grad_accum, "train.grad_accum"),
        (("train_batch_size",), t.micro_batch_size * t.grad_accum * world_size,
         f"train.micro_batch_size x train.grad_accum x {world_size} ranks"),
        (("gradient_clipping",), o.grad_clip, "optim.grad_clip"),
        (("optimizer", "params", "lr"), o.lr, "optim.lr"),
        (("optimizer", "params", "betas"), list(o.betas), "optim.betas"),
        (("optimizer", "params", "eps"), o.eps, "optim.eps"),
        (("optimizer", "params", "weight_decay"), o.weight_decay, "optim.weight_decay"),
    ]
    for keys, value, recipe_key in owned:
        _fill(ds, keys, value, path, recipe_path, recipe_key)

    zero = ds.setdefault("zero_optimization", {})
    engine_auto = {
        # HF's integration uses the same sizes: they scale with the model's width.
        "reduce_bucket_size": hidden_size * hidden_size,
        "stage3_prefetch_bucket_size": max(int(0.9 * hidden_size * hidden_size),
                                           _whole_layer(recipe, zero.get("stage", 0), layer_parameters)),
        "stage3_param_persistence_threshold": 10 * hidden_size,
        # ZeRO-1/2's overlap synchronizes the whole device before each gradient bucket is reduced (DeepSpeed 0.19's
        # stage_1_and_2.py, allreduce_and_copy): on one rank there is no communication to hide, only those waits.
        # ZeRO-3 prefetches weights through it, so it stays on there (docs/benchmarks/2026-12-04-h200-fp8-vs-peer.md).
        "overlap_comm": world_size > 1 or zero.get("stage") == 3,
    }
    for key, value in engine_auto.items():
        if zero.get(key) == AUTO:
            zero[key] = value
    _fill_nvme(zero, recipe, path, recipe_path, hidden_size * vocab_size)

    if "optimizer" in ds and ds["optimizer"].get("type", "AdamW").lower() != "adamw":
        raise ConfigError(f"{path}: optimizer.type {ds['optimizer']['type']!r}: zerotune trains with AdamW; remove the block or set \"AdamW\"")
    if "scheduler" in ds:
        raise ConfigError(
            f"{path}: remove the 'scheduler' block: the recipe owns the schedule "
            f"(optim.warmup_steps, optim.min_lr_ratio, train.max_steps in {recipe_path})"
        )
    if ds.get("fp16", {}).get("enabled") is True:
        raise ConfigError(f"{path}: fp16 is not supported for Mistral (it overflows); use \"bf16\": {{\"enabled\": true}}")
    if zero.get("stage", 0) == 0 and ds.get("bf16", {}).get("enabled") is True:
        raise ConfigError(
            f"{path}: ZeRO-0 with \"bf16\" accumulates gradients in bf16 in DeepSpeed; use "
            f"\"torch_autocast\": {{\"enabled\": true, \"dtype\": \"bfloat16\"}} instead (see ds_configs/zero0.json)"
        )
    if zero.get("stage", 0) not in (0, 1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage must be 0, 1, 2 or 3, got {zero.get('stage')!r}")

    leftover = list(_find_auto(ds))
    if leftover:
        raise ConfigError(
            f"{path}: {', '.join(leftover)} still \"auto\": zerotune fills only fields the recipe owns "
            f"(batch sizes, clipping, optimizer values, ZeRO bucket sizes, overlap_comm); write a number there"
        )
    ds.setdefault("steps_per_print", 10**9)  # our own progress line replaces DeepSpeed's
    ds.setdefault("wall_clock_breakdown", False)
    return ds


def resolve_for_model(path: str, recipe: Recipe, world_size: int, model_config: dict[str, Any],
                      recipe_path: str = "the recipe") -> dict[str, Any]:
    """resolve_ds_config with the model's sizes read from its config.json (model_config): what a run, the planner
    and `zerotune estimate` resolve."""
    return resolve_ds_config(path, recipe, world_size, model_config["hidden_size"], recipe_path,
                             vocab_size=model_config["vocab_size"], layer_parameters=shapes.layer_parameters(model_config))


def gathers_whole_layers(recipe: Recipe, stage: int) -> bool:
    """Whether ZeRO-3 gathers each decoder layer's weights as one (lora.zero3_layer_gather, LoRA under ZeRO-3;
    finetune/perf/layer_gather.py): perf.apply installs it, and the prefetch bucket is sized for it here."""
    return stage == 3 and recipe.lora.enabled and recipe.lora.zero3_layer_gather


def _whole_layer(recipe: Recipe, stage: int, layer_parameters: int) -> int:
    """ZeRO-3's prefetch under whole-layer gathers: the next layer's weights all, so that its gather overlaps this
    layer's work. DeepSpeed prefetches weights in the recorded order until the bucket is full; at the width-based
    size (0.9 h^2, a projection or two) the rest of a layer whose weights are gathered as one would wait for its
    gather. Two layers' weights gathered at once is what the memory estimate counts for ZeRO-3
    (finetune/memory/estimate.py estimate_buffers). 0 where layers are not gathered whole."""
    return layer_parameters if gathers_whole_layers(recipe, stage) else 0


def _fill_nvme(zero: dict[str, Any], recipe: Recipe, path: str, recipe_path: str, largest_param: int) -> None:
    """NVMe offload: nvme_path "auto" comes from train.nvme_path; the parameter swap buffers must hold the largest
    tensor (the embedding), which DeepSpeed's default of 1e8 elements does not for Mistral-7B (131M)."""
    for block in ("offload_optimizer", "offload_param"):
        section = zero.get(block, {})
        if section.get("device") != "nvme":
            continue
        if section.get("nvme_path") == AUTO:
            nvme = recipe.train.nvme_path
            if not nvme:
                raise ConfigError(f"{path} offloads to NVMe: set train.nvme_path=/a/folder/on/local/nvme in {recipe_path} "
                                  f"(or on the command line)")
            if not os.path.isdir(nvme) or not os.access(nvme, os.W_OK):
                raise ConfigError(f"train.nvme_path {nvme!r} is not a writable folder: create it on a local NVMe disk "
                                  f"(DeepSpeed swaps optimizer states and parameters there)")
            # A folder of this run's own (named after its output_dir): two jobs sharing a disk must not swap into
            # each other's files, and the run removes it at the end (DeepSpeed leaves the swap files behind).
            run_id = hashlib.sha1(os.path.abspath(recipe.train.output_dir).encode()).hexdigest()[:10]
            section["nvme_path"] = os.path.join(nvme, f"zerotune-swap-{run_id}")
        if section.get("buffer_size") == AUTO:
            section["buffer_size"] = max(10**8, largest_param)
    if zero.get("offload_param", {}).get("device") == "nvme" and recipe.lora.enabled:
        # DeepSpeed 0.19.8's NVMe prefetch hands a peft base weight a second swap buffer ("param N already assigned
        # swap buffer id"); without prefetch LoRA trains (tests/integration/test_offload.py).
        zero["stage3_prefetch_bucket_size"] = 0


def nvme_swap_dirs(ds: dict[str, Any]) -> list[str]:
    """The run's NVMe swap folders (filled by _fill_nvme), to remove when it ends."""
    zero = ds.get("zero_optimization", {})
    paths = {zero.get(block, {}).get("nvme_path") for block in ("offload_optimizer", "offload_param")
             if zero.get(block, {}).get("device") == "nvme"}
    return sorted(p for p in paths if p and os.path.basename(p).startswith("zerotune-swap-"))


def zero_stage(ds: dict[str, Any]) -> int:
    return int(ds.get("zero_optimization", {}).get("stage", 0))


def bf16_enabled(ds: dict[str, Any]) -> bool:
    return bool(ds.get("bf16", {}).get("enabled", False))


@functools.cache
def native_cpu_bf16() -> bool:
    """Whether this CPU computes bf16 natively (oneDNN's AVX-512 paths). Without them (e.g. an AVX2-only CPU) torch
    emulates bf16 GEMMs, far slower than fp32 ones (docs/benchmarks/2026-12-01-cpu-bf16-emulation.md);
    finetune/perf/fused_loss.py runs the output layer's in fp32 there."""
    import torch  # lazy: `zerotune estimate` and `compare` resolve DeepSpeed JSONs without torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the check: assume native, as before
        return True


def emulated_bf16_note(ds: dict[str, Any]) -> str | None:
    """A note for a bf16 run on the CPU of a machine without native bf16, or None."""
    import torch  # lazy: as in native_cpu_bf16

    if not bf16_enabled(ds) or torch.cuda.is_available() or native_cpu_bf16():
        return None
    return (f"note: this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native bf16, so torch emulates it: a "
            f"bf16 run here is slower than fp32 (docs/benchmarks/2026-12-01-cpu-bf16-emulation.md). "
            f"For a CPU run, pass a DeepSpeed file with \"bf16\": {{\"enabled\": false}}, e.g. "
            f"ds_configs/zero3_fp32.json")


def quickstart_ds_config() -> str:
    """The DeepSpeed file launch/quickstart.sh trains the tiny recipe with (and its test,
    tests/integration/test_tiny_recipe.py): ZeRO-3 in bf16 on GPUs, in fp32 on a CPU. CPUs with and without native
    bf16 round bf16 differently (emulated bf16 GEMMs accumulate otherwise), so fp32 keeps CPU runs comparable, and it
    is the faster where bf16 is emulated (docs/benchmarks/2026-12-01-cpu-bf16-emulation.md)."""
    import torch  # lazy: `zerotune --help` and the launcher import this module without torch

    return "ds_configs/zero3.json" if torch.cuda.is_available() else "ds_configs/zero3_fp32.json"


def offloads_optimizer(ds: dict[str, Any]) -> bool:
    device = ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device in ("cpu", "nvme")


def engine_config(ds: dict[str, Any]) -> dict[str, Any]:
    """What deepspeed.initialize gets: zerotune builds the optimizer and schedule itself (one code path on CPU, GPU and
    offload, and exactly what the plain-PyTorch oracle does), so the filled optimizer block is documentation only."""
    cfg = copy.deepcopy(ds)
    cfg.pop("optimizer", None)
    if zero_stage(cfg) == 0:
        cfg["gradient_clipping"] = 0.0  # zerotune clips ZeRO-0 itself, exactly (see optim.clip_grad_norm_exact)
    if offloads_optimizer(cfg):
        # DeepSpeedCPUAdam is a DeepSpeed optimizer, but ZeRO checks the client optimizer's class by name.
        cfg["zero_allow_untested_optimizer"] = True
    return cfg


def _fill(ds: dict, keys: tuple[str, ...], value: Any, path: str, recipe_path: str, recipe_key: str) -> None:
    node = ds
    for key in keys[:-1]:
        if key not in node:
            return
        node = node[key]
    last = keys[-1]
    if last not in node:
        node[last] = value if len(keys) == 1 else node.get(last, value)
        return
    current = node[last]
    if current == AUTO:
        node[last] = value
    elif not _same(current, value):
        raise ConfigError(
            f"{path} sets {'.'.join(keys)} = {current!r} but {recipe_path} gives {recipe_key} = {value!r}: "
            f"set it to \"auto\" in {path} (the recipe owns it) or change {recipe_key}"
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _find_auto(node: Any, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _find_auto(value, f"{prefix}{key}.")
    elif node == AUTO:
        yield prefix.rstrip(".")
