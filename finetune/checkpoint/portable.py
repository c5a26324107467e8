"""Checkpoints that resume on any number of ranks and any ZeRO stage: every trained parameter's fp32 weight and Adam
moments by name, beside DeepSpeed's own (sharded) checkpoint.

    portable.save(engine, tmp, writes.run)            # every rank, inside store.save
    route, why = portable.resume_route(path, run.ds)  # "engine", "portable" or "universal" (ConfigError: none fits)
    portable.load(engine, path)                       # every rank, when the route is "portable"

Layout: <checkpoint>/portable/{index.json, state.pt, params/<i>.<key>.pt}. index.json maps each trained parameter's
name to its files (fp32, exp_avg, exp_avg_sq); state.pt holds the optimizer's step per param group, the lr schedule
and DeepSpeed's step counters. Frozen weights (LoRA's base) are not stored: a resume builds them from model.path.
DeepSpeed's per-parameter gathers are collectives, so every rank gathers every parameter in the same order and
parameter i is written by rank i mod world: no rank holds more than one gathered tensor at a time.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from finetune import dist
from finetune.checkpoint.layout import saved_meta, write_json_atomic
from finetune.config import ConfigError
from finetune.ds_config import zero_stage

FOLDER = "portable"
INDEX = "index.json"
MOMENTS = ("exp_avg", "exp_avg_sq")
FP32 = "fp32"


def trained(engine) -> list[tuple[str, torch.nn.Parameter]]:
    """The trained parameters by name, in the module's order (the same on every rank and world size)."""
    return [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]


def has_layout(path: str) -> bool:
    return os.path.isfile(os.path.join(path, FOLDER, INDEX))


def save(engine, path: str, write) -> None:
    """Write portable/ into checkpoint folder `path`; all ranks call this. `write(fn, *args)` runs each write (store's
    _Writes.run: an error is recorded, later writes skipped, the gathers still run so no rank waits alone)."""
    folder, rank, world = os.path.join(path, FOLDER), dist.rank(), dist.world_size()
    write(os.makedirs, os.path.join(folder, "params"), exist_ok=True)
    keys = (FP32, *MOMENTS) if _has_moments(engine) else (FP32,)
    if len(keys) > 1:
        _link_moments(engine)
    index = {}
    for i, (name, p) in enumerate(trained(engine)):
        file = f"params/{i:05d}"
        index[name] = {"file": file, "shape": list(getattr(p, "ds_shape", p.shape))}
        for key in keys:
            value = _gather(engine, p, key)  # a collective: every rank, every parameter
            if i % world == rank:
                write(torch.save, value.detach().cpu().clone(), os.path.join(folder, f"{file}.{key}.pt"))
            del value
    if dist.is_main():
        state = {"optimizer_steps": optimizer_steps(engine),
                 "scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                 "global_steps": engine.global_steps, "global_samples": engine.global_samples,
                 "skipped_steps": engine.skipped_steps}
        write(torch.save, state, os.path.join(folder, "state.pt"))
        write(write_json_atomic, os.path.join(folder, INDEX),
              {"format": 1, "world_size": world, "zero_stage": engine.zero_optimization_stage(), "keys": list(keys),
               "params": index})


def load(engine, path: str) -> int:
    """Set every trained parameter's fp32 master, its training-precision copy (the master, cast, as a step leaves
    it) and Adam moments from portable/, then the optimizer steps, lr schedule and step counters; all ranks call
    this on a fresh engine. Returns the number of parameters set."""
    folder = os.path.join(path, FOLDER)
    with open(os.path.join(folder, INDEX)) as f:
        index = json.load(f)
    params = trained(engine)
    _check_names(path, index["params"], [name for name, _ in params])
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=False)
    base, z3 = _base(engine), engine.zero_optimization_stage() == 3
    if MOMENTS[0] in index["keys"]:
        _create_state(engine)
    if z3:
        engine.optimizer.checkpoint_event_prologue()  # every parameter partitioned: only the shards are set
    for name, p in params:
        for key in index["keys"]:
            value = torch.load(os.path.join(folder, f"{index['params'][name]['file']}.{key}.pt"), weights_only=True)
            _set(engine, p, key, value)
            del value
    if z3:
        opt = engine.optimizer
        for group in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(group)  # the 16-bit shards from the fp32 ones
        opt.checkpoint_event_epilogue()  # re-gathers the parameters ZeRO-3 keeps whole
    for group, step in zip(_state_groups(engine), state["optimizer_steps"]):
        _set_step(base, group, step)
    if state["scheduler"] is not None and engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(state["scheduler"])
    engine.global_steps, engine.global_samples = state["global_steps"], state["global_samples"]
    engine.skipped_steps = state["skipped_steps"]
    return len(params)


