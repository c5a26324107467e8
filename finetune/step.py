"""One optimizer step on every rank, its metrics.jsonl record, and the eval pass.

    result, upcoming = train_step(loop, step, upcoming)
    record = step_record(step + 1, result, loop.world, loop.peak_tflops)

A step runs each micro-batch's forward and backward, stops before the optimizer step if any rank's loss is not
finite, steps, then builds the next step's micro-batches while the device still works, reducing their target count
in the same collective as this step's sums, with each rank's note of a stopping signal (finetune/run/preempt.py), so
that every rank stops after the same step. Every rank runs the same collectives in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from finetune import checkpoint, dist, parallel
from finetune.config import Recipe
from finetune.data.loader import StepLoader, eval_micro_batches
from finetune.data.samples import TokenizedData
from finetune.ds_config import zero_stage
from finetune.model.loss import micro_batch_loss_sum, token_loss_sum
from finetune.model.optim import clip_grad_norm_exact
from finetune.model.preference import STATS, PreferenceLoss, pairs_in
from finetune.parallel.ulysses import sharded
from finetune.perf.profiling import phase, step_profiler
from finetune.prepare import Run
from finetune.run import preempt
from finetune.run.activity import ACTIVITY
from finetune.run.metrics import peak_host_gib, peak_memory_gib, peak_reserved_gib, peak_tflops, training_flops


class TrainingError(RuntimeError):
    """Training cannot go on; the message says where it stopped, what was saved and what to do."""


@dataclass
class Loop:
    """What the loop reads, built by the steps before it."""

    run: Run
    engine: Any
    optimizer: Any
    loader: StepLoader
    eval_data: TokenizedData | None
    tokenizer: Any
    world: int = field(init=False)
    rank: int = field(init=False)
    device: torch.device = field(init=False)
    own_clipping: bool = field(init=False)
    """ZeRO-0: the gradients are all-reduced in the boundary backward, before step(), and clipped here."""
    synced: bool = field(init=False)
    """ZeRO-3 on several ranks: every rank joins each generated token's parameter gathers."""
    sp_degree: int = field(init=False)
    """train.sequence_parallel: the ranks that share each row, each with a slice of it."""
    sp_rank: int = field(init=False)
    end_step: int = field(init=False)
    peak_tflops: float | None = field(init=False)
    preference: PreferenceLoss | None = None
    """A preference objective's loss (train.objective dpo, ipo, orpo, simpo); None: the token loss (sft)."""

    def __post_init__(self):
        t, stage = self.run.recipe.train, zero_stage(self.run.ds)
        self.world, self.rank, self.device = dist.world_size(), dist.rank(), dist.device()
        self.own_clipping, self.synced = stage == 0, stage == 3 and self.world > 1
        self.sp_degree = parallel.degree_of(self.run.recipe)
        self.sp_rank = parallel.layout(self.rank, self.sp_degree)[1]
        self.end_step = min(t.max_steps, t.stop_at) if t.stop_at else t.max_steps
        self.peak_tflops = peak_tflops()


@dataclass
class StepResult:
    """One optimizer step, summed over the ranks (peak memory: the largest rank's)."""

    lr: float
    loss_sum: float
    n_targets: float
    tokens: float
    flops: float
    seconds: float
    grad_norm: Any
    """A float or 0-d tensor; None where nothing computed it."""
    peak_gib: float
    reserved_gib: float
    host_gib: float = 0.0
    """Peak resident host memory of the largest rank's process (checkpoint offload, pinned buffers, CPU Adam)."""
    stats: dict[str, float] | None = None
    """A preference step's STATS summed over its pairs (finetune/model/preference.py); None for sft."""
    stop: str = ""
    """The signal any rank received by the end of this step (`SIGTERM`): the run stops after it; '' to go on."""


