"""LoRA's input dropout drawn from a seed inside the adapter's Triton kernels, never stored (lora.dropout_kernel).

    seed = new_seed(x.device)                 # forward: one int64 per call, from torch's generator
    low = dropped_low_rank(x, a, seed, p)     # drop(x)·Aᵀ    [tokens, r]
    grad_a = dropped_backward(grad_low, a, seed, p, grad_x=grad_x, x=x)
                                              # grad_x += drop'(grad_low·A); grad_a = grad_lowᵀ·drop(x)  [r, in]

The fused LoRA function (finetune/perf/fused_lora.py) with torch's dropout writes a bool mask per adapter in forward (kept
for backward: a byte per input element, 6 x 4,096 + 14,336 per token per layer for Mistral-7B's seven projections),
a dropped copy of x for the rank-r GEMM, then in backward rebuilds that copy and masks the adapter's input gradient
in separate passes. These kernels read x once per product, in forward and once in backward for both of its
products, and draw the keep/drop decision of element (row, col) from Philox the same way in each (eight elements per
draw: finetune/perf/_lora_dropout_triton.py), so nothing but the seed is kept. The seed comes from torch's generator
on x's device, so activation checkpointing, which restores that generator before recomputing, redraws the same masks.

An element is dropped with probability p rounded to a multiple of 2⁻¹⁶ (drawn_p: 0.05 -> 0.0500031) and a kept one
is scaled by 1/(1-that), as torch's dropout does; the masks are not torch's (another random stream), so runs with
this kernel and with torch's dropout agree in distribution, not bit for bit. Triton needs CUDA; on CPU
TRITON_INTERPRET=1 runs the same kernels (fp32) for tests/integration/test_lora_dropout.py.

Against torch's dropout these kernels train Mistral-7B LoRA faster and with less memory, and cost less time per step
over no dropout (docs/benchmarks/2026-11-30-2xh200-vs-peer.md, calls ld1 and ld2; benchmarks/lora_dropout_kernels.py
times the kernels alone). So lora.dropout_kernel=auto takes these kernels wherever they can run.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re

import torch

from finetune.config import ConfigError

MAX_ELEMENTS = 2**31 - 1  # the kernels' offsets row·in + col are int32; larger inputs take torch's dropout
_UNIFORM = 2**16  # the resolution of the kernels' uniforms (16 bits each)


MIN_TRITON = (3, 0)  # tl.join, with which each draw serves eight elements


def _triton_problem() -> str | None:
    """Why the installed Triton cannot compile the kernels, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    version = importlib.metadata.version("triton")
    if tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < MIN_TRITON:
        return f"triton {version} is older than {'.'.join(map(str, MIN_TRITON))}"
    return None


def available() -> str | None:
    """Why the Triton dropout cannot run here, or None when it can (CUDA, or Triton's CPU interpreter for tests)."""
    if why := _triton_problem():
        return why
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "its Triton kernels need a CUDA GPU"
    return None


def _auto_gpu() -> bool:
    """The GPUs `auto` takes the kernels on: NVIDIA's, compute capability 8.0 or newer, whose bf16 tensor cores the
    kernels' products use (timed on H200s only: docs/benchmarks/2026-11-30-2xh200-vs-peer.md). Elsewhere (older cards,
    ROCm) `triton` still asks for them."""
    return torch.cuda.is_available() and torch.version.cuda is not None and torch.cuda.get_device_capability() >= (8, 0)


def uses_kernels(dropout_kernel: str, cuda: bool | None = None) -> bool:
    """Whether fused LoRA layers with dropout draw their masks here: lora.dropout_kernel `triton`, or `auto` (the
    default) with Triton 3.0 or newer on a GPU `_auto_gpu` accepts. cuda: None = this machine's GPU decides; True =
    assume such a GPU (the estimator on a machine without one); False = none."""
    if dropout_kernel != "auto":
        return dropout_kernel == "triton"
    if _triton_problem():
        return False
    return _auto_gpu() if cuda is None else cuda


def check(lora) -> None:
    """A clear error, before any rank starts, when lora.dropout_kernel=triton cannot be had."""
    if lora.enabled and lora.dropout_kernel == "triton" and (why := available()):
        raise ConfigError(f"lora.dropout_kernel=triton: {why}; set lora.dropout_kernel=torch (torch's dropout, "
                          f"which keeps a bool mask per adapted input)")


def drawn_p(p: float) -> float:
    """The probability the kernels drop an element with: p rounded to a multiple of 2⁻¹⁶."""
    return round(p * _UNIFORM) / _UNIFORM


def _threshold_and_scale(p: float) -> tuple[int, float]:
    """An element is kept when its 16-bit uniform >= threshold, and then scaled by 1/(1 - drawn_p(p))."""
    threshold = round(p * _UNIFORM)
    return threshold, _UNIFORM / (_UNIFORM - threshold)


