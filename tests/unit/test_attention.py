"""zerotune's block-sparse attention (finetune/perf/attention.py, model.attn_implementation=flex) computes what
transformers' sdpa computes with the explicit mask it builds from packed position_ids and the sliding window.

On CPU the function runs its dense path: scaled_dot_product_attention over a boolean mask evaluated from the same
mask function the CUDA path hands to FlexAttention's create_block_mask; one test runs FlexAttention itself (eager,
forward only: it has no CPU backward) over that block mask. Tiny fp32 Mistrals (vocab 256, hidden 64, 2 layers, GQA
4/2 heads); the sliding window (5) is shorter than the samples, so it masks inside each of them.
tests/gpu/test_gpu_attention.py checks the compiled CUDA path in bf16.
"""

import copy

import pytest
import torch

from finetune import perf
from finetune.config import load_recipe
from finetune.perf import attention
from tests.helpers import TINY_RECIPE

WINDOW = 5
# Two rows as finetune.data.loader.collate makes them: samples restarting at 0, then padding counting from 0 again.
POSITIONS = torch.tensor([
    [*range(9), *range(11), *range(4)],
    [*range(14), *range(7), *range(3)],
])


def _config(window: int | None):
    from transformers import MistralConfig

    return MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False,
                         sliding_window=window, max_position_embeddings=256)


def _pair(window: int | None):
    """transformers' sdpa model and an identical one with zerotune's attention installed (each its own config)."""
    from transformers import AutoModelForCausalLM

    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(AutoModelForCausalLM.from_config(copy.deepcopy(_config(window)), dtype=torch.float32,
                                                       attn_implementation="sdpa"))
    assert attention.install(models[1]) == 1
    assert models[0].config._attn_implementation == "sdpa" and attention.installed(models[1])
    return models


def _sdpa_reference(module, config, q, k, v, position_ids):
    """transformers' own: the mask Mistral builds for sdpa from position_ids, then sdpa_attention_forward."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    make = create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
    embeds = torch.zeros(q.shape[0], q.shape[2], 1)
    mask = make(config=config, inputs_embeds=embeds, attention_mask=None, position_ids=position_ids,
                **_no_cache(make))
    return sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)[0]


@pytest.mark.parametrize("window", [WINDOW, None])
@pytest.mark.parametrize("positions", ["per_row", "one_row", "none"])
def test_output_and_qkv_gradients_equal_sdpa_with_its_mask(window, positions):
    from transformers.models.mistral.modeling_mistral import MistralAttention

    config = _config(window)
    config._attn_implementation = "sdpa"
    module = MistralAttention(config, 0)
    position_ids = {"per_row": POSITIONS, "one_row": POSITIONS[:1], "none": None}[positions]
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, h, POSITIONS.shape[1], 16, generator=g) for h in (4, 2, 2)]
    results = []
    for fn in ("zerotune", "sdpa"):
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        if fn == "zerotune":
            out = attention.attention(module, q, k, v, None, position_ids=position_ids, scaling=module.scaling,
                                      sliding_window=window)[0]
        else:
            out = _sdpa_reference(module, config, q, k, v, position_ids)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        results.append([out, q.grad, k.grad, v.grad])
    assert results[0][0].shape == (2, POSITIONS.shape[1], 4, 16)
    for name, got, expected in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0, msg=name)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_over_the_block_mask_equals_the_dense_path():
    """The CUDA path's pieces on CPU: create_block_mask evaluates the mask function with scalar indices, block by
    block, and FlexAttention (eager, forward) over that block mask gives the dense path's output."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    docs = attention.document_ids(POSITIONS)
    assert docs.tolist() == [[0] * 9 + [1] * 11 + [2] * 4, [0] * 14 + [1] * 7 + [2] * 3]
    mask_mod = attention.document_mask(docs, WINDOW)
    dense = attention.dense_mask(mask_mod, 2, POSITIONS.shape[1], torch.device("cpu"))
    assert torch.equal(create_mask(mask_mod, 2, 1, 24, 24, device="cpu"), dense)
    # sliding window as transformers defines it: q sees kv > q - WINDOW, i.e. itself and WINDOW - 1 keys before it
    assert dense[0, 0, 8].nonzero().flatten().tolist() == [4, 5, 6, 7, 8]
    assert dense[0, 0, 9].nonzero().flatten().tolist() == [9]  # the second sample's first token sees only itself
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 24, 16, generator=g), torch.randn(2, 2, 24, 16, generator=g), torch.randn(2, 2, 24, 16, generator=g)
    block_mask = create_block_mask(mask_mod, 2, None, 24, 24, device="cpu")
    with torch.no_grad():
        flex = flex_attention(q, k, v, block_mask=block_mask, scale=0.25, enable_gqa=True)
        ours = attention.attention(None, q, k, v, None, position_ids=POSITIONS, scaling=0.25,
                                   sliding_window=WINDOW)[0]
    torch.testing.assert_close(flex.transpose(1, 2), ours, atol=1e-6, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [3, None])
