"""lora.joint_qkv on the tiny Mistral, on CPU (finetune/perf/joint_qkv.py): q, k and v's FP8 base GEMMs as one,
kept (ZeRO-0/1/2) or quantized at each use (ZeRO-3), against a plain-PyTorch reference that quantizes the same way
(loss and every gradient within 2e-6 in fp32); the forward the same as the separate projections'; one quantization
of the three output gradients per attention; the bases' FP8 copies as views of one stacked weight; dropout masks and
recomputation; a projection called alone runs alone.

2 ranks under ZeRO-2/3 (where perf.apply joins them): tests/integration/test_precision.py."""

import pytest
import torch

from finetune.perf import fp8, joint_qkv, precision
from finetune.perf.fused_lora import install_fused_lora
from tests.fixtures.fp8_reference import ReferenceFp8, ReferenceJointFp8
from tests.fixtures.fused_lora_checks import TARGETS, loss_and_grads, peft_mistral, rel_err

QKV = ("q_proj", "k_proj", "v_proj")


def _ids(seed=1):
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


def _fp8_model(keep: bool, joint: bool = True, dropout: float = 0.0, dtype=torch.float32):
    model = peft_mistral(dtype, dropout=dropout)
    precision.install(model, lora=True, zero_stage=2 if keep else 3)
    install_fused_lora(model, zero_stage=0)
    if joint:
        assert joint_qkv.install_joint_qkv(model) == 2  # one attention per decoder layer
    return model


def _attentions(model):
    return [m for name, m in model.named_modules() if name.endswith("self_attn")]


def _reference_model(model):
    """peft's forward with every base layer the plain reference: q, k and v through ReferenceJointFp8 (q's base
    computes the three; k's and v's return theirs), the other projections through ReferenceFp8."""
    joined = {}
    for attn in _attentions(model):
        q, k, v = (getattr(attn, name).base_layer for name in QKV)

        def q_forward(x, q=q, k=k, v=v):
            outs = ReferenceJointFp8.apply(x, q.weight, k.weight, v.weight)
            joined[k], joined[v] = outs[1], outs[2]
            return outs[0]

        q.forward = q_forward
        k.forward = lambda x, k=k: joined.pop(k)
        v.forward = lambda x, v=v: joined.pop(v)
    for name, layer in model.named_modules():
        if name.endswith(".base_layer") and "forward" not in vars(layer) and ".layers." in name:
            layer.forward = lambda x, w=layer.weight: ReferenceFp8.apply(x, w)
    return model


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "at-each-use"])
def test_joint_qkv_equals_a_plain_reference_that_quantizes_the_three_side_by_side(keep):
    """In float64 (the GEMMs still take fp32 products of the FP8 values): the order in which the fused function and
    autograd add the adapters' input gradients then rounds below fp32's resolution, so no FP8 rounding of a later
    gradient can flip between the two (in fp32 one does: 6e-4 at inputs_embeds, where the rest agree to 1e-6)."""
    ids = _ids()
    ref_loss, ref = loss_and_grads(_reference_model(peft_mistral(torch.float64)), ids)
    loss, got = loss_and_grads(_fp8_model(keep, dtype=torch.float64), ids)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert set(got) == set(ref) and rel_err(got, ref) < 1e-12
    loss, got = loss_and_grads(_fp8_model(keep), ids)
    # the forward is the separate projections' (per-row scales stack), the backward is not: each token's gradient
    # row is scaled by its largest value across q, k and v instead of within each
    apart_loss, apart = loss_and_grads(_fp8_model(keep, joint=False), ids)
    assert loss == pytest.approx(apart_loss, rel=1e-6)
    assert 1e-4 < rel_err(got, apart) < 0.1


def test_one_quantization_of_the_three_gradients_per_attention(monkeypatch):
    """Forward: one per distinct input of a decoder layer (q/k/v's, o's, gate/up's, down's) = 4; backward: o, gate,
    up, down and one for q, k and v together, where their input needs a gradient (not layer 0's): 4 + 5."""
    model = _fp8_model(keep=True)
    calls = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t, col_scale=None: calls.append(t.shape) or real(t, col_scale))
    loss = model(input_ids=_ids(), labels=_ids()).loss
    forward = len(calls)
    loss.backward()
    assert (forward, len(calls) - forward) == (2 * 4, 4 + 5)
    assert torch.Size([2 * 24, 64 + 2 * 32]) in calls[forward:]  # [tokens, q + k + v] quantized as one


