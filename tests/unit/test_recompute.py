"""Selective activation checkpointing with a chosen number of recomputed layers (model.recompute_layers): which layers
are recomputed, that they really run twice and nothing else does, that the gradients are the ones without
recomputation, what the estimator counts, and the errors for counts that cannot be."""

import os

import pytest
import torch

from finetune.config import ConfigError, load_recipe
from finetune.memory.estimate import estimate_activations, recomputed_layers
from finetune.model.build import build_model
from tests.fixtures.model_shapes import MISTRAL
from tests.helpers import TINY_RECIPE, save_tiny_model

FP32_STAGE0 = {"zero_optimization": {"stage": 0}}


def test_recomputed_layers_are_spread_evenly_from_layer_0():
    assert recomputed_layers("selective", 32, 4) == [0, 8, 16, 24]
    assert recomputed_layers("selective", 32, 5) == [0, 6, 12, 19, 25]
    assert recomputed_layers("selective", 32) == list(range(0, 32, 2))  # null: every second layer, as before
    assert recomputed_layers("selective", 32, 32) == recomputed_layers("full", 32) == list(range(32))
    assert recomputed_layers("none", 32) == []
    with pytest.raises(ValueError, match="the model has 32 decoder layers, so selective checkpointing recomputes 1 to 32"):
        recomputed_layers("selective", 32, 33)


def test_estimate_counts_each_kept_layer():
    none = estimate_activations(MISTRAL, None, 2048, 8, "none")
    layer, layer_input = none["layers"] / 32, 2 * 4096 * 2048 * 8
    for k in (1, 4, 16, 31):
        sel = estimate_activations(MISTRAL, None, 2048, 8, "selective", recompute_layers=k)
        assert sel["layers"] == (32 - k) * layer + k * layer_input
        assert sel["recompute"] == layer  # one recomputed layer's activations live at a time
    assert estimate_activations(MISTRAL, None, 2048, 8, "selective")["layers"] == 16 * layer + 16 * layer_input


def _forward_counts_and_grads(model_dir: str, tmp_path, *overrides: str):
    recipe = load_recipe(TINY_RECIPE, [f"model.path={model_dir}", f"train.output_dir={tmp_path / 'run'}",
                                       "model.fused_loss=false", "model.kernels=none", *overrides])
    model, _ = build_model(recipe.model, recipe.lora, FP32_STAGE0)
    model.train()
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        # a pre-hook: recomputation stops as soon as the last saved tensor is rebuilt, before the layer returns
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(0, model.config.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    return calls, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_only_the_chosen_layers_run_twice_and_gradients_are_unchanged(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "model"), num_hidden_layers=4)  # which 1, 2 or 3 of 4 run twice
    calls, plain = _forward_counts_and_grads(model_dir, tmp_path, "model.activation_checkpointing=none")
    assert calls == [1, 1, 1, 1]
    for k, twice in ((1, [0]), (2, [0, 2]), (3, [0, 1, 2])):
        calls, grads = _forward_counts_and_grads(model_dir, tmp_path, "model.activation_checkpointing=selective",
                                                 f"model.recompute_layers={k}")
        assert calls == [2 if i in twice else 1 for i in range(4)], (k, calls)
        assert grads.keys() == plain.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_impossible_counts_are_refused_before_loading(tmp_path):
    model_dir = save_tiny_model(str(tmp_path / "model"), num_hidden_layers=4)
    with pytest.raises(ConfigError, match="model.recompute_layers applies to activation_checkpointing selective"):
        load_recipe(TINY_RECIPE, ["model.activation_checkpointing=full", "model.recompute_layers=2"])
    with pytest.raises(ConfigError, match="model.recompute_layers must be > 0"):
        load_recipe(TINY_RECIPE, ["model.activation_checkpointing=selective", "model.recompute_layers=0"])
    recipe = load_recipe(TINY_RECIPE, [f"model.path={model_dir}", "model.activation_checkpointing=selective",
                                       "model.recompute_layers=5"])
    with pytest.raises(ConfigError, match=r"model.recompute_layers=5: the model has 4 decoder layers"):
        build_model(recipe.model, recipe.lora, FP32_STAGE0)
    assert os.path.isdir(model_dir)