def train_step(loop: Loop, step: int, upcoming: tuple | None) -> tuple[StepResult, tuple | None]:
    """Optimizer step `step` (from 0) on every rank. Returns its sums, and the next step's (micro-batches, global
    target count) made while the device still works on this one (None after the last step); `upcoming` is that pair
    as the previous call returned it (None for the first step of a run)."""
    r, engine = loop.run.recipe, loop.engine
    start = time.perf_counter()
    ACTIVITY.start_step(step + 1)
    lr = loop.optimizer.param_groups[0]["lr"]
    if upcoming is None:
        ACTIVITY.mark("data")
        micro_batches = loop.loader.step(step)
        n_targets = float(dist.all_reduce_sum(_normalizer(micro_batches, loop.preference)))
    else:
        micro_batches, n_targets = upcoming
    grad_norm = None
    losses = []  # each micro-batch's summed token loss, left on the device: reading one would stall it
    pair_stats = []  # a preference objective's STATS per micro-batch, likewise
    with step_profiler(step + 1 == r.train.profile_step, r.train.output_dir, step + 1, dist.is_main()), \
            sharded(engine.module, loop.sp_degree > 1):
        for i, mb in enumerate(micro_batches):
            with phase("forward"):
                ACTIVITY.mark("forward", i)
                if loop.preference is None:
                    token_sum = micro_batch_loss_sum(engine, mb, loop.device, r.model.fused_loss)
                else:  # summed pair losses; the step's loss is their mean over the global batch's pairs
                    token_sum, stats = loop.preference(engine, mb, loop.device)
                    pair_stats.append(stats.detach())
                losses.append(token_sum.detach())
                watch = NonfiniteWatch(losses) if i == len(micro_batches) - 1 else None
            with phase("backward"):
                ACTIVITY.mark("backward", i)
                # DeepSpeed divides by grad_accum and averages over ranks (every rank, sequence-parallel ones too:
                # finetune/parallel/groups.py); undo both so the step's gradient is sum(token losses of the whole
                # global batch) / (its number of target tokens). Under sequence parallelism each target token is in
                # one rank's slice, so the ranks' sums add up to the rows' and n_targets counts each once.
                engine.backward(token_sum * (loop.world * r.train.grad_accum / max(n_targets, 1.0)))
            with phase("nonfinite check"):
                # Asked once the backward is queued (the device keeps working), and before the optimizer step,
                # which is what a non-finite loss must never reach.
                if watch is not None and watch.found():
                    _stop_on_nonfinite(engine, loop.run, step, micro_batches, losses)
            with phase("optimizer step"):
                ACTIVITY.mark("optimizer step", i)
                if loop.own_clipping and engine.is_gradient_accumulation_boundary():
                    grad_norm = clip_grad_norm_exact(engine.module.parameters(), r.optim.grad_clip)
                engine.step()
    # The host is ahead of the device here (the optimizer step is still running there): build the next step's
    # micro-batches now, and reduce their target count with this step's sums in one collective, so the next
    # step's first kernel follows this step's last without the device waiting for the host. The signal votes ride
    # in the same collective: a signal reaches the ranks at different moments, the sum reaches them all alike.
    ACTIVITY.mark("data")
    following = loop.loader.step(step + 1) if step + 1 < loop.end_step else None
    # A row's tokens and FLOPs once, by the first rank of its sequence-parallel group (every rank of it holds the row).
    lengths = [int(n) for mb in micro_batches for n in mb["sample_lengths"]] if loop.sp_rank == 0 else []
    local = torch.tensor([sum(lengths), training_flops(engine.module.config, lengths),
                          _normalizer(following or [], loop.preference), *preempt.votes()], dtype=torch.float64,
                         device=losses[0].device)
    loss_sum = torch.stack(losses).double().sum().reshape(1)
    stats_sum = torch.stack(pair_stats).double().sum(0) if pair_stats else loss_sum.new_zeros(0)
    ACTIVITY.mark("step sums")
    loss_sum, *summed = dist.all_reduce_sum(torch.cat([loss_sum, stats_sum, local])).tolist()
    stats = dict(zip(STATS, summed[:len(stats_sum)])) if pair_stats else None
    tokens, flops, next_targets, *votes = summed[len(stats_sum):]
    seconds = time.perf_counter() - start
    if not loop.own_clipping:
        grad_norm = engine.get_global_grad_norm()
    peak_gib, reserved_gib, host_gib = dist.all_reduce_max_each([peak_memory_gib(), peak_reserved_gib(),
                                                                 peak_host_gib()])
    result = StepResult(lr, loss_sum, n_targets, tokens, flops, seconds, grad_norm, peak_gib, reserved_gib, host_gib,
                        stats, preempt.agreed(votes))
    return result, ((following, next_targets) if following is not None else None)


