"""The training entry point: recipe + DeepSpeed JSON -> engine -> loop(forward, backward, step) -> eval, metrics.

    deepspeed --num_gpus 2 finetune/main.py --deepspeed ds_configs/zero3.json --config recipes/tiny.yaml train.max_steps=20

No Trainer class: the DeepSpeed engine owns accumulation, clipping, precision, ZeRO and the scheduler. `train(run)`
reads as its steps. What is checked before any process group exists lives in finetune/prepare.py; the step body and
the eval pass in finetune/step.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Any

import deepspeed
import torch
import yaml

from finetune import checkpoint, dist, perf
from finetune.config import ConfigError, recipe_to_dict
from finetune.data import build_datasets
from finetune.data.loader import StepLoader
from finetune.data.samples import TokenizedData
from finetune.data.tokenizer import load_tokenizer
from finetune.ds_config import engine_config, nvme_swap_dirs, zero_stage
from finetune.export import export_engine
from finetune.generate import answer
from finetune.memory.budget import enforce
from finetune.metrics import METRICS_FILE, MetricsLog, truncate_metrics
from finetune.model import build_model, trainable_parameters
from finetune.optim import build_optimizer
from finetune.prepare import Run, parse_args, prepare
from finetune.step import Loop, TrainingError, evaluate, step_record, train_step

# What callers import from here, though defined beside it (prepare: the checks before any process group; step: the
# step body and the eval pass).
__all__ = ["Run", "TrainingError", "evaluate", "main", "parse_args", "prepare", "train", "train_step"]


def train(run: Run, on_end=None) -> list[dict[str, Any]]:
    """Train to max_steps; returns the step and eval records (rank 0 also writes them to metrics.jsonl).

    `on_end(engine)`, if given, runs on every rank after the last step, while the engine still holds the model.
    """
    # 1. Initial setup: the process group, this rank's seed, the resolved config in the run folder
    _setup(run)
    # 2. Data: tokenized once into the cache the ranks share; the loader makes any step's micro-batches
    tokenizer, loader, eval_data = _load_data(run)
    # 3. Model, and its speed-ups before the optimizer sees its parameters
    model, keepalive = build_model(run.recipe.model, run.recipe.lora, run.ds)
    applied = perf.apply(model, run.recipe, run.ds)
    _report_model(run, model)
    # 4. Optimizer, schedule and DeepSpeed engine, and the engine's speed-ups
    engine, optimizer, scheduler = _build_engine(run, model)
    applied += perf.apply_engine(engine, run.recipe)
    _report_speedups(run, applied)
    # 5. Resume: the checkpoint's engine, optimizer, schedule and RNG; its step is the data position
    start_step = _resume(run, engine, optimizer, scheduler)
    # 6. Train: the steps, with metrics, eval and checkpoints at their cadence
    loop = Loop(run, engine, optimizer, loader, eval_data, tokenizer)
    records, samples = _train_loop(loop, start_step)
    # 7. End: the last sample, the export and on_end; then the engine is released
    _finish(loop, samples, on_end)
    _release(engine, keepalive)
    _remove_swap(run.ds)
    return records


def _setup(run: Run) -> None:
    """Join the process group, cap GPU memory, seed this rank; rank 0 writes the resolved config into the run folder
    and cuts metrics.jsonl back to the checkpoint it resumes."""
    t = run.recipe.train
    dist.init()
    dist.barrier()  # every rank has checked the output dir (prepare) before rank 0 writes into it
    if t.gpu_memory_gib and enforce(t.gpu_memory_gib):
        dist.print0(f"GPU memory capped at {t.gpu_memory_gib:g} GiB per GPU (train.gpu_memory_gib)")
    torch.manual_seed(t.seed + dist.rank())
    os.makedirs(t.output_dir, exist_ok=True)
    if dist.is_main():
        with open(os.path.join(t.output_dir, "recipe.yaml"), "w") as f:
            yaml.safe_dump(recipe_to_dict(run.recipe), f, sort_keys=False)
        with open(os.path.join(t.output_dir, "ds_config.json"), "w") as f:
            json.dump(run.ds, f, indent=2)
        if run.plan is not None:
            with open(os.path.join(t.output_dir, "memory_plan.json"), "w") as f:
                json.dump(dataclasses.asdict(run.plan), f, indent=2)
        resumed = checkpoint.saved_step(run.resume_from) if run.resume_from else 0
        truncate_metrics(os.path.join(t.output_dir, METRICS_FILE), keep_until=resumed)


def _load_data(run: Run) -> tuple[Any, StepLoader, TokenizedData | None]:
    """The tokenizer, this rank's loader of training micro-batches for any step, and the eval data (or None)."""
    r, t = run.recipe, run.recipe.train
    tokenizer = load_tokenizer(r.model.tokenizer or r.model.path)
    train_data, eval_data, report = build_datasets(r.data, tokenizer, t.seed, os.path.join(t.output_dir, ".cache"))
    dist.print0(f"data: {report.summary()}")
    loader = StepLoader(train_data, t.micro_batch_size, t.grad_accum, dist.world_size(), dist.rank(),
                        r.data.max_seq_len, r.data.packing, t.seed, tokenizer.pad_id, shuffle=r.data.shuffle)
    return tokenizer, loader, eval_data


def _report_model(run: Run, model) -> None:
    trainable, total = trainable_parameters(model)
    dist.print0(f"model: {total:,} parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%), "
                f"ZeRO-{zero_stage(run.ds)}, {dist.world_size()} rank(s)")


