"""LoRA under ZeRO-3: each decoder layer's weights gathered and released in one go, the layers made DeepSpeed's leaf
modules.

    if install_layer_gather(model): ...   # LoRA, ZeRO-3, before deepspeed.initialize registers its hooks

ZeRO-3 hooks every module that runs: a fetch before its forward and a release after, the same around its backward,
each with an autograd Function around the module's outputs or inputs, and every trained parameter's gradient is
reduced from a hook of its own. With LoRA the device's work per layer is small (the base frozen, its GEMMs in FP8)
and the host that runs these hooks for each projection, norm and container sets the step's pace. A leaf module is
hooked alone: its forward hook gathers all the weights beneath it, its backward hook gathers them again, and its
trained parameters' gradients are reduced together by one full backward hook
(docs/benchmarks/2026-12-04-h200-zero3-layer-gather.md).

What makes the gradients right: a full backward hook fires once the gradient of the module's input is computed,
after the module's whole backward, if that input requires a gradient; if it does not, the hook fires as soon as the
output's gradient arrives, before any weight's gradient exists. Under LoRA layer 0's input is the frozen embeddings'
output, so it is made to require one (the hook transformers' enable_input_require_grads adds): layer 0 then also
computes its input's gradient, which nothing reads. Projections as leaves would not hold (their inputs in q/k/v of
layer 0 need no gradient either, and a norm's output sits between), which is why the layer is the unit.
Full fine-tuning keeps DeepSpeed's per-module hooks: its step is bound by the device's work, not the host's.
"""

from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM, bare or inside peft: the modules of the `layers` list."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def _requires_grad(module, inputs, output):
    return output.requires_grad_(True)


def install_layer_gather(model: torch.nn.Module) -> bool:
    """Mark the decoder layers as ZeRO-3 leaf modules and make the embeddings' output require a gradient; False where
    the model has no decoder layers to mark."""
    from deepspeed.utils import set_z3_leaf_modules

    layers = decoder_layers(model)
    if not layers:
        return False
    set_z3_leaf_modules(model, [type(layers[0])])
    model.get_input_embeddings().register_forward_hook(_requires_grad)
    return True
