"""The training entry point: recipe + DeepSpeed JSON -> engine -> loop(forward, backward, step) -> eval, metrics.

    deepspeed --num_gpus 2 finetune/main.py --deepspeed ds_configs/zero3.json --config recipes/tiny.yaml train.max_steps=20

No Trainer class: the DeepSpeed engine owns accumulation, clipping, precision, ZeRO and the scheduler.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import yaml

from finetune import checkpoint
from finetune.config import ConfigError, Recipe, load_recipe, recipe_to_dict
from finetune.ds_config import emulated_bf16_note, engine_config, resolve_ds_config, zero_stage


@dataclass
class Run:
    """Everything resolved and validated before any process group or model exists."""

    recipe: Recipe
    ds: dict[str, Any]
    model_config: dict[str, Any]
    resume_from: str | None = None
    plan: Any = None
    """The memory plan (finetune.memory.budget.MemoryPlan) when train.gpu_memory_gib or --deepspeed auto chose the settings."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="finetune/main.py", description="Fine-tune Mistral with DeepSpeed ZeRO.")
    p.add_argument("--deepspeed", metavar="PATH", default="ds_configs/zero3.json",
                   help="DeepSpeed JSON (ds_configs/), or `auto`: the fastest that fits train.gpu_memory_gib (or this GPU)")
    p.add_argument("--config", metavar="PATH", default=None, help="YAML recipe (default recipes/mistral7b_lora.yaml)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the deepspeed launcher")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    return p.parse_args(argv)


def prepare(config: str | None, deepspeed_json: str, overrides: list[str]) -> Run:
    """Load and check everything a user can get wrong, before any rank starts work (raises ConfigError)."""
    from finetune import dist
    from finetune.memory import budget
    from finetune.perf import liger as kernels, lora_dropout
    from finetune.loggers import check_backends
    from finetune.model import check_model_dir

    recipe = load_recipe(config, overrides)
    check_backends(recipe.train.log_to)
    kernels.check(recipe.model.kernels)
    lora_dropout.check(recipe.lora)
    model_config = check_model_dir(recipe.model)
    _check_tokenizer_and_data(recipe)
    recipe_path = config or "recipes/mistral7b_lora.yaml"
    recipe, deepspeed_json, plan = budget.fit(recipe, model_config, deepspeed_json, dist.world_size(), recipe_path)
    ds = resolve_ds_config(deepspeed_json, recipe, dist.world_size(), model_config["hidden_size"],
                           recipe_path=recipe_path, vocab_size=model_config["vocab_size"])
    budget.check_offload_fits_host(recipe, model_config, ds, dist.world_size())
    if note := emulated_bf16_note(ds):
        dist.print0(note)
    out = recipe.train.output_dir
    # Other ranks may be probing the folder right now (check_output_dir's .write-test-* files): not content.
    content = [f for f in os.listdir(out) if not f.startswith(checkpoint.WRITE_PROBE)] if os.path.isdir(out) else []
    if content and not (recipe.train.overwrite or recipe.train.resume):
        raise ConfigError(f"train.output_dir {out!r} is not empty: choose a new one, pass train.resume=auto to "
                          f"continue it, or train.overwrite=true")
    resume_from = checkpoint.resolve_resume(recipe.train.resume, out)
    if resume_from and zero_stage(ds) == 3 and checkpoint.saved_world_size(resume_from) != dist.world_size():
        # Measured: DeepSpeed 0.19.8's universal conversion of a ZeRO-3 checkpoint restores the weights exactly but
        # not Adam's state, so the loss curve drifts (1e-2 within 5 steps); ZeRO-1/2 continue within 1e-4.
        raise ConfigError(
            f"{resume_from} was saved by {checkpoint.saved_world_size(resume_from)} rank(s) under ZeRO-3; resume it on "
            f"that many ranks, or export it (zerotune export) and start a new run: ZeRO-3 checkpoints do not "
            f"reshard exactly to {dist.world_size()} rank(s) (ZeRO-1/2 checkpoints do)")
    lora_fraction = 0.01 if recipe.lora.enabled else None
    needed = checkpoint.estimate_checkpoint_bytes(model_config, lora_fraction) if recipe.train.save_every > 0 else 0
    checkpoint.check_output_dir(out, needed)
    return Run(recipe, ds, model_config, resume_from, plan)


