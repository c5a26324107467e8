"""LoRA under FP8: an attention's q, k and v base GEMMs as one, in forward and in backward, chosen by lora.joint_qkv.

    install_joint_qkv(model)   # by perf.apply: after precision and fused_lora, before deepspeed.initialize

q, k and v read the same input. Apart, each is a GEMM of its own in forward (k and v only 1,024 wide for Mistral-7B,
too narrow to fill an H200), and in backward each quantizes its output's gradient, transposes its FP8 weight and
runs a GEMM for the input's gradient, which autograd then adds up: two adds over a [tokens, hidden] tensor per layer.
Joined, forward is one FP8 GEMM against the stacked weight [q; k; v] whose output is split into q, k and v (views),
and backward quantizes the three gradients side by side, each token's row scaled by its largest value across all
three, and runs one GEMM whose fp32 accumulator sums the three input gradients. The adapters keep their own products,
dropout masks and gradients (fused_lora.adapter_forward / adapter_backward), added into that one input gradient.

How the attention is run unchanged: transformers' attention calls q_proj, k_proj and v_proj in that order on one
tensor. q_proj (the leader) computes all three and leaves k's and v's outputs on k_proj and v_proj, which return them
when called next on the same tensor (the same object, unchanged since: its version counter); called on anything else
they compute their own output as before, so a caller that runs one projection alone gets the separate path.

Where it applies: the three are fused-LoRA layers on FP8 bases (finetune/perf/precision.py) without bias, each
with one plain adapter. ZeRO-0/1/2 keep the stacked FP8 weight (each base's FP8 weight and scales are views into it:
no extra bytes); under ZeRO-3 the three gathered weights are stacked and quantized at each use, which needs all three
gathered when q_proj runs: ZeRO-3 only with whole-layer gathers (finetune/perf/layer_gather.py).
"""

from __future__ import annotations

import weakref

import torch

from finetune.perf import fp8
from finetune.perf.fused_lora import _fusable, adapter_backward, adapter_forward, fused_class
from finetune.perf.precision import Fp8FrozenLinear

NAMES = ("q_proj", "k_proj", "v_proj")


class JointQkvFunction(torch.autograd.Function):
    """(q, k, v) = split(x·[Wq; Wk; Wv]ᵀ) + each adapter's scaling·(drop(x)·Aᵀ)·Bᵀ, the base GEMMs in FP8.

    weights: the stacked FP8 weight and its row scales (kept), or with w_scale None the three gathered bf16 weights,
    stacked and quantized in forward and again in backward. adapters: (A, B) of q, k and v, in that order. Gradients
    for x and every A and B."""

    @staticmethod
    def forward(ctx, x, w_q, w_scale, spec, *tensors):
        widths, scalings, dropouts, seeded, quantize = spec
        gathered, adapters = (tensors[:3], tensors[3:]) if w_scale is None else ((), tensors)
        x2 = x.reshape(-1, x.shape[-1])
        y = fp8.fp8_linear(x, *_stacked(w_q, w_scale, gathered, quantize), quantize)
        saved, start = [], 0
        for i, width in enumerate(widths):
            lora_a, lora_b = adapters[2 * i], adapters[2 * i + 1]
            low_rank, mask, seed = adapter_forward(x2, lora_a, dropouts[i], seeded)
            y[:, start:start + width].addmm_(low_rank, lora_b.t(), alpha=scalings[i])
            saved += [lora_a, lora_b, low_rank, mask, seed]
            start += width
        ctx.save_for_backward(x, w_q, w_scale, *gathered, *saved)
        ctx.spec, ctx.n_gathered = spec, len(gathered)
        # q stays a view of y; k and v (narrow) are copied out: a view keeps all of y alive as long as it lives, and
        # attention keeps v (and under some attention functions k) for its backward, which pinned every layer's
        # [tokens, q + k + v] output (5 GiB more at Mistral-7B's shape, 16,384 tokens). RoPE keeps nothing of q.
        first, *rest = y.split(widths, dim=-1)
        return tuple(part.view(*x.shape[:-1], part.shape[-1]) for part in (first, *(t.contiguous() for t in rest)))

    @staticmethod
    def backward(ctx, *grads):
        widths, scalings, dropouts, _, quantize = ctx.spec
        x, w_q, w_scale, *rest = ctx.saved_tensors
        gathered, saved = rest[:ctx.n_gathered], rest[ctx.n_gathered:]
        x2 = x.reshape(-1, x.shape[-1])
        grads2 = [g.reshape(-1, g.shape[-1]) for g in grads]
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8.fp8_input_grad(torch.cat(grads2, dim=-1), *_stacked(w_q, w_scale, gathered, quantize),
                                        quantize)
        adapter_grads = []
        first = 4 + ctx.n_gathered  # the index of q's A among forward's inputs
        for i in range(len(widths)):
            lora_a, lora_b, low_rank, mask, seed = saved[5 * i:5 * i + 5]
            adapter_grads += adapter_backward(grads2[i], x2, lora_a, lora_b, low_rank, mask, seed, scalings[i],
                                              dropouts[i], grad_x, ctx.needs_input_grad[first + 2 * i],
                                              ctx.needs_input_grad[first + 2 * i + 1])
        if grad_x is not None:
            grad_x = grad_x.view(x.shape)
        return grad_x, None, None, None, *([None] * ctx.n_gathered), *adapter_grads


