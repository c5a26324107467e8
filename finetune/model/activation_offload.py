"""model.activation_checkpointing: offload: every decoder layer recomputed in backward, as `full`, with each layer's
input waiting for backward in CPU memory instead of the GPU's.

    layer._gradient_checkpointing_func = offloading_checkpoint   # by finetune.model.build._enable_checkpointing

Under `full` the one tensor a recomputed layer keeps is its input hidden state, [tokens, hidden], once per layer: at
long rows what is left of the activations once the layers are recomputed, and it grows with the row. torch's non-reentrant checkpoint saves the layer's tensor arguments as saved tensors
(`_CheckpointFrame.save_inputs`), before it installs its own hooks for the layer's inner tensors. The hooks installed
here around it therefore see exactly those arguments: each is copied to CPU memory (pinned on CUDA, so the copy is
asynchronous on the compute stream, as torch.autograd.graph.save_on_cpu does), and nothing keeps the GPU tensor, so
it is freed when the model moves on to the next layer. Backward copies it back before it recomputes the layer.

Everything else stays as `full`: the checkpointed function is transformers' own (the layer's forward with its
keyword arguments: position embeddings, position ids, mask), the module hooks (ZeRO-3's parameter gathering) run
outside the checkpoint, LoRA's frozen bases need no gradient, and the random state is restored for the recomputation
by torch. On a CPU the input is already in CPU memory and is kept as it is.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def to_host(t: torch.Tensor):
    """Pack a saved tensor: a CPU copy of a device tensor (pinned where CUDA is), a CPU tensor itself."""
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=t.is_cuda)
    host.copy_(t, non_blocking=t.is_cuda)
    return t.device, host


def to_device(packed):
    if isinstance(packed, torch.Tensor):
        return packed
    device, host = packed
    return host.to(device, non_blocking=host.is_pinned())


def offloading_checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint.checkpoint (non-reentrant) with the checkpoint's saved arguments in CPU memory."""
    kwargs.setdefault("use_reentrant", False)
    with torch.autograd.graph.saved_tensors_hooks(to_host, to_device):
        return checkpoint(function, *args, **kwargs)