def test_a_continued_document_sees_the_shared_prompt_on_both_paths(window):
    """A document starting at position p > 0 (a pair's rejected response after the prompt it shares with the chosen
    one) sees the first p tokens of the document before it, not the rest, and the window counts positions: the dense
    path (CPU) and FlexAttention over the block mask (the CUDA path) alike, and each query's output is what a row
    holding only the prompt and that document gives."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    positions = torch.tensor([[*range(7), *range(3, 8), *range(4)]])  # prompt 0-2 + chosen 3-6, rejected 3-7, pad
    docs, starts = attention.document_ids(positions), attention.document_starts(positions)
    assert starts.tolist() == [[0] * 7 + [3] * 5 + [0] * 4]
    mask_mod = attention.document_mask(docs, window, positions, starts)
    dense = attention.dense_mask(mask_mod, 1, 16, torch.device("cpu"))
    assert torch.equal(create_mask(mask_mod, 1, 1, 16, 16, device="cpu"), dense)
    seen = dense[0, 0, 9].nonzero().flatten().tolist()  # the rejected response's third token (position 5)
    assert seen == ([0, 1, 2, 7, 8, 9] if window is None else [7, 8, 9])
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    with torch.no_grad():
        ours = attention.attention(None, q, k, v, None, position_ids=positions, scaling=0.3, sliding_window=window)[0]
        flex = flex_attention(q, k, v, block_mask=create_block_mask(mask_mod, 1, None, 16, 16, device="cpu"),
                              scale=0.3)
        alone_index = [0, 1, 2, 7, 8, 9, 10, 11]  # the prompt, then the rejected response: one plain document
        alone = attention.attention(None, q[:, :, alone_index], k[:, :, alone_index], v[:, :, alone_index], None,
                                    position_ids=torch.arange(8)[None], scaling=0.3, sliding_window=window)[0]
    torch.testing.assert_close(flex.transpose(1, 2), ours, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:, 7:12], alone[:, 3:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("window", [WINDOW, None])
def test_model_logits_and_every_parameter_gradient_equal_sdpa(window):
    sdpa, flex = _pair(window)
    ids = torch.randint(0, 256, POSITIONS.shape, generator=torch.Generator().manual_seed(4))
    grads = []
    for model in (sdpa, flex):
        logits = model(input_ids=ids, position_ids=POSITIONS).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
        loss.backward()
        grads.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-6, rtol=0)
    assert grads[0][1].keys() == grads[1][1].keys()
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, atol=1e-6, rtol=0, msg=name)


def test_a_sample_never_sees_its_neighbour():
    """Changing the first sample's tokens leaves every output of the samples after it in the row unchanged."""
    _, flex = _pair(WINDOW)
    ids = torch.randint(0, 256, POSITIONS.shape, generator=torch.Generator().manual_seed(5))
    changed = ids.clone()
    changed[:, :9] = (changed[:, :9] + 17) % 256
    with torch.no_grad():
        a, b = (flex(input_ids=x, position_ids=POSITIONS).logits for x in (ids, changed))
    assert not torch.allclose(a[0, :9], b[0, :9])
    torch.testing.assert_close(a[0, 9:], b[0, 9:], atol=0, rtol=0)