def _check_tokenizer_and_data(recipe: Recipe) -> None:
    """Fail before any rank starts work on a missing tokenizer, data file, format or plugin."""
    from finetune.data.registry import get_format, load_plugins
    from finetune.data.tokenizer import load_tokenizer

    try:
        load_tokenizer(recipe.model.tokenizer or recipe.model.path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer: {e}") from None
    try:
        load_plugins(recipe.data.plugins)
        get_format(recipe.data.format)
    except (ImportError, ValueError) as e:
        raise ConfigError(str(e)) from None
    for key, path in (("data.path", recipe.data.path), ("data.eval_path", recipe.data.eval_path)):
        if path and not os.path.exists(path):
            raise ConfigError(f"{key} {path!r} not found: point it at a local JSONL/JSON/Parquet/CSV/Arrow file or a "
                              f"save_to_disk folder")


def train(run: Run, on_end=None) -> list[dict[str, Any]]:
    """Train to max_steps; returns the step and eval records (rank 0 also writes them to metrics.jsonl).

    `on_end(engine)`, if given, runs on every rank after the last step, while the engine still holds the model.
    """
    import deepspeed
    import torch

    from finetune import dist
    from finetune.data import build_datasets
    from finetune.data.loader import StepLoader
    from finetune.data.tokenizer import load_tokenizer
    from finetune.generate import answer
    from finetune.metrics import MetricsLog, peak_memory_gib, peak_reserved_gib, peak_tflops, training_flops
    from finetune.model import build_model, trainable_parameters
    from finetune.optim import build_optimizer, clip_grad_norm_exact
    from finetune.perf.overflow_check import install_overflow_check
    from finetune.loss import micro_batch_loss_sum
    from finetune.perf.profiling import phase, step_profiler

    r, t = run.recipe, run.recipe.train
    dist.init()
    dist.barrier()  # every rank has checked the output dir (prepare) before rank 0 writes into it
    if t.gpu_memory_gib:
        from finetune.memory.budget import enforce

        if enforce(t.gpu_memory_gib):
            dist.print0(f"GPU memory capped at {t.gpu_memory_gib:g} GiB per GPU (train.gpu_memory_gib)")
    world, rank = dist.world_size(), dist.rank()
    torch.manual_seed(t.seed + rank)
    os.makedirs(t.output_dir, exist_ok=True)
    if dist.is_main():
        with open(os.path.join(t.output_dir, "recipe.yaml"), "w") as f:
            yaml.safe_dump(recipe_to_dict(r), f, sort_keys=False)
        with open(os.path.join(t.output_dir, "ds_config.json"), "w") as f:
            json.dump(run.ds, f, indent=2)
        if run.plan is not None:
            with open(os.path.join(t.output_dir, "memory_plan.json"), "w") as f:
                json.dump(dataclasses.asdict(run.plan), f, indent=2)
        _truncate_metrics(os.path.join(t.output_dir, "metrics.jsonl"), keep_until=_resume_step(run))

    tokenizer = load_tokenizer(r.model.tokenizer or r.model.path)
    train_data, eval_data, report = build_datasets(r.data, tokenizer, t.seed, os.path.join(t.output_dir, ".cache"))
    dist.print0(f"data: {report.summary()}")

    model, keepalive = build_model(r.model, r.lora, run.ds)
    trainable, total = trainable_parameters(model)
    dist.print0(f"model: {total:,} parameters, {trainable:,} trainable ({100 * trainable / total:.2f}%), "
                f"ZeRO-{zero_stage(run.ds)}, {world} rank(s)")
    optimizer, scheduler = build_optimizer(model, r.optim, t.max_steps, run.ds)
    engine_cfg = engine_config(run.ds)
    if run.resume_from and checkpoint.saved_world_size(run.resume_from) != world:
        dist.print0(f"resuming a checkpoint of {checkpoint.saved_world_size(run.resume_from)} rank(s) on {world}: "
                    f"converting it to a universal checkpoint")
        checkpoint.prepare_reshard(run.resume_from)
        engine_cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=engine_cfg)
    install_overflow_check(engine, r.optim.overflow_check)
    device = dist.device()
    synced = zero_stage(run.ds) == 3 and world > 1
    own_clipping = zero_stage(run.ds) == 0  # gradients are all-reduced in the boundary backward, before step()
    grad_norm = None
    samples = []

    def sample(step: int) -> None:
        if t.sample_prompt:
            text = answer(engine.module, tokenizer, t.sample_prompt, t.sample_max_new_tokens, synced_gpus=synced)
            samples.append({"step": step, "prompt": t.sample_prompt, "answer": text})
            dist.print0(f"sample at step {step}: {t.sample_prompt!r} -> {text!r}")

    loader = StepLoader(train_data, t.micro_batch_size, t.grad_accum, world, rank, r.data.max_seq_len,
                        r.data.packing, t.seed, tokenizer.pad_id, shuffle=r.data.shuffle)
    hf_config = engine.module.config
    peak = peak_tflops()
    start_step = checkpoint.load(engine, run.resume_from) if run.resume_from else 0
    if start_step:
        # The optimizer state brought back the lr of the saved step under the saved max_steps; the schedule of
        # this run decides the lr of the next step (they differ when max_steps was raised to train longer).
        for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * fn(scheduler.last_epoch)
        dist.print0(f"resumed from {run.resume_from} at step {start_step}")
    log = MetricsLog(t.output_dir, t.max_steps, enabled=dist.is_main(), start_step=start_step, log_to=t.log_to,
                     run_config={"recipe": recipe_to_dict(r), "ds_config": run.ds}, wandb_project=t.wandb_project)
    records = []
    if start_step == 0:
        sample(0)
    engine.train()
    end_step = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
    upcoming = None  # the next step's micro-batches and global target count, made while the device ends this step
    for step in range(start_step, end_step):
        start = time.perf_counter()
        lr = optimizer.param_groups[0]["lr"]
        if upcoming is None:
            micro_batches = loader.step(step)
            n_targets = float(dist.all_reduce_sum(_target_count(micro_batches)))
        else:
            micro_batches, n_targets = upcoming
        losses = []  # each micro-batch's summed token loss, left on the device: reading one would stall it
        with step_profiler(step + 1 == t.profile_step, t.output_dir, step + 1, dist.is_main()):
            for i, mb in enumerate(micro_batches):
                with phase("forward"):
                    token_sum = micro_batch_loss_sum(engine, mb, device, r.model.fused_loss)
                    losses.append(token_sum.detach())
                    watch = NonfiniteWatch(losses) if i == len(micro_batches) - 1 else None
                with phase("backward"):
                    # DeepSpeed divides by grad_accum and averages over ranks; undo both so the step's gradient is
                    # sum(token losses of the whole global batch) / (its number of target tokens).
                    engine.backward(token_sum * (world * t.grad_accum / max(n_targets, 1.0)))
                with phase("nonfinite check"):
                    # Asked once the backward is queued (the device keeps working), and before the optimizer step,
                    # which is what a non-finite loss must never reach.
                    if watch is not None and watch.found():
                        _stop_on_nonfinite(engine, run, step, micro_batches, losses)
                with phase("optimizer step"):
                    if own_clipping and engine.is_gradient_accumulation_boundary():
                        grad_norm = clip_grad_norm_exact(engine.module.parameters(), r.optim.grad_clip)
                    engine.step()
        # The host is ahead of the device here (the optimizer step is still running there): build the next step's
        # micro-batches now, and reduce their target count with this step's sums in one collective, so the next
        # step's first kernel follows this step's last without the device waiting for the host.
        following = loader.step(step + 1) if step + 1 < end_step else None
        lengths = [int(n) for mb in micro_batches for n in mb["sample_lengths"]]
        local = torch.tensor([sum(lengths), training_flops(hf_config, lengths), _target_count(following or [])],
                             dtype=torch.float64, device=losses[0].device)
        loss_sum = torch.stack(losses).double().sum().reshape(1)
        loss_sum, tokens, flops, next_targets = dist.all_reduce_sum(torch.cat([loss_sum, local])).tolist()
        upcoming = (following, next_targets) if following is not None else None
        elapsed = time.perf_counter() - start
        if not own_clipping:
            grad_norm = engine.get_global_grad_norm()
        peak_gib, reserved_gib = dist.all_reduce_max_each([peak_memory_gib(), peak_reserved_gib()])
        record = {
            "step": step + 1,
            "loss": loss_sum / max(n_targets, 1.0),
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else None,
            "tokens": int(tokens),
            "target_tokens": int(n_targets),
            "tokens_per_s": tokens / elapsed,
            "tokens_per_s_per_gpu": tokens / elapsed / world,
            "mfu": flops / elapsed / world / (peak * 1e12) if peak else None,
            "step_time_s": elapsed,
            "peak_mem_gib": peak_gib,
            "peak_reserved_gib": reserved_gib,
        }
        records.append(record)
        log.write(record)
        if (step + 1) % t.log_every == 0 or step + 1 == t.max_steps:
            log.progress(record)
        last = step + 1 == end_step
        if eval_data is not None and ((t.eval_every and (step + 1) % t.eval_every == 0) or last):
            eval_loss = evaluate(engine, eval_data, r, world, rank, tokenizer.pad_id, device)
            records.append({"step": step + 1, "eval_loss": eval_loss})
            log.write(records[-1])
            dist.print0(f"eval at step {step + 1}: loss {eval_loss:.4f}")
        if t.save_every > 0 and ((step + 1) % t.save_every == 0 or last):
            meta = {"recipe": recipe_to_dict(r), "ds_config": run.ds}
            path = checkpoint.save(engine, t.output_dir, step + 1, t.keep_last, meta)
            dist.print0(f"saved {path}")
    log.close()
    sample(end_step)
    if dist.is_main() and samples:
        with open(os.path.join(t.output_dir, "samples.jsonl"), "w") as f:
            f.writelines(json.dumps(s) + "\n" for s in samples)
    if t.export:
        from finetune.export import export_engine

        path = export_engine(engine, os.path.join(t.output_dir, "export"), tokenizer, r.lora.enabled)
        dist.print0(f"exported {path}")
    if on_end is not None:
        on_end(engine)
    dist.barrier()
    _release(engine, keepalive)
    _remove_swap(run.ds)
    return records


