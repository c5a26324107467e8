"""AdamW with no decay on norms and biases, warm-up then cosine decay.

    optimizer, scheduler = build_optimizer(model, recipe.optim, recipe.train.max_steps, ds_config)

The optimizer is chosen by where it runs: DeepSpeedCPUAdam when ZeRO offloads the optimizer; on GPU torch's
fused AdamW (one multi-tensor kernel like DeepSpeed's FusedAdam, but nothing to JIT-compile, so no nvcc and no
TORCH_CUDA_ARCH_LIST pitfalls such as "9.0a") or, with optim.implementation=deepspeed, DeepSpeed's FusedAdam;
torch's plain AdamW on a CPU accelerator.
"""

from __future__ import annotations

import math
from typing import Any

import deepspeed
import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

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
