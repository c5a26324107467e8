"""The training entry point: recipe + DeepSpeed JSON -> engine -> loop(forward, backward, step) -> eval, metrics.

    deepspeed --num_gpus 2 finetune/main.py --deepspeed ds_configs/zero3.json --config recipes/tiny.yaml train.max_steps=20

No Trainer class: the DeepSpeed engine owns accumulation, clipping, precision, ZeRO and the scheduler. `train(run)`
reads as its steps. What is checked before any process group exists lives in finetune/prepare.py; the step body and
the eval pass in finetune/step.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
from typing import Any

import deepspeed
import torch

from finetune import checkpoint, dist, parallel, perf
from finetune.checkpoint import resume_check
from finetune.config import ConfigError, recipe_to_dict
from finetune.data import ReportedElsewhere, build_datasets
from finetune.data.loader import StepLoader, eval_micro_batches
from finetune.data.samples import TokenizedData
from finetune.data.tokenizer import load_tokenizer
from finetune.ds_config import engine_config, nvme_swap_dirs, zero_stage
from finetune.export.weights import export_engine
from finetune.memory.budget import enforce
from finetune.model.build import build_model, trainable_parameters
from finetune.model.generate import answer
from finetune.model.optim import build_optimizer, install_exact_grad_norm
from finetune.model.preference import build_preference_loss
from finetune.parallel import groups as sp_groups, ulysses
from finetune.prepare import Run, parse_args, prepare
from finetune.run import console, folder, folder_lock, preempt, watchdog
from finetune.run.activity import ACTIVITY
from finetune.run.metrics import MetricsLog, truncate_metrics
from finetune.step import Loop, TrainingError, evaluate, step_record, train_step

# What callers import from here, though defined beside it (prepare: the checks before any process group; step: the
# step body and the eval pass).
__all__ = ["Run", "TrainingError", "evaluate", "main", "parse_args", "prepare", "train", "train_step"]


def train(run: Run, on_end=None) -> list[dict[str, Any]]:
    """Train to max_steps; returns the step and eval records (rank 0 also writes them to metrics.jsonl).

    `on_end(engine)`, if given, runs on every rank after the last step, while the engine still holds the model.
    """
    # 1. Initial setup: the process group (and, with train.sequence_parallel > 1, the groups of ranks that share
    #    rows), this rank's seed; nothing is written to the run folder yet
    cache_before = _setup(run)
    degree = parallel.degree_of(run.recipe)
    groups = sp_groups.build(degree) if degree > 1 else None
    # 2. Data: read, checked and tokenized once into the cache the ranks share; the loader makes any step's
    #    micro-batches. A data error ends every rank here, with the run folder as it was found.
    tokenizer, loader, eval_data = _load_data(run, cache_before)
    # 3. The run folder: the resolved config, metrics.jsonl cut back to the checkpoint it resumes
    _write_run_files(run)
    # 4. Model, and its speed-ups before the optimizer sees its parameters
    model, keepalive = build_model(run.recipe.model, run.recipe.lora, run.ds)
    applied = perf.apply(model, run.recipe, run.ds)
    if groups is not None:  # after the speed-ups: the all-to-all wraps whatever attention they left
        ulysses.install(model, groups)
    _report_model(run, model)
    # 5. Optimizer, schedule and DeepSpeed engine, and the engine's speed-ups
    engine, optimizer, scheduler = _build_engine(run, model)
    applied += perf.apply_engine(engine, run.recipe)
    applied += ["shared_prompt"] if loader.data.prefix is not None else []  # the data's layout (_load_data)
    _report_speedups(run, applied)
    # 6. Resume: the checkpoint's engine, optimizer, schedule and RNG; its step is the data position
    start_step = _resume(run, engine, optimizer, scheduler)
    # 7. Train: the steps, with metrics, eval and checkpoints at their cadence; 8. End: the last sample, the export
    #    and on_end. The stall watchdog watches both: a rank that hangs ends the run, named (finetune/run/watchdog.py).
    loop = Loop(run, engine, optimizer, loader, eval_data, tokenizer)
    loop.preference = build_preference_loss(run, engine, lambda: _scoring_batches(loop), start_step)
    with watchdog.watching(run.recipe.train.output_dir, run.recipe.train.stall_timeout_s):
        records, samples = _train_loop(loop, start_step)
        _finish(loop, samples, on_end)
    # 9. Release: the engine, zero.Init's hold on transformers, the NVMe swap files
    _release(engine, keepalive)
    _remove_swap(run.ds)
    return records


def _setup(run: Run) -> set[str] | None:
    """Join the process group, verify the checkpoint to resume (run.resume_from), cap GPU memory, seed this rank.
    Returns the entries of the run's tokenization cache (output_dir/.cache) before this run (None: no cache yet), so
    that a data error can remove what this run added."""
    t = run.recipe.train
    watchdog.enable_flight_recorder(t.stall_timeout_s)  # read by torch when the process group starts
    dist.init()
    # The checkpoint to resume, its files checked against its manifest by all ranks together: a damaged one gives way
    # to the one before under train.resume=auto (checked against this recipe as prepare checked the first pick); a
    # damaged one named by train.resume ends the run, naming its bad files.
    try:
        chosen = checkpoint.verified_resume(t.resume, run.resume_from, t.output_dir)
        if chosen != run.resume_from:
            resume_check.check(chosen, run.resolved_config())
            run.resume_from = chosen
    except ConfigError as e:  # met by every rank alike: rank 0 reports it, once
        raise (e if dist.is_main() else ReportedElsewhere(str(e))) from None
    cache_dir = os.path.join(t.output_dir, ".cache")
    cache_before = set(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else None
    dist.barrier()  # every rank has checked the output dir (prepare) and its cache before any rank writes into them
    if t.gpu_memory_gib and enforce(t.gpu_memory_gib):
        dist.print0(f"GPU memory capped at {t.gpu_memory_gib:g} GiB per GPU (train.gpu_memory_gib)")
    torch.manual_seed(t.seed + dist.rank())
    return cache_before


def _write_run_files(run: Run) -> None:
    """Rank 0 writes the resolved config (and the memory plan) into the run folder and cuts metrics.jsonl back to the
    checkpoint it resumes: after the data is known to be good, so a data error leaves the folder as it was."""
    t = run.recipe.train
    os.makedirs(t.output_dir, exist_ok=True)
    if dist.is_main():
        folder.write_yaml(t.output_dir, folder.RECIPE, recipe_to_dict(run.recipe))
        folder.write_json(t.output_dir, folder.DS_CONFIG, run.ds)
        if run.plan is not None:
            folder.write_json(t.output_dir, folder.MEMORY_PLAN, dataclasses.asdict(run.plan))
        resumed = checkpoint.saved_step(run.resume_from) if run.resume_from else 0
        truncate_metrics(folder.path(t.output_dir, folder.METRICS), keep_until=resumed)


def _load_data(run: Run, cache_before: set[str] | None) -> tuple[Any, StepLoader, TokenizedData | None]:
    """The tokenizer, this rank's loader of training micro-batches for any step, and the eval data (or None).

    A data error (a DataError names the file, the line and what to fix) stops every rank: the lowest rank that found
    it raises it, the others raise ReportedElsewhere, and the cache entries this run added are removed.
    """
    r, t = run.recipe, run.recipe.train
    tokenizer = load_tokenizer(r.model.tokenizer or r.model.path)
    cache_dir = os.path.join(t.output_dir, ".cache")
    error = None
    try:
        train_data, eval_data, report = build_datasets(r.data, tokenizer, t.seed, cache_dir)
        if getattr(train_data, "paired", False) != (t.objective != "sft"):
            raise ConfigError(f"train.objective={t.objective} trains on preference pairs and only on them: data.format "
                              f"(and every data.mix source) must be preference exactly when the objective is dpo, ipo, "
                              f"orpo or simpo")
    except Exception as e:  # whatever it is, every rank joins the all-reduce below, or the others would wait in it
        error = e
    # Which rank reports (the lowest whose own data check failed) and whether any failed, in one collective.
    world = dist.world_size()
    own = isinstance(error, ConfigError) and not isinstance(error, ReportedElsewhere)
    reporter, failed = dist.all_reduce_max_each([world - dist.rank() if own else 0, 1.0 if error else 0.0])
    if failed:
        if dist.local_rank() == 0:  # the rank of each node that writes the cache
            _remove_new_cache_entries(cache_dir, cache_before)
        if error is not None and (not own or dist.rank() == world - reporter):
            raise error
        raise ReportedElsewhere("the data error is reported by another rank")
    dist.print0(f"data: {report.summary()}")
    if perf.shares_prompts(r):  # one copy of each pair's prompt per row (finetune/data/loader.py collate)
        train_data = train_data.with_shared_prompts()
        eval_data = eval_data.with_shared_prompts() if eval_data is not None else None
        shared, total = int(train_data.prefix.sum()), int(train_data.lengths.sum())
        dist.print0(f"shared prompts: each pair's prompt once per row, {shared:,} of {total:,} training tokens "
                    f"({shared / max(total, 1):.0%}) fewer")
    # The ranks of a sequence-parallel group take the same rows, each its slice of them.
    degree = parallel.degree_of(r)
    dp_rank, sp_rank = parallel.layout(dist.rank(), degree)
    loader = StepLoader(train_data, t.micro_batch_size, t.grad_accum, dist.world_size() // degree, dp_rank,
                        r.data.max_seq_len, r.data.packing, t.seed, tokenizer.pad_id, shuffle=r.data.shuffle,
                        sequence_parallel=(degree, sp_rank))
    saved = checkpoint.data_position(run.resume_from) if run.resume_from else None
    if saved is not None:  # the saved run's next row, whatever its rows per step were
        run.data_start = loader.start = loader.continuing_at(checkpoint.saved_step(run.resume_from), saved)
    return tokenizer, loader, eval_data


def _scoring_batches(loop: Loop) -> dict[str, tuple[list, TokenizedData]]:
    """This rank's share of every train and eval sample, for scoring a precomputed reference (no sequence
    parallelism under a preference objective: prepare refuses it)."""
    r = loop.run.recipe
    splits = {"train": loop.loader.data, "eval": loop.eval_data}
    return {split: (eval_micro_batches(data, r.train.micro_batch_size, loop.world, loop.rank, r.data.max_seq_len,
                                       r.data.packing, loop.tokenizer.pad_id), data)
            for split, data in splits.items() if data is not None}


def _remove_new_cache_entries(cache_dir: str, before: set[str] | None) -> None:
    """Remove the cache folder if this run created it, else only the entries this run added to it."""
    if before is None:
        shutil.rmtree(cache_dir, ignore_errors=True)
        return
    added = set(os.listdir(cache_dir)) - before if os.path.isdir(cache_dir) else set()
    for name in added:
        # Never in the way of the data error being reported; on a shared filesystem another node may remove it first.
        with contextlib.suppress(OSError):
            os.remove(os.path.join(cache_dir, name))


def _report_model(run: Run, model) -> None:
    trainable, total = trainable_parameters(model)
    degree = parallel.degree_of(run.recipe)
    ranks = (f"{dist.world_size()} rank(s)" if degree == 1 else
             f"{dist.world_size()} ranks: {dist.world_size() // degree} data-parallel x {degree} sequence-parallel")
    dist.print0(f"model: {total:,} parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%), "
                f"ZeRO-{zero_stage(run.ds)}, {ranks}")


def _build_engine(run: Run, model) -> tuple[Any, Any, Any]:
    """The DeepSpeed engine, the optimizer and its lr schedule; an older ZeRO-1/2 checkpoint (without portable/) saved
    on another number of ranks is converted to a universal one first. Under sequence parallelism too the engine sees
    every rank as data-parallel (finetune/parallel/groups.py says why)."""
    optimizer, scheduler = build_optimizer(model, run.recipe.optim, run.recipe.train.max_steps, run.ds)
    engine_cfg = engine_config(run.ds)
    route, why = checkpoint.resume_route(run.resume_from, run.ds) if run.resume_from else ("engine", "")
    if route == "universal":
        dist.print0(f"resuming {run.resume_from} on another layout ({why}): converting it to a universal checkpoint")
        checkpoint.prepare_reshard(run.resume_from)
        engine_cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=engine_cfg)
    install_exact_grad_norm(engine)  # ZeRO-1/2: a clipping norm that does not depend on the number of ranks
    return engine, optimizer, scheduler


def _report_speedups(run: Run, applied: list[str]) -> None:
    """Name the applied speed-ups once; rank 0 writes every switch, on or off, to speedups.json in the run folder."""
    dist.print0(f"speed-ups: {', '.join(applied) if applied else 'none'}")
    if dist.is_main():
        folder.write_json(run.recipe.train.output_dir, folder.SPEEDUPS, perf.report(run.recipe, applied))


def _resume(run: Run, engine, optimizer, scheduler) -> int:
    """The step to start from: 0, or run.resume_from's, after restoring its engine, optimizer, schedule and RNG."""
    start_step = checkpoint.load(engine, run.resume_from) if run.resume_from else 0
    if start_step:
        # The optimizer state brought back the lr of the saved step under the saved max_steps; the schedule of
        # this run decides the lr of the next step (they differ when max_steps was raised to train longer).
        for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * fn(scheduler.last_epoch)
        note = checkpoint.resume_note(run.resume_from, run.ds, run.resolved_config()["data_position"],
                                      run.recipe.lora.enabled)
        dist.print0(f"resumed from {run.resume_from} at step {start_step}{note}")
    return start_step


