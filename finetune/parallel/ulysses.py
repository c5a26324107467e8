"""Ulysses attention on one model: an all-to-all turns each rank's [slice, all heads] into [whole row, heads / N],
zerotune's attention (finetune/perf/attention.py) runs on the whole rows, and a second all-to-all turns the output back.

    install(model, groups)           # after perf.apply, before deepspeed.initialize
    with sharded(model):             # the forwards (and backwards) whose rows are split over the group
        loss = ...

Installed like perf/attention.py installs its own: KEY is added to transformers' attention and mask interfaces (an
added key changes no model that does not name it) and set on this model's configs only. DeepSpeed's
`UlyssesSPAttentionHF.register_with_transformers` instead replaces an existing key's function for every model in the
process, and drops the mask, which would let packed samples see each other; here the core attention finds the
samples and the sliding window in the whole row's position_ids, gathered from the group once per forward.

Outside `sharded` (generation, a sample after training) each rank holds whole rows, and the wrapper is the core
attention itself. The all-to-all is DeepSpeed's differentiable one (deepspeed/sequence/layer.py), so the backward
exchanges the gradients the same way, activation checkpointing's recomputation included.
"""

from __future__ import annotations

import contextlib

import torch

from finetune.parallel.groups import Groups

KEY = "zerotune_ulysses"
"""The key in transformers' AttentionInterface and AttentionMaskInterface; only models whose config names it use it."""

STATE = "_zerotune_ulysses"
"""The attribute holding a model's Ulysses state, on the model and on each of its attention modules."""


class Ulysses:
    """One model's sequence-parallel attention: its group, whether the rows are split now, and the whole rows'
    position_ids of the current forward."""

    def __init__(self, groups: Groups):
        self.group, self.degree = groups.sequence_group, groups.degree
        self.active = False
        self._local: torch.Tensor | None = None
        self._version = -1
        self._whole: torch.Tensor | None = None

    def whole_positions(self, local: torch.Tensor) -> torch.Tensor:
        """The group's slices of position_ids side by side: the whole rows'. Every layer of a forward, and its
        recomputation in backward, passes the same tensor, so it is gathered once per forward; every rank of the
        group runs the same forwards, so they all gather, or all reuse, together."""
        if self._local is local and local._version == self._version and self._whole is not None:
            return self._whole
        parts = [torch.empty_like(local) for _ in range(self.degree)]
        torch.distributed.all_gather(parts, local.contiguous(), group=self.group)
        self._local, self._version, self._whole = local, local._version, torch.cat(parts, dim=-1)
        return self._whole

    def forget(self) -> None:
        self._local = self._whole = None


def _scatter_heads(x: torch.Tensor, state: Ulysses) -> torch.Tensor:
    """[b, h, slice, d] on each rank -> [b, h / N, whole, d]: rank r gets heads block r of every rank's slice."""
    from deepspeed.sequence.layer import _dim_zero_all_to_all

    b, h, s, d = x.shape
    n = state.degree
    sent = x.reshape(b, n, h // n, s, d).permute(1, 0, 2, 3, 4)  # [destination rank, b, h/N, slice, d]
    got = _dim_zero_all_to_all(state.group, sent)  # [source rank = slice index, b, h/N, slice, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _gather_heads(x: torch.Tensor, state: Ulysses) -> torch.Tensor:
    """[b, whole, h / N, d] -> [b, slice, h, d]: the inverse of _scatter_heads, for the attention's output."""
    from deepspeed.sequence.layer import _dim_zero_all_to_all

    b, s, h, d = x.shape
    n = state.degree
    sent = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4)  # [destination rank = slice index, b, slice, h/N, d]
    got = _dim_zero_all_to_all(state.group, sent)  # [source rank = heads block, b, slice, h/N, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def _whole_kv_heads(x: torch.Tensor, degree: int) -> torch.Tensor:
    """Key/value heads fewer than the degree: each repeated degree / kv_heads times, so that rank r's one key/value
    head is the one its query heads block uses (query head q reads kv head q // (heads / kv_heads)). The repeat's
    backward sums the copies' gradients."""
    kv = x.shape[1]
    return x if kv % degree == 0 else x.repeat_interleave(degree // kv, dim=1)


def ulysses_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                      position_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """KEY's attention function: query [b, hq, slice, d], key/value [b, hkv, slice, d] -> ([b, slice, hq, d], None)
    while sharded; the core attention unchanged otherwise."""
    from finetune.perf.attention import attention as core

    state: Ulysses | None = getattr(module, STATE, None)
    if state is None:
        raise RuntimeError(f"{type(module).__name__} runs {KEY} without finetune.parallel.ulysses.install on its model")
    if not state.active or attention_mask is not None:  # whole rows on every rank, or generation with a cache
        return core(module, query, key, value, attention_mask, position_ids=position_ids, **kwargs)
    if position_ids is None:
        raise RuntimeError("sequence parallelism needs each slice's position_ids in the forward (they say which "
                           "samples the whole row holds)")
    whole = state.whole_positions(position_ids)
    q = _scatter_heads(query, state)
    k = _scatter_heads(_whole_kv_heads(key, state.degree), state)
    v = _scatter_heads(_whole_kv_heads(value, state.degree), state)
    out, _ = core(module, q, k, v, None, position_ids=whole, **kwargs)
    return _gather_heads(out, state), None


def register() -> None:
    """Add KEY to transformers' attention and mask interfaces (idempotent); no existing key changes. Its mask is the
    core's: none for a training forward, sdpa's for generation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    from finetune.perf import attention as core

    core.register()
    AttentionInterface.register(KEY, ulysses_attention)
    AttentionMaskInterface.register(KEY, ALL_MASK_ATTENTION_FUNCTIONS[core.KEY])


def install(model, groups: Groups) -> int:
    """Make this model's attention modules (peft-wrapped or not) run Ulysses over `groups`; returns how many."""
    from deepspeed.sequence.layer import register_all_to_all_group

    register()
    register_all_to_all_group(groups.sequence_group)  # the all-to-all op finds its group by name
    from finetune.perf.attention import name_attention

    state = Ulysses(groups)
    setattr(model, STATE, state)
    count = 0
    for m in model.modules():
        if hasattr(m, "q_proj") and hasattr(m, "o_proj"):
            object.__setattr__(m, STATE, state)  # a plain attribute: no submodule, nothing for ZeRO to hook
            count += 1
    name_attention(model, KEY)
    return count


@contextlib.contextmanager
def sharded(model, on: bool = True):
    """Within: this model's rows are split over its group (a no-op for a model without install, or on=False)."""
    state: Ulysses | None = getattr(model, STATE, None)
    if state is None or not on:
        yield
        return
    state.active = True
    try:
        yield
    finally:
        state.active = False
        state.forget()
