"""Every speed-up of a run, each behind its own recipe switch, applied only here (finetune/perf/README.md).

    applied = perf.apply(model, recipe, ds_config)     # after build_model, before deepspeed.initialize
    applied += perf.apply_engine(engine, recipe)       # after deepspeed.initialize
    perf.report(recipe, applied)                       # one record per speed-up: RUN/speedups.json

A speed-up changes only the model (or engine) it is given: modules' classes are swapped for subclasses, forwards
bound to instances, an optimizer method replaced on the instance. No library's module or class is patched, so a
second model built in the same process (export, chat, a test) is transformers' own.

apply's order, and why:
  1. liger        RMSNorm, SwiGLU and RoPE kernels in the model's modules (the MLPs' forward included);
  2. fp8          the linear layers' precision (model.precision): LoRA's base layers swapped for FP8 ones, which
                  the fused class then runs; for full fine-tuning every decoder projection an Fp8Linear, whose
                  down projection fused_mlp then runs in FP8 itself;
  3. fused_lora   peft's LoRA layers swapped for the fused class (with lora_dropout_kernel: its Triton dropout);
  4. fused_mlp    after LoRA, which decides whether down_proj is still a plain linear layer (an adapted one keeps its
                  path); it replaces the MLP forward liger set, and uses liger's SwiGLU product when liger is on;
  5. tiled_mlp    after the four above: it wraps whatever forward each MLP has by then (liger's, the fused one, with
                  LoRA projections inside) and runs it a tile of tokens at a time;
  6. fused_loss   the output layer; independent of the others.
  7. flex_attention  the attention function the model's config names (attention.py); independent of the others
                  (liger's attention forward looks the function up by that name too).
  8. layer_gather LoRA under ZeRO-3: the decoder layers as DeepSpeed's leaf modules; independent of the others,
                  whose changes all lie inside the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.config import ConfigError, Recipe
from finetune.ds_config import bf16_enabled, gathers_whole_layers, zero_stage
from finetune.perf import attention, liger, lora_dropout, precision, tiled_mlp
from finetune.perf.fused_lora import install_fused_lora
from finetune.perf.fused_loss import install_fused_loss
from finetune.perf.fused_mlp import install_fused_mlp
from finetune.perf.layer_gather import install_layer_gather
from finetune.perf.overflow_check import install_overflow_check


@dataclass(frozen=True)
class SpeedUp:
    name: str
    switch: str
    """The recipe key that turns it on or off."""
    off: Any
    """The switch's value that turns it off."""
    description: str
    engine: bool = False
    """Applied to the DeepSpeed engine (apply_engine) rather than to the model (apply)."""
    data: bool = False
    """Applied to the data's layout by the run (finetune/train.py), neither to the model nor to the engine."""
    zero3: bool = False
    """A model speed-up that applies under ZeRO-3 only."""


SPEEDUPS = (
    SpeedUp("liger", "model.kernels", "none", "liger-kernel's Triton RMSNorm, SwiGLU and RoPE (CUDA)"),
    SpeedUp("fp8", "model.precision", "bf16",
            "the linear layers' GEMMs in FP8: LoRA's frozen base weights, or every decoder projection (full)"),
    SpeedUp("fused_lora", "lora.fused", False,
            "each LoRA projection as one autograd function, base GEMM and adapter together"),
    SpeedUp("lora_dropout_kernel", "lora.dropout_kernel", "torch",
            "fused LoRA's dropout masks drawn from a seed inside Triton kernels, none kept (CUDA)"),
    SpeedUp("fused_mlp", "model.fused_mlp", False,
            "SwiGLU product and down projection in one function that keeps no product"),
    SpeedUp("tiled_mlp", "model.tiled_mlp", "off",
            "each MLP a tile of tokens at a time, forward and backward; no whole-row [tokens, intermediate] tensor"),
    SpeedUp("fused_loss", "model.fused_loss", False,
            "output layer and loss a chunk of rows at a time, logits never whole"),
    SpeedUp("flex_attention", "model.attn_implementation", "sdpa",
            "FlexAttention over a block mask of the packed samples and the sliding window, no S x S mask (CUDA)"),
    SpeedUp("layer_gather", "lora.zero3_layer_gather", False,
            "LoRA under ZeRO-3: each decoder layer's weights gathered and released in one go, not module by module",
            zero3=True),
    SpeedUp("shared_prompt", "train.share_prompt", "off",
            "a preference pair's prompt once per row, the rejected response attending to the chosen one's copy",
            data=True),
    SpeedUp("overflow_check", "optim.overflow_check", "deepspeed",
            "bf16 ZeRO-1/2 find a non-finite gradient by its norm alone, without DeepSpeed's per-tensor test", True),
)
"""Every speed-up, in the order apply and apply_engine apply them."""

