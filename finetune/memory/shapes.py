"""A Mistral config.json's shapes as the memory estimator needs them: widths, parameter counts, LoRA's adapters.

    h, i, q, kv, layers, vocab = dims(config)      # hidden, intermediate, q width, kv width, layers, vocabulary
"""

from __future__ import annotations

import dataclasses
from typing import Any

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def dims(cfg: dict[str, Any]) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, q width, kv width, layers, vocab) of a Mistral config.json."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    return h, cfg["intermediate_size"], heads * head_dim, kv * head_dim, cfg["num_hidden_layers"], cfg["vocab_size"]


def heads(cfg: dict[str, Any]) -> tuple[int, int]:
    """(query heads, key/value heads)."""
    return cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]


def linear_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one decoder layer, and of lm_head."""
    h, i, q, kv, _, vocab = dims(cfg)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h), "lm_head": (h, vocab)}


def layer_parameters(cfg: dict[str, Any]) -> int:
    """One decoder layer's weights: its seven projections and two RMSNorm weights."""
    return sum(a * b for name, (a, b) in linear_shapes(cfg).items() if name != "lm_head") + 2 * dims(cfg)[0]


def count_parameters(cfg: dict[str, Any]) -> int:
    """Exact parameter count: embeddings, GQA attention, SwiGLU MLP, RMSNorms, lm_head (unless tied)."""
    h, _, _, _, layers, vocab = dims(cfg)
    head = 0 if cfg.get("tie_word_embeddings", False) else h * vocab
    return vocab * h + layers * layer_parameters(cfg) + h + head


def lora_settings(lora_cfg: Any) -> dict[str, Any] | None:
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
    lora = lora_settings(lora_cfg)
    if lora is None:
        return 0
    shapes, layers = linear_shapes(cfg), cfg["num_hidden_layers"]
    return sum(lora["rank"] * sum(shapes[t]) * (1 if t == "lm_head" else layers) for t in lora["targets"])