def step_record(step: int, s: StepResult, world: int, peak_tflops: float | None) -> dict[str, Any]:
    """The metrics.jsonl record of finished step `step` (from 1)."""
    record = {
        "step": step,
        "loss": s.loss_sum / max(s.n_targets, 1.0),
        "lr": s.lr,
        "grad_norm": float(s.grad_norm) if s.grad_norm is not None else None,
        "tokens": int(s.tokens),
        ("pairs" if s.stats is not None else "target_tokens"): int(s.n_targets),
        "tokens_per_s": s.tokens / s.seconds,
        "tokens_per_s_per_gpu": s.tokens / s.seconds / world,
        "mfu": s.flops / s.seconds / world / (peak_tflops * 1e12) if peak_tflops else None,
        "step_time_s": s.seconds,
        "peak_mem_gib": s.peak_gib,
        "peak_reserved_gib": s.reserved_gib,
        "peak_host_gib": s.host_gib,
    }
    if s.stats is not None:
        pairs = max(s.n_targets, 1.0)
        record.update({name: value / pairs for name, value in s.stats.items()})
        record["reward_margin"] = record["chosen_reward"] - record["rejected_reward"]
    return record


def _normalizer(micro_batches: list, preference: PreferenceLoss | None) -> int:
    """What this rank adds to the step's divisor: its trained tokens (targets that are not -100), or under a
    preference objective its pairs."""
    if preference is not None:
        return sum(pairs_in(mb) for mb in micro_batches)
    return sum(int((mb["targets"] != -100).sum()) for mb in micro_batches)


class NonfiniteWatch:
    """Whether any rank's loss of this step is NaN or inf, without stalling the device: the flags are reduced over
    the ranks and copied to the host behind the forward pass, and `found()` waits for that copy alone (by then the
    backward is queued behind it). One host wait per step, where a check per micro-batch costs one each."""

    def __init__(self, losses: list):
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
    t = run.recipe.train
    bad = [i for mb, loss in zip(micro_batches, losses) if not torch.isfinite(loss).item()
           for i in mb["sample_ids"].tolist()]
    width = int(dist.all_reduce_max(float(len(bad))))
    padded = torch.full((dist.world_size(), max(width, 1)), -1, dtype=torch.long)
    padded[dist.rank(), :len(bad)] = torch.tensor(bad, dtype=torch.long)
    everyone = dist.all_reduce_sum(padded.double() + 1).long() - 1  # each rank's row, the others' zeros
    try:
        path = checkpoint.save(engine, t.output_dir, step, t.keep_last,
                               {**run.resolved_config(), "note": "state before a non-finite loss"})
    except checkpoint.SaveError as e:  # raised on every rank alike (a full disk): the run still ends with exit 3
        raise TrainingError(f"non-finite loss at step {step + 1}, and the state before it could not be saved: {e}") from None
    per_rank = {r: [i for i in everyone[r].tolist() if i >= 0] for r in range(dist.world_size())}
    samples = "; ".join(f"rank {r}: {ids}" for r, ids in per_rank.items() if ids)
    raise TrainingError(
        f"non-finite loss at step {step + 1}: samples (indices into the tokenized training data, "
        f"see `zerotune preprocess --show`) {samples}. The state before this step is saved in {path}. Lower optim.lr "
        f"or fix those samples, then continue with train.resume=auto"
    )


def evaluate(engine, data, recipe: Recipe, world: int, rank: int, pad_id: int, device,
             preference: PreferenceLoss | None = None) -> float:
    """Token-weighted mean loss over the whole eval set, summed over ranks (under sequence parallelism each rank
    scores its slice of its group's rows); under a preference objective the mean pair loss."""
    engine.eval()
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    degree = parallel.degree_of(recipe)
    dp_rank, sp_rank = parallel.layout(rank, degree)
    with torch.no_grad(), sharded(engine.module, degree > 1):
        for i, mb in enumerate(eval_micro_batches(data, recipe.train.micro_batch_size, world // degree, dp_rank,
                                                  recipe.data.max_seq_len, recipe.data.packing, pad_id,
                                                  (degree, sp_rank))):
            ACTIVITY.mark("eval", i)  # each micro-batch is progress: an eval may take many steps' time
            if preference is not None:
                s, _ = preference(engine, mb, device, split="eval")
                total += s.double().cpu()
                count += pairs_in(mb)
                continue
            logits = engine(input_ids=mb["input_ids"].to(device), position_ids=mb["position_ids"].to(device)).logits
            s, n = token_loss_sum(logits, mb["targets"].to(device))  # eval keeps the plain path: no backward
            total += s.double().cpu()
            count += n
    engine.train()
    return float(dist.all_reduce_sum(total)) / max(float(dist.all_reduce_sum(count)), 1.0)
