"""The fused MLP (finetune/perf/fused_mlp.py) computes what transformers' Mistral MLP computes, bit for bit, while keeping
two [tokens, intermediate] tensors per layer where transformers keeps four; it is installed only where down_proj is a
plain linear layer; under ZeRO-3 on 2 ranks it trains as the unfused model does, with and without recomputation.

Its saved bytes against the estimator are in tests/integration/test_estimate.py; ZeRO 0-3 training with it (the default) against
a plain-PyTorch loop over transformers' model is tests/integration/test_parity.py.
"""

import copy

import pytest
import torch

from finetune.perf.fused_mlp import SwiGLUDownFunction, install_fused_mlp
from tests.helpers import TINY_RECIPE, save_tiny_model

HIDDEN, INTERMEDIATE, LAYERS = 64, 160, 2


def _mistral(dtype=torch.float32, seed=0, act="silu"):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, hidden_act=act)
    torch.manual_seed(seed)
    return MistralForCausalLM(cfg).to(dtype)


def _loss_and_grads(model, ids, autocast=False, saved=None):
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):  # activations by storage (views of one tensor count once), the weights left out
        if saved is not None and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32", "bf16", "autocast-bf16"])
def test_loss_and_every_gradient_bit_equal_to_transformers(dtype, autocast):
    """fp32, bf16 weights, and fp32 weights under bf16 autocast (zerotune's ZeRO-0): the same ops in the same order."""
    plain = _mistral(dtype)
    fused = copy.deepcopy(plain)
    assert install_fused_mlp(fused, zero_stage=2, liger=False) == LAYERS
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    calls = []
    original = SwiGLUDownFunction.forward

    def counted(ctx, *args):
        calls.append(args[0].dtype)
        return original(ctx, *args)

    loss_p, grads_p = _loss_and_grads(plain, ids, autocast)
    SwiGLUDownFunction.forward = staticmethod(counted)
    try:
        loss_f, grads_f = _loss_and_grads(fused, ids, autocast)
    finally:
        SwiGLUDownFunction.forward = staticmethod(original)
    assert calls == [torch.bfloat16 if autocast else dtype] * LAYERS  # the function ran in every layer
    assert torch.equal(loss_f, loss_p)
    assert grads_f.keys() == grads_p.keys() and len(grads_p) == 3 + 9 * LAYERS
    for name, grad in grads_p.items():
        assert grad is not None and torch.equal(grads_f[name], grad), name


def test_keeps_gate_and_up_not_their_product():
    """Transformers' MLP keeps gate (silu's input), silu(gate) and up (the product's factors) and the product (down's
    input); the fused one keeps gate and up: two [tokens, intermediate] tensors less per layer."""
    plain = _mistral(torch.bfloat16)
    fused = copy.deepcopy(plain)
    install_fused_mlp(fused, zero_stage=2, liger=False)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    saved_plain, saved_fused = {}, {}
    _loss_and_grads(plain, ids, saved=saved_plain)
    _loss_and_grads(fused, ids, saved=saved_fused)
    tokens, bytes_ = ids.numel(), 2
    assert sum(saved_plain.values()) - sum(saved_fused.values()) == LAYERS * 2 * tokens * INTERMEDIATE * bytes_


def test_installed_only_where_down_proj_is_a_plain_linear():
    from peft import LoraConfig, get_peft_model

    def lora(targets):
        model = get_peft_model(_mistral(), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        return install_fused_mlp(model, zero_stage=2, liger=False), model

    assert lora(["q_proj", "v_proj", "down_proj"])[0] == 0  # the adapted down_proj keeps its LoRA path
    count, model = lora(["q_proj", "gate_proj", "up_proj"])
    assert count == LAYERS  # frozen down_proj: fused, its weight gets no gradient
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    _, grads = _loss_and_grads(model, ids)
    assert all(g is None for n, g in grads.items() if "down_proj" in n)
    assert all(g is not None for n, g in grads.items() if "lora_" in n)
    assert install_fused_mlp(_mistral(act="gelu"), zero_stage=2, liger=False) == 0  # not a SwiGLU
    zero3 = _mistral()
    assert install_fused_mlp(zero3, zero_stage=3, liger=False) == LAYERS
    for layer in zero3.model.layers:  # ZeRO-3: the MLP's hooks gather down_proj's weight for the function
        assert list(layer.mlp._external_params.values()) == [layer.mlp.down_proj.weight]


def test_recipe_switch(tmp_path):
    from finetune import perf
    from finetune.config import load_recipe
    from finetune.model.build import build_model

    model_dir = save_tiny_model(str(tmp_path / "model"))
    for on, expected in ((True, True), (False, False)):
        recipe = load_recipe(TINY_RECIPE, [f"model.path={model_dir}", "lora.enabled=false",
                                           f"model.fused_mlp={str(on).lower()}"])
        ds = {"bf16": {"enabled": False}}
        model, _ = build_model(recipe.model, recipe.lora, ds)
        assert ("fused_mlp" in perf.apply(model, recipe, ds)) == expected
        assert {hasattr(m, "_fused_mlp_liger") for n, m in model.named_modules() if n.endswith(".mlp")} == {expected}


