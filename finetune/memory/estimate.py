"""Per-GPU memory of a fine-tune before running it: model states per ZeRO stage, activations, and the fastest fit.

    zerotune estimate --config recipes/mistral7b_lora.yaml --deepspeed ds_configs/zero3.json --gpus 2 --gpu-memory-gib 141

Model states follow the ZeRO paper for mixed-precision Adam: per trained parameter 2 bytes of bf16 weight, 2 of gradient
and 12 of optimizer state (fp32 master 4, Adam m and v 8); frozen (LoRA base) parameters cost their weight only.
ZeRO-1 splits the optimizer states over the N data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights.
Activations (finetune/memory/activations.py) are what autograd saves for backward in transformers' Mistral, counted
tensor by tensor at any sequence length (attention implementation, tiled MLP, checkpointing with CPU offload, sequence
parallelism), plus backward's transient working set; checked against torch's saved-tensor hooks in
tests/unit/test_estimate.py. Calibration constants: finetune/memory/calibration.py.
"""

from __future__ import annotations

import os
from typing import Any

from finetune import shipped
from finetune.memory.activations import (attention_kind, estimate_activations, recomputed_layers,  # noqa: F401
                                         tiled_mlp_on)
from finetune.memory.calibration import FIT_FRACTION  # noqa: F401  (the planner's and `zerotune estimate`'s)
from finetune.memory.shapes import (LORA_TARGETS, count_parameters, dims, linear_shapes, lora_parameters,  # noqa: F401
                                    lora_settings)

GIB = 2**30
# The shipped DeepSpeed JSONs by (stage, offload optimizer, offload parameters), fastest first. ZeRO-2 reduces bf16
# gradients in buckets overlapped with backward; ZeRO-1 reduces the same bytes after backward; zerotune's ZeRO-0
# all-reduces fp32 gradients (autocast keeps fp32 weights), twice the bytes; ZeRO-3 adds weight all-gathers.
# `zerotune compare` ran Mistral-7B's shape in this order, ZeRO-1 and ZeRO-2 within noise of each other
# (docs/benchmarks/2026-11-30-2xh200-compare.md). Offloading runs Adam on the CPU over the whole partition every step
# (seconds for a 7B model); offloading the parameters too adds their CPU->GPU copies to every forward and backward.
# zero3_nvme.json is not here: it needs a disk (train.nvme_path) and is the slowest; estimate it with --deepspeed.
SHIPPED = {
    (2, False, False): "zero2.json",
    (1, False, False): "zero1.json",
    (0, False, False): "zero0.json",
    (3, False, False): "zero3.json",
    (2, True, False): "zero2_offload.json",
    (3, True, False): "zero3_offload_optimizer.json",
    (3, True, True): "zero3_offload.json",
}
SPEED_ORDER = list(SHIPPED)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def estimate_model_states(config_dict: dict[str, Any], lora_cfg: Any, stage: int, world: int,
                          offload_optimizer: bool = False, offload_params: bool = False,
                          dtype_bytes: int = 2, adapter_dtype_bytes: int | None = None,
                          fp8_base: bool = False) -> dict[str, int]:
    """Bytes per rank of weights, gradients and optimizer states on the GPU, and what offloading puts in CPU memory.

    dtype_bytes is the weights' width: 2 for bf16; 4 for fp32 (zerotune's ZeRO-0, whose bf16 is torch autocast).
    adapter_dtype_bytes is the LoRA adapters' width when it differs (fp32 under ZeRO-3, see adapter_bytes).
    Under ZeRO-1/2/3 DeepSpeed keeps a separate fp32 master partition even for fp32 weights (its ZeRO optimizers
    always build one); plain data parallelism (ZeRO-0) steps fp32 weights in place.
    fp8_base (LoRA, model.precision=fp8, ZeRO-0/1/2): each adapted projection's frozen weight is kept as 1 byte per
    element and one fp32 scale per output row instead of its bf16 copy (finetune/perf/precision.py).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload_optimizer and stage == 0:
        raise ValueError("optimizer offload needs ZeRO-1, 2 or 3")
    if offload_params and (stage != 3 or not offload_optimizer):
        raise ValueError("parameter offload needs ZeRO-3 with optimizer offload")
    total = count_parameters(config_dict)
    lora = lora_settings(lora_cfg) is not None
    trained = lora_parameters(config_dict, lora_cfg) if lora else total
    frozen = total if lora else 0  # LoRA adds adapters on top of the frozen base
    trained_bytes = (adapter_dtype_bytes or dtype_bytes) if lora else dtype_bytes
    n = max(1, world)
    weights = dtype_bytes * frozen + trained_bytes * trained
    if lora and fp8_base and stage < 3:
        shapes, layers = linear_shapes(config_dict), dims(config_dict)[4]
        targets = [shapes[t] for t in lora_settings(lora_cfg)["targets"]]
        weights -= layers * sum((dtype_bytes - 1) * a * b - 4 * b for a, b in targets)
    params = _ceil_div(weights, n) if stage == 3 else weights
    grads = _ceil_div(trained_bytes * trained, n) if stage >= 2 else trained_bytes * trained
    master = 4 * trained if (stage >= 1 or trained_bytes < 4) else 0
    optimizer = master + 8 * trained  # + Adam's exp_avg and exp_avg_sq, fp32
    optimizer = _ceil_div(optimizer, n) if stage >= 1 else optimizer
    cpu = 0
    if offload_optimizer:
        # The fp32 master and Adam step on the CPU; the gradient partition is copied there in fp32. Under ZeRO-2/3 the
        # GPU keeps only the reduce buckets (counted in buffers), under ZeRO-1 the full 16-bit gradients.
        cpu = optimizer + _ceil_div(4 * trained, n)
        optimizer = 0
        grads = grads if stage == 1 else 0
    if offload_params:
        cpu, params = cpu + params, 0
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer, "cpu": cpu,
            "parameters": trained + frozen, "trained_parameters": trained}


def estimate_buffers(config_dict: dict[str, Any], ds: dict[str, Any], stage: int, dtype_bytes: int) -> int:
    """DeepSpeed's working buffers: gradient reduce buckets (ZeRO-1/2/3) and, under ZeRO-3, the gathered weights of the
    module being computed plus the prefetched next one."""
    zero = ds.get("zero_optimization", {})
    h = config_dict["hidden_size"]
    if stage == 0:
        return 0
    bucket = zero.get("reduce_bucket_size", 5e8)
    bucket = h * h if bucket == "auto" else int(bucket)
    overlap = zero.get("overlap_comm", stage == 3)  # DeepSpeed's default: on for ZeRO-3 only; it doubles the bucket
    buffers = bucket * dtype_bytes * (2 if overlap else 1)
    if stage == 3:
        shapes = linear_shapes(config_dict)
        layer = sum(a * b for n, (a, b) in shapes.items() if n != "lm_head")
        buffers += 2 * max(layer, h * config_dict["vocab_size"]) * dtype_bytes
    return buffers


def fp8_buffers(config_dict: dict[str, Any], recipe, stage: int, fp8: bool) -> int:
    """What FP8 GEMMs add while a layer computes, where a weight is quantized at each use (LoRA under ZeRO-3, full
    fine-tuning under any stage): the computing layer's weights at a byte each, and in backward a transposed copy
    (a bound: each projection's copies are freed after its GEMM). LoRA under ZeRO-0/1/2 keeps its FP8 base copy in
    the model states instead (estimate_model_states)."""
    if not fp8 or (recipe.lora.enabled and stage < 3):
        return 0
    layer = sum(a * b for n, (a, b) in linear_shapes(config_dict).items() if n != "lm_head")
    return 2 * layer


def precision_bytes(ds: dict[str, Any], stage: int) -> tuple[int, int, int]:
    """(weight, activation, LoRA adapter) bytes under a DeepSpeed JSON.

    bf16 weights, except zerotune's ZeRO-0 whose bf16 is torch autocast over fp32 weights (DeepSpeed's bf16 at stage 0
    accumulates gradients in bf16, which zerotune refuses). LoRA adapters follow the weights (finetune/model/build.py casts
    them under ZeRO-3, where DeepSpeed would leave peft's fp32).
    """
    bf16 = ds.get("bf16", {}).get("enabled") is True or ds.get("torch_autocast", {}).get("enabled") is True
    if not bf16:
        return 4, 4, 4
    return (4, 2, 4) if stage == 0 else (2, 2, 2)


def sequence_parallel_degree(recipe) -> int:
    """train.sequence_parallel as an estimate takes it: `auto` (not planned) is 1."""
    sp = recipe.train.sequence_parallel
    return sp if isinstance(sp, int) else 1


def estimate_run(model_config: dict[str, Any], recipe, ds: dict[str, Any], world: int,
                 cuda: bool | None = None) -> dict[str, Any]:
    """Every term for one resolved DeepSpeed config, in bytes per GPU (cpu: per rank).

    cuda: whether the run is on CUDA, which resolves model.attn_implementation `auto` (flex there, sdpa elsewhere);
    None = this machine. ZeRO partitions over the whole world also under sequence parallelism (DeepSpeed's
    sequence-data-parallel group); activations are per rank's share of each row.
    """
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    offload_params = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
    weight_bytes, act_bytes, adapter_bytes = precision_bytes(ds, stage)
    lora = recipe.lora if recipe.lora.enabled else None
    from finetune.perf import precision  # lazy, as uses_liger's import

    fp8 = precision.of_recipe(recipe, weight_bytes == 2) == "fp8"
    states = estimate_model_states(model_config, lora, stage, world, offload_optimizer, offload_params, weight_bytes,
                                   adapter_bytes, fp8_base=fp8)
    m, seq_len = recipe.model, recipe.data.max_seq_len
    attn, sp = attention_kind(m.attn_implementation, cuda), sequence_parallel_degree(recipe)
    tiled = tiled_mlp_on(m.tiled_mlp, seq_len)
    acts = estimate_activations(model_config, lora, seq_len, recipe.train.micro_batch_size, m.activation_checkpointing,
                                act_bytes, attn, recipe.data.packing, adapter_dtype_bytes=adapter_bytes,
                                # a preference objective keeps the whole logits (each token's log-prob; perf.apply)
                                fused_loss=m.fused_loss and recipe.train.objective == "sft",
                                liger=uses_liger(m.kernels), recompute_layers=m.recompute_layers,
                                fused_mlp=m.fused_mlp, tiled_mlp=tiled, sequence_parallel=sp,
                                recompute_segment=m.recompute_segment, offload_layers=m.offload_layers)
    buffers = estimate_buffers(model_config, ds, stage, weight_bytes) + fp8_buffers(model_config, recipe, stage, fp8)
    trained_bytes = adapter_bytes if lora is not None else weight_bytes
    step = step_gradients(states, stage, world, trained_bytes, offload_optimizer, zero.get("sub_group_size", 10**9))
    # Activations live in backward, the step's gradient copies after it: the peak is the larger of the two moments,
    # or of the engine's start (init_transients).
    backward = states["total"] + acts["total"] + buffers
    at_step = states["params"] + states["optimizer"] + buffers + step
    at_init, cpu_at_init = init_transients(states, stage, world, trained_bytes, offload_optimizer)
    return {"config": config_label(stage, offload_optimizer, offload_params, zero), "stage": stage,
            "offload_optimizer": offload_optimizer, "offload_params": offload_params,
            "params": states["params"], "grads": states["grads"], "optimizer": states["optimizer"],
            "activations": acts["kept"], "transient": acts["transient"], "buffers": buffers, "step": step,
            "init": at_init, "backward": backward, "total": max(backward, at_step, at_init),
            "cpu": states["cpu"] + cpu_at_init + acts["cpu"], "cpu_states": states["cpu"] + cpu_at_init,
            "cpu_activations": acts["cpu"], "parameters": states["parameters"],
            "trained_parameters": states["trained_parameters"],
            "seq_len": seq_len, "micro_batch_size": recipe.train.micro_batch_size, "attention": attn,
            "tiled_mlp": tiled, "sequence_parallel": sp, "activation_checkpointing": m.activation_checkpointing,
            "terms": {k: acts[k] for k in ("layers", "other", "logits", "layer_backward", "attention_backward",
                                           "mlp_tile", "loss_chunk")}}


def uses_liger(kernels: str) -> bool:
    """Whether a run with this model.kernels uses liger's modules: `auto` only where they can run (CUDA + installed)."""
    from finetune.perf import liger as fused_kernels  # lazy: finetune.perf imports torch (see shapes.lora_settings)

    return kernels == "liger" or (kernels == "auto" and fused_kernels.available() is None)


def init_transients(states: dict[str, int], stage: int, world: int, trained_bytes: int, offload: bool) -> tuple[int, int]:
    """(GPU bytes at the engine's start, extra CPU bytes then): what deepspeed.initialize holds for a moment.

    ZeRO-1/2 clone the 16-bit partition on the GPU before casting it to the fp32 master: with offload, the weights
    plus that clone are the GPU's peak (twice the 16-bit weights, on one GPU). Offloading also builds the fp32
    master in ordinary memory before copying it into pinned memory: 4 more bytes per trained parameter for a moment.
    A full 7B fine-tune died at each of them (docs/benchmarks/2026-11-30-h200-budget.md).
    """
    partition = -(-states["trained_parameters"] // max(1, world))
    gpu = 0
    if stage in (1, 2):
        gpu = states["params"] + trained_bytes * partition + (0 if offload else 4 * partition)
    return gpu, (4 * partition if offload else 0)


def config_label(stage: int, offload_optimizer: bool, offload_params: bool, zero: dict[str, Any]) -> str:
    """"ZeRO-3 + offload opt+params" and the like; NVMe instead of offload when that is where states go."""
    if not offload_optimizer:
        return f"ZeRO-{stage}"
    nvme = zero.get("offload_optimizer", {}).get("device") == "nvme"
    return f"ZeRO-{stage} + {'NVMe' if nvme else 'offload'} opt" + ("+params" if offload_params else "")


def step_gradients(states: dict[str, int], stage: int, world: int, trained_bytes: int, offload: bool,
                   sub_group_size: int) -> int:
    """Gradient bytes on the GPU during DeepSpeed's optimizer step.

    ZeRO-1/2 flatten the 16-bit gradient partition and cast it to fp32 for the step: partition, flat copy and fp32
    copy (a full fine-tune peaks here, not in backward: docs/benchmarks/2026-11-30-2xh200-compare.md). ZeRO-3 does
    the same one sub-group (sub_group_size elements) at a time; ZeRO-0's torch AdamW steps the fp32 gradients in place.
    """
    partition = -(-states["trained_parameters"] // max(1, world))
    if offload:  # the fp32 partition is on the CPU
        return states["grads"]
    if stage in (1, 2):
        return (2 * trained_bytes + 4) * partition
    if stage == 3:
        return states["grads"] + (trained_bytes + 4) * min(partition, int(sub_group_size))
    return states["grads"]


def shipped_dir() -> str:
    """The folder of the shipped DeepSpeed JSONs (finetune/shipped.py finds it in a checkout or an install)."""
    return os.path.join(shipped.ROOT, "ds_configs")


def display_path(path: str) -> str:
    """A path relative to the working directory when it lies below it; else a shipped file as ds_configs/<name>.json,
    which --deepspeed finds from any folder; else the absolute path."""
    rel = os.path.relpath(os.path.abspath(path))
    if not rel.startswith(".."):
        return rel
    return shipped.shipped_name(path) or os.path.abspath(path)
