"""Each LoRA-adapted projection as one autograd function: y = x·Wᵀ + s·(drop(x)·Aᵀ)·Bᵀ, chosen by lora.fused.

    install_fused_lora(model, zero_stage)   # by perf.apply: after get_peft_model, before deepspeed.initialize

peft computes an adapted projection as `base(x) + lora_B(lora_A(dropout(x))) * scaling`: a dropout kernel writing a
copy of x per adapter (which lora_A then keeps for backward), a scaling kernel and an add over the whole output, and in
backward the same again plus an add of the two input gradients. Here the adapter's rank-r product is accumulated into
the base GEMM's output by addmm (the scaling is its alpha), and in backward into the input gradient the same way. Kept
for backward: x once (q, k and v share it), the bool dropout mask, and the r-wide x·Aᵀ; drop(x) is rebuilt from x and
the mask when A's gradient needs it. With lora.dropout_kernel's Triton kernels (finetune/perf/lora_dropout.py, on CUDA) the
mask is not kept either: each kernel that needs it draws it again from a seed, and reads x instead of a dropped copy
(the default on CUDA). Mistral-7B LoRA with it: docs/benchmarks/2026-11-30-2xh200-vs-peer.md.

The class of each peft `lora.Linear` is swapped for a subclass, so parameter names, checkpoints, adapter export and
merging are peft's. Anything the function does not cover (several active adapters, DoRA and other variants, merged or
disabled adapters, a trained base weight, mixed dtypes, autocast) runs peft's own forward. Under ZeRO-3 the base
weight and both adapters are the layer's external parameters: gathered together by the layer's own hooks.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from finetune.perf import fp8, lora_dropout
from finetune.perf.precision import Fp8FrozenLinear


class LoraLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ (+ bias) + scaling·(drop(x)·Aᵀ)·Bᵀ for a frozen W; gradients for x, A and B."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float, dropout: float, seeded: bool = False,
                w_scale=None, quantize=None):
        x2 = x.reshape(-1, x.shape[-1])
        if quantize is None:
            y = F.linear(x2, weight, bias)
        else:  # an FP8 base (finetune/perf/precision.py): weight is its w_q, or with no w_scale the bf16 weight
            y = fp8.fp8_linear(x, *fp8.frozen_weight(weight, w_scale, quantize), quantize)
            if bias is not None:
                y += bias.to(y.dtype)
        mask = seed = None
        seeded = seeded and dropout > 0 and x2.is_contiguous() and x2.numel() <= lora_dropout.MAX_ELEMENTS
        if seeded:  # the mask is drawn from the seed in each kernel that needs it (finetune/perf/lora_dropout.py)
            seed = lora_dropout.new_seed(x.device)
            low_rank = lora_dropout.dropped_low_rank(x2, lora_a, seed, dropout)
        elif dropout > 0:
            dropped, mask = torch.native_dropout(x2, dropout, True)
            low_rank = dropped @ lora_a.t()
            del dropped  # rebuilt from x and the bool mask in backward, never kept
        else:
            low_rank = x2 @ lora_a.t()
        y.addmm_(low_rank, lora_b.t(), alpha=scaling)
        ctx.save_for_backward(x, weight, lora_a, lora_b, low_rank, mask, seed, w_scale)
        ctx.scaling, ctx.dropout, ctx.quantize = scaling, dropout, quantize
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, lora_a, lora_b, low_rank, mask, seed, w_scale = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])
        grad2 = grad_out.reshape(-1, grad_out.shape[-1])
        keep_scale = 1.0 / (1.0 - ctx.dropout) if mask is not None else 1.0
        grad_low = (grad2 @ lora_b).mul_(ctx.scaling)  # [tokens, r]: the gradient of drop(x)·Aᵀ
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad2 @ weight if ctx.quantize is None
                      else fp8.fp8_input_grad(grad2, *fp8.frozen_weight(weight, w_scale, ctx.quantize), ctx.quantize))
        grad_a = None
        if seed is not None:  # one pass through x and grad_x for both, the mask drawn once
            if grad_x is not None or ctx.needs_input_grad[3]:
                grad_a = lora_dropout.dropped_backward(grad_low, lora_a, seed, ctx.dropout, grad_x=grad_x,
                                                       x=x2 if ctx.needs_input_grad[3] else None)
        else:
            if grad_x is not None:
                if mask is None:
                    grad_x.addmm_(grad_low, lora_a)
                else:
                    grad_x.add_(torch.ops.aten.native_dropout_backward(grad_low @ lora_a, mask, keep_scale))
            if ctx.needs_input_grad[3]:
                dropped = x2 if mask is None else torch.ops.aten.native_dropout_backward(x2, mask, keep_scale)
                grad_a = grad_low.t() @ dropped
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        grad_b = None
        if ctx.needs_input_grad[4]:
            grad_b = (grad2.t() @ low_rank).mul_(ctx.scaling)
        return grad_x, None, None, grad_a, grad_b, None, None, None, None, None



def _fusable(layer, x: torch.Tensor, args, kwargs) -> bool:
    """Whether layer(x) is plain single-adapter LoRA on a frozen nn.Linear, all in x's dtype."""
    if args or kwargs or layer.disable_adapters or layer.merged or torch.is_autocast_enabled(x.device.type):
        return False
    active = layer.active_adapters
    if len(active) != 1 or active[0] not in layer.lora_A or active[0] in layer.lora_variant:
        return False
    base, name = layer.get_base_layer(), active[0]
    if type(base) not in (torch.nn.Linear, Fp8FrozenLinear):
        return False
    weight = base._parameters.get("weight")  # none on an FP8 base that keeps only its FP8 copy
    if weight is not None and weight.requires_grad:
        return False
    if base.bias is not None and base.bias.requires_grad:
        return False
    a, b = layer.lora_A[name], layer.lora_B[name]
    if a.bias is not None or b.bias is not None:
        return False
    dropout = layer.lora_dropout[name]
    if not isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity)):
        return False
    return all(t.dtype == x.dtype for t in (a.weight, b.weight) + ((weight,) if weight is not None else ()))


