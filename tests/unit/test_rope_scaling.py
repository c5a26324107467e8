"""model.rope_scaling (finetune/model/build.py apply_rope_scaling) reaches transformers' rotary embedding: linear scaling by
2 gives position p the angles of p/2, the model's rope_theta kept and max_position_embeddings doubled; yarn sets the
attention scaling transformers defines for it; an unknown type or a missing field is a ConfigError naming the key."""

import math

import pytest
import torch
from transformers import MistralConfig

from finetune.config import ConfigError, load_recipe
from finetune.model.build import build_model
from tests.helpers import TINY_RECIPE

THETA, MAX_POS = 5000.0, 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rope"))
    MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rope_theta=THETA, max_position_embeddings=MAX_POS,
                  use_cache=False).save_pretrained(path)
    return path


def _model(model_dir, rope=None):
    overrides = [f"model.path={model_dir}", "lora.enabled=false", "model.activation_checkpointing=none"]
    if rope is not None:
        overrides.append(f"model.rope_scaling={rope}")
    recipe = load_recipe(TINY_RECIPE, overrides)
    return build_model(recipe.model, recipe.lora, {"bf16": {"enabled": False}})[0]


def _angles(model, positions):
    x = torch.zeros(1, positions.shape[-1], 8)
    return model.model.rotary_emb(x, positions)


def test_linear_factor_2_gives_position_p_the_angles_of_p_over_2(model_dir):
    plain = _model(model_dir)
    scaled = _model(model_dir, "{rope_type: linear, factor: 2.0}")
    assert scaled.config.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": THETA}
    assert scaled.config.max_position_embeddings == 2 * MAX_POS
    p = torch.arange(0, 400).unsqueeze(0)
    cos_s, sin_s = _angles(scaled, p)
    cos_p, sin_p = _angles(plain, p.float() / 2)
    torch.testing.assert_close(cos_s, cos_p, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin_s, sin_p, rtol=0, atol=1e-6)
    assert not torch.allclose(cos_s, _angles(plain, p)[0], atol=1e-3)  # scaling changed something


def test_yarn_sets_transformers_attention_scaling(model_dir):
    yarn = _model(model_dir, "{rope_type: yarn, factor: 4.0}")
    params = yarn.config.rope_parameters
    assert params["original_max_position_embeddings"] == MAX_POS and params["rope_theta"] == THETA
    assert yarn.config.max_position_embeddings == 4 * MAX_POS
    scaling = 0.1 * math.log(4.0) + 1.0  # transformers' get_mscale(factor) for yarn without an attention_factor
    assert yarn.model.rotary_emb.attention_scaling == pytest.approx(scaling)
    cos, _ = _angles(yarn, torch.zeros(1, 1, dtype=torch.long))
    torch.testing.assert_close(cos, torch.full_like(cos, scaling))  # position 0: cos 1, times the scaling


@pytest.mark.parametrize("rope,message", [
    ("{rope_type: stretchy, factor: 2.0}", r"model.rope_scaling.rope_type = 'stretchy' is not one of: dynamic, "
                                           r"linear, llama3, longrope, proportional, yarn"),
    ("{factor: 2.0}", r"model.rope_scaling.rope_type = None is not one of"),
    ("{rope_type: linear}", r"model.rope_scaling for rope_type 'linear': Missing required keys .*'factor'"),
])
def test_a_bad_type_or_a_missing_field_is_a_config_error(model_dir, rope, message):
    with pytest.raises(ConfigError, match=message):
        _model(model_dir, rope)