def _build_engine(run: Run, model) -> tuple[Any, Any, Any]:
    """The DeepSpeed engine, the optimizer and its lr schedule; a checkpoint saved on another number of ranks is
    converted to a universal one first."""
    world = dist.world_size()
    optimizer, scheduler = build_optimizer(model, run.recipe.optim, run.recipe.train.max_steps, run.ds)
    engine_cfg = engine_config(run.ds)
    if run.resume_from and checkpoint.saved_world_size(run.resume_from) != world:
        dist.print0(f"resuming a checkpoint of {checkpoint.saved_world_size(run.resume_from)} rank(s) on {world}: "
                    f"converting it to a universal checkpoint")
        checkpoint.prepare_reshard(run.resume_from)
        engine_cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=engine_cfg)
    return engine, optimizer, scheduler


def _report_speedups(run: Run, applied: list[str]) -> None:
    """Name the applied speed-ups once; rank 0 writes every switch, on or off, to speedups.json in the run folder."""
    dist.print0(f"speed-ups: {', '.join(applied) if applied else 'none'}")
    if dist.is_main():
        with open(os.path.join(run.recipe.train.output_dir, "speedups.json"), "w") as f:
            json.dump(perf.report(run.recipe, applied), f, indent=2)


def _resume(run: Run, engine, optimizer, scheduler) -> int:
    """The step to start from: 0, or run.resume_from's, after restoring its engine, optimizer, schedule and RNG."""
    start_step = checkpoint.load(engine, run.resume_from) if run.resume_from else 0
    if start_step:
        # The optimizer state brought back the lr of the saved step under the saved max_steps; the schedule of
        # this run decides the lr of the next step (they differ when max_steps was raised to train longer).
        for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * fn(scheduler.last_epoch)
        dist.print0(f"resumed from {run.resume_from} at step {start_step}")
    return start_step


def _train_loop(loop: Loop, start_step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Steps start_step..end_step, each followed by its record, eval and checkpoint at their cadence; returns the
    records and the samples."""
    run, engine, t = loop.run, loop.engine, loop.run.recipe.train
    log = MetricsLog(t.output_dir, t.max_steps, enabled=dist.is_main(), start_step=start_step, log_to=t.log_to,
                     run_config=run.resolved_config(), wandb_project=t.wandb_project)
    records = []
    samples = _sample(loop, 0) if start_step == 0 else []
    engine.train()
    upcoming = None  # the next step's micro-batches and global target count, made while the device ends this step
    for step in range(start_step, loop.end_step):
        result, upcoming = train_step(loop, step, upcoming)
        records.append(step_record(step + 1, result, loop.world, loop.peak_tflops))
        log.write(records[-1])
        if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
            log.progress(records[-1])
        last = step + 1 == loop.end_step
        if loop.eval_data is not None and ((t.eval_every and (step + 1) % t.eval_every == 0) or last):
            eval_loss = evaluate(engine, loop.eval_data, run.recipe, loop.world, loop.rank, loop.tokenizer.pad_id,
                                 loop.device)
            records.append({"step": step + 1, "eval_loss": eval_loss})
            log.write(records[-1])
            dist.print0(f"eval at step {step + 1}: loss {eval_loss:.4f}")
        if t.save_every > 0 and ((step + 1) % t.save_every == 0 or last):
            path = checkpoint.save(engine, t.output_dir, step + 1, t.keep_last, run.resolved_config())
            dist.print0(f"saved {path}")
    log.close()
    return records, samples


def _sample(loop: Loop, step: int) -> list[dict[str, Any]]:
    """The model's answer to train.sample_prompt ([] without one); every rank generates (ZeRO-3 gathers need all)."""
    t = loop.run.recipe.train
    if not t.sample_prompt:
        return []
    text = answer(loop.engine.module, loop.tokenizer, t.sample_prompt, t.sample_max_new_tokens, synced_gpus=loop.synced)
    dist.print0(f"sample at step {step}: {t.sample_prompt!r} -> {text!r}")
    return [{"step": step, "prompt": t.sample_prompt, "answer": text}]


def _finish(loop: Loop, samples: list[dict[str, Any]], on_end) -> None:
    """The last sample and samples.jsonl, the export, on_end: on every rank, while the engine holds the model."""
    t = loop.run.recipe.train
    samples = samples + _sample(loop, loop.end_step)
    if dist.is_main() and samples:
        with open(os.path.join(t.output_dir, "samples.jsonl"), "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    if t.export:
        path = export_engine(loop.engine, os.path.join(t.output_dir, "export"), loop.tokenizer,
                             loop.run.recipe.lora.enabled)
        dist.print0(f"exported {path}")
    if on_end is not None:
        on_end(loop.engine)
    dist.barrier()


def _release(engine, keepalive) -> None:
    """Free the engine and end zero.Init's hold on transformers, so a later run in this process starts clean."""
    # Lazy: transformers loads when the model is built (finetune/model.py); a recipe error is answered without it.
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if hasattr(engine, "destroy"):
        engine.destroy()
    del keepalive
    unset_hf_deepspeed_config()


def _remove_swap(ds: dict[str, Any]) -> None:
    """Delete this run's NVMe swap files (DeepSpeed leaves them: the size of the optimizer states, fp32 weights and
    Adam's moments of every trained parameter), once every rank of the node is done with them."""
    dirs = nvme_swap_dirs(ds)
    if not dirs:
        return
    dist.barrier()
    if dist.local_rank() == 0:
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dist.adopt_openmpi_env()  # under mpirun, WORLD_SIZE must be known before the DeepSpeed JSON is resolved
    try:
        run = prepare(args.config, args.deepspeed, args.overrides)
    except ConfigError as e:
        print(f"zerotune: error: {e}", file=sys.stderr)
        return 2
    try:
        train(run)
    except TrainingError as e:
        print(f"zerotune: error: {e}", file=sys.stderr)
        return 3
    finally:
        dist.shutdown()
    return 0