def resume_route(path: str, ds: dict[str, Any]) -> tuple[str, str]:
    """How checkpoint `path` resumes under DeepSpeed config `ds` on this many ranks: ("engine", "") on the layout it
    was saved with (DeepSpeed's own checkpoint: bit-exact, RNG included); ("portable", why) on another number of
    ranks or ZeRO stage; ("universal", why) for a ZeRO-1/2 checkpoint without portable/ on another number of ranks
    (DeepSpeed's universal conversion). ConfigError when it cannot resume here, saying why and what to do."""
    meta = saved_meta(path)
    saved_world, world = int(meta["world_size"]), dist.world_size()
    saved_stage = meta.get("ds_config", {}).get("zero_optimization", {}).get("stage")
    stage = zero_stage(ds)
    changes = ([f"{saved_world} rank(s) -> {world}"] if saved_world != world else []) + (
        [f"ZeRO-{saved_stage} -> ZeRO-{stage}"] if saved_stage is not None and int(saved_stage) != stage else [])
    if not changes:
        return "engine", ""
    why = ", ".join(changes)
    if has_layout(path):
        if ds.get("zero_optimization", {}).get("offload_optimizer", {}).get("device") == "nvme":
            raise ConfigError(f"{path} was saved on another layout ({why}); its portable state cannot be loaded into "
                              f"an optimizer offloaded to NVMe: resume it with the saved layout, or with "
                              f"offload_optimizer on the CPU or off")
        return "portable", why
    missing = (f"it has no portable layout ({FOLDER}/: saved with train.portable_checkpoints=false, or by an older "
               f"zerotune)")
    if saved_world != world and stage < 3 and (saved_stage is None or int(saved_stage) == stage):
        return "universal", why
    if saved_stage is not None and int(saved_stage) != stage:
        raise ConfigError(f"{path} was saved under ZeRO-{saved_stage} and {missing}, so it resumes only under "
                          f"ZeRO-{saved_stage}: pass a DeepSpeed config of that stage, or export it (zerotune export) "
                          f"and start a new run from the export")
    # DeepSpeed 0.19.8's universal conversion of a ZeRO-3 checkpoint restores the weights exactly but not Adam's
    # state, so the loss curve drifts (docs/benchmarks/2026-11-30-cpu-zero3-resume.md).
    raise ConfigError(
        f"{path} was saved by {saved_world} rank(s) under ZeRO-3 and {missing}; resume it on that many ranks, or "
        f"export it (zerotune export) and start a new run: without it, ZeRO-3 checkpoints do not reshard exactly "
        f"to {world} rank(s)")


def data_position(path: str) -> dict[str, int] | None:
    """Where the run saved in `path` took its rows: {"step", "epoch", "row", "rows_per_step"}, its step `step` began
    at that row of that epoch (finetune/data/loader.py). A checkpoint saved before it was kept: from step 0, with its
    DeepSpeed config's rows per step (None when that is missing too)."""
    meta = saved_meta(path)
    if "data_position" in meta:
        return meta["data_position"]
    rows = meta.get("ds_config", {}).get("train_batch_size")
    return {"step": 0, "epoch": 0, "row": 0, "rows_per_step": rows} if isinstance(rows, int) else None


def resume_note(path: str, ds: dict[str, Any], data_now: dict[str, int], lora: bool) -> str:
    """What a resume of `path` on another layout, or with other rows per step, does (empty when neither); data_now:
    this run's data position (Run.resolved_config)."""
    route, why = resume_route(path, ds)
    note = (f" on another layout ({why}): trained weights, Adam moments and steps from its {FOLDER}/ state"
            + (", frozen weights from model.path" if lora else "") if route == "portable" else
            f" on another layout ({why}), through DeepSpeed's universal checkpoint" if route == "universal" else "")
    saved = data_position(path)
    if saved is not None and saved["rows_per_step"] != data_now["rows_per_step"]:
        note += (f"; the saved run took {saved['rows_per_step']} rows per step, this one takes "
                 f"{data_now['rows_per_step']}: the data continues at row {data_now['row']} of epoch "
                 f"{data_now['epoch']}, where the saved run stopped")
    return note


def _base(engine):
    """The Adam that holds the state: under DeepSpeed's ZeRO wrapper, or the engine's own without one (ZeRO-0)."""
    opt = engine.optimizer
    return getattr(opt, "optimizer", opt)