def _target_count(micro_batches: list) -> int:
    """This rank's number of trained tokens (targets that are not -100) in these micro-batches."""
    return sum(int((mb["targets"] != -100).sum()) for mb in micro_batches)


class TrainingError(RuntimeError):
    """Training cannot go on; the message says where it stopped, what was saved and what to do."""


class NonfiniteWatch:
    """Whether any rank's loss of this step is NaN or inf, without stalling the device: the flags are reduced over
    the ranks and copied to the host behind the forward pass, and `found()` waits for that copy alone (by then the
    backward is queued behind it). One host wait per step, where a check per micro-batch costs one each."""

    def __init__(self, losses: list):
        import torch

        flag = (~torch.isfinite(torch.stack(losses))).any().to(torch.float32).reshape(1)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # NCCL: queued, the host goes on
        self._event = None
        if flag.is_cuda:
            self._host = torch.empty(1, dtype=torch.float32, pin_memory=True)
            self._host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = flag

    def found(self) -> bool:
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host.item() > 0)


def _stop_on_nonfinite(engine, run: Run, step: int, micro_batches: list, losses: list) -> None:
    """A NaN/inf loss on any rank: save the state at the start of this step (the optimizer has not stepped; the
    gradients of this step are dropped) and stop, naming the step and the samples of every rank that saw a
    non-finite loss. All ranks call this."""
    import torch

    from finetune import dist

    t = run.recipe.train
    bad = [i for mb, loss in zip(micro_batches, losses) if not torch.isfinite(loss).item()
           for i in mb["sample_ids"].tolist()]
    width = int(dist.all_reduce_max(float(len(bad))))
    padded = torch.full((dist.world_size(), max(width, 1)), -1, dtype=torch.long)
    padded[dist.rank(), :len(bad)] = torch.tensor(bad, dtype=torch.long)
    everyone = dist.all_reduce_sum(padded.double() + 1).long() - 1  # each rank's row, the others' zeros
    path = checkpoint.save(engine, t.output_dir, step, t.keep_last,
                           {"recipe": recipe_to_dict(run.recipe), "ds_config": run.ds, "note": "state before a non-finite loss"})
    per_rank = {r: [i for i in everyone[r].tolist() if i >= 0] for r in range(dist.world_size())}
    samples = "; ".join(f"rank {r}: {ids}" for r, ids in per_rank.items() if ids)
    raise TrainingError(
        f"non-finite loss at step {step + 1}: samples (indices into the tokenized training data, "
        f"see `zerotune preprocess --show`) {samples}. The state before this step is saved in {path}. Lower optim.lr "
        f"or fix those samples, then continue with train.resume=auto"
    )