def _stacked(w_q, w_scale, gathered, quantize) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked weight's (FP8 values, row scales): kept, or quantized now from the gathered bf16 weights (one
    quantizer launch for the three; per output row, so the same values as quantizing each apart)."""
    if w_scale is not None:
        return w_q, w_scale
    return fp8.quantize_weight(torch.cat(gathered), quantize)


def output(layer, x: torch.Tensor) -> torch.Tensor | None:
    """A joined projection's output for x, or None where it runs alone: k_proj's or v_proj's output as its q_proj
    left it for this very x (taken once), q_proj's from the three run as one."""
    pending = layer.__dict__.pop("_joint_pending", None)
    if pending is not None:
        ref, version, out = pending
        return out if ref() is x and version == x._version else None
    followers = layer.__dict__.get("_joint_followers")
    return _run(layer, followers, x) if followers else None


def _run(leader, followers, x: torch.Tensor) -> torch.Tensor | None:
    """q_proj's output with k's and v's left on their layers, or None where the three cannot run as one now."""
    layers = (leader, *followers)
    if not all(_fusable(layer, x, (), {}) for layer in layers):
        return None
    names = [layer.active_adapters[0] for layer in layers]
    bases = [layer.get_base_layer() for layer in layers]
    stacked = (leader._buffers["joint_fp8"], leader._buffers["joint_scale"]) if "joint_fp8" in leader._buffers else None
    gathered = () if stacked is not None else tuple(base.weight for base in bases)
    if stacked is None and any(base.fp8_weight()[0] is not None for base in bases):
        return None  # kept FP8 copies that are not views of one stacked weight: the separate path
    dropouts = tuple(_dropout(layer, name) for layer, name in zip(layers, names))
    spec = (tuple(base.out_features for base in bases), tuple(float(layer.scaling[n]) for layer, n in zip(layers, names)),
            dropouts, leader.seeded_dropout, fp8.quantizer(x.device))
    adapters = [t for layer, n in zip(layers, names) for t in (layer.lora_A[n].weight, layer.lora_B[n].weight)]
    w_q, w_scale = stacked if stacked is not None else (None, None)
    q, k, v = JointQkvFunction.apply(x, w_q, w_scale, spec, *gathered, *adapters)
    ref = weakref.ref(x)
    for layer, out in zip(layers[1:], (k, v)):
        layer.__dict__["_joint_pending"] = (ref, x._version, out)
    return q


def _dropout(layer, name: str) -> float:
    dropout = layer.lora_dropout[name]
    return dropout.p if isinstance(dropout, torch.nn.Dropout) and layer.training else 0.0


def install_joint_qkv(model: torch.nn.Module) -> int:
    """Join q, k and v in every attention where they qualify (see the module's docstring); returns how many. Kept FP8
    bases are restacked: one [q; k; v] weight whose row blocks become the bases' own FP8 weights and scales."""
    joined = 0
    for module in model.modules():
        layers = [getattr(module, name, None) for name in NAMES]
        if not all(type(layer) is fused_class() for layer in layers):
            continue
        bases = [layer.get_base_layer() for layer in layers]
        if not all(type(base) is Fp8FrozenLinear and base.bias is None for base in bases):
            continue
        kept = [base.fp8_weight() for base in bases]
        if all(w_q is not None for w_q, _ in kept):
            stacked = (torch.cat([w_q for w_q, _ in kept]), torch.cat([s for _, s in kept]))
            start = 0
            for base in bases:  # the bases' own copies become views of the stacked one: no byte kept twice
                rows = slice(start, start + base.out_features)
                base.register_buffer("weight_fp8", stacked[0][rows], persistent=False)
                base.register_buffer("weight_scale", stacked[1][rows], persistent=False)
                start += base.out_features
            # buffers, so that a move of the model moves them; non-persistent: never saved
            layers[0].register_buffer("joint_fp8", stacked[0], persistent=False)
            layers[0].register_buffer("joint_scale", stacked[1], persistent=False)
        elif any(w_q is not None for w_q, _ in kept):
            continue
        # a plain attribute, not submodules: nothing is registered, saved or hooked twice
        layers[0].__dict__["_joint_followers"] = tuple(layers[1:])
        for layer in layers:
            layer.joint = output
        joined += 1
    return joined