@functools.cache
def fused_class():
    """peft's lora.Linear with the fused forward (built on first use: peft is imported only for LoRA runs)."""
    from peft.tuners.lora.layer import Linear

    class FusedLoraLinear(Linear):
        seeded_dropout = False  # set per layer by install_fused_lora (lora.dropout_kernel)

        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if not _fusable(self, x, args, kwargs):
                return super().forward(x, *args, **kwargs)
            name = self.active_adapters[0]
            base = self.get_base_layer()
            dropout = self.lora_dropout[name]
            p = dropout.p if isinstance(dropout, torch.nn.Dropout) and self.training else 0.0
            weight, w_scale, quantize = base._parameters.get("weight"), None, None
            if isinstance(base, Fp8FrozenLinear):
                w_q, w_scale = base.fp8_weight()
                weight, quantize = (w_q if w_q is not None else weight), fp8.quantizer(x.device)
            return LoraLinearFunction.apply(x, weight, base.bias, self.lora_A[name].weight,
                                            self.lora_B[name].weight, float(self.scaling[name]), p,
                                            self.seeded_dropout, w_scale, quantize)

    FusedLoraLinear.__name__ = FusedLoraLinear.__qualname__ = "FusedLoraLinear"
    return FusedLoraLinear


def install_fused_lora(model: torch.nn.Module, zero_stage: int, dropout_kernel: str = "auto") -> int:
    """Swap every peft lora.Linear in model for FusedLoraLinear; returns how many. Under ZeRO-3, call it before
    deepspeed.initialize, which registers the parameter hooks. dropout_kernel (lora.dropout_kernel): `triton` draws
    the dropout masks from a seed in finetune/perf/lora_dropout.py's kernels, `torch` keeps native_dropout's bool mask per
    adapter, `auto` is triton where lora_dropout.uses_kernels says (NVIDIA, compute capability 8.0+, Triton 3.0+)."""
    from peft.tuners.lora.layer import Linear

    seeded = lora_dropout.uses_kernels(dropout_kernel)

    if zero_stage == 3:
        # ZeRO-3 gathers a module's parameters in its own forward hooks; the fused forward never calls the base
        # layer's or the adapters' forward, so their parameters are registered to the adapted layer, whose hooks then
        # gather and release them, in forward and backward, unless the decoder layer holding them is a leaf module
        # (finetune/perf/layer_gather.py), whose hooks gather everything beneath it. (The projections themselves
        # cannot be leaves: a leaf reduces its gradients in a full backward hook, which fires before this function's
        # backward where the input needs no gradient, e.g. layer 0's q/k/v under LoRA: a GPU run with them crashed
        # at the first backward.)
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
    layers = [m for m in model.modules() if type(m) is Linear]
    for layer in layers:
        layer.__class__ = fused_class()
        layer.seeded_dropout = seeded
        if zero_stage == 3:
            for p in layer.parameters():  # the base weight (and bias) and every adapter's A and B
                register_external_parameter(layer, p)
    return len(layers)
