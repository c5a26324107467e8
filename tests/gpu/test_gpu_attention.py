"""zerotune's attention on CUDA (finetune/perf/attention.py): the compiled FlexAttention path over its block mask
equals transformers' sdpa over the explicit mask it builds, in bf16, at 8,192 tokens with a 4,096-token sliding
window and packed samples; the block mask is built once per forward; a tiny model through perf.apply trains and
generates as sdpa does. The last test prints (asserts nothing) one Mistral-7B-shaped layer's attention forward and
backward at 32K tokens, FlexAttention against sdpa with its 4-D mask. CPU CI skips this file; the exact mask logic is
tests/unit/test_attention.py.
"""

import copy

import pytest
import torch

from finetune.perf import attention

pytestmark = pytest.mark.skipif(attention.available() is not None, reason=str(attention.available()))

WINDOW = 4096


def _positions(length: int, samples: tuple[int, ...]) -> torch.Tensor:
    """One packed row: the samples' positions restarting at 0, then the padding's from 0 again (as collate does)."""
    parts = [torch.arange(n) for n in samples]
    parts.append(torch.arange(length - sum(samples)))
    return torch.cat(parts)[None].cuda()


def _config(window: int | None):
    from transformers import MistralConfig

    config = MistralConfig(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                           sliding_window=window, num_hidden_layers=1, intermediate_size=256, vocab_size=1000)
    config._attn_implementation = "sdpa"
    return config


def _mask(config, q, position_ids):
    """The mask Mistral builds for sdpa from position_ids (transformers' masking_utils), once per forward."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
    embeds = torch.zeros(q.shape[0], q.shape[2], 1, device=q.device, dtype=q.dtype)
    return make(config=config, inputs_embeds=embeds, attention_mask=None, position_ids=position_ids,
                **_no_cache(make))


def _sdpa(module, mask):
    """transformers' sdpa_attention_forward over that mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return lambda q, k, v: sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)[0]


def _run(fn, inputs, grad_out):
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    out = fn(q, k, v)
    out.backward(grad_out.to(out.dtype))
    return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]


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
    position_ids = _positions(length, samples)
    causal = attention._block_mask(position_ids, length, position_ids.device, window) is attention.CAUSAL
    assert causal == (samples == (length,) and window is None)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(1, h, length, 128, device="cuda", generator=g) for h in (8, 2, 2)]
    grad_out = torch.randn(1, length, 8, 128, device="cuda", generator=g)
    flex = lambda q, k, v: attention.attention(module, q, k, v, None, position_ids=position_ids,
                                               scaling=module.scaling, sliding_window=window)[0]
    sdpa = _sdpa(module, _mask(config, inputs[0], position_ids))
    reference = _run(sdpa, inputs, grad_out)  # fp32
    bf16 = [t.bfloat16() for t in inputs]
    got, baseline = _run(flex, bf16, grad_out), _run(sdpa, bf16, grad_out)
    for name, g_, b_, r_ in zip(("out", "dq", "dk", "dv"), got, baseline, reference):
        err, base_err = (g_ - r_).abs().max().item(), (b_ - r_).abs().max().item()
        assert err <= 2 * base_err + 1e-3, (name, err, base_err)


def test_one_block_mask_per_forward():
    """Equal position_ids in a fresh tensor (every layer under sequence parallelism) reuse the cached block mask;
    other position_ids, another length or another window build a new one."""
    position_ids = _positions(4096, (1000, 2000))
    first = attention._block_mask(position_ids, 4096, position_ids.device, 1024)
    assert attention._block_mask(position_ids, 4096, position_ids.device, 1024) is first
    assert attention._block_mask(position_ids.clone(), 4096, position_ids.device, 1024) is first
    other = _positions(4096, (1000, 2001))
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
    position_ids = _positions(512, (200, 150, 100)).expand(2, -1)
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


def test_print_flex_vs_sdpa_with_mask_per_layer_at_32k():
    """Mistral-7B's attention shapes (32 query heads, 8 key/value heads, head_dim 128), one packed row of 32,768
    tokens (8 samples), window 4,096: forward + backward of one layer's attention, in milliseconds. Printed only."""
    from transformers import MistralConfig
    from transformers.models.mistral.modeling_mistral import MistralAttention

    length = 32768
    config = MistralConfig(sliding_window=WINDOW)
    config._attn_implementation = "sdpa"
    module = MistralAttention(config, 0)
    position_ids = _positions(length, (4096,) * 8)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(1, h, length, 128, device="cuda", dtype=torch.bfloat16, generator=g) for h in (32, 8, 8)]
    grad_out = torch.randn(1, length, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    flex = lambda q, k, v: attention.attention(module, q, k, v, None, position_ids=position_ids,
                                               scaling=module.scaling, sliding_window=WINDOW)[0]
    sdpa = _sdpa(module, _mask(config, inputs[0], position_ids))  # built once, as a model's forward builds it
    timings = {}
    for name, fn in (("flex", flex), ("sdpa with its mask", sdpa)):
        for _ in range(3):  # compile, then warm
            _run(fn, inputs, grad_out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            _run(fn, inputs, grad_out)
        end.record()
        torch.cuda.synchronize()
        timings[name] = start.elapsed_time(end) / 5
    print(f"\nattention fwd+bwd per layer at {length} tokens, window {WINDOW}: "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in timings.items()))


def _no_cache(make) -> dict:
    """`cache=None` in transformers >= 5.20's mask functions, `past_key_values=None` before."""
    import inspect

    return {"cache" if "cache" in inspect.signature(make).parameters else "past_key_values": None}
