"""model.recompute_segment = k: two-level recomputation. Of k consecutive recomputed decoder layers (a segment) only
the first keeps its input for backward; the others' inputs are rebuilt in backward from it, by running the segment's
layers forward again, without gradients.

    checkpoints = segment_checkpoints(recomputed, k, checkpoint, offload)   # by finetune.model.build._enable_checkpointing
    layer._gradient_checkpointing_func = checkpoints[i]

Under `full` every layer keeps its input hidden state ([tokens, hidden]) until its backward: L of them, what limits
the row's length once the layers are recomputed (docs/long_context.md). Here L/k are kept, and
while backward runs through a segment its other k-1 inputs are rebuilt at once, when the segment's last layer asks
for its own, and each is dropped when its layer's recomputation takes it: at most L/k + k - 1 at a time, for one more
forward of each layer but the last of each segment. k near √L keeps the fewest (32 layers: k = 6, 6 + 5 instead of 32).

How: torch's non-reentrant checkpoint saves a layer's tensor arguments through the saved-tensor hooks around it
(finetune/model/activation_offload.py says the same). Around a segment's later layers, the hooks save, instead of the
hidden state, a handle that rebuilds it; around its first layer they keep the hidden state (in CPU memory under
`offload`, shared with the segment, which rebuilds from that copy). A rebuild replays layers start..i-1 through
their modules (so ZeRO-3's hooks gather their weights), with the random state each had in forward (LoRA dropout
draws the same masks) and the forward's keyword arguments; the checkpoint then recomputes layer i from the rebuilt
input exactly as under `full`, so losses and gradients are `full`'s, bit for bit on a deterministic device.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from finetune.model.activation_offload import to_device, to_host


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class _Segment:
    """One forward's record of one segment: its first layer's input, each layer's call, the rebuilt inputs."""

    def __init__(self, start: int, kept):
        self.start, self.kept = start, kept  # kept: the hidden state, or its CPU copy under offload
        self.calls: dict[int, tuple] = {}  # layer index -> (module, other args, kwargs, random state, device)
        self.rebuilt: dict[int, torch.Tensor] = {}

    def input_of(self, i: int) -> torch.Tensor:
        """Layer i's input: rebuilt by the last layer's request for the whole segment up to i, then handed out."""
        if i not in self.rebuilt:
            x = to_device(self.kept)
            for j in range(self.start, i):
                module, args, kwargs, rng, device = self.calls[j]
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                    _set_rng_state(device, rng)
                    x = module(x, *args, **kwargs)
                x = x[0] if isinstance(x, tuple) else x
                self.rebuilt[j + 1] = x
        return self.rebuilt.pop(i)


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.dtype


def _is(t: torch.Tensor, hidden: tuple) -> bool:
    """Whether the tensor a hook is given is the layer's hidden-state argument, known by its _key (the checkpoint may
    save a view). Only the key: autograd keeps the hooks with what they saved until backward, so a hook that held the
    tensor itself would keep every layer's input alive, which is what the segments are there to drop."""
    return _key(t) == hidden


def segment_checkpoints(recomputed: list[int], segment: int, checkpoint: Callable,
                        offload: int = 0) -> dict[int, Callable]:
    """A checkpoint function per recomputed layer index: each run of consecutive recomputed layers split into segments
    of `segment` layers. checkpoint: what runs each layer's function once its saved hidden state is arranged (torch's
    non-reentrant checkpoint, marked by finetune/model/recompute.py); it is given transformers' partial(forward,
    layer, **kwargs) unchanged. offload: how many segments, the first ones, keep their input in CPU memory."""
    starts, previous = {}, None
    for i in sorted(recomputed):
        contiguous = previous is not None and i == previous + 1 and i - starts[previous] < segment
        starts[i] = starts[previous] if contiguous else i
        previous = i
    offloaded = set(sorted(set(starts.values()))[:offload])
    state: dict[str, _Segment | None] = {"open": None}

    def for_layer(i: int) -> Callable:
        def two_level_checkpoint(function, *args, **kwargs):
            if not args:  # a layer called with hidden_states=...: the checkpoint is to save it, so pass it positionally
                keywords = dict(function.keywords)
                args = (keywords.pop("hidden_states"),)
                function = partial(function.func, *function.args, **keywords)
            hidden, device = _key(args[0]), args[0].device
            if starts[i] == i:
                seg = state["open"] = _Segment(i, to_host(args[0]) if i in offloaded else args[0])

                def pack(t):
                    if _is(t, hidden):
                        return "start", seg
                    return "other", t

                def unpack(packed):
                    kind, value = packed
                    if kind == "other":
                        return value
                    x = to_device(value.kept)
                    value.kept = None  # the segment's last use: its layers are done
                    return x
            else:
                seg = state["open"]

                def pack(t):
                    return ("rebuild", seg) if _is(t, hidden) else ("other", t)

                def unpack(packed):
                    kind, value = packed
                    return value if kind == "other" else value.input_of(i)
            # transformers checkpoints partial(forward, layer, **kwargs), the replay calls the layer itself (hooks);
            # older versions checkpoint partial(nn.Module.__call__ bound to the layer, **kwargs), hooks included
            module = function.args[0] if function.args else function.func
            seg.calls[i] = (module, args[1:], function.keywords, _rng_state(device), device)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                return checkpoint(function, *args, **kwargs)

        return two_level_checkpoint

    return {i: for_layer(i) for i in recomputed}
