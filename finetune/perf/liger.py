"""Fused GPU kernels for Mistral's RMSNorm, SwiGLU and RoPE (liger-kernel's Triton kernels), chosen by model.kernels.

    check(recipe.model.kernels)     # in prepare: a clear error when `liger` cannot be had
    count = install(model)          # by perf.apply: liger's kernels in this model's modules only

Each replaces several elementwise kernels (and their recomputation under activation checkpointing) by one; the
effect is in docs/benchmarks/2026-11-30-2xh200-vs-peer.md. Triton needs CUDA, so on CPU `auto` means none; their loss
parity is checked on a GPU by tests/gpu/test_gpu_kernels.py. The loss itself is fused by zerotune
(finetune/perf/fused_loss.py), which also runs on CPU.

liger's own apply_liger_kernel_to_mistral rebinds names in transformers' modeling_mistral module (its RoPE function,
RMSNorm and MLP classes), which changes every Mistral built afterwards in the process, even when given a model. Here
only the given model's modules change: each RMSNorm and MLP gets liger's forward as an instance attribute, and each
attention module a copy of its class's forward whose globals map `apply_rotary_pos_emb` to liger's. transformers'
module, its classes and functions stay as they are.

liger looks for every backend of an op (its Triton kernels, CuTe DSL, cuTile, Ascend NPU) the first time the op runs,
and logs a warning for each one whose package this machine lacks (cutlass, cuda.tile, torch_npu). zerotune runs the
Triton kernels, so those notices are noise to a user: a filter on liger's registry logger holds them back unless the
run is verbose (`--verbose`, ZEROTUNE_LOG=info). A failure of the Triton backend itself, and every other warning of
liger's, still shows.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import types
from dataclasses import dataclass
from typing import Any, Callable

from finetune.config import ConfigError
from finetune.run import console

ROPE_NAME = "apply_rotary_pos_emb"
"""The global name MistralAttention.forward calls RoPE by."""
REGISTRY_LOGGER = "liger_kernel.backends.registry"
"""The logger liger's op registry reports a backend it could not import on."""
TRITON_BACKEND = "liger_kernel.ops.backends._triton."
"""The module prefix of the backend zerotune runs; a failure there is never held back."""
_IMPORT_FAILURE = re.compile(r"Backend impl '(?P<module>[\w.]+)' for op '[\w.]+' could not be imported")


class _OtherBackends(logging.Filter):
    """Drops liger's notice that a backend other than Triton could not be imported, unless the run is verbose."""

    def filter(self, record: logging.LogRecord) -> bool:
        if console.is_verbose():
            return True
        found = _IMPORT_FAILURE.match(record.getMessage())
        return found is None or found["module"].startswith(TRITON_BACKEND)


_OTHER_BACKENDS = _OtherBackends()


def quiet_other_backends() -> None:
    """Hold back liger's notices about backends zerotune does not run (see the module's docstring); safe to call
    again, and before liger is imported: its registry module's getLogger returns this same logger."""
    registry = logging.getLogger(REGISTRY_LOGGER)
    if _OTHER_BACKENDS not in registry.filters:
        registry.addFilter(_OTHER_BACKENDS)


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


@dataclass(frozen=True)
class Kernels:
    """What install puts into a model: forwards to bind to RMSNorm and MLP instances, and the RoPE function."""

    rms_norm_forward: Callable
    rms_norm_attributes: dict[str, Any]
    """The settings rms_norm_forward reads from its module besides weight and variance_epsilon."""
    mlp_forward: Callable
    rotary: Callable


def load_kernels() -> Kernels:
    """liger-kernel's RMSNorm and SwiGLU forwards and its RoPE function."""
    quiet_other_backends()
    # liger-kernel is optional (CUDA only): imported when a run asks for it. Importing it patches nothing.
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    # The settings LigerRMSNorm.forward reads (offset, casting mode, in-place backward, ...) differ between liger's
    # versions: take them from an instance built as its own patch builds them (hidden size and eps aside).
    template = LigerRMSNorm(1)
    settings = {k: v for k, v in vars(template).items()
                if not k.startswith("_") and k not in ("training", "variance_epsilon")}
    return Kernels(LigerRMSNorm.forward, settings, LigerSwiGLUMLP.forward, liger_rotary_pos_emb)


def install(model, kernels: Kernels | None = None) -> int:
    """Put liger's kernels (or `kernels`) into every Mistral RMSNorm, SwiGLU MLP and attention module of model;
    returns how many modules changed. Call it before fused_mlp's install, which replaces the MLPs' forward again."""
    from transformers.models.mistral import modeling_mistral as mm

    kernels = kernels or load_kernels()
    attention_forward = {}  # one rebuilt forward per attention class, bound to each of its instances
    count = 0
    for module in model.modules():
        if isinstance(module, mm.MistralRMSNorm):
            for name, value in kernels.rms_norm_attributes.items():
                setattr(module, name, value)
            module.forward = types.MethodType(kernels.rms_norm_forward, module)
        elif isinstance(module, mm.MistralMLP):
            if getattr(module.config, "hidden_act", None) not in ("silu", "swish"):
                continue  # not a SwiGLU: keeps its own activation
            module.forward = types.MethodType(kernels.mlp_forward, module)
        elif isinstance(module, mm.MistralAttention):
            cls = type(module)
            if cls not in attention_forward:
                attention_forward[cls] = with_globals(cls.forward, {ROPE_NAME: kernels.rotary})
            module.forward = types.MethodType(attention_forward[cls], module)
        else:
            continue
        count += 1
    return count


def with_globals(fn: Callable, names: dict[str, Any]) -> Callable:
    """A copy of fn that looks these global names up in `names` first; fn, its module and its other callers unchanged.

    A decorated fn (functools.wraps: `__wrapped__`) is copied down to the function that calls the names, and each
    wrapper is copied with its closure pointing at the copy below it, so the decorators still run (transformers wraps
    attention forwards in deprecate_kwarg)."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        missing = [n for n in names if n not in fn.__code__.co_names]
        if missing:
            raise RuntimeError(f"{fn.__qualname__} no longer calls {', '.join(missing)} by that global name (a "
                               f"transformers change): liger's kernels cannot be put into this model; set "
                               f"model.kernels=none")
        copy = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__,
                                  fn.__closure__)
    else:
        inner_copy = with_globals(inner, names)
        cells = fn.__closure__ or ()
        replaced = tuple(types.CellType(inner_copy) if _holds(cell, inner) else cell for cell in cells)
        if replaced == cells:
            raise RuntimeError(f"{fn.__qualname__}: a decorator that does not call the function it wraps from its "
                               f"closure; liger's kernels cannot be put into this model: set model.kernels=none")
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, replaced)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__, copy.__doc__, copy.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    if inner is not None:
        copy.__wrapped__ = inner_copy
    return copy


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False
