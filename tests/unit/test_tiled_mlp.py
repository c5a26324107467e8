"""The tiled MLP (finetune/perf/tiled_mlp.py) computes what the MLP it wraps computes, a tile of tokens at a time: fp32
output and gradients (input and every trained parameter) within 1e-6, over transformers' MLP and the fused one, full
and LoRA (peft's and fused), with tiles that do not divide the tokens; dropout masks are drawn again in backward; the
tiled loss (finetune/perf/fused_loss.py) and the tiled MLP together equal the plain model within 1e-6.

Real engines (ZeRO-2 and ZeRO-3 on 2 ranks, tiled vs untiled) are tests/integration/test_tiled_mlp.py.
"""

import copy

import pytest
import torch

from finetune.perf import tiled_mlp
from finetune.perf.fused_lora import install_fused_lora
from finetune.perf.fused_mlp import install_fused_mlp
from finetune.perf.tiled_mlp import install_tiled_mlp
from tests.fixtures.tile_log import log_tiles

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 32, 88, 2, 96
TILE = 16
ROWS, SEQ = 2, 37  # 74 tokens: 5 tiles of 15 or 14, none a multiple of the tile


def _mistral(seed=0):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    torch.manual_seed(seed)
    return MistralForCausalLM(cfg).float()


def _lora(model, targets, dropout=0.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=targets))
    for n, p in model.named_parameters():  # lora_B starts at zero: give it values so every gradient is non-trivial
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    return model


def _variant(kind: str, fused_mlp: bool):
    model = _mistral()
    if kind != "full":
        model = _lora(model, ["q_proj", "gate_proj", "up_proj"] if fused_mlp else ["gate_proj", "up_proj", "down_proj"])
        if kind == "fused-lora":
            assert install_fused_lora(model, zero_stage=2, dropout_kernel="torch") > 0
    if fused_mlp:
        assert install_fused_mlp(model, zero_stage=2, liger=False) == LAYERS
    return model


def _mlp_of(model):
    return next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))


def _grads(module, x, weight):
    y = module(x)
    (y * weight).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters() if p.requires_grad}


def _close(a, b, what):
    err = (a - b).abs().max().item()
    assert err <= 1e-6 * max(1.0, b.abs().max().item()), (what, err)


@pytest.mark.parametrize("fused_mlp", [True, False], ids=["fused-mlp", "plain-mlp"])
@pytest.mark.parametrize("kind", ["full", "peft-lora", "fused-lora"])
def test_fp32_output_and_gradients_equal_the_untiled_mlp(kind, fused_mlp):
    plain = _variant(kind, fused_mlp)
    tiled = copy.deepcopy(plain)
    assert install_tiled_mlp(tiled, zero_stage=2, max_tokens=ROWS * SEQ, tile_tokens=TILE) == LAYERS
    g = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, SEQ, HIDDEN, generator=g)
    weight = torch.randn(ROWS, SEQ, HIDDEN, generator=g)
    calls = log_tiles(_mlp_of(tiled))
    y_p, gx_p, gp = _grads(_mlp_of(plain), x.clone().requires_grad_(), weight)
    y_t, gx_t, gt = _grads(_mlp_of(tiled), x.clone().requires_grad_(), weight)
    assert calls == [15, 15, 15, 15, 14] * 2  # forward's tiles, then backward's
    _close(y_t, y_p, "output")
    _close(gx_t, gx_p, "input gradient")
    assert gt.keys() == gp.keys() and len(gp) == (3 if kind == "full" else 4 if fused_mlp else 6)
    for name, grad in gp.items():
        _close(gt[name], grad, name)


