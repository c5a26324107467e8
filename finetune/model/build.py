"""Load Mistral from a local folder (or build it from config.json with seeded random weights), then checkpointing and LoRA.

    model, keepalive = build_model(recipe.model, recipe.lora, ds_config)
    applied = perf.apply(model, recipe, ds_config)   # the speed-ups are applied by finetune/perf, not here

Under ZeRO-3 the model is built inside `zero.Init` (through transformers' HfDeepSpeedConfig), so each rank
materialises only its own shard while loading: no rank ever holds the full model in RAM.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from finetune.config import ConfigError, LoraConfig, ModelConfig
from finetune.ds_config import bf16_enabled, zero_stage
from finetune.model import folder, init_weights
from finetune.model.recompute import marking

def check_model_dir(cfg: ModelConfig) -> dict[str, Any]:
    """Read config.json from model.path, or explain how to get one; returns the config as a dict."""
    if not os.path.isdir(cfg.path):
        raise ConfigError(
            f"model.path {cfg.path!r} does not exist. Download the weights first, e.g. "
            f"`huggingface-cli download mistralai/Mistral-7B-v0.1 --local-dir {cfg.path}` on a machine with network, "
            f"then run with model.path=/path/to/Mistral-7B-v0.1 (or try the tiny recipe: --config recipes/tiny.yaml)"
        )
    return folder.read_config(cfg.path)


def build_model(model_cfg: ModelConfig, lora_cfg: LoraConfig, ds_config: dict[str, Any]):
    """The model to hand to deepspeed.initialize (after finetune.perf.apply), and an object that must stay alive until
    then (ZeRO-3's HfDeepSpeedConfig). It is transformers' and peft's model as built: no speed-up is applied here."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from finetune.memory.estimate import recomputed_layers

    check_model_dir(model_cfg)
    dtype = torch.bfloat16 if bf16_enabled(ds_config) else torch.float32
    # transformers consults a global weak reference: while this object lives, from_pretrained/from_config run
    # under deepspeed.zero.Init and partition each layer as it is built.
    keepalive = HfDeepSpeedConfig(ds_config) if zero_stage(ds_config) == 3 else None
    config = AutoConfig.from_pretrained(model_cfg.path)
    config.use_cache = False
    apply_rope_scaling(config, model_cfg.rope_scaling)
    try:  # checked before loading: a wrong layer count must not cost a 7B load
        # offload recomputes every layer, as full does (it differs in where each layer's input waits)
        recomputed = recomputed_layers(model_cfg.activation_checkpointing, config.num_hidden_layers,
                                       model_cfg.recompute_layers)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if model_cfg.random_init or not folder.has_weights(model_cfg.path):
        torch.manual_seed(model_cfg.init_seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=library_attention(model_cfg))
        # transformers' draw depends on the stage (zero.Init draws module by module on rank 0): redrawn from the seed
        # and each parameter's name, the weights are the same on every stage and world size
        init_weights.initialize(model, model_cfg.init_seed)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            model_cfg.path, config=config, dtype=dtype, attn_implementation=library_attention(model_cfg)
        )
    if model_cfg.activation_checkpointing != "none":
        _enable_checkpointing(model, recomputed, offload=model_cfg.activation_checkpointing == "offload",
                              segment=model_cfg.recompute_segment, offload_layers=model_cfg.offload_layers)
    if lora_cfg.enabled:
        model = _apply_lora(model, lora_cfg, model_cfg.init_seed)
        if dtype != torch.float32:
            # peft creates the adapters in fp32. ZeRO-0/1/2 cast the module to bf16 in deepspeed.initialize; ZeRO-3
            # casts no parameter of a model built under zero.Init, so its adapters stayed fp32 and every adapted
            # projection upcast its input, at a fraction of ZeRO-2's speed
            # (docs/benchmarks/2026-11-30-2xh200-compare.md). The optimizer keeps its fp32 master copy either way.
            for p in model.parameters():
                if p.requires_grad and p.dtype == torch.float32:
                    p.data = p.data.to(dtype)
    return model, keepalive


def library_attention(cfg: ModelConfig) -> str:
    """The attention transformers builds the model with. zerotune's own (`flex`, and `auto`) is installed on the built
    model by finetune.perf.apply; until then the model runs transformers' sdpa."""
    return "sdpa" if cfg.attn_implementation in ("auto", "flex") else cfg.attn_implementation