@pytest.mark.parametrize("window", [WINDOW, None])
def test_generation_with_a_cache_gives_sdpas_tokens(window):
    """Prefill, then decoding one token at a time (queries shorter than the keys), past the window, for an unpadded
    batch and a left-padded one (a 2-D attention mask): the same greedy tokens as transformers' sdpa."""
    sdpa, flex = _pair(window)
    prompt = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(6))
    padded = torch.ones_like(prompt)
    padded[1, :3] = 0
    for mask in (torch.ones_like(prompt), padded):
        out = [m.generate(prompt, attention_mask=mask, max_new_tokens=9, do_sample=False, use_cache=True,
                          pad_token_id=0) for m in (sdpa, flex)]
        assert out[0].shape == (2, 16)
        assert torch.equal(out[1], out[0])
    with torch.no_grad():  # and the prefill itself, whose logits come from zerotune's path
        logits = [m(input_ids=prompt, use_cache=True).logits for m in (sdpa, flex)]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-6, rtol=0)


def test_attention_dropout_in_training_is_an_error():
    from transformers import AutoModelForCausalLM

    config = _config(WINDOW)
    config.attention_dropout = 0.1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    attention.install(model)
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        model.eval()(input_ids=ids)  # eval: no dropout, runs
    with pytest.raises(ValueError, match="no attention dropout .*attn_implementation=sdpa"):
        model.train()(input_ids=ids)


def test_resolve():
    assert attention.resolve("flex", "cpu") == "flex" and attention.resolve("auto", "cpu") == "sdpa"
    assert attention.resolve("eager", "cuda") == "eager" and attention.resolve("sdpa", "cuda") == "sdpa"
    assert attention.resolve("auto", "cuda") == ("flex" if attention.available() is None else "sdpa")


def test_the_switch_installs_it_on_that_model_only_peft_wrapped_too(tmp_path):
    from transformers import AutoModelForCausalLM

    from finetune.model.build import build_model

    _config(WINDOW).save_pretrained(str(tmp_path))
    stage2 = {"bf16": {"enabled": False}, "zero_optimization": {"stage": 2}}
    built = {}
    for value in ("flex", "sdpa", "auto"):
        recipe = load_recipe(TINY_RECIPE, [f"model.path={tmp_path}", "model.activation_checkpointing=none",
                                           f"model.attn_implementation={value}", "lora.enabled=true", "lora.rank=4"])
        model, _ = build_model(recipe.model, recipe.lora, stage2)
        built[value] = (model, perf.apply(model, recipe, stage2))
    model, applied = built["flex"]
    assert "flex_attention" in applied and type(model).__name__ == "PeftModelForCausalLM"
    configs = [m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")]
    assert configs and all(c._attn_implementation == attention.KEY for c in configs)
    off = ("sdpa",) if torch.cuda.is_available() else ("sdpa", "auto")  # `auto` is flex on CUDA, sdpa elsewhere
    for value in off:
        model, applied = built[value]
        assert "flex_attention" not in applied and model.config._attn_implementation == "sdpa"
    assert {r["name"]: r["on"] for r in perf.report(load_recipe(TINY_RECIPE, []), built["flex"][1])}["flex_attention"]
    later = AutoModelForCausalLM.from_config(_config(WINDOW), attn_implementation="sdpa")
    assert later.config._attn_implementation == "sdpa"


def _no_cache(make) -> dict:
    """`cache=None` in transformers >= 5.20's mask functions, `past_key_values=None` before."""
    import inspect

    return {"cache" if "cache" in inspect.signature(make).parameters else "past_key_values": None}


def test_plain_causal_only_for_one_document_per_row_inside_the_window():
    """The CUDA path hands a mask that is exactly is_causal's to SDPA's causal kernel, and every other to
    FlexAttention: one document in each row, and a window (if any) no shorter than the row."""
    one = attention.document_ids(torch.arange(12).expand(2, -1))
    assert attention.plain_causal(one, None, 12) and attention.plain_causal(one, 12, 12)
    assert not attention.plain_causal(one, 11, 12)
    assert not attention.plain_causal(attention.document_ids(POSITIONS), None, POSITIONS.shape[1])
    padded = torch.tensor([[*range(10), 0, 1]])  # a padded tail is a document of its own
    assert not attention.plain_causal(attention.document_ids(padded), None, 12)
    mixed = torch.stack([torch.arange(12), torch.tensor([*range(6), *range(6)])])
    assert not attention.plain_causal(attention.document_ids(mixed), None, 12)
    causal = attention.dense_mask(attention.document_mask(one, None), 2, 12, torch.device("cpu"))
    assert torch.equal(causal, torch.ones(12, 12, dtype=torch.bool).tril().expand(2, 1, 12, 12))