def test_short_calls_pad_to_the_same_tile_count_and_no_grad_runs_tiles_too():
    """A micro-batch shorter than one row per tile still runs every tile (ZeRO-3's module trace is the same on every
    rank); the zero rows change nothing. Without grad the same tiles run and nothing is kept."""
    plain = _mistral()
    tiled = copy.deepcopy(plain)
    install_tiled_mlp(tiled, zero_stage=2, max_tokens=ROWS * SEQ, tile_tokens=TILE)
    mlp = _mlp_of(tiled)
    calls = log_tiles(mlp)
    x = torch.randn(1, 3, HIDDEN, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(1, 3, HIDDEN)
    y_p, gx_p, gp = _grads(_mlp_of(plain), x.clone().requires_grad_(), weight)
    y_t, gx_t, gt = _grads(mlp, x.clone().requires_grad_(), weight)
    assert calls == [1] * 10
    _close(y_t, y_p, "output")
    _close(gx_t, gx_p, "input gradient")
    for name, grad in gp.items():
        _close(gt[name], grad, name)
    calls.clear()
    with torch.no_grad():
        long = torch.randn(ROWS, SEQ, HIDDEN)
        _close(mlp(long), _mlp_of(plain)(long), "no-grad output")
    assert calls == [15, 15, 15, 15, 14]


def test_dropout_masks_are_drawn_again_in_backward():
    """LoRA dropout: backward's recomputed tiles draw the forward's masks. The reference runs the same tiles with
    autograd on from the same seed (the same draws in the same order); a backward that did not restore the random
    state would differentiate other masks."""
    plain = _lora(_mistral(), ["gate_proj", "up_proj", "down_proj"], dropout=0.3).train()
    tiled = copy.deepcopy(plain)
    install_tiled_mlp(tiled, zero_stage=2, max_tokens=ROWS * SEQ, tile_tokens=TILE)
    x = torch.randn(ROWS, SEQ, HIDDEN, generator=torch.Generator().manual_seed(4))
    weight = torch.randn(ROWS, SEQ, HIDDEN, generator=torch.Generator().manual_seed(5))
    ref_mlp = _mlp_of(plain)
    torch.manual_seed(7)
    xr = x.clone().requires_grad_()
    y_r = torch.cat([ref_mlp(t) for t in torch.tensor_split(xr.reshape(-1, HIDDEN), 5)]).view_as(x)
    (y_r * weight).sum().backward()
    ref = {n: p.grad for n, p in ref_mlp.named_parameters() if p.requires_grad}
    torch.manual_seed(7)
    y_t, gx_t, got = _grads(_mlp_of(tiled), x.clone().requires_grad_(), weight)
    _close(y_t, y_r.detach(), "output")
    _close(gx_t, xr.grad, "input gradient")
    for name, grad in ref.items():
        _close(got[name], grad, name)


def test_with_the_tiled_loss_and_recomputed_layers_the_model_equals_the_plain_one():
    """The long-context path: every layer recomputed (non-reentrant), the tiled MLP inside, and the fused loss (the
    tiled output layer and loss, chunk rows not dividing the tokens): loss and every gradient within 1e-6 of the
    plain model's materialised logits and whole MLPs."""
    from finetune.model.loss import token_loss_sum
    from finetune.perf import fused_loss

    plain = _mistral()
    tiled = copy.deepcopy(plain)
    tiled.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    install_fused_mlp(tiled, zero_stage=2, liger=False)
    install_tiled_mlp(tiled, zero_stage=2, max_tokens=ROWS * SEQ, tile_tokens=TILE)
    fused_loss.install_fused_loss(tiled)
    plain.train(), tiled.train()
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(6))
    targets = torch.roll(ids, -1, 1)
    targets[:, :4] = -100
    ref, _ = token_loss_sum(plain(input_ids=ids).logits, targets)
    ref.backward()
    chunk = fused_loss.CHUNK_ROWS
    fused_loss.CHUNK_ROWS = 24  # 74 tokens: chunks of 24, 24, 24, 2
    try:
        with fused_loss.fused_loss(tiled, targets):
            got = tiled(input_ids=ids).logits
    finally:
        fused_loss.CHUNK_ROWS = chunk
    got.backward()
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for (name, a), (_, b) in zip(plain.named_parameters(), tiled.named_parameters()):
        _close(b.grad, a.grad, name)