def test_the_bases_fp8_copies_are_views_of_one_stacked_weight():
    apart, model = _fp8_model(keep=True, joint=False), _fp8_model(keep=True)
    for attn, attn_apart in zip(_attentions(model), _attentions(apart)):
        leader = attn.q_proj
        stacked, scales = leader.joint_fp8, leader.joint_scale
        assert stacked.shape == (64 + 2 * 32, 64) and stacked.dtype == torch.float8_e4m3fn and scales.shape == (128, 1)
        start = 0
        for name in QKV:
            base, base_apart = getattr(attn, name).base_layer, getattr(attn_apart, name).base_layer
            assert base.weight_fp8.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
            assert base.weight_fp8.storage_offset() == start * 64
            assert torch.equal(base.weight_fp8.view(torch.uint8), base_apart.weight_fp8.view(torch.uint8))
            assert torch.equal(base.weight_scale, base_apart.weight_scale)
            start += base.out_features
    # nothing new is saved: the stacked weight is a non-persistent buffer
    assert set(model.state_dict()) == set(apart.state_dict())


def test_dropout_masks_and_recomputation_give_the_same_step():
    """torch's dropout masks are drawn in q, k, v order as the separate projections draw them (the same forward),
    and non-reentrant activation checkpointing recomputes the three as one again: the same loss and gradients."""
    ids = _ids()
    results = []
    for joint, checkpointing in ((False, False), (True, False), (True, True)):
        model = _fp8_model(keep=True, joint=joint, dropout=0.3)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        torch.manual_seed(11)
        results.append(loss_and_grads(model, ids))
    (apart_loss, _), (loss, grads), (recomputed_loss, recomputed) = results
    assert loss == pytest.approx(apart_loss, rel=1e-6)
    assert recomputed_loss == loss and rel_err(recomputed, grads) == 0


def test_a_projection_called_alone_runs_alone_and_an_output_is_taken_once():
    model, apart = _fp8_model(keep=True), _fp8_model(keep=True, joint=False)
    attn, attn_apart = _attentions(model)[0], _attentions(apart)[0]
    x, other = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    with torch.no_grad():
        q = attn.q_proj(x)
        assert torch.equal(q, attn_apart.q_proj(x))
        assert torch.equal(attn.k_proj(other), attn_apart.k_proj(other))  # not q's x: k's own GEMM
        assert torch.equal(attn.v_proj(x), attn_apart.v_proj(x))  # left by q for x
        assert "_joint_pending" not in vars(attn.v_proj)  # taken, not kept
        x.add_(1.0)  # changed in place since q ran: v computes its own output
        attn.q_proj(other)
        assert torch.equal(attn.v_proj(x), attn_apart.v_proj(x))


def test_only_fp8_bases_of_all_three_are_joined():
    bf16 = peft_mistral(torch.float32)
    install_fused_lora(bf16, zero_stage=0)
    assert joint_qkv.install_joint_qkv(bf16) == 0  # bf16 bases
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    partial = get_peft_model(MistralForCausalLM(cfg), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    precision.install(partial, lora=True, zero_stage=2)
    install_fused_lora(partial, zero_stage=0)
    assert joint_qkv.install_joint_qkv(partial) == 0  # k_proj is not adapted
    assert len(TARGETS) == 7


def test_k_and_v_do_not_keep_the_joint_output_alive():
    """Attention keeps v (and k) for its backward: they are tensors of their own, so the [tokens, q + k + v] output
    lives only as long as q, which RoPE does not keep."""
    attn = _attentions(_fp8_model(keep=True))[0]
    x = torch.randn(2, 5, 64, requires_grad=True)
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    assert q.untyped_storage().nbytes() == 2 * 5 * 128 * 4  # q is the joint output's first columns
    assert k.is_contiguous() and v.is_contiguous()
    assert k.untyped_storage().nbytes() == v.untyped_storage().nbytes() == 2 * 5 * 32 * 4
