"""The two runs of a recomputed decoder layer, told apart.

    layer._gradient_checkpointing_func = marking(checkpoint)   # by finetune.model.build._enable_checkpointing
    if recomputing(): ...                                      # in a part of the layer (finetune/perf/tiled_mlp.py)

torch's non-reentrant checkpoint runs a recomputed layer's function twice: in forward, where it keeps only the
layer's inputs, and in backward, where it runs it again only to rebuild the tensors that the first run's graph saved
for backward (by default it stops that second run as soon as the last of them is rebuilt). The second run's outputs
are never used: backward runs the first run's graph with the rebuilt tensors. So a part of the layer that saves
what it needs before it computes, and whose output feeds no tensor saved after it, may skip its work in the second
run and return a placeholder of the right shape. The tiled MLP is such a part: it saves only its input, and in a
Mistral decoder layer only the residual add follows it, which saves nothing. Without the skip a recomputed layer's
MLP forward runs three times per step (forward, the recomputation, and the tiles' own recomputation in backward).

The mark is per thread (backward on a GPU runs on autograd's device thread, where the recomputation runs too) and
counts nested recomputations.
"""

from __future__ import annotations

import threading
from typing import Callable

_state = threading.local()


def recomputing() -> bool:
    """True while a checkpointed layer runs again in backward to rebuild its saved tensors."""
    return getattr(_state, "depth", 0) > 0


def marking(checkpoint: Callable) -> Callable:
    """checkpoint (torch.utils.checkpoint.checkpoint with its options, or finetune.model.activation_offload's) with each
    layer function's second and later runs marked as recomputations."""

    def checkpoint_marking_recomputation(function: Callable, *args, **kwargs):
        runs = 0

        def run(*inner_args, **inner_kwargs):
            nonlocal runs
            runs += 1
            if runs == 1:
                return function(*inner_args, **inner_kwargs)
            _state.depth = getattr(_state, "depth", 0) + 1
            try:  # the recomputation may end early: torch raises out of it once the saved tensors are rebuilt
                return function(*inner_args, **inner_kwargs)
            finally:
                _state.depth -= 1

        return checkpoint(run, *args, **kwargs)

    return checkpoint_marking_recomputation