@pytest.mark.parametrize("checkpointing, recomputed", [("full", [0, 1]), ("selective", [1]), ("offload", [0, 1])])
@pytest.mark.parametrize("kind", ["full", "peft-lora"])
def test_a_recomputed_layer_runs_its_tiles_twice_not_three_times(kind, checkpointing, recomputed):
    """Layers recomputed as finetune/model/build.py sets them up (finetune/model/recompute.py marks the second run): a recomputed
    layer's MLP runs its tiles in forward and in backward only, not again in the layer's recomputation, as a layer
    kept whole does; loss and every gradient equal the plain model's (no tiles, no recomputation) within 1e-6."""
    from finetune.model.build import _enable_checkpointing

    plain, tiled = _mistral(), _mistral()
    _enable_checkpointing(tiled, recomputed, offload=checkpointing == "offload")  # before LoRA, as finetune/model/build.py
    if kind == "peft-lora":
        plain, tiled = (_lora(m, ["gate_proj", "up_proj", "down_proj"]) for m in (plain, tiled))
    install_tiled_mlp(tiled, zero_stage=2, max_tokens=ROWS * SEQ, tile_tokens=TILE)
    tiles = [log_tiles(m) for name, m in tiled.named_modules() if name.endswith(".mlp")]
    plain.train(), tiled.train()
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(8))
    losses = []
    for model in (plain, tiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    calls = [len(t) for t in tiles]
    assert calls == [5 * 2] * LAYERS  # 5 tiles in forward and 5 in backward, recomputed or not
    assert abs(losses[1] - losses[0]) <= 1e-6 * abs(losses[0])
    grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (plain, tiled)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        _close(grads[1][name], grad, name)


def test_zero3_registers_every_mlp_parameter_with_the_mlp():
    """Under ZeRO-3 the MLP's hooks gather all its projections' parameters once, for forward and for backward, and
    they are whole when handed to the tiled function."""
    model = _lora(_mistral(), ["gate_proj", "down_proj"])
    install_tiled_mlp(model, zero_stage=3, max_tokens=64, tile_tokens=TILE)
    for layer in model.base_model.model.model.layers:
        assert set(layer.mlp._external_params.values()) == set(layer.mlp.parameters())


def test_recipe_switch(tmp_path, monkeypatch):
    """perf.apply: `on`, `off`, and `auto` = on for rows longer than one tile; the tile count is fixed by the
    recipe's micro-batch."""
    from transformers import MistralConfig

    from finetune import perf
    from finetune.config import load_recipe
    from finetune.model.build import build_model
    from tests.helpers import TINY_RECIPE

    path = str(tmp_path)
    MistralConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8).save_pretrained(path)
    monkeypatch.setattr(tiled_mlp, "TILE_TOKENS", 64)
    # quoted: YAML reads a bare on/off as a boolean
    ds = {"bf16": {"enabled": False}}
    for setting, seq, expected in (("auto", 64, False), ("auto", 65, True), ("on", 32, True), ("off", 4096, False)):
        recipe = load_recipe(TINY_RECIPE, [f"model.path={path}", "lora.enabled=false", f"model.tiled_mlp='{setting}'",
                                           f"data.max_seq_len={seq}", "train.micro_batch_size=3",
                                           "model.activation_checkpointing=none"])
        model, _ = build_model(recipe.model, recipe.lora, ds)
        assert ("tiled_mlp" in perf.apply(model, recipe, ds)) == expected, (setting, seq)
        mlps = [m for n, m in model.named_modules() if n.endswith(".mlp")]
        assert {getattr(m, "_tiled_mlp_tiles", None) for m in mlps} == ({-(-3 * seq // 64)} if expected else {None})
