"""The training loss: the sum of next-token cross-entropies over target positions, in fp32.

    token_sum, n_targets = token_loss_sum(logits, targets)      # from materialised logits (eval, fused_loss=false)
    token_sum = micro_batch_loss_sum(engine, mb, device, fused)  # one training micro-batch, either path

The step's gradient is this sum over the whole global batch divided by its number of target tokens (train.py
scales each micro-batch's backward so); the fused path (finetune/perf/fused_loss.py) computes the same sum without
the logits.
"""

from __future__ import annotations

import torch.nn.functional as F

from finetune.perf.fused_loss import fused_loss


def token_loss_sum(logits, targets):
    """(sum of next-token cross-entropies over target positions, number of targets), in fp32."""
    flat = targets.reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=-100, reduction="sum")
    return loss, int((flat != -100).sum())


def micro_batch_loss_sum(engine, mb, device, fused: bool):
    """The micro-batch's summed token loss (fp32), through the model's fused loss head or from its logits."""
    inputs = {"input_ids": mb["input_ids"].to(device), "position_ids": mb["position_ids"].to(device)}
    targets = mb["targets"].to(device)
    if not fused:
        return token_loss_sum(engine(**inputs).logits, targets)[0]
    with fused_loss(engine.module, targets):
        return engine(**inputs).logits
