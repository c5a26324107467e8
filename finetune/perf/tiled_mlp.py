"""Each decoder MLP a tile of tokens at a time, forward and backward, chosen by model.tiled_mlp.

    install_tiled_mlp(model, zero_stage, max_tokens)   # by perf.apply: after fused_mlp, before deepspeed.initialize

Mistral-7B's MLP makes [tokens, 14,336] tensors (gate, up, their product), 3.5 times the width of the layer's
[tokens, 4,096] input and larger than any other activation of a long row, and backward needs them too. Here the MLP's forward (whatever it is by then:
transformers', liger's, finetune/perf/fused_mlp.py's, with peft's or fused LoRA projections inside) runs on one tile
of tokens after another under no_grad, and only its input is kept. Backward runs each tile's forward again with
autograd on and differentiates it at once, so no [row, intermediate] tensor ever exists, in forward or backward: only
one tile's. The price is one more MLP forward per step. A recomputed layer's MLP adds none: the layer's recomputation
only rebuilds the MLP's input, so the tiles are skipped there (finetune/model/recompute.py).

The tile is TILE_TOKENS tokens: Mistral-7B's hidden size, DeepSpeed ALST's choice (its TiledMLP uses hidden_size
tokens), which makes a tile's [tile, intermediate] tensor the size of one MLP weight and keeps its GEMMs large enough
to run at full speed. It is a fixed count rather than the model's hidden size so that `auto` (on for rows longer than
one tile) leaves a small model's short rows alone; tests set it smaller.

Gradients under DeepSpeed: the trained parameters of the MLP (LoRA adapters, or every weight in a full fine-tune) are
inputs of the autograd function, and backward takes each tile's parameter gradients with torch.autograd.grad (which
captures them instead of accumulating them into .grad) and sums them in fp32. The function returns one gradient per
parameter, so each parameter's gradient is accumulated once per backward and ZeRO-1/2's and ZeRO-3's
post-accumulate-grad hooks fire once, as without tiles. DeepSpeed's own TiledMLP (runtime/sequence_parallel/
ulysses_sp.py) instead runs a nested backward per tile into .grad and marks the parameters `ds_grad_is_ready = False`
until the last tile so that ZeRO's hooks skip the reduction; their hook counts and the `params_already_reduced` checks
then see several firings per parameter. Under ZeRO-3 every parameter of the MLP is registered as an external parameter
of the MLP (as fused LoRA does for its layer): gathered once for the MLP's forward and once for its backward, where the
projections' own hooks would otherwise gather them once per tile, and already whole when passed to the function.

Every call under grad (and every one with fewer tokens than that) runs the same number of tiles, ceil(max_tokens /
TILE_TOKENS) for the recipe's micro-batch (`max_tokens`), a few zero rows padding a micro-batch shorter than one row
per tile. ZeRO-3 records the order in which modules run and prefetches by it: a rank whose rows happen to be shorter
must not run fewer projection calls than another (DeepSpeed's TiledMLP all-reduces its tile count for the same reason).
Zero rows give zero output and add exactly zero to every gradient.

Dropout inside the MLP (LoRA dropout) draws the same masks again: backward restores the random state the forward
started from, as torch.utils.checkpoint does.
"""

from __future__ import annotations

import math

import torch

from finetune.model.recompute import recomputing

TILE_TOKENS = 4096
"""Tokens per tile (an upper bound: a call's tokens are split into equal tiles of at most this many)."""


def tile_count(tokens: int, tiles: int, tile_tokens: int) -> int:
    """The tiles a call of `tokens` tokens runs: the installed count, more only for a call beyond the recipe's shape."""
    return max(tiles, math.ceil(tokens / tile_tokens))


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as [tokens, features], padded with zero rows to at least n tokens."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] < n:
        flat = torch.cat([flat, flat.new_zeros(n - flat.shape[0], flat.shape[1])])
    return flat


def _run_tiles(inner, flat: torch.Tensor, n: int) -> torch.Tensor:
    out = None
    start = 0
    for tile in torch.tensor_split(flat, n):
        y = inner(tile)
        if out is None:  # the output's width and dtype are the MLP's (autocast's under ZeRO-0)
            out = y.new_empty((flat.shape[0], *y.shape[1:]))
        out[start:start + tile.shape[0]] = y
        start += tile.shape[0]
        del y
    return out