def _state_groups(engine) -> list[list[torch.Tensor]]:
    """Per param group, the flat tensors Adam keeps state for on this rank. ZeRO-3 takes its fp32 shards out of the
    optimizer's param groups between steps, so they are found through its sub-groups."""
    opt, base = engine.optimizer, _base(engine)
    if not hasattr(opt, "sub_group_to_group_id"):
        return [list(group["params"]) for group in base.param_groups]
    groups: list[list[torch.Tensor]] = [[] for _ in base.param_groups]
    for sub, group in opt.sub_group_to_group_id.items():
        groups[group].append(opt.fp32_partitioned_groups_flat[sub])
    return groups


def _has_moments(engine) -> bool:
    """Whether Adam's state exists (it appears at the first step) on every rank alike."""
    base = _base(engine)
    mine = any(base.state.get(t) for group in _state_groups(engine) for t in group)
    return dist.all_reduce_max(1.0 if mine else 0.0) > 0


def _gather(engine, p, key: str) -> torch.Tensor:
    # Lazy: prepare reads a checkpoint's route (resume_route) without loading DeepSpeed.
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    value = safe_get_full_fp32_param(p) if key == FP32 else safe_get_full_optimizer_state(p, key)
    if value is None:  # ZeRO-0: the parameter is the fp32 master, whole on every rank
        value = p.detach() if key == FP32 else _base(engine).state[p][key]
    return value.float()


def _set(engine, p, key: str, value: torch.Tensor) -> None:
    from deepspeed.utils import (safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                 safe_set_local_optimizer_state)  # lazy: as in _gather

    if hasattr(p, "ds_id"):
        # ZeRO-3's full-tensor setter narrows past the end of the last rank's padded shard: set the shard itself.
        opt, part = engine.optimizer, p.partition_numel()
        padded = torch.zeros(part * opt._get_param_partition_world_size(p), dtype=torch.float32)
        padded[:value.numel()] = value.flatten()
        shard = padded.narrow(0, part * opt._get_param_partition_rank(p), part)
        if key == FP32:
            safe_set_local_fp32_param(p, shard)
        else:
            safe_set_local_optimizer_state(p, shard, key)
    elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2 and DeepSpeed's bf16 optimizer: this rank's fragment of the master
        if key == FP32:
            safe_set_full_fp32_param(p, value)
            p.data.copy_(value.view_as(p))  # the training-precision copy is whole on every rank
        else:
            safe_set_full_optimizer_state(p, value, key)
    else:  # ZeRO-0
        (p.data if key == FP32 else _base(engine).state[p][key]).copy_(value.view_as(p))


def _create_state(engine) -> None:
    """Adam creates its state (moments, step) at its first step: a step on zero gradients makes it, in the
    optimizer's own types and places; every value it writes is then overwritten from the checkpoint."""
    opt, base = engine.optimizer, _base(engine)
    held = {t: t.grad for group in _state_groups(engine) for t in group}
    for t in held:
        t.grad = torch.zeros_like(t)
    if hasattr(opt, "_set_fp32_optimizer_param_groups"):  # ZeRO-3: its shards back in the groups, for this step
        opt._set_fp32_optimizer_param_groups()
    base.step()
    if hasattr(opt, "_clear_fp32_optimizer_param_groups"):
        opt._clear_fp32_optimizer_param_groups()
    for t, grad in held.items():
        t.grad = grad
    _link_moments(engine)


def _link_moments(engine) -> None:
    """ZeRO-1/2 and the bf16 optimizer give each parameter its views of Adam's flat state once, after their first step
    of the first param group, so ZeRO-1/2's views of the other groups (no state yet then) stay empty: link all anew."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def optimizer_steps(engine) -> list[int]:
    """Adam's step count per param group (the same for all its tensors); 0 before the first step."""
    base, steps = _base(engine), []
    for group in _state_groups(engine):
        found = [base.state[t]["step"] for t in group if "step" in base.state.get(t, {})]
        steps.append(int(found[0].item() if torch.is_tensor(found[0]) else found[0]) if found else 0)
    return steps


def _set_step(base, group: list[torch.Tensor], step: int) -> None:
    for t in group:
        state = base.state.get(t)
        if state and "step" in state:
            if torch.is_tensor(state["step"]):
                state["step"].fill_(step)
            else:
                state["step"] = step


def _check_names(path: str, saved: dict[str, Any], now: list[str]) -> None:
    missing, extra = sorted(set(saved) - set(now)), sorted(set(now) - set(saved))
    if missing or extra:
        raise ConfigError(f"{path}: its trained parameters do not match this model's (in the checkpoint only: "
                          f"{missing[:3]}; in this model only: {extra[:3]}): resume with the recipe it was saved with")
