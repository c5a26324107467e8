"""model.precision=fp8 on the tiny Mistral (finetune/perf/precision.py), on CPU: LoRA's FP8 base, fused or peft's
forward, kept or quantized at each use (ZeRO-3), against a plain-PyTorch reference that quantizes the same way (loss
and every gradient within 1e-6 in fp32) and against the unquantized model (within the bounds stated below); each
layer's input quantized once for q/k/v and once for gate/up; the memory the kept copy takes; full fine-tuning's FP8
projections (the fused MLP's down projection among them) against the same kind of reference, with bf16's weight
gradients; where `auto` picks FP8; a merged export refused from the FP8 copy.

2 ranks under ZeRO-2/3, resume and the merged export from the bf16 base: tests/integration/test_precision.py."""

import copy

import pytest
import torch

from finetune import perf
from finetune.config import ConfigError, load_recipe
from finetune.perf import fp8, precision
from finetune.perf.fused_lora import install_fused_lora
from tests.fixtures.fused_lora_checks import TARGETS, loss_and_grads, peft_mistral, rel_err
from tests.helpers import TINY_RECIPE

# The FP8 model against the unquantized one (fp32, this tiny model): the loss within 1% (relative), every gradient
# within 15% of its largest element (e4m3 keeps 3 mantissa bits; errors add up over 14 projections and 2 layers;
# measured: 0.05% and about 6%).
LOSS_BOUND, GRAD_BOUND = 1e-2, 0.15


def _ids(seed=1):
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


def _ref_quantize(t):
    """Row-wise e4m3 as the reference does it, written apart from the module."""
    t = t.float()
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) * (1 / 448.0)
    return (t / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _ref_forward(x, weight):
    """x·Wᵀ with x quantized per token and W per output row, in fp32."""
    w_q, w_s = _ref_quantize(weight)
    x_q, x_s = _ref_quantize(x)
    return ((x_q.float() * x_s) @ (w_q.float() * w_s).t()).to(x.dtype)


def _ref_input_grad(grad_y, weight):
    """grad_x = quantize(grad_y·diag(s_W))·W_q, in fp32."""
    w_q, w_s = _ref_quantize(weight)
    g_q, g_s = _ref_quantize(grad_y.float() * w_s.t())
    return ((g_q.float() * g_s) @ w_q.float()).to(grad_y.dtype)


class _ReferenceFp8(torch.autograd.Function):
    """The frozen base: _ref_forward, and only x's gradient."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return _ref_forward(x, weight)

    @staticmethod
    def backward(ctx, grad_y):
        return _ref_input_grad(grad_y, *ctx.saved_tensors), None


def _reference_model(model):
    """The peft model with each base layer's forward the plain reference above."""
    for name, layer in model.named_modules():
        if name.endswith(".base_layer"):  # the adapted projections' frozen base; lm_head stays as it is
            layer.forward = lambda x, w=layer.weight: _ReferenceFp8.apply(x, w)
    return model


def _fp8_model(keep: bool, fused: bool):
    model = peft_mistral(torch.float32)
    assert precision.install(model, lora=True, zero_stage=2 if keep else 3) == 2 * len(TARGETS)
    if fused:
        install_fused_lora(model, zero_stage=0)
    return model


@pytest.mark.parametrize("keep,fused", [(True, True), (False, True), (True, False)],
                         ids=["kept-fused", "at-each-use-fused", "kept-peft"])
def test_fp8_lora_equals_a_plain_reference_and_stays_near_the_unquantized_model(keep, fused):
    ids = _ids()
    ref_loss, ref = loss_and_grads(_reference_model(peft_mistral(torch.float32)), ids)
    loss, got = loss_and_grads(_fp8_model(keep, fused), ids)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    # inputs_embeds: the input gradient through every layer. fp32 rounding alone: the fused function adds the adapter
    # into the base GEMM's output in one addmm where the reference (peft's forward) rounds the product, the scaling
    # and the sum apart; measured up to 1.01e-6 fused (layer 0's k_proj.lora_B), below 1e-6 with peft's forward.
    assert set(got) == set(ref) and rel_err(got, ref) < (2e-6 if fused else 1e-6)
    plain_loss, plain = loss_and_grads(peft_mistral(torch.float32), ids)
    assert abs(loss - plain_loss) / plain_loss < LOSS_BOUND
    assert 1e-4 < rel_err(got, plain) < GRAD_BOUND  # near, and not equal: the GEMMs did run in FP8


def test_each_layer_input_is_quantized_once_for_qkv_and_once_for_gate_up(monkeypatch):
    """Forward: one quantization per distinct input of a decoder layer (q/k/v's, o's, gate/up's, down's) = 4, not 7;
    backward: one per projection whose input needs a gradient (layer 0's q/k/v read the embeddings, which do not)."""
    model = _fp8_model(keep=True, fused=True)
    calls = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t, col_scale=None: calls.append(t.shape) or real(t, col_scale))
    loss = model(input_ids=_ids(), labels=_ids()).loss
    forward = len(calls)
    loss.backward()
    assert (forward, len(calls) - forward) == (2 * 4, 2 * 7 - 3)