NAMES = tuple(s.name for s in SPEEDUPS)


def apply(model, recipe: Recipe, ds_config: dict[str, Any]) -> list[str]:
    """Apply every model speed-up whose switch is on and which can run here, in SPEEDUPS' order; the names applied.
    Call it after build_model (LoRA in place) and before deepspeed.initialize, which registers ZeRO-3's hooks."""
    m, lora, stage = recipe.model, recipe.lora, zero_stage(ds_config)
    liger.check(m.kernels)  # an explicit `liger` that cannot run is an error, not a silent fallback
    lora_dropout.check(lora)
    applied = []
    if m.kernels != "none" and liger.available() is None and liger.install(model):
        applied.append("liger")
    if precision.of_recipe(recipe, bf16_enabled(ds_config)) == "fp8" and precision.install(model, lora.enabled, stage):
        applied.append("fp8")
    if lora.enabled and lora.fused and install_fused_lora(model, stage, lora.dropout_kernel):
        applied.append("fused_lora")
        if lora.dropout > 0 and lora_dropout.uses_kernels(lora.dropout_kernel):
            applied.append("lora_dropout_kernel")
    if m.fused_mlp and install_fused_mlp(model, stage, liger="liger" in applied):
        applied.append("fused_mlp")
    micro_batch_tokens = recipe.train.micro_batch_size * recipe.data.max_seq_len
    if tiled_mlp.wanted(m.tiled_mlp, recipe.data.max_seq_len) and tiled_mlp.install_tiled_mlp(model, stage,
                                                                                            micro_batch_tokens):
        applied.append("tiled_mlp")
    if m.fused_loss and recipe.train.objective == "sft":  # a preference objective needs each token's log-prob
        install_fused_loss(model)
        applied.append("fused_loss")
    if attention.resolve(m.attn_implementation, _device_type()) == "flex":
        attention.install(model)
        applied.append("flex_attention")
    if gathers_whole_layers(recipe, stage) and install_layer_gather(model):
        applied.append("layer_gather")
    return applied


def shares_prompts(recipe: Recipe) -> bool:
    """Whether a preference run lays each pair out with one copy of its prompt (train.share_prompt): only where
    zerotune's attention runs, the one that lets a continued document see the prompt before it."""
    t = recipe.train
    if t.objective == "sft" or t.share_prompt == "off":
        return False
    flex = attention.resolve(recipe.model.attn_implementation, _device_type()) == "flex"
    if t.share_prompt == "on" and not flex:
        raise ConfigError(f"train.share_prompt=on needs zerotune's attention, which model.attn_implementation="
                          f"{recipe.model.attn_implementation} does not run here: set model.attn_implementation=flex "
                          f"(auto is flex on a CUDA GPU), or train.share_prompt=auto")
    return flex


def _device_type() -> str:
    """Where the model will run: perf.apply sees it still on the CPU, before deepspeed.initialize moves it."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_engine(engine, recipe: Recipe) -> list[str]:
    """Apply the engine speed-ups whose switch is on and which apply to this engine; the names applied."""
    return ["overflow_check"] if install_overflow_check(engine, recipe.optim.overflow_check) else []


def report(recipe: Recipe, applied: list[str]) -> list[dict[str, Any]]:
    """One record per known speed-up: its name, its recipe switch and whether this run applied it."""
    unknown = sorted(set(applied) - set(NAMES))
    if unknown:
        raise ValueError(f"unknown speed-up(s) {unknown}: the known ones are {', '.join(NAMES)}")
    for s in SPEEDUPS:
        if s.name in applied and switch_value(recipe, s.switch) == s.off:
            raise ValueError(f"{s.name} reported as applied while {s.switch}={s.off!r} turns it off")
    return [{"name": s.name, "switch": s.switch, "on": s.name in applied} for s in SPEEDUPS]


def switch_value(recipe: Recipe, switch: str) -> Any:
    """The recipe's value of a switch key such as `model.fused_mlp`."""
    section, key = switch.split(".")
    return getattr(getattr(recipe, section), key)
