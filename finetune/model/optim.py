"""AdamW with no decay on norms and biases, warm-up then cosine decay.

    optimizer, scheduler = build_optimizer(model, recipe.optim, recipe.train.max_steps, ds_config)
    install_exact_grad_norm(engine)   # ZeRO-1/2, after deepspeed.initialize (finetune/train.py _build_engine)

The optimizer is chosen by where it runs: DeepSpeedCPUAdam when ZeRO offloads the optimizer; on GPU torch's
fused AdamW (one multi-tensor kernel like DeepSpeed's FusedAdam, but nothing to JIT-compile, so no nvcc and no
TORCH_CUDA_ARCH_LIST pitfalls such as "9.0a") or, with optim.implementation=deepspeed, DeepSpeed's FusedAdam;
torch's plain AdamW on a CPU accelerator.
"""

from __future__ import annotations

import math
import types
from typing import Any

import deepspeed
import torch
from deepspeed import comm
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from finetune.config import OptimConfig
from finetune.ds_config import offloads_optimizer


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters split into decayed (matrices) and not decayed (norms, biases: every 1-D tensor)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))
        (no_decay if ndim < 2 or name.endswith(".bias") or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_lambda(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up to 1, cosine down to min_lr_ratio."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model, cfg: OptimConfig, max_steps: int, ds_config: dict[str, Any]):
    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if offloads_optimizer(ds_config):
        optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    elif deepspeed.get_accelerator().device_name() == "cpu":
        optimizer = torch.optim.AdamW(groups, foreach=False, **kwargs)
    elif cfg.implementation == "deepspeed":
        optimizer = FusedAdam(groups, adam_w_mode=True, **kwargs)
    else:
        optimizer = torch.optim.AdamW(groups, fused=True, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler


@torch.no_grad()
def clip_grad_norm_exact(parameters, max_norm: float) -> float:
    """Clip to `max_norm` using the global norm summed in float64; returns the norm before clipping.

    Used for ZeRO-0, whose DeepSpeed clipping takes per-tensor norms in float32: on a 32,000-row embedding
    that is off by ~1e-4 relative, while ZeRO-1/2/3 (and this) agree with float64 to 1e-7.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    norm = sum(g.double().pow(2).sum() for g in grads).sqrt().item() if grads else 0.0
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)
    return norm


def install_exact_grad_norm(engine) -> bool:
    """ZeRO-1/2: the gradient norm that clipping divides by (and the logged grad_norm) summed across ranks in float64,
    so that it is the same on any number of ranks. Returns whether the engine's optimizer is ZeRO-1/2's.

    DeepSpeed's ZeRO-1/2 optimizer sums each rank's squared gradient norms in float64 but rounds that sum to float32
    before the all-reduce: 2 ranks round twice where 1 rank rounds once, so the norm, the clipping factor and every
    update after it can differ in the last bit with the number of ranks (and FP8's rounding of the weights can grow
    that). Here the float64 sums are all-reduced and rounded to float32 once, after the square root: the float64
    sums of 1 and of 2 ranks differ only by float64 rounding (a few 2^-53 relative), which that one rounding absorbs
    unless the norm falls that close to a float32 rounding boundary (odds of order 2^-29 a step). The methods are replaced
    on this optimizer only; everything else (model-parallel group, padding, inf/NaN reported as -1, which step()
    treats as an overflow) is DeepSpeed's. tests/integration/test_grad_norm.py checks it.
    """
    optimizer = engine.optimizer
    if not isinstance(optimizer, DeepSpeedZeroOptimizer):
        return False
    optimizer.get_grad_norm_direct = types.MethodType(_grad_norm_direct, optimizer)
    optimizer.complete_grad_norm_calculation_for_cpu_offload = types.MethodType(_grad_norm_offload, optimizer)
    return True


@torch.no_grad()
def _grad_norm_direct(self, gradients, params, norm_type=2):
    """DeepSpeedZeroOptimizer.get_grad_norm_direct (the norm of the gradients in this rank's partition, all-reduced)
    with the sum of squares all-reduced in float64. Its only caller, scaled_global_norm, asks for the L2 norm; other
    norms (a max: exact in any precision) are DeepSpeed's."""
    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    device = deepspeed.get_accelerator().current_device_name()
    norms = []
    for g, p in zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params):
        if getattr(p, "ds_pipe_replicated", False):  # a pipeline-replicated parameter counts once
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            norms.append(torch.linalg.vector_norm(g.detach().to(torch.float64)).to(device))
    total = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64, device=device)
    return _all_reduce_norm(self, total)


@torch.no_grad()
def _grad_norm_offload(self, params):
    """DeepSpeedZeroOptimizer.complete_grad_norm_calculation_for_cpu_offload (the norm with the optimizer on CPU,
    from the per-parameter norms its gradient hooks kept) with the sum of squares all-reduced in float64."""
    total = 0.0  # a Python float: float64
    for p in params:
        if getattr(p, "ds_pipe_replicated", False):
            continue
        if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
            norm = self.norm_for_param_grads.get(self.get_param_id(p))
            if norm is not None:
                total += norm.item() ** 2
            elif not self.ignore_unused_parameters:
                raise RuntimeError("a trainable parameter got no gradient in the step: make every trainable parameter "
                                   "take part in the loss, or set zero_optimization.ignore_unused_parameters=true")
    device = deepspeed.get_accelerator().current_device_name()
    return _all_reduce_norm(self, torch.tensor(total, dtype=torch.float64, device=device))


def _all_reduce_norm(self, sum_of_squares: torch.Tensor) -> torch.Tensor:
    """The L2 norm from each rank's float64 sum of squares: summed over the data- and model-parallel ranks, then
    rounded to the float32 DeepSpeed returns, inf or NaN as -1."""
    comm.all_reduce(sum_of_squares, op=comm.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=sum_of_squares, op=comm.ReduceOp.SUM)
    norm = sum_of_squares.sqrt().float().to(self.device)
    mask_nan_or_inf_with_val_inplace(norm, device=self.device)
    return norm
