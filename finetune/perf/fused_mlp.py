"""The MLP's SwiGLU product and down projection as one autograd function that keeps gate and up only, chosen by
model.fused_mlp.

    install_fused_mlp(model, zero_stage, liger)   # by perf.apply: after LoRA, before deepspeed.initialize

Mistral's MLP is down(silu(gate(x)) · up(x)). Unfused, autograd keeps gate and up for the SwiGLU's backward and the
product silu(gate)·up for the down projection's weight gradient: three [tokens, intermediate] tensors per layer with
liger's SwiGLU (transformers' own MLP keeps silu(gate) too), 3 x 14,336 bf16 values per token per layer for
Mistral-7B, most of what a layer keeps. Here the product is rebuilt from gate and up in backward, one elementwise pass
(by the same kernel as in forward, so the same bits), and never kept: 14,336 bf16 values less per token per layer,
times tokens and layers. The memory planner (finetune/memory/budget.py) counts that saving, so a run that fits more
activations recomputes fewer layers; what it gave on H200s is in docs/benchmarks/2026-11-30-2xh200-vs-peer.md.

Under model.precision=fp8 (full fine-tuning; finetune/perf/precision.py) the down projection's forward and input
gradient GEMMs run in FP8 here too, its weight gradient in bf16, as every other FP8 projection's.

Only an MLP whose down projection is a plain nn.Linear (or an FP8 one) without bias is fused (a LoRA-adapted down_proj keeps peft's or
finetune/perf/fused_lora.py's path); parameter names and checkpoints are unchanged. Under ZeRO-3 down_proj's weight is an
external parameter of the MLP, whose hooks gather it in forward and backward (the function never calls down_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.perf import fp8
from finetune.perf.precision import Fp8Linear


def _product(gate: torch.Tensor, up: torch.Tensor, liger: bool) -> torch.Tensor:
    """silu(gate)·up: liger's kernel (fp32 silu, as its SwiGLU module) or transformers' two ops."""
    if liger:
        from liger_kernel.ops.swiglu import swiglu_forward

        return swiglu_forward(gate, up)[2]
    return F.silu(gate) * up


class SwiGLUDownFunction(torch.autograd.Function):
    """y = (silu(gate)·up)·Wᵀ, keeping gate, up and W for backward; gradients for gate, up and W. With `quantize`
    (an FP8 down projection) the product's GEMM and its input gradient's run in FP8 (fp8.Fp8LinearFunction's)."""

    @staticmethod
    def forward(ctx, gate, up, weight, liger: bool, quantize=None):
        product = _product(gate, up, liger)
        if quantize is None:
            y = F.linear(product, weight)
        else:
            y = fp8.fp8_linear(product, *fp8.quantize_weight(weight, quantize), quantize)
            y = y.view(*product.shape[:-1], weight.shape[0])
        ctx.save_for_backward(gate, up, weight)
        ctx.liger, ctx.quantize = liger, quantize
        return y

    @staticmethod
    def backward(ctx, grad_y):
        gate, up, weight = ctx.saved_tensors
        grad_w = None
        if ctx.needs_input_grad[2]:
            product = _product(gate, up, ctx.liger)  # rebuilt: the same kernel on the same inputs, the same bits
            grad_w = grad_y.reshape(-1, grad_y.shape[-1]).t() @ product.reshape(-1, product.shape[-1])
            del product
        if ctx.quantize is None:
            grad_product = grad_y @ weight
        else:
            grad_product = fp8.fp8_input_grad(grad_y.reshape(-1, grad_y.shape[-1]),
                                              *fp8.quantize_weight(weight, ctx.quantize), ctx.quantize)
            grad_product = grad_product.view(*grad_y.shape[:-1], weight.shape[1])
        if ctx.liger:
            from liger_kernel.ops.swiglu import swiglu_backward  # optional dependency: only with liger installed

            # liger writes the gradients over gate and up, which nothing needs after this (their projections keep
            # their own inputs); its SwiGLU module does the same.
            grad_gate, grad_up = swiglu_backward(gate.contiguous(), up.contiguous(), grad_product)
        else:  # as autograd differentiates silu(gate) * up: the same ops, the same bits
            grad_up = grad_product * F.silu(gate)
            grad_gate = torch.ops.aten.silu_backward(grad_product * up, gate)
        return grad_gate, grad_up, grad_w, None, None


def fusable(mlp: torch.nn.Module) -> bool:
    """Whether mlp is a SwiGLU MLP (gate_proj, up_proj, down_proj; its config's hidden_act silu) whose down projection
    is a plain nn.Linear or an FP8 one."""
    down = getattr(mlp, "down_proj", None)
    act = getattr(getattr(mlp, "config", None), "hidden_act", None)
    return (type(down) in (torch.nn.Linear, Fp8Linear) and down.bias is None and act in ("silu", "swish")
            and hasattr(mlp, "gate_proj") and hasattr(mlp, "up_proj"))


def fused_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate, up, weight = mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj.weight
    if torch.is_autocast_enabled(x.device.type):  # zerotune's ZeRO-0: fp32 weights, bf16 compute
        weight = weight.to(torch.get_autocast_dtype(x.device.type))  # the cast autocast's F.linear would make
    if not gate.dtype == up.dtype == weight.dtype:
        return mlp.down_proj(_product(gate, up, mlp._fused_mlp_liger))
    quantize = fp8.quantizer(x.device) if type(mlp.down_proj) is Fp8Linear else None
    return SwiGLUDownFunction.apply(gate, up, weight, mlp._fused_mlp_liger, quantize)


def install_fused_mlp(model: torch.nn.Module, zero_stage: int, liger: bool) -> int:
    """Give every fusable decoder MLP of model the fused forward; returns how many. Under ZeRO-3, call it before
    deepspeed.initialize, which registers the parameter hooks."""
    if zero_stage == 3:
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp") and fusable(m)]
    for mlp in mlps:
        mlp._fused_mlp_liger = liger
        mlp.forward = fused_forward.__get__(mlp)
        if zero_stage == 3:
            register_external_parameter(mlp, mlp.down_proj.weight)
    return len(mlps)
