"""Fused GPU kernels for Mistral's RMSNorm, SwiGLU and RoPE (liger-kernel's Triton kernels), chosen by model.kernels.

    check(recipe.model.kernels)           # in prepare: a clear error when `liger` cannot be had
    name = apply(recipe.model.kernels)    # before the model is built: "liger" or None

Each replaces several elementwise kernels (and their recomputation under activation checkpointing) by one. The HF
Trainer peer measured liger's kernels at 10.0K tok/s/GPU against 8.2K without (Mistral-7B full fine-tune, ZeRO-2,
2xH200, shared/FACTS.md). Triton needs CUDA, so on CPU `auto` means none; their loss parity is checked on a GPU by
tests/test_gpu_kernels.py. The loss itself is fused by zerotune (finetune/perf/fused_loss.py), which also runs on CPU.
"""

from __future__ import annotations

import importlib.util

from finetune.config import ConfigError


def available() -> str | None:
    """Why liger cannot be used here, or None when it can."""
    import torch

    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    if not torch.cuda.is_available():
        return "liger-kernel's Triton kernels need a CUDA GPU"
    return None


def check(kernels: str) -> None:
    if kernels == "liger" and (why := available()):
        raise ConfigError(f"model.kernels=liger: {why}; set model.kernels=auto (liger when available) or none")


def apply(kernels: str) -> str | None:
    """Patch transformers' Mistral modules with liger's before a model is built; the kernels in use, or None."""
    if kernels == "none" or available():
        return None
    from liger_kernel.transformers import apply_liger_kernel_to_mistral

    # zerotune computes the loss itself (finetune/perf/fused_loss.py): leave the model's forward and loss alone.
    apply_liger_kernel_to_mistral(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                  fused_linear_cross_entropy=False)
    return "liger"
