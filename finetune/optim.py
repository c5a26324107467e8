"""AdamW with no decay on norms and biases, warm-up then cosine decay.

    optimizer, scheduler = build_optimizer(model, recipe.optim, recipe.train.max_steps, ds_config)

The optimizer is chosen by where it runs: DeepSpeed's FusedAdam on GPU, DeepSpeedCPUAdam when ZeRO
offloads the optimizer, and torch's AdamW on a CPU accelerator (it needs no compiler).
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
    import deepspeed

    groups = param_groups(model, cfg.weight_decay)
    kwargs = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if offloads_optimizer(ds_config):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(groups, adamw_mode=True, **kwargs)
    elif deepspeed.get_accelerator().device_name() == "cpu":
        optimizer = torch.optim.AdamW(groups, foreach=False, **kwargs)
    else:
        from deepspeed.ops.adam import FusedAdam

        optimizer = FusedAdam(groups, adam_w_mode=True, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_lambda(step, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler
