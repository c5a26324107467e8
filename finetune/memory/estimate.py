"""Per-GPU memory of a fine-tune before running it: model states per ZeRO stage, activations, and the fastest fit.

    zerotune estimate --config recipes/mistral7b_lora.yaml --deepspeed ds_configs/zero3.json --gpus 2 --gpu-memory-gib 141

Model states follow the ZeRO paper for mixed-precision Adam: per trained parameter 2 bytes of bf16 weight, 2 of gradient
and 12 of optimizer state (fp32 master 4, Adam m and v 8); frozen (LoRA base) parameters cost their weight only.
ZeRO-1 splits the optimizer states over the N data-parallel ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights.
Activations are what autograd saves for backward in transformers' Mistral (bf16, sdpa), counted tensor by tensor and
checked against torch's saved-tensor hooks in tests/integration/test_estimate.py.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from finetune import shipped

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
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
FIT_FRACTION = 0.9  # the rest of the GPU goes to the CUDA context, NCCL buffers and allocator fragmentation


def _dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, q width, kv width, layers, vocab) of a Mistral config.json."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    return h, cfg["intermediate_size"], heads * head_dim, kv * head_dim, cfg["num_hidden_layers"], cfg["vocab_size"]


def linear_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one decoder layer, and of lm_head."""
    h, i, q, kv, _, vocab = _dims(cfg)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "lm_head": (h, vocab)}


def count_parameters(cfg: dict[str, Any]) -> int:
    """Exact parameter count: embeddings, GQA attention, SwiGLU MLP, RMSNorms, lm_head (unless tied)."""
    h, _, _, _, layers, vocab = _dims(cfg)
    shapes = linear_shapes(cfg)
    per_layer = sum(a * b for name, (a, b) in shapes.items() if name != "lm_head") + 2 * h  # + two RMSNorm weights
    head = 0 if cfg.get("tie_word_embeddings", False) else h * vocab
    return vocab * h + layers * per_layer + h + head


def _lora(lora_cfg: Any) -> dict[str, Any] | None:
    """The LoRA settings as a dict (from LoraConfig or a dict), or None for full fine-tuning."""
    if lora_cfg is None:
        return None
    d = dataclasses.asdict(lora_cfg) if dataclasses.is_dataclass(lora_cfg) else dict(lora_cfg)
    if not d.get("enabled", True):
        return None
    targets = list(d.get("target_modules") or [])
    if not targets or not set(targets) <= set(LORA_TARGETS):
        raise ValueError(f"lora.target_modules {targets!r}: the estimator knows {', '.join(LORA_TARGETS)}")
    # lazy: finetune.perf imports torch, which `zerotune estimate` and `compare` otherwise do without
    import torch

    from finetune.perf.lora_dropout import uses_kernels

    # lora.dropout_kernel resolved as a run on this machine's GPU resolves it, or, without one, on a recent NVIDIA GPU:
    # these are estimates of GPU memory
    seeded = uses_kernels(d.get("dropout_kernel", "auto"), cuda=None if torch.cuda.is_available() else True)
    return {"rank": int(d["rank"]), "targets": targets, "dropout": float(d.get("dropout", 0.0)),
            "fused": bool(d.get("fused", False)), "seeded_dropout": seeded}


def lora_parameters(cfg: dict[str, Any], lora_cfg: Any) -> int:
    """Adapter parameters: rank x (in + out) for every targeted projection of every layer (A is r x in, B is out x r)."""
    lora = _lora(lora_cfg)
    if lora is None:
        return 0
    shapes, layers = linear_shapes(cfg), cfg["num_hidden_layers"]
    return sum(lora["rank"] * sum(shapes[t]) * (1 if t == "lm_head" else layers) for t in lora["targets"])


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def estimate_model_states(config_dict: dict[str, Any], lora_cfg: Any, stage: int, world: int,
                          offload_optimizer: bool = False, offload_params: bool = False,
                          dtype_bytes: int = 2, adapter_dtype_bytes: int | None = None) -> dict[str, int]:
    """Bytes per rank of weights, gradients and optimizer states on the GPU, and what offloading puts in CPU memory.

    dtype_bytes is the weights' width: 2 for bf16; 4 for fp32 (zerotune's ZeRO-0, whose bf16 is torch autocast).
    adapter_dtype_bytes is the LoRA adapters' width when it differs (fp32 under ZeRO-3, see adapter_bytes).
    Under ZeRO-1/2/3 DeepSpeed keeps a separate fp32 master partition even for fp32 weights (its ZeRO optimizers
    always build one); plain data parallelism (ZeRO-0) steps fp32 weights in place.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if offload_optimizer and stage == 0:
        raise ValueError("optimizer offload needs ZeRO-1, 2 or 3")
    if offload_params and (stage != 3 or not offload_optimizer):
        raise ValueError("parameter offload needs ZeRO-3 with optimizer offload")
    total = count_parameters(config_dict)
    lora = _lora(lora_cfg) is not None
    trained = lora_parameters(config_dict, lora_cfg) if lora else total
    frozen = total if lora else 0  # LoRA adds adapters on top of the frozen base
    trained_bytes = (adapter_dtype_bytes or dtype_bytes) if lora else dtype_bytes
    n = max(1, world)
    weights = dtype_bytes * frozen + trained_bytes * trained
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


def _layer_bytes(cfg: dict[str, Any], lora: dict[str, Any] | None, seq_len: int, d: int, attn: str, packing: bool,
                 mask_bytes: int, ad: int, first: bool = False, liger: bool = False, fused_mlp: bool = False) -> float:
    """Bytes autograd saves per token in one decoder layer (transformers' Mistral, traced with saved-tensor hooks).

    liger (model.kernels): liger-kernel's RMSNorm saves its 16-bit input and rstd (transformers' keeps an fp32 copy
    and the normalised x), its SwiGLU saves gate and up (transformers' also silu(gate)); from liger's autograd code.
    fused_mlp (finetune/perf/fused_mlp.py): the MLP keeps gate and up only, where down_proj is not LoRA-adapted.
    """
    h, i, q, kv, _, _ = _dims(cfg)
    heads = cfg["num_attention_heads"]
    shapes = linear_shapes(cfg)
    fused = lora is not None and lora["fused"] and ad == d  # finetune/perf/fused_lora.py; mixed dtypes run peft's forward
    masked = attn != "sdpa" or packing  # with a mask, transformers repeats k/v to every head before attention
    kv_saved = q if masked else kv
    if attn == "sdpa":
        # q, k, v after RoPE, the output (also o_proj's input), fp32 log-sum-exp; a packed batch's block-diagonal
        # mask is materialised per layer in the activations' dtype.
        attention = d * (2 * q + 2 * kv_saved) + 4 * heads + (d * seq_len if packing else 0)
    else:
        # eager: q, k, v, the fp32 softmax plus its 16-bit copy for every (query, key) pair, and o_proj's input when
        # something keeps it (a trained o_proj, or its adapter without dropout).
        keeps_out = lora is None or ("o_proj" in lora["targets"] and (lora["dropout"] == 0 or fused))
        attention = d * (q + 2 * kv_saved + (q if keeps_out else 0)) + heads * seq_len * (4 + d)
    norm_full = 4 * h + 4 + 2 * d * h  # fp32 input, rstd, normalised x (weight grad), output (projections' input)
    if liger:
        norm_full = 2 * d * h + 4  # input, rstd, output (the projections' input)
    if lora is None:  # gate, up, silu(gate), product (down's input)
        return 2 * norm_full + attention + (2 if fused_mlp else 3 if liger else 4) * d * i
    norm = d * h + 4 if liger else 4 * h + 4  # frozen weights: neither the normalised x nor the projections' input
    mlp = (2 if liger or fused_mlp else 3) * d * i  # silu(gate)'s input, and both factors of the product
    adapters = 0.0
    shared = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "gate_proj": "mlp_in", "up_proj": "mlp_in",
              "o_proj": "attn_out", "down_proj": "down_in"}
    inputs_saved = set()
    for t in lora["targets"]:
        if t == "lm_head":
            continue
        width = shapes[t][0]
        adapters += ad * lora["rank"]  # lora_A's output, saved by lora_B
        if fused or (lora["dropout"] == 0 and ad == d):
            # x itself is kept, once per distinct input (attention keeps o_proj's); the fused function adds a bool
            # mask per adapter (native_dropout's), or only a seed with the Triton dropout (finetune/perf/lora_dropout.py)
            adapters += width if lora["dropout"] > 0 and not (fused and lora["seeded_dropout"]) else 0
            if shared[t] not in inputs_saved and shared[t] != "attn_out":
                inputs_saved.add(shared[t])
                adapters += d * width
        elif lora["dropout"] > 0:
            # each adapter drops its own copy of the input: lora_A keeps it, dropout keeps the mask (none is needed
            # in the first layer, where nothing upstream is trained)
            no_mask = first and shared[t] == "attn_in"
            adapters += ad * width + (0 if no_mask else mask_bytes * width)
        else:  # peft casts the input to the adapters' dtype, a copy per adapter
            adapters += ad * width
    norms = norm if first else 2 * norm  # the first layer's input norm: its input (the frozen embedding) needs no grad
    return norms + attention + mlp + adapters


def recomputed_layers(checkpointing: str, layers: int, recompute_layers: int | None = None) -> list[int]:
    """The decoder layers recomputed in backward: none; all (full); `recompute_layers` of them spread evenly, layer 0
    first (selective; null = every second one: 0, 2, 4...)."""
    if checkpointing not in ("none", "selective", "full"):
        raise ValueError(f"checkpointing must be none, selective or full, got {checkpointing!r}")
    if checkpointing != "selective":
        return list(range(layers)) if checkpointing == "full" else []
    if recompute_layers is None:
        return list(range(0, layers, 2))
    if not 0 < recompute_layers <= layers:
        raise ValueError(f"model.recompute_layers={recompute_layers}: the model has {layers} decoder layers, so "
                         f"selective checkpointing recomputes 1 to {layers} of them")
    return [j * layers // recompute_layers for j in range(recompute_layers)]


def estimate_activations(config_dict: dict[str, Any], lora_cfg: Any, seq_len: int, micro_batch: int,
                         checkpointing: str = "full", dtype_bytes: int = 2, attn_implementation: str = "sdpa",
                         packing: bool = True, dropout_mask_bytes: int = 1,
                         adapter_dtype_bytes: int | None = None, fused_loss: bool = False,
                         liger: bool = False, recompute_layers: int | None = None,
                         fused_mlp: bool = False) -> dict[str, float]:
    """Activation bytes of one micro-batch (rows of seq_len tokens) per GPU, at the peak of backward.

    checkpointing: none keeps every layer's activations; full keeps each layer's input and recomputes one layer at a
    time in backward; selective recomputes `recompute_layers` of them (recomputed_layers). The loss adds the 16-bit
    logits kept by the training loop, their fp32 copy and the fp32 log-softmax (10 bytes per vocabulary entry per token
    in bf16).
    dropout_mask_bytes: CUDA's dropout keeps a bool mask; the CPU kernel keeps one in the input's dtype.
    adapter_dtype_bytes: the LoRA adapters' width when it differs from the activations' (fp32 under ZeRO-0's autocast).
    fused_loss (finetune/perf/fused_loss.py): one chunk of rows' logits at a time; the gradients of the head's input (and of its
    weight, when trained: an fp32 sum while it is built) are computed in forward and held until backward.
    fused_mlp (finetune/perf/fused_mlp.py): each MLP keeps gate and up, not their product, which backward rebuilds one
    layer at a time. It applies where down_proj is a plain linear layer, not LoRA-adapted.
    """
    lora = _lora(lora_cfg)
    fused_mlp = fused_mlp and (lora is None or "down_proj" not in lora["targets"])
    h, _, q, _, layers, vocab = _dims(config_dict)
    tokens = seq_len * micro_batch
    d = dtype_bytes
    layer_args = (config_dict, lora, seq_len, d, attn_implementation, packing, dropout_mask_bytes, adapter_dtype_bytes or d)
    per_layer = _layer_bytes(*layer_args, liger=liger, fused_mlp=fused_mlp)
    first = _layer_bytes(*layer_args, first=True, liger=liger, fused_mlp=fused_mlp) if lora is not None else per_layer
    recomputed = len(recomputed_layers(checkpointing, layers, recompute_layers))  # layer 0 among them, if any
    kept = layers - recomputed
    if lora is not None and checkpointing == "none":
        saved_layers = first + (layers - 1) * per_layer
    else:
        saved_layers = kept * per_layer + recomputed * d * h  # a checkpointed layer keeps only its input
    recompute = per_layer if recomputed else 0.0  # one layer's activations rebuilt at a time in backward
    recompute += d * _dims(config_dict)[1] if fused_mlp else 0  # and one layer's MLP product
    rope = 2 * d * (q // config_dict["num_attention_heads"])  # cos and sin, shared by every layer
    lm_head_trained = lora is None or "lm_head" in lora["targets"]
    final_norm = 4 * h + 4 + (2 * d * h if lm_head_trained and not fused_loss else 0)
    ids = 8 if lora is None else 0  # the embedding's backward needs the token ids
    if fused_loss:
        from finetune.perf.fused_loss import CHUNK_ROWS  # lazy: that module imports torch (see _lora)

        head = vocab * h if lm_head_trained else 0
        loss_saved = tokens * d * h + d * head  # the head's input and weight gradients
        loss_transient = min(tokens, CHUNK_ROWS) * vocab * (8 + d) + 4 * head  # a chunk's fp32 logits, softmax, 16-bit grad
    else:
        loss_saved = tokens * 4 * vocab  # fp32 log-softmax, kept for backward
        loss_transient = tokens * (d + 4) * vocab  # the 16-bit logits held by the loop and their fp32 copy
    out = {
        "layers": tokens * saved_layers,
        "recompute": tokens * recompute,
        "other": tokens * (rope + final_norm + ids),
        "logits": loss_saved + loss_transient,
    }
    out["saved"] = out["layers"] + out["other"] + loss_saved  # what autograd holds after forward
    out["total"] = out["layers"] + out["recompute"] + out["other"] + out["logits"]
    return out


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


def precision_bytes(ds: dict[str, Any], stage: int) -> tuple[int, int, int]:
    """(weight, activation, LoRA adapter) bytes under a DeepSpeed JSON.

    bf16 weights, except zerotune's ZeRO-0 whose bf16 is torch autocast over fp32 weights (DeepSpeed's bf16 at stage 0
    accumulates gradients in bf16, which zerotune refuses). LoRA adapters follow the weights (finetune/model.py casts
    them under ZeRO-3, where DeepSpeed would leave peft's fp32).
    """
    bf16 = ds.get("bf16", {}).get("enabled") is True or ds.get("torch_autocast", {}).get("enabled") is True
    if not bf16:
        return 4, 4, 4
    return (4, 2, 4) if stage == 0 else (2, 2, 2)


def estimate_run(model_config: dict[str, Any], recipe, ds: dict[str, Any], world: int) -> dict[str, Any]:
    """Every term for one resolved DeepSpeed config, in bytes per GPU (cpu: per rank)."""
    zero = ds.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") in ("cpu", "nvme")
    offload_params = zero.get("offload_param", {}).get("device", "none") in ("cpu", "nvme")
    weight_bytes, act_bytes, adapter_bytes = precision_bytes(ds, stage)
    lora = recipe.lora if recipe.lora.enabled else None
    states = estimate_model_states(model_config, lora, stage, world, offload_optimizer, offload_params, weight_bytes,
                                   adapter_bytes)
    acts = estimate_activations(model_config, lora, recipe.data.max_seq_len, recipe.train.micro_batch_size,
                                recipe.model.activation_checkpointing, act_bytes,
                                "sdpa" if recipe.model.attn_implementation in ("auto", "flex") else recipe.model.attn_implementation,
                                recipe.data.packing, adapter_dtype_bytes=adapter_bytes,
                                fused_loss=recipe.model.fused_loss, liger=uses_liger(recipe.model.kernels),
                                recompute_layers=recipe.model.recompute_layers, fused_mlp=recipe.model.fused_mlp)
    buffers = estimate_buffers(model_config, ds, stage, weight_bytes)
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
            "activations": acts["total"], "buffers": buffers, "step": step, "init": at_init,
            "total": max(backward, at_step, at_init), "cpu": states["cpu"] + cpu_at_init,
            "parameters": states["parameters"], "trained_parameters": states["trained_parameters"]}


def uses_liger(kernels: str) -> bool:
    """Whether a run with this model.kernels uses liger's modules: `auto` only where they can run (CUDA + installed)."""
    from finetune.perf import liger as fused_kernels  # lazy: finetune.perf imports torch (see _lora)

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