def _resume_step(run: Run) -> int:
    if not run.resume_from:
        return 0
    with open(os.path.join(run.resume_from, checkpoint.MARKER)) as f:
        return int(json.load(f)["step"])


def _truncate_metrics(path: str, keep_until: int) -> None:
    """Keep the records of steps <= keep_until: a resumed run rewrites what came after its checkpoint."""
    kept = []
    if keep_until > 0 and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_until]
    with open(path, "w") as f:
        f.writelines(kept)


def _release(engine, keepalive) -> None:
    """Free the engine and end zero.Init's hold on transformers, so a later run in this process starts clean."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if hasattr(engine, "destroy"):
        engine.destroy()
    del keepalive
    unset_hf_deepspeed_config()


def _remove_swap(ds: dict[str, Any]) -> None:
    """Delete this run's NVMe swap files (DeepSpeed leaves them: the size of the optimizer states, ~100 GB for a
    full 7B fine-tune), once every rank of the node is done with them."""
    import shutil

    from finetune import dist
    from finetune.ds_config import nvme_swap_dirs

    dirs = nvme_swap_dirs(ds)
    if not dirs:
        return
    dist.barrier()
    if dist.local_rank() == 0:
        for path in dirs:
            shutil.rmtree(path, ignore_errors=True)


def evaluate(engine, data, recipe: Recipe, world: int, rank: int, pad_id: int, device) -> float:
    """Token-weighted mean loss over the whole eval set, summed over ranks."""
    import torch

    from finetune import dist
    from finetune.data.loader import eval_micro_batches
    from finetune.loss import token_loss_sum

    engine.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    with torch.no_grad():
        for mb in eval_micro_batches(data, recipe.train.micro_batch_size, world, rank, recipe.data.max_seq_len,
                                     recipe.data.packing, pad_id):
            logits = engine(input_ids=mb["input_ids"].to(device), position_ids=mb["position_ids"].to(device)).logits
            s, n = token_loss_sum(logits, mb["targets"].to(device))  # eval keeps the plain path: no backward
            total += s.double().cpu()
            count += n
    engine.train()
    return float(dist.all_reduce_sum(total)) / max(float(dist.all_reduce_sum(count)), 1.0)


def main(argv: list[str] | None = None) -> int:
    from finetune import dist

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
