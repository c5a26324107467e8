"""A Hugging Face model folder: the one reader of its config.json, and whether it holds weights or a LoRA adapter.

    config = folder.read_config("models/Mistral-7B-v0.1")   # ConfigError naming the file when it cannot be read

Imports neither torch nor transformers: the planner, `estimate`, sequence parallelism's checks and the launcher read a
model's shape before (or without) any training process.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

from finetune.config import ConfigError

CONFIG = "config.json"
ADAPTER_CONFIG = "adapter_config.json"
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def config_path(path: str) -> str:
    return os.path.join(path, CONFIG)


def read_config(path: str, key: str = "model.path") -> dict[str, Any]:
    """The config.json of the model folder `path` as a dict; `key` is the recipe key or flag that named the folder,
    for the error a user reads when the folder or its file is missing or not JSON."""
    file = config_path(path)
    if not os.path.isdir(path):
        raise ConfigError(f"{key} {path!r} does not exist")
    if not os.path.isfile(file):
        raise ConfigError(f"{key} {path!r} has no {CONFIG}: point {key} at a Hugging Face model folder")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{file}: cannot be read as JSON ({e}); restore it from the model's download") from None


def has_config(path: str) -> bool:
    return os.path.isfile(config_path(path))


def has_weights(path: str) -> bool:
    return any(glob.glob(os.path.join(path, pattern)) for pattern in WEIGHT_PATTERNS)


def is_exported(path: str) -> bool:
    """A folder that AutoModelForCausalLM or peft loads as it is: a model (config.json) or a LoRA adapter."""
    return has_config(path) or os.path.isfile(os.path.join(path, ADAPTER_CONFIG))