def _train_loop(loop: Loop, start_step: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Steps start_step..end_step, each followed by its record, eval and checkpoint at their cadence; returns the
    records and the samples. SIGTERM or SIGUSR1 on any rank ends the step every rank is in, saves it (whatever
    train.save_every) and raises preempt.Stopped on every rank."""
    run, engine, t = loop.run, loop.engine, loop.run.recipe.train
    log = MetricsLog(t.output_dir, t.max_steps, enabled=dist.is_main(), start_step=start_step, log_to=t.log_to,
                     run_config=run.resolved_config(), wandb_project=t.wandb_project)
    records = []
    samples = _sample(loop, 0) if start_step == 0 else []
    engine.train()
    upcoming = None  # the next step's micro-batches and global target count, made while the device ends this step
    with preempt.watching():
        for step in range(start_step, loop.end_step):
            result, upcoming = train_step(loop, step, upcoming)
            ACTIVITY.step_done(step + 1, result.seconds)
            records.append(step_record(step + 1, result, loop.world, loop.peak_tflops))
            log.write(records[-1])
            if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
                log.progress(records[-1])
            last = step + 1 == loop.end_step
            stop = "" if last else result.stop  # a signal in the last step: the run ends there as planned
            # A stop skips the eval: the time before the job is killed is the save's.
            if loop.eval_data is not None and not stop and ((t.eval_every and (step + 1) % t.eval_every == 0) or last):
                ACTIVITY.mark("eval")
                eval_loss = evaluate(engine, loop.eval_data, run.recipe, loop.world, loop.rank, loop.tokenizer.pad_id,
                                     loop.device, loop.preference)
                records.append({"step": step + 1, "eval_loss": eval_loss})
                log.write(records[-1])
                dist.print0(f"eval at step {step + 1}: loss {eval_loss:.4f}")
            if (t.save_every > 0 and ((step + 1) % t.save_every == 0 or last)) or stop:
                ACTIVITY.mark("save")
                try:
                    path = checkpoint.save(engine, t.output_dir, step + 1, t.keep_last, run.resolved_config())
                except checkpoint.SaveError as e:  # raised on every rank alike (a full disk): the run ends, exit 3
                    raise TrainingError(str(e)) from None
                dist.print0(f"saved {path}")
            if stop:
                log.close()
                raise preempt.Stopped(step + 1, f"by {stop}", preempt.ignored())
    log.close()
    return records, samples


def _sample(loop: Loop, step: int) -> list[dict[str, Any]]:
    """The model's answer to train.sample_prompt ([] without one); every rank generates (ZeRO-3 gathers need all)."""
    t = loop.run.recipe.train
    if not t.sample_prompt:
        return []
    ACTIVITY.mark("sample")
    text = answer(loop.engine.module, loop.tokenizer, t.sample_prompt, t.sample_max_new_tokens, synced_gpus=loop.synced)
    dist.print0(f"sample at step {step}: {t.sample_prompt!r} -> {text!r}")
    return [{"step": step, "prompt": t.sample_prompt, "answer": text}]


def _finish(loop: Loop, samples: list[dict[str, Any]], on_end) -> None:
    """The last sample and samples.jsonl, the export, on_end: on every rank, while the engine holds the model."""
    t = loop.run.recipe.train
    samples = samples + _sample(loop, loop.end_step)
    if dist.is_main() and samples:
        folder.write_jsonl(t.output_dir, folder.SAMPLES, samples)
    if t.export:
        ACTIVITY.mark("export")
        path = export_engine(loop.engine, folder.path(t.output_dir, folder.EXPORT), loop.tokenizer,
                             loop.run.recipe.lora.enabled)
        dist.print0(f"exported {path}")
    if on_end is not None:
        ACTIVITY.mark("on_end")
        on_end(loop.engine)
    ACTIVITY.mark("finish")
    dist.barrier()


def _release(engine, keepalive) -> None:
    """Free the engine and end zero.Init's hold on transformers, so a later run in this process starts clean."""
    # Lazy: transformers loads when the model is built (finetune/model/build.py); a recipe error is answered without it.
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
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    console.setup(args.verbose)
    dist.adopt_openmpi_env()  # under mpirun, WORLD_SIZE must be known before the DeepSpeed JSON is resolved
    try:
        run = prepare(args.config, args.deepspeed, args.overrides)
    except ConfigError as e:
        dist.report_error(str(e))  # every rank meets it: printed once, by local rank 0
        return 2
    t, stopped = run.recipe.train, None
    try:
        records = train(run)
        if t.stop_at and t.stop_at < t.max_steps:  # ended early, as asked: the same line as a signal's
            step = max((r["step"] for r in records), default=t.stop_at)
            if t.save_every > 0:
                dist.print0(preempt.stopped_line(step, "by train.stop_at", _resume_command(run, argv, True)))
            else:
                dist.print0(f"stopped at step {step} by train.stop_at (train.save_every=0: nothing saved to resume)")
    except preempt.Stopped as e:  # saved at e.step on every rank
        stopped = e
        if e.ignored:
            dist.print0(f"{e.ignored} later signal(s) ignored: the save was finished")
        dist.print0(preempt.stopped_line(e.step, e.reason, _resume_command(run, argv, False)))
    except ReportedElsewhere:
        return 2  # another rank prints the data error, once
    except ConfigError as e:
        console.error(e)
        return 2
    except TrainingError as e:
        console.error(e)
        return 3
    finally:
        # Here too: finetune/main.py ends the process with os._exit, which skips atexit. Before shutdown's barrier:
        # once a rank exits with an error, DeepSpeed's launcher stops the others, the lock holder among them.
        folder_lock.release_all()
        dist.shutdown()
        if stopped is not None:  # only now: a signal while the ranks leave together must not kill a saved run
            stopped.restore_signals()
    return 0


def _resume_command(run: Run, argv: list[str], stop_at_ended: bool) -> str:
    """The command that continues this run, as this rank was started (finetune/run/preempt.py resume_command)."""
    return preempt.resume_command(sys.argv[0], argv, run.recipe.train.output_dir, stop_at_ended=stop_at_ended)