class TiledMLPFunction(torch.autograd.Function):
    """y = mlp(x) a tile at a time; keeps x; gradients for x and for the trained parameters passed after it."""

    @staticmethod
    def forward(ctx, mlp, x, n, *params):
        ctx.mlp, ctx.n, ctx.params = mlp, n, params
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        kind = x.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x)
        if recomputing():  # the layer's recomputation needs only x rebuilt; this output is never read
            return torch.empty_like(x)
        y = _run_tiles(mlp._tiled_mlp_inner, _rows(x, n), n)
        return y[:x.shape[:-1].numel()].view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        n, mlp = ctx.n, ctx.mlp
        want_x = ctx.needs_input_grad[1]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        params = [ctx.params[i] for i in wanted]
        flat, grads = _rows(x.detach(), n), _rows(grad_y, n)
        grad_x = torch.empty_like(flat) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        kind, autocast, dtype = ctx.autocast
        start = 0
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []), torch.enable_grad(), \
                torch.autocast(kind, dtype=dtype, enabled=autocast):
            torch.set_rng_state(ctx.cpu_rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, x.device)
            for tile, grad in zip(torch.tensor_split(flat, n), torch.tensor_split(grads, n)):
                tile = tile.detach().requires_grad_(want_x)
                y = mlp._tiled_mlp_inner(tile)
                got = torch.autograd.grad(y, ([tile] if want_x else []) + params, grad, allow_unused=True)
                del y
                if want_x:
                    grad_x[start:start + tile.shape[0]] = got[0]
                    got = got[1:]
                for i, g in enumerate(got):
                    if g is not None:  # summed in fp32: each tile's gradient is rounded once, as one GEMM's would be
                        sums[i] = g.float() if sums[i] is None else sums[i].add_(g)
                start += tile.shape[0]
        out: list[torch.Tensor | None] = [None] * len(ctx.params)
        for i, s in zip(wanted, sums):
            out[i] = s.to(ctx.params[i].dtype) if s is not None else None
        if grad_x is not None:
            grad_x = grad_x[:x.shape[:-1].numel()].view(x.shape)
        return (None, grad_x, None, *out)


def tiled_forward(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    tokens = x.shape[:-1].numel()
    n = tile_count(tokens, mlp._tiled_mlp_tiles, mlp._tiled_mlp_tile)
    params = [p for p in mlp.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (x.requires_grad or params):
        return TiledMLPFunction.apply(mlp, x, n, *params)
    y = _run_tiles(mlp._tiled_mlp_inner, _rows(x, n), n)  # eval, generation: the same tiles, nothing kept
    return y[:tokens].view(*x.shape[:-1], y.shape[-1])


def install_tiled_mlp(model: torch.nn.Module, zero_stage: int, max_tokens: int, tile_tokens: int | None = None) -> int:
    """Give every decoder MLP of model the tiled forward around the forward it has now; returns how many. max_tokens:
    the tokens of one micro-batch (rows x max_seq_len), which fixes the tile count. Under ZeRO-3, call it before
    deepspeed.initialize, which registers the parameter hooks."""
    tile_tokens = tile_tokens or TILE_TOKENS
    if zero_stage == 3:
        from deepspeed.runtime.zero.partition_parameters import register_external_parameter
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    for mlp in mlps:
        mlp._tiled_mlp_inner = mlp.forward  # bound: liger's or the fused MLP's instance forward, or the class's
        mlp._tiled_mlp_tile = tile_tokens
        mlp._tiled_mlp_tiles = max(1, math.ceil(max_tokens / tile_tokens))
        mlp.forward = tiled_forward.__get__(mlp)
        if zero_stage == 3:
            for p in mlp.parameters():  # the projections' weights and adapters, trained or frozen
                register_external_parameter(mlp, p)
    return len(mlps)


def wanted(setting: str, max_seq_len: int) -> bool:
    """model.tiled_mlp: `on`, `off`, or `auto` = on for rows longer than one tile."""
    return setting == "on" or (setting == "auto" and max_seq_len > TILE_TOKENS)
