"""The training loss: the sum of next-token cross-entropies over target positions, in fp32.

    token_sum, n_targets = token_loss_sum(logits, targets)            # logits materialised (eval, fused_loss=false)
    with fused_loss(model, targets): token_sum = engine(...).logits   # model.fused_loss=true: logits never held whole

A 7B model's logits are the largest activation of a step: vocabulary 32,000 x 2,048 tokens x 4 rows is 0.5 GB in
bf16, and the loss copies them to fp32 and keeps an fp32 log-softmax for backward (2.6 GB per micro-batch of 4 rows).
The fused path computes the output projection and the loss a chunk of rows at a time and its gradients in the same
pass (as liger-kernel's fused linear cross-entropy does), so only one chunk's logits exist at any moment.

It runs inside the output layer's own forward (the head module's class is swapped, its parameter names are kept), so
ZeRO-3 gathers the head's weight for it exactly as for the plain projection, and checkpoints and exports are
unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

CHUNK_ROWS = 1024
"""Rows of logits computed at once: 1,024 x 32,000 fp32 is 131 MB."""


def token_loss_sum(logits, targets):
    """(sum of next-token cross-entropies over target positions, number of targets), in fp32."""
    flat = targets.reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), flat, ignore_index=-100, reduction="sum")
    return loss, int((flat != -100).sum())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, target_i) over targets != -100, with d/dhidden and d/dweight computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, grad_enabled):
        # Inside forward autograd is off; whether a backward will follow was decided by the caller.
        grad_hidden = torch.empty_like(hidden) if grad_enabled and hidden.requires_grad else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grad_enabled and weight.requires_grad else None
        needs_grad = grad_hidden is not None or grad_weight is not None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = hidden[start:start + chunk_rows]
            target = targets[start:start + chunk_rows]
            logits = (rows @ weight.t()).float()  # the projection in the model's dtype, as nn.Linear computes it
            valid = target != -100
            safe = torch.where(valid, target, 0)
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse - picked, 0.0).sum()
            if needs_grad:
                # d(sum CE)/dlogits = softmax - onehot(target) on target rows, 0 elsewhere.
                grad = torch.exp(logits - lse.unsqueeze(1))
                grad.scatter_add_(1, safe.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
                grad *= valid.unsqueeze(1)
                grad = grad.to(hidden.dtype)  # what autograd would hand the bf16 projection
                if grad_hidden is not None:
                    grad_hidden[start:start + chunk_rows] = grad @ weight
                if grad_weight is not None:
                    grad_weight += grad.t() @ rows  # a 16-bit GEMM per chunk (fast), summed over chunks in fp32
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None,
                grad_weight * grad_output.to(grad_weight.dtype) if grad_weight is not None else None, None, None, None)


def linear_cross_entropy_sum(hidden, weight, targets, chunk_rows: int = CHUNK_ROWS):
    """token_loss_sum(hidden @ weight.T, targets)[0] without materialising the logits."""
    return _ChunkedLinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                            chunk_rows, torch.is_grad_enabled())


class _LossHead(torch.nn.Linear):
    """The output projection; while `targets` is set, its forward returns the loss sum instead of the logits."""

    targets = None

    def forward(self, hidden):
        if self.targets is None:
            return super().forward(hidden)
        return linear_cross_entropy_sum(hidden, self.weight, self.targets)


def install_fused_loss(model) -> None:
    """Make the model's output layer able to compute the loss itself (see the module docstring)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise ValueError(f"model.fused_loss needs a bias-free nn.Linear output layer, this model has "
                         f"{type(head).__name__}: set model.fused_loss=false")
    head.__class__ = _LossHead


@contextlib.contextmanager
def fused_loss(model, targets):
    """Within the block, the model's forward returns `.logits` = token_loss_sum(logits, targets)[0] (a scalar)."""
    head = model.get_output_embeddings()
    head.targets = targets
    try:
        yield
    finally:
        head.targets = None