def new_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed on `device` from torch's generator there: no host sync, and recomputation redraws it."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


@functools.cache
def _kernels():
    """The Triton module, imported on first use: only runs that use the kernels import triton."""
    import triton

    from finetune.perf import _lora_dropout_triton as k

    return triton, k.low_rank_kernel, k.backward_kernel, k.mask_kernel


# Each kernel's tile (rows, columns; columns a multiple of 8: masks are drawn eight columns at a time), warps and
# software-pipeline stages, as chosen by `benchmarks/lora_dropout_kernels.py --sweep` (its timings:
# docs/benchmarks/2026-11-30-2xh200-vs-peer.md). A tile changes speed only, never a mask: each element's draw is indexed
# by its row and column.
TILES = {"low_rank": (32, 128, 4, 4), "backward": (32, 256, 4, 3), "mask": (64, 64, 4, 3)}


def _block_r(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())  # tl.dot needs every dimension >= 16


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"  # fp32 products in full precision; 16-bit ones ignore it


def _check(x: torch.Tensor) -> None:
    if x.dim() != 2 or not x.is_contiguous() or x.numel() > MAX_ELEMENTS:
        raise ValueError(f"seeded LoRA dropout takes a contiguous 2-D input of at most {MAX_ELEMENTS} elements, "
                         f"got {tuple(x.shape)}")


def dropped_low_rank(x: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """drop(x)·Aᵀ for x [tokens, in] and A [r, in], in x's dtype."""
    _check(x)
    triton, low_rank, *_ = _kernels()
    m, k = x.shape
    out = torch.empty(m, a.shape[0], dtype=x.dtype, device=x.device)
    block_m, block_k, warps, stages = TILES["low_rank"]
    low_rank[(triton.cdiv(m, block_m),)](x, a.contiguous(), out, seed, m, k, a.shape[0], *_threshold_and_scale(p),
                                         PRECISION=_precision(x), BLOCK_M=block_m, BLOCK_K=block_k,
                                         BLOCK_R=_block_r(a.shape[0]), num_warps=warps, num_stages=stages)
    return out


def dropped_backward(grad_low: torch.Tensor, a: torch.Tensor, seed: torch.Tensor, p: float,
                     grad_x: torch.Tensor | None = None, x: torch.Tensor | None = None) -> torch.Tensor | None:
    """The adapter's backward through the dropout of the forward that drew `seed`, the mask drawn once for both
    products: grad_x += (grad_low·A) dropped, in place, when grad_x is given; A's gradient grad_lowᵀ·drop(x) [r, in],
    in x's dtype, returned when x is given. Programs take a block of columns and a share of the tokens (each writes
    an fp32 partial sum of A's gradient) so that an in-dimension of 4,096 still fills the GPU."""
    inputs = grad_x if grad_x is not None else x
    _check(inputs)
    triton, _, backward, _ = _kernels()
    m, k = inputs.shape
    r = grad_low.shape[1]
    block_m, block_k, warps, stages = TILES["backward"]
    col_blocks = triton.cdiv(k, block_k)
    programs = 4 * (torch.cuda.get_device_properties(inputs.device).multi_processor_count if inputs.is_cuda else 1)
    splits = max(1, min(triton.cdiv(m, block_m), triton.cdiv(programs, col_blocks)))
    rows_per_split = triton.cdiv(triton.cdiv(m, splits), block_m) * block_m
    splits = triton.cdiv(m, rows_per_split)
    parts = torch.empty(splits if x is not None else 0, r, k, dtype=torch.float32, device=inputs.device)
    # a kernel pointer that a product does not use points at the tensor given
    backward[(col_blocks, splits)](inputs, inputs if x is None else x,
                                   grad_low.contiguous(), a.contiguous(), parts, seed, m, k, r,
                                   *_threshold_and_scale(p), rows_per_split, INPUT_GRAD=grad_x is not None,
                                   WEIGHT_GRAD=x is not None, PRECISION=_precision(inputs), BLOCK_M=block_m,
                                   BLOCK_K=block_k, BLOCK_R=_block_r(r), num_warps=warps, num_stages=stages)
    return parts.sum(0).to(x.dtype) if x is not None else None


def keep_mask(seed: torch.Tensor, shape: tuple[int, int], p: float, device: torch.device) -> torch.Tensor:
    """The bool keep mask the kernels draw for an input of this shape: for tests and inspection only."""
    triton, *_, mask = _kernels()
    m, k = shape
    out = torch.empty(m, k, dtype=torch.bool, device=device)
    block_m, block_k, warps, stages = TILES["mask"]
    mask[(triton.cdiv(m, block_m), triton.cdiv(k, block_k))](out, seed, m, k, _threshold_and_scale(p)[0],
                                                            BLOCK_M=block_m, BLOCK_K=block_k, num_warps=warps,
                                                            num_stages=stages)
    return out
