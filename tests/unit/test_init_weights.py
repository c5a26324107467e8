"""finetune/model/init_weights.py: a parameter's values depend on the seed and its name only, not on which slice of it a rank
draws (ZeRO-3's partitions on 1, 2 or 3 ranks, cut anywhere across the blocks); the distributions are transformers'
(normal with the config's initializer_range, ones for norms, a zero padding row); an unknown parameter is an error.
The same values on ZeRO-2 and ZeRO-3 training runs: tests/integration/test_init_parity.py."""

import math
import os

import pytest
import torch
from torch import nn

from finetune.model import init_weights
from finetune.config import ConfigError
from finetune.model.init_weights import BLOCK, draw, initialize, partition_range
from tests.helpers import SMALL_VOCAB


def _model(**overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(SMALL_VOCAB)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("numel", [5, BLOCK - 1, BLOCK, 2 * BLOCK + 7])
def test_partitions_of_1_2_3_ranks_hold_the_whole_draw(numel):
    whole = draw("w", "normal", (numel,), 0, numel, seed=1, std=0.02)
    for world in (1, 2, 3):
        parts = [draw("w", "normal", (numel,), *partition_range(numel, world, r), seed=1, std=0.02) for r in range(world)]
        assert torch.equal(torch.cat(parts), whole), world
        sizes = [p.numel() for p in parts]
        # DeepSpeed's cut: equal partitions of ceil(numel / world), the last one short by the padding
        assert sizes[:-1] == [math.ceil(numel / world)] * (world - 1) and sum(sizes) == numel


def test_ranges_across_block_boundaries_equal_the_whole_draw():
    numel = 3 * BLOCK + 11
    whole = draw("x", "normal", (numel,), 0, numel, seed=4, std=1.0)
    for start, end in ((BLOCK - 3, BLOCK + 3), (BLOCK, 2 * BLOCK), (2 * BLOCK - 1, 3 * BLOCK + 11), (7, 7), (0, 1)):
        assert torch.equal(draw("x", "normal", (numel,), start, end, seed=4, std=1.0), whole[start:end]), (start, end)
    # each block is its own stream: neither a copy of another nor the continuation of one generator
    assert not torch.equal(whole[:BLOCK], whole[BLOCK:2 * BLOCK])
    g = torch.Generator().manual_seed(init_weights.block_seed(4, "x", 0))
    assert torch.equal(whole[:BLOCK], torch.empty(BLOCK).normal_(0, 1.0, generator=g))


def test_values_depend_on_seed_and_name_only():
    a = draw("model.layers.0.mlp.up_proj.weight", "normal", (64, 32), 0, 2048, seed=0, std=0.02)
    assert torch.equal(a, draw("model.layers.0.mlp.up_proj.weight", "normal", (64, 32), 0, 2048, seed=0, std=0.02))
    assert not torch.equal(a, draw("model.layers.1.mlp.up_proj.weight", "normal", (64, 32), 0, 2048, seed=0, std=0.02))
    assert not torch.equal(a, draw("model.layers.0.mlp.up_proj.weight", "normal", (64, 32), 0, 2048, seed=1, std=0.02))
    # a stable hash: the same in every process and Python version (the first block of seed 0, name "w")
    assert init_weights.block_seed(0, "w", 0) == int.from_bytes(
        __import__("hashlib").sha256(b"0\x00w\x000").digest()[:8], "little") >> 1


def test_a_large_matrix_is_normal_with_the_configured_std():
    values = draw("m", "normal", (2048, 1024), 0, 2048 * 1024, seed=0, std=0.02)
    assert abs(values.mean().item()) < 1e-4 and abs(values.std().item() - 0.02) < 2e-4
    assert abs((values.abs() < 0.02).float().mean().item() - 0.6827) < 2e-3  # one sigma holds 68.27% of a normal


def test_the_padding_row_is_zero_in_every_partition():
    shape, pad = (10, 7), 3
    whole = draw("emb", "normal", shape, 0, 70, seed=2, std=0.02, zero_rows=(pad,)).view(shape)
    assert torch.equal(whole[pad], torch.zeros(7)) and bool((whole[pad + 1] != 0).all())
    for world in (2, 3):
        parts = [draw("emb", "normal", shape, *partition_range(70, world, r), seed=2, std=0.02, zero_rows=(pad,))
                 for r in range(world)]
        assert torch.equal(torch.cat(parts).view(shape), whole)


def test_initialize_follows_the_rule_table_on_a_real_model():
    model = _model(pad_token_id=0)
    initialize(model, seed=5)
    std = model.config.initializer_range
    params = dict(model.named_parameters())
    for name, p in params.items():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            expected = draw(name, "normal", tuple(p.shape), 0, p.numel(), seed=5, std=std,
                            zero_rows=(0,) if "embed" in name else ())
            assert torch.equal(p.detach().flatten(), expected), name
    assert torch.equal(params["model.embed_tokens.weight"][0], torch.zeros(128))  # padding_idx 0
    assert abs(params["lm_head.weight"].std().item() - std) < 1e-3
    # the same model built again, with another global RNG state, gets the same weights
    torch.manual_seed(123)
    again = _model(pad_token_id=0)
    initialize(again, seed=5)
    assert all(torch.equal(p, dict(again.named_parameters())[n]) for n, p in params.items())


def test_linear_biases_are_zero_and_their_weights_drawn():
    model = _model()
    model.model.layers[0].mlp.up_proj = nn.Linear(128, 352, bias=True)  # Mistral has none; the rule has to hold
    initialize(model, seed=0)
    proj = model.model.layers[0].mlp.up_proj
    assert torch.equal(proj.bias, torch.zeros(352))
    assert torch.equal(proj.weight.detach().flatten(), draw("model.layers.0.mlp.up_proj.weight", "normal", (352, 128), 0,
                                                             352 * 128, seed=0, std=0.02))


def test_an_unknown_parameter_is_an_error_naming_it():
    model = _model()
    model.model.layers[1].mlp.scale = nn.Parameter(torch.ones(3))  # no rule draws an MLP's own parameter
    with pytest.raises(ConfigError, match=r"no rule for parameter 'model.layers.1.mlp.scale' \(MistralMLP.scale\)"):
        initialize(model, seed=0)
    with pytest.raises(ConfigError, match=r"'conv.weight' \(Conv1d.weight\)"):
        init_weights.rule_for("conv.weight", nn.Conv1d(2, 2, 1))


def test_a_model_with_its_own_init_is_refused(tmp_path):
    """Gemma's norms store weight - 1 and are drawn as zeros: the table (ones) would be wrong, so it is refused."""
    from transformers import AutoModelForCausalLM, GemmaConfig

    config = GemmaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match="GemmaForCausalLM initialises its weights its own way"):
        initialize(model, seed=0)



def test_a_saved_tiny_model_is_the_random_init_a_run_builds(tmp_path):
    """tests/helpers.py save_tiny_model and build_model's random-init branch give the same weights for one seed."""
    from safetensors.torch import load_file

    from finetune.config import load_recipe
    from finetune.model.build import build_model
    from tests.helpers import TINY_RECIPE, save_tiny_model

    saved = load_file(os.path.join(save_tiny_model(str(tmp_path / "model"), seed=7), "model.safetensors"))
    recipe = load_recipe(TINY_RECIPE, [f"model.path={SMALL_VOCAB}", "model.init_seed=7", "model.random_init=true"])
    model, _ = build_model(recipe.model, recipe.lora, {"zero_optimization": {"stage": 0}})
    built = dict(model.named_parameters())
    assert sorted(saved) == sorted(built)
    assert all(torch.equal(saved[n], built[n].detach()) for n in saved)
