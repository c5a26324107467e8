"""Resume checks what changed: the recipe saved in a checkpoint against this run's, before any state is loaded.

    listed = check(resume_from, run.resolved_config())   # ConfigError when the parameters would differ

A change that alters the parameters (another model shape, full vs LoRA, another adapter rank, alpha or target
modules, a LoRA base's precision under ZeRO-0/1/2) does not fit the saved state: DeepSpeed would fail deep inside
load_checkpoint on mismatched shapes or missing weights or, for alpha, load it silently and train another function.
Those refuse the resume with a table of the differences. Every other change (lr, max_steps, save cadence, logging,
data) is safe: it is listed, and the run continues.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from finetune.checkpoint import MARKER, saved_meta
from finetune.config import ConfigError

SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")
"""The model config.json keys that set the parameters' shapes; saved with each checkpoint (Run.resolved_config)."""

# The recipe keys that alter the parameters, and when: "always", or "lora" = only when LoRA is on both before and
# after (with LoRA off, the adapter settings build nothing). model.path counts only for a checkpoint saved without the
# model's shape: with the shape known, a moved or renamed model folder of the same shape is a safe change (the
# checkpoint holds every weight, frozen ones included).
PARAMETER_KEYS = {
    "lora.enabled": "always",
    "lora.rank": "lora",
    "lora.alpha": "lora",
    "lora.target_modules": "lora",
}
NOT_LISTED = {"train.resume"}  # differs on every resume by design
ABSENT = "(absent)"


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any
    now: Any


def shape(model_config: dict[str, Any]) -> dict[str, Any]:
    """The shape-setting part of a model's config.json, as checkpoints keep it."""
    return {k: model_config[k] for k in SHAPE_KEYS if k in model_config}


def compare(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[Difference], list[Difference]]:
    """(refused, listed) differences between two resolved configs ({"recipe": ..., "model_config": ...})."""
    before, after = _flat(saved.get("recipe", {})), _flat(now.get("recipe", {}))
    refused, listed = [], []
    lora_both = before.get("lora.enabled") is True and after.get("lora.enabled") is True
    saved_shape, now_shape = saved.get("model_config"), now.get("model_config")
    if saved_shape is not None and now_shape is not None:
        for key in SHAPE_KEYS:
            a, b = saved_shape.get(key, ABSENT), now_shape.get(key, ABSENT)
            if a != b:
                refused.append(Difference(f"model {key} (config.json)", a, b))
    for key in sorted(before.keys() | after.keys()):
        a, b = before.get(key, ABSENT), after.get(key, ABSENT)
        if a == b or key in NOT_LISTED:
            continue
        when = PARAMETER_KEYS.get(key)
        alters = when == "always" or (when == "lora" and lora_both)
        if key == "model.path" and (saved_shape is None or now_shape is None):
            alters = os.path.normpath(str(a)) != os.path.normpath(str(b))
        if key == "model.precision" and lora_both:
            # Under ZeRO-0/1/2 an FP8 LoRA base is a non-persistent FP8 copy in place of the weight, so one side's
            # checkpoint holds base weights the other's module has no place for (ZeRO-3 keeps the 16-bit weight)
            alters = min(_stage(saved), _stage(now)) < 3
        (refused if alters else listed).append(Difference(key, a, b))
    return refused, listed


def _stage(config: dict[str, Any]) -> int:
    return int(config.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))


def check(checkpoint_path: str, now: dict[str, Any]) -> list[Difference]:
    """The safe differences between the checkpoint's saved recipe and `now`; ConfigError when one alters the
    parameters. A checkpoint saved without its recipe has nothing to compare: []."""
    try:
        saved = saved_meta(checkpoint_path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.resume: cannot read {os.path.join(checkpoint_path, MARKER)} ({e})") from None
    if not isinstance(saved, dict) or "recipe" not in saved:
        return []
    refused, listed = compare(saved, now)
    if refused:
        raise ConfigError(
            f"train.resume: {checkpoint_path} was trained with other parameters than this recipe builds:\n"
            f"{table(refused)}\nIts weights and optimizer state do not fit this model. To resume it, change these "
            f"settings back; or start a new run in another train.output_dir (to start from this run's weights, "
            f"`zerotune export` it and set model.path to the export)")
    return listed


def table(differences: list[Difference]) -> str:
    """The differences as an aligned table: key, checkpoint value, value now."""
    rows = [("key", "checkpoint", "now")] + [(d.key, _show(d.saved), _show(d.now)) for d in differences]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"  {k:<{widths[0]}}  {a:<{widths[1]}}  {b}" for k, a, b in rows)


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _flat(section: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in section.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