def test_kept_fp8_base_halves_its_bytes_and_is_never_saved():
    model = peft_mistral(torch.bfloat16)
    bases = [m.get_base_layer() for n, m in model.named_modules() if n.endswith(tuple(TARGETS))]
    bf16_bytes = sum(b.weight.numel() * b.weight.element_size() for b in bases)
    saved_before = set(model.state_dict())
    precision.install(model, lora=True, zero_stage=2)
    assert all(type(b) is precision.Fp8FrozenLinear and "weight" not in b._parameters for b in bases)
    assert {b.weight_fp8.dtype for b in bases} == {torch.float8_e4m3fn}
    assert all(b.weight_scale.shape == (b.out_features, 1) and b.weight_scale.dtype == torch.float32 for b in bases)
    fp8_bytes = sum(b.weight_fp8.nbytes + b.weight_scale.nbytes for b in bases)
    assert fp8_bytes < 0.55 * bf16_bytes
    # the state dict (what a checkpoint holds) loses the frozen base weights and gains no FP8 tensor
    assert set(model.state_dict()) == {k for k in saved_before if not k.endswith("base_layer.weight")}


class _ReferenceFp8Trained(torch.autograd.Function):
    """_ReferenceFp8 for a trained W: the same forward and input gradient, and W's gradient grad_yᵀ·x unquantized."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _ref_forward(x, weight)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g2, x2 = grad_y.reshape(-1, grad_y.shape[-1]), x.reshape(-1, x.shape[-1])
        return _ref_input_grad(grad_y, weight), (g2.t() @ x2).to(weight.dtype)


def _tiny_full():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    return MistralForCausalLM(cfg)


@pytest.mark.parametrize("fused_mlp", [False, True], ids=["unfused", "fused-mlp"])
def test_full_fine_tuning_fp8_equals_a_plain_reference_with_bf16_weight_gradients(fused_mlp):
    """Every decoder projection (the fused MLP's down projection too) in FP8 forward and input gradient, its weight
    gradient unquantized: within 1e-6 of the reference above, loss and every gradient; near the unquantized model."""
    from finetune.perf.fused_mlp import install_fused_mlp

    plain = _tiny_full()
    model, reference = copy.deepcopy(plain), copy.deepcopy(plain)
    assert precision.install(model, lora=False, zero_stage=3) == 2 * len(TARGETS)
    assert type(model.lm_head) is torch.nn.Linear  # the output layer stays in the training precision
    assert sum(type(m) is precision.Fp8Linear for m in model.modules()) == 2 * len(TARGETS)
    if fused_mlp:
        assert install_fused_mlp(model, zero_stage=0, liger=False) == 2
    for name, layer in reference.named_modules():
        if type(layer) is torch.nn.Linear and ".layers." in f".{name}":
            layer.forward = lambda x, w=layer.weight: _ReferenceFp8Trained.apply(x, w)
    ids = _ids()
    ref_loss, ref_grads = _full_loss_and_grads(reference, ids)
    loss, grads = _full_loss_and_grads(model, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    assert set(grads) == set(ref_grads) and rel_err(grads, ref_grads) < 1e-6
    plain_loss, plain_grads = _full_loss_and_grads(plain, ids)
    assert abs(loss - plain_loss) / plain_loss < LOSS_BOUND
    assert 1e-4 < rel_err(grads, plain_grads) < GRAD_BOUND  # near, and not equal: the GEMMs did run in FP8
    # names are the model's own: checkpoints and exports do not change
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


def _full_loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_auto_is_bf16_on_a_cpu_and_fp8_only_where_asked():
    assert precision.resolve("auto", lora=True, bf16=True, micro_batch_tokens=16384, seq_len=2048) == "bf16"
    assert precision.resolve("fp8", lora=True, bf16=False, micro_batch_tokens=1, seq_len=1) == "fp8"
    assert precision.resolve("bf16", lora=False, bf16=True, micro_batch_tokens=16384, seq_len=2048) == "bf16"
    recipe = load_recipe(TINY_RECIPE, ["model.precision=fp8", "lora.enabled=true"])
    model = peft_mistral(torch.float32)
    applied = perf.apply(model, recipe, {"zero_optimization": {"stage": 2}})
    assert applied[:2] == ["fp8", "fused_lora"]
    assert {r["name"]: r["on"] for r in perf.report(recipe, applied)}["fp8"] is True
    with pytest.raises(ConfigError, match="model.precision"):
        load_recipe(TINY_RECIPE, ["model.precision=fp4"])


def test_auto_on_an_fp8_gpu_follows_the_gate_and_the_micro_batch(monkeypatch):
    monkeypatch.setattr(fp8, "fp8_gemm_runs", lambda device, dtype: dtype == torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the device only reaches the stand-in above
    big, small, row = precision.AUTO_MIN_TOKENS, precision.AUTO_MIN_TOKENS - 1, precision.AUTO_MAX_SEQ_LEN

    def auto(lora=True, bf16=True, tokens=big, seq_len=row):
        return precision.resolve("auto", lora=lora, bf16=bf16, micro_batch_tokens=tokens, seq_len=seq_len)

    assert auto() == ("fp8" if precision.GATE_PASSED["lora"] else "bf16")
    assert auto(tokens=small) == "bf16"
    assert auto(seq_len=row + 1, tokens=4 * row) == "bf16"  # longer rows than the gate measured
    assert auto(bf16=False) == "bf16"  # an fp32 run
    assert auto(lora=False) == ("fp8" if precision.GATE_PASSED["full"] else "bf16")


def test_a_merged_export_is_never_made_from_the_fp8_copy(tmp_path):
    from finetune.export.weights import export_module

    model = _fp8_model(keep=True, fused=True)
    with pytest.raises(ConfigError, match="zerotune export .* --merge"):
        export_module(model, str(tmp_path / "merged"), None, lora=True, merge=True)
    assert not (tmp_path / "merged").exists() and not (tmp_path / "merged.tmp").exists()
