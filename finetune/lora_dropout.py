"""LoRA's input dropout drawn from a seed inside the adapter's Triton kernels, never stored (lora.dropout_kernel).

    seed = new_seed(x.device)                           # forward: one int64 per call, from torch's generator
    low = dropped_low_rank(x, a, seed, p)               # drop(x)·Aᵀ          [tokens, r]
    add_dropped_input_grad_(grad_x, grad_low, a, seed, p)   # grad_x += drop'(grad_low·A)
    grad_a = dropped_weight_grad(grad_low, x, seed, p)  # grad_lowᵀ·drop(x)   [r, in]

The fused LoRA function (finetune/fused_lora.py) with torch's dropout writes a bool mask per adapter in forward (kept
for backward: 20 GiB for Mistral-7B at 8 rows of 2,048 tokens, all seven projections), a dropped copy of x for the
rank-r GEMM, then in backward rebuilds that copy and masks the adapter's input gradient in separate passes. These
kernels read x once per product and draw the keep/drop decision of element (row, col) from Philox at counter
row·in + col, the same in each kernel, so nothing but the seed is kept. The seed comes from torch's generator on x's
device, so activation checkpointing, which restores that generator before recomputing, redraws the same masks.

A kept element is scaled by 1/(1-p), as torch's dropout does; the masks are not torch's (another random stream), so
runs with this kernel and with torch's dropout agree in distribution, not bit for bit. Triton needs CUDA; on CPU
TRITON_INTERPRET=1 runs the same kernels (fp32) for tests/test_lora_dropout.py.

Measured on 2xH200 (Mistral-7B LoRA r16, ZeRO-2, 8 rows of 2,048 tokens per GPU): peak 82.7 GiB against 102.4 with
torch's dropout, and 13,749 tok/s/GPU against 14,956. One gate_proj forward and backward took 7.00 ms against 6.20
(tests/test_gpu_lora_dropout.py): a Philox draw per element in each of three kernels costs more than the bytes saved.
So it is a memory lever, off by default (docs/benchmarks/vs_peer_2xh200.md).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from finetune.config import ConfigError

MAX_ELEMENTS = 2**31 - 1  # Philox counters are int32 row·in + col; larger inputs take torch's dropout


def available() -> str | None:
    """Why the Triton dropout cannot run here, or None when it can (CUDA, or Triton's CPU interpreter for tests)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "its Triton kernels need a CUDA GPU"
    return None


def uses_kernels(dropout_kernel: str) -> bool:
    """Whether fused LoRA layers with dropout draw their masks here (lora.dropout_kernel)."""
    return dropout_kernel == "triton"


def check(lora) -> None:
    """A clear error, before any rank starts, when lora.dropout_kernel=triton cannot be had."""
    if lora.enabled and getattr(lora, "dropout_kernel", "torch") == "triton" and (why := available()):
        raise ConfigError(f"lora.dropout_kernel=triton: {why}; set lora.dropout_kernel=torch (torch's dropout, "
                          f"which keeps a bool mask per adapted input)")


def new_seed(device: torch.device) -> torch.Tensor:
    """A fresh seed on `device` from torch's generator there: no host sync, and recomputation redraws it."""
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


@functools.cache
def _kernels():
    """The Triton module, imported on first use: only runs that use the kernels import triton."""
    import triton

    from finetune import _lora_dropout_triton as k

    return triton, k.low_rank_kernel, k.input_grad_kernel, k.weight_grad_kernel, k.mask_kernel


BLOCK_M, BLOCK_K = 64, 64


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
    low_rank[(triton.cdiv(m, BLOCK_M),)](x, a.contiguous(), out, seed, m, k, a.shape[0], p, 1.0 / (1.0 - p),
                                         PRECISION=_precision(x), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
                                         BLOCK_R=_block_r(a.shape[0]))
    return out


def add_dropped_input_grad_(grad_x: torch.Tensor, grad_low: torch.Tensor, a: torch.Tensor, seed: torch.Tensor,
                            p: float) -> torch.Tensor:
    """grad_x += the input gradient through the adapter, (grad_low·A) dropped with the forward's mask; in place."""
    _check(grad_x)
    triton, _, input_grad, *_ = _kernels()
    m, k = grad_x.shape
    input_grad[(triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))](
        grad_x, grad_low.contiguous(), a.contiguous(), seed, m, k, a.shape[0], p, 1.0 / (1.0 - p),
        PRECISION=_precision(grad_x), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_R=_block_r(a.shape[0]))
    return grad_x


def dropped_weight_grad(grad_low: torch.Tensor, x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """grad_lowᵀ·drop(x): A's gradient [r, in], in x's dtype. The tokens are split over programs (each writes an
    fp32 partial sum) so that an in-dimension of 4,096 still fills the GPU."""
    _check(x)
    triton, _, _, weight_grad, _ = _kernels()
    m, k = x.shape
    r = grad_low.shape[1]
    col_blocks = triton.cdiv(k, BLOCK_K)
    programs = 4 * (torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1)
    splits = max(1, min(triton.cdiv(m, BLOCK_M), triton.cdiv(programs, col_blocks)))
    rows_per_split = triton.cdiv(triton.cdiv(m, splits), BLOCK_M) * BLOCK_M
    splits = triton.cdiv(m, rows_per_split)
    parts = torch.empty(splits, r, k, dtype=torch.float32, device=x.device)
    weight_grad[(col_blocks, splits)](grad_low.contiguous(), x, parts, seed, m, k, r, p, 1.0 / (1.0 - p),
                                      rows_per_split, PRECISION=_precision(x), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
                                      BLOCK_R=_block_r(r))
    return parts.sum(0).to(x.dtype)


def keep_mask(seed: torch.Tensor, shape: tuple[int, int], p: float, device: torch.device) -> torch.Tensor:
    """The bool keep mask the kernels draw for an input of this shape: for tests and inspection only."""
    triton, *_, mask = _kernels()
    m, k = shape
    out = torch.empty(m, k, dtype=torch.bool, device=device)
    mask[(triton.cdiv(m, BLOCK_M), triton.cdiv(k, BLOCK_K))](out, seed, m, k, p, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    return out
