"""zerotune's attention on CUDA (finetune/perf/attention.py): the compiled FlexAttention path over its block mask
equals transformers' sdpa over the explicit mask it builds, in bf16, at 8,192 tokens with a 4,096-token sliding
window and packed samples; the block mask is built once per forward; a tiny model through perf.apply trains and
generates as sdpa does. CPU CI skips this file; the exact mask logic is tests/unit/test_attention.py. The time of one
Mistral-7B-shaped layer's attention at 32K tokens, FlexAttention against sdpa with its mask: benchmarks/attention_32k.py.
"""

import copy

import pytest
import torch

from finetune.perf import attention
from tests.fixtures.cuda_attention import forward_backward, packed_positions, sdpa_mask, sdpa_over

pytestmark = pytest.mark.skipif(attention.available() is not None, reason=str(attention.available()))

WINDOW = 4096


def _config(window: int | None):
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                           sliding_window=window, num_hidden_layers=1, intermediate_size=256, vocab_size=1000)
    config._attn_implementation = "sdpa"
    return config


PACKED = (3000, 2500, 1700)


@pytest.mark.parametrize("length,window,samples", [(8192, WINDOW, PACKED), (8192, None, PACKED),
                                                   (8192 - 37, WINDOW, PACKED), (8192, None, (8192,)),
                                                   (8192, WINDOW, (8192,))])
def test_compiled_flex_equals_sdpa_with_its_mask_in_bf16(length, window, samples):
    """Output and q/k/v gradients: zerotune's attention in bf16 is as close to an fp32 reference as sdpa in bf16 is
    (both against the same fp32 computation over the same mask). A length off the block size runs FlexAttention's
    partial block; one whole-row document without a window runs SDPA's causal kernel, with a window FlexAttention."""
    from transformers.models.mistral.modeling_mistral import MistralAttention

    config = _config(window)
    module = MistralAttention(config, 0).cuda()
    position_ids = packed_positions(length, samples)
    causal = attention._block_mask(position_ids, length, position_ids.device, window) is attention.CAUSAL
    assert causal == (samples == (length,) and window is None)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(1, h, length, 128, device="cuda", generator=g) for h in (8, 2, 2)]
    grad_out = torch.randn(1, length, 8, 128, device="cuda", generator=g)
    flex = lambda q, k, v: attention.attention(module, q, k, v, None, position_ids=position_ids,
                                               scaling=module.scaling, sliding_window=window)[0]
    sdpa = sdpa_over(module, sdpa_mask(config, inputs[0], position_ids))
    reference = forward_backward(sdpa, inputs, grad_out)  # fp32
    bf16 = [t.bfloat16() for t in inputs]
    got, baseline = forward_backward(flex, bf16, grad_out), forward_backward(sdpa, bf16, grad_out)
    for name, g_, b_, r_ in zip(("out", "dq", "dk", "dv"), got, baseline, reference):
        err, base_err = (g_ - r_).abs().max().item(), (b_ - r_).abs().max().item()
        assert err <= 2 * base_err + 1e-3, (name, err, base_err)


def test_one_block_mask_per_forward():
    """Equal position_ids in a fresh tensor (every layer under sequence parallelism) reuse the cached block mask;
    other position_ids, another length or another window build a new one."""
    position_ids = packed_positions(4096, (1000, 2000))
    first = attention._block_mask(position_ids, 4096, position_ids.device, 1024)
    assert attention._block_mask(position_ids, 4096, position_ids.device, 1024) is first
    assert attention._block_mask(position_ids.clone(), 4096, position_ids.device, 1024) is first
    other = packed_positions(4096, (1000, 2001))
    assert attention._block_mask(other, 4096, other.device, 1024) is not first
    assert attention._block_mask(other, 4096, other.device, None) is not first


def test_tiny_model_through_perf_apply_trains_and_generates_as_sdpa():
    from transformers import AutoModelForCausalLM

    from finetune import perf
    from finetune.config import load_recipe
    from tests.helpers import TINY_RECIPE

    config = _config(64)
    config.num_hidden_layers = 2
    models = []
    for value in ("sdpa", "flex"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").cuda()
        recipe = load_recipe(TINY_RECIPE, [f"model.attn_implementation={value}", "lora.enabled=false",
                                           "model.fused_loss=false", "model.fused_mlp=false", "model.kernels=none"])
        applied = perf.apply(model, recipe, {"zero_optimization": {"stage": 0}})
        assert ("flex_attention" in applied) == (value == "flex")
        models.append(model)
    ids = torch.randint(0, 1000, (2, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    position_ids = packed_positions(512, (200, 150, 100)).expand(2, -1)
    losses = []
    for model in models:
        logits = model(input_ids=ids, position_ids=position_ids).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten()))
        losses[-1].backward()
    torch.testing.assert_close(losses[1], losses[0], atol=2e-2, rtol=0)
    prompt = ids[:, :100]
    out = [m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                      use_cache=True, pad_token_id=0) for m in (m.eval() for m in models)]
    assert out[1].shape == out[0].shape == (2, 108)