def _enable_checkpointing(model, recomputed: list[int], offload: bool = False, segment: int | None = None,
                          offload_layers: int | None = None) -> None:
    """Recompute the decoder layers at these indices in backward; the others keep their activations. offload: each
    recomputed layer's input waits for backward in CPU memory (finetune/model/activation_offload.py), or only the
    first `offload_layers` of the inputs kept: the first layers' inputs wait longest, the last layers' are needed
    first. segment: keep the input of one recomputed layer in `segment` and rebuild the others'
    (finetune/model/two_level.py); the inputs kept are then the segments' first layers'.

    Non-reentrant checkpointing works with frozen LoRA bases and ZeRO-3's parameter hooks. transformers >= 5.20
    names it activation_checkpointing_enable; older 5.x only has gradient_checkpointing_enable. Both set the flag on
    every layer, which is then cleared on the layers that keep their activations.
    """
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    chosen = set(recomputed)
    offloaded = (offload_layers or len(recomputed)) if offload else 0  # kept inputs in CPU memory, the first ones
    two_level, to_host = {}, set()
    if segment:  # the segments' first layers keep the inputs
        from finetune.model.two_level import segment_checkpoints

        plain = model.model.layers[0]._gradient_checkpointing_func
        two_level = segment_checkpoints(recomputed, segment, marking(plain), offloaded)
    else:  # every recomputed layer keeps its input
        to_host = set(sorted(chosen)[:offloaded])
    for i, layer in enumerate(model.model.layers):
        layer.gradient_checkpointing = i in chosen
        checkpoint = layer._gradient_checkpointing_func
        if i in to_host:
            from finetune.model.activation_offload import offloading_checkpoint

            checkpoint = offloading_checkpoint
        # Parts of the layer (the tiled MLP) skip work that the recomputation does not need (finetune/model/recompute.py).
        layer._gradient_checkpointing_func = two_level.get(i) or marking(checkpoint)


def apply_rope_scaling(config, rope_scaling: dict[str, Any] | None) -> None:
    """Set model.rope_scaling on a loaded config as transformers 5.x takes it: config.rope_parameters holds rope_type,
    its fields and the model's rope_theta (kept unless the recipe names one). The pretraining length becomes
    original_max_position_embeddings where the type reads it, and max_position_embeddings grows by the factor for the
    types that interpolate (dynamic scales against max_position_embeddings itself, so it is left)."""
    if not rope_scaling:
        return
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_scaling)
    rope_type = params.pop("type", None) or params.get("rope_type")
    valid = ", ".join(sorted(ROPE_INIT_FUNCTIONS))
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ConfigError(f"model.rope_scaling.rope_type = {rope_type!r} is not one of: {valid} "
                          f"(e.g. model.rope_scaling={{rope_type: yarn, factor: 4.0}})")
    params["rope_type"] = rope_type
    current = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", current.get("rope_theta", getattr(config, "rope_theta", None)))
    original = config.max_position_embeddings
    if rope_type in ("yarn", "longrope", "llama3"):
        params.setdefault("original_max_position_embeddings", original)
    config.rope_parameters = params
    try:
        config.validate_rope()
    except (KeyError, ValueError) as e:
        message = e.args[0] if e.args else str(e)
        raise ConfigError(f"model.rope_scaling for rope_type {rope_type!r}: {message} (set them in "
                          f"model.rope_scaling; the types are {valid})") from None
    factor = params.get("factor")
    if rope_type != "dynamic" and isinstance(factor, (int, float)) and factor > 1:
        config.max_position_embeddings = max(original, int(params.get("original_max_position_embeddings", original)
                                                           * factor))


def _apply_lora(model, cfg: LoraConfig, seed: int):
    # peft is slow to import and only LoRA runs need it
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(seed + 1)  # the adapters' init must not depend on how much RNG loading consumed
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )
    return get_peft_model(model, peft_cfg)


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts; correct under ZeRO-3, where a partitioned parameter reports ds_numel."""
    trainable = total = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def resident_parameter_elements(model) -> int:
    """Parameter elements this rank holds in memory right now (its ZeRO-3 partitions, or full tensors)."""
    count = 0
    for p in model.parameters():
        shard = getattr(p, "ds_tensor", None)
        count += shard.numel() if shard is not None else p.data.numel()
    return count
