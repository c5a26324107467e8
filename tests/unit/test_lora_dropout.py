"""LoRA dropout drawn from a seed in Triton kernels (finetune/perf/lora_dropout.py, lora.dropout_kernel). Triton's CPU
interpreter runs the kernels (fp32) in tests/drivers/lora_dropout_cases.py: each kernel equals torch on the mask it draws, the
fused LoRA function with them equals autograd over that mask, recomputation redraws the same masks, and it keeps a seed
where torch's path keeps a bool per element. Here: those cases, the estimator's term, what `auto` resolves to and the
config's errors. On CUDA (bf16, Mistral-7B's widths) the same checks are tests/gpu/test_gpu_lora_dropout.py."""

import importlib.metadata
import importlib.util

import pytest
import torch

from finetune.perf import lora_dropout
from finetune.config import ConfigError, LoraConfig, load_recipe
from finetune.memory.estimate import estimate_activations
from tests.helpers import TINY_RECIPE

pytest.importorskip("triton")


def test_estimator_drops_the_masks_with_the_kernels():
    """Per token and layer, one byte per adapted input element fewer: 6 x hidden + intermediate for Mistral's seven."""
    cfg = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "model_type": "mistral"}

    def activations(kernel: str) -> float:
        lora = LoraConfig(dropout=0.1, dropout_kernel=kernel)
        return estimate_activations(cfg, lora, 32, 2, "none", 2, "sdpa", False, adapter_dtype_bytes=2)["total"]

    assert activations("torch") - activations("triton") == 2 * 32 * 2 * (6 * 64 + 160)  # layers x tokens x widths
    # the default, auto: the kernels on a CUDA GPU with Triton, which the estimate (of GPU memory) assumes
    assert LoraConfig().dropout_kernel == "auto"
    assert activations("auto") == activations("triton")


def test_auto_takes_the_kernels_on_cuda_with_triton_only(monkeypatch):
    assert lora_dropout.uses_kernels("auto", cuda=True)  # triton is in the dev extra
    assert not lora_dropout.uses_kernels("auto", cuda=False)
    assert not lora_dropout.uses_kernels("torch", cuda=True) and lora_dropout.uses_kernels("triton", cuda=False)
    assert lora_dropout.uses_kernels("auto") == lora_dropout._auto_gpu()  # this machine: an NVIDIA GPU, sm 8.0+
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.3.1" if name == "triton" else real_version(name))
    assert not lora_dropout.uses_kernels("auto", cuda=True)  # tl.join needs Triton 3.0
    recipe = load_recipe(TINY_RECIPE, ["lora.enabled=true", "lora.dropout_kernel=triton"])
    with pytest.raises(ConfigError, match=r"lora\.dropout_kernel=triton: triton 2\.3\.1 is older than 3\.0; set "):
        lora_dropout.check(recipe.lora)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert not lora_dropout.uses_kernels("auto", cuda=True)


def test_triton_without_cuda_is_a_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU, on any machine
    recipe = load_recipe(TINY_RECIPE, ["lora.enabled=true", "lora.dropout_kernel=triton"])
    why = r"lora\.dropout_kernel=triton: its Triton kernels need a CUDA GPU; set lora\.dropout_kernel=torch"
    with pytest.raises(ConfigError, match=why):
        lora_dropout.check(recipe.lora)
    lora_dropout.check(load_recipe(TINY_RECIPE, ["lora.enabled=true"]).lora)  # the default needs no GPU
    with pytest.raises(ConfigError, match="lora.dropout_kernel"):
        load_recipe(TINY_RECIPE, ["lora.dropout_kernel=cuda"])
