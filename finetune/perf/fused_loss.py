"""The fused loss head (model.fused_loss): the output projection and the token loss a chunk of rows at a time.

    install_fused_loss(model)                                          # by perf.apply
    with fused_loss(model, targets): token_sum = engine(...).logits   # the logits are never held whole

A 7B model's logits are the largest activation of a step: vocabulary x tokens values (32,000 x 2,048 x 4 for a
micro-batch of 4 rows), 2 bytes each in bf16, and the loss copies them to fp32 and keeps an fp32 log-softmax for
backward: 10 bytes per value in all.
The fused path computes the output projection and the loss a chunk of rows at a time and its gradients in the same
pass (as liger-kernel's fused linear cross-entropy does), so only one chunk's logits exist at any moment.

It runs inside the output layer's own forward (the head module's class is swapped, its parameter names are kept), so
ZeRO-3 gathers the head's weight for it exactly as for the plain projection, and checkpoints and exports are
unchanged.

On a CPU without native bf16 (AVX2-only: torch emulates bf16 GEMMs there) the head's bf16 GEMMs run in fp32 on
upcast copies and are rounded to bf16 once, as a bf16 GEMM's fp32 accumulator is: the same values up to summation
order. Emulated, the output layer's input gradient (K = 32,000) took most of a tiny bf16 training step's time
(docs/benchmarks/2026-12-01-cpu-bf16-emulation.md).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

CHUNK_ROWS = 1024
"""Rows of logits computed at once: a chunk holds rows x vocabulary fp32 values, 4 bytes each."""


def emulated_bf16(t: torch.Tensor) -> bool:
    """Whether a GEMM on t would run in torch's emulated bf16 (a bf16 CPU tensor on a CPU without native bf16)."""
    from finetune.ds_config import native_cpu_bf16

    return t.dtype == torch.bfloat16 and t.device.type == "cpu" and not native_cpu_bf16()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_i CE(hidden_i @ weight.T, target_i) over targets != -100, with d/dhidden and d/dweight computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, grad_enabled, upcast):
        # Inside forward autograd is off; whether a backward will follow was decided by the caller.
        want_hidden = grad_enabled and hidden.requires_grad
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if grad_enabled and weight.requires_grad else None
        # Only target rows enter the GEMMs: a row without a target (a prompt token, padding, a sequence's last token)
        # adds nothing to the loss and gets a zero gradient, so leaving it out changes no value and saves its share of
        # the output projection, the largest GEMM of a small model's step.
        kept = (targets != -100).nonzero().squeeze(1)
        rows_kept, targets = hidden.index_select(0, kept), targets.index_select(0, kept)
        grad_rows = torch.empty_like(rows_kept) if want_hidden else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # Each GEMM below is rounded to the model's dtype, as nn.Linear's is; with upcast its operands are fp32 copies.
        gemm_weight = weight.float() if upcast else weight
        for start in range(0, rows_kept.shape[0], chunk_rows):
            rows = rows_kept[start:start + chunk_rows]
            gemm_rows = rows.float() if upcast else rows
            target = targets[start:start + chunk_rows]
            logits = (gemm_rows @ gemm_weight.t()).to(hidden.dtype).float()
            lse = torch.logsumexp(logits, dim=-1)
            total += (lse - logits.gather(1, target.unsqueeze(1)).squeeze(1)).sum()
            if want_hidden or grad_weight is not None:
                # d(sum CE)/dlogits = softmax - onehot(target)
                grad = torch.exp(logits - lse.unsqueeze(1))
                grad.scatter_add_(1, target.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
                grad = grad.to(hidden.dtype)  # what autograd would hand the bf16 projection
                gemm_grad = grad.float() if upcast else grad
                if want_hidden:
                    grad_rows[start:start + chunk_rows] = gemm_grad @ gemm_weight
                if grad_weight is not None:
                    # a 16-bit GEMM per chunk (fast), summed over chunks in fp32
                    grad_weight += (gemm_grad.t() @ gemm_rows).to(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden).index_copy_(0, kept, grad_rows) if want_hidden else None
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_output.to(grad_hidden.dtype) if grad_hidden is not None else None,
                grad_weight * grad_output.to(grad_weight.dtype) if grad_weight is not None else None,
                None, None, None, None)


def linear_cross_entropy_sum(hidden, weight, targets, chunk_rows: int = CHUNK_ROWS, upcast: bool | None = None):
    """token_loss_sum(hidden @ weight.T, targets)[0] without materialising the logits. upcast: GEMMs in fp32 (rounded
    to the model's dtype); None = where bf16 would be emulated (emulated_bf16)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    upcast = emulated_bf16(flat) if upcast is None else upcast
    return _ChunkedLinearCrossEntropy.apply(flat, weight, targets.reshape(-1), chunk_rows, torch.is_grad_enabled(),
                                            upcast)


class _LossHead(torch.nn.Linear):
    """The output projection; while `targets` is set, its forward returns the loss sum instead of the logits."""

    targets = None

    def forward(self, hidden):
        if self.targets is None:
            if emulated_bf16(hidden):  # eval and generation: the logits' GEMM in fp32, rounded as in bf16
                return F.linear(hidden.float(), self.weight.float()).to(hidden.dtype)
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
    if not isinstance(head, _LossHead):  # a plain head would return the logits where the caller expects the loss
        raise RuntimeError(f"the model's output layer ({type(head).__name__}) computes no loss: apply the speed-ups "
                           f"with finetune.perf.apply(model, recipe, ds_config) (model.fused_loss) before training")
    head.targets = targets
    try:
        yield
    finally:
        head.targets = None
