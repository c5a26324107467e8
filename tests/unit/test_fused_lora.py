"""The fused LoRA projection (finetune/perf/fused_lora.py) computes what peft computes: loss and every gradient inside a
Mistral (fp32 to 1e-5; bf16 within the error of peft's own bf16 path), one dropout mask used consistently by forward,
backward and recomputation, and peft's forward wherever it does not apply.

ZeRO 0-3 training with it (the default) against a plain-PyTorch loop over peft is tests/integration/test_parity.py; ZeRO-3 on 2
ranks with dropout and recomputation, fused against peft's forward, is the last test here; its saved bytes against the
estimator are in tests/integration/test_estimate.py.
"""

import copy

import pytest
import torch

from finetune.perf.fused_lora import LoraLinearFunction, fused_class, install_fused_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_mistral(dtype, dropout=0.0, seed=0):
    from peft import LoraConfig, get_peft_model
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    model = get_peft_model(MistralForCausalLM(cfg), LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout,
                                                               target_modules=TARGETS))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which would leave A's gradient zero and untested
            torch.nn.init.normal_(p, std=0.2)
    return model.to(dtype)


def _loss_and_grads(model, ids, embeds_grad=True):
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(embeds_grad)
    loss = model(inputs_embeds=embeds, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad}
    grads["inputs_embeds"] = embeds.grad.float()
    return loss.item(), grads


def _rel_err(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)


def _with_and_without_recomputation(ids, device="cpu", dropout_kernel="torch"):
    """(loss, grads) of one training-mode step of a fused LoRA Mistral with dropout 0.3, without then with
    non-reentrant activation checkpointing, from the same torch seed; and the last model."""
    results = []
    for checkpointing in (False, True):
        model = _peft_mistral(torch.float32, dropout=0.3).to(device)
        install_fused_lora(model, zero_stage=0, dropout_kernel=dropout_kernel)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        torch.manual_seed(11)
        results.append(_loss_and_grads(model, ids.to(device)))
    return results, model


def test_installs_on_every_adapted_projection_and_only_there():
    model = _peft_mistral(torch.float32)
    assert install_fused_lora(model, zero_stage=2) == 2 * len(TARGETS)
    swapped = [n for n, m in model.named_modules() if type(m) is fused_class()]
    assert len(swapped) == 14 and all(n.split(".")[-1] in TARGETS for n in swapped)
    assert not any(hasattr(m, "_external_params") for m in model.modules())  # ZeRO-3 only
    model3 = _peft_mistral(torch.float32)
    install_fused_lora(model3, zero_stage=3)
    for m in model3.modules():  # ZeRO-3 gathers base weight and adapters in the fused layer's hooks
        if type(m) is fused_class():
            assert {id(p) for p in m._external_params.values()} == {
                id(m.base_layer.weight), id(m.lora_A["default"].weight), id(m.lora_B["default"].weight)}
    # parameter names (checkpoints, adapter export) are peft's
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _peft_mistral(torch.float32).named_parameters()]


def test_fp32_loss_and_gradients_equal_peft():
    peft_model = _peft_mistral(torch.float32)
    fused = copy.deepcopy(peft_model)
    install_fused_lora(fused, zero_stage=0)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = _loss_and_grads(peft_model, ids)
    loss, got = _loss_and_grads(fused, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(got) == set(ref) and len(got) == 2 * 2 * len(TARGETS) + 1
    assert _rel_err(got, ref) < 1e-5


def test_bf16_error_is_of_peft_bf16_order():
    """Against an fp32 oracle: the fused bf16 path rounds once per addmm where peft rounds the scaled product and the sum."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    _, oracle = _loss_and_grads(_peft_mistral(torch.float32), ids)
    _, peft_bf16 = _loss_and_grads(_peft_mistral(torch.bfloat16), ids)
    fused = _peft_mistral(torch.bfloat16)
    install_fused_lora(fused, zero_stage=2)
    _, fused_bf16 = _loss_and_grads(fused, ids)
    assert _rel_err(fused_bf16, oracle) < 2 * _rel_err(peft_bf16, oracle)


def _check_against_autograd_over_mask(rows, width, out, rank, mask_of, seeded=False, device="cpu", tol=1e-5):
    """LoraLinearFunction (scaling 0.5, dropout 0.25) gives the output and the x, A and B gradients of autograd over
    x·Wᵀ + s·(x·m/(1-p))·Aᵀ·Bᵀ, where m = mask_of(x as [tokens, width]) is drawn from the torch seed the function
    drew its own from."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*rows, width, generator=g).to(device).requires_grad_()
    w = torch.randn(out, width, generator=g).to(device)
    a = torch.randn(rank, width, generator=g).to(device).requires_grad_()
    b = torch.randn(out, rank, generator=g).to(device).requires_grad_()
    weights = torch.linspace(-1, 1, out, device=device)
    torch.manual_seed(7)
    y = LoraLinearFunction.apply(x, w, None, a, b, 0.5, 0.25, seeded)
    (y * weights).sum().backward()
    got = (y.detach(), x.grad, a.grad, b.grad)
    torch.manual_seed(7)
    mask = mask_of(x.detach().reshape(-1, width))
    assert 0.6 < mask.float().mean() < 0.9
    x.grad = a.grad = b.grad = None
    ref = x @ w.t() + 0.5 * ((x * mask.view(x.shape) / 0.75) @ a.t()) @ b.t()
    (ref * weights).sum().backward()
    for mine, theirs in zip(got, (ref.detach(), x.grad, a.grad, b.grad)):
        torch.testing.assert_close(mine, theirs, rtol=tol, atol=tol)


def test_dropout_mask_is_one_for_forward_and_backward():
    """torch's dropout: the mask of the function's first random draw, used by forward and backward alike."""
    _check_against_autograd_over_mask((3, 5), 16, 24, 4, lambda x2: torch.native_dropout(x2, 0.25, True)[1])


def test_recomputation_rebuilds_the_same_masks():
    """Dropout on, training: activation checkpointing (non-reentrant, RNG state restored) gives the gradients of no
    checkpointing, so each recomputed forward drew the mask its backward uses."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    ((loss_plain, plain), (loss_ckpt, ckpt)), _ = _with_and_without_recomputation(ids)
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert _rel_err(ckpt, plain) < 1e-5
    # and dropout did act: eval mode (no dropout) gives another loss
    model = _peft_mistral(torch.float32, dropout=0.3)
    install_fused_lora(model, zero_stage=0)
    model.eval()
    assert abs(_loss_and_grads(model, ids)[0] - loss_plain) > 1e-4


def test_falls_back_to_peft_where_it_does_not_apply(monkeypatch):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    peft_model = _peft_mistral(torch.float32)
    fused = copy.deepcopy(peft_model)
    install_fused_lora(fused, zero_stage=0)
    calls = []
    original = LoraLinearFunction.apply
    monkeypatch.setattr(LoraLinearFunction, "apply", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        with fused.disable_adapter(), peft_model.disable_adapter():  # the base model alone
            assert torch.equal(fused(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        assert not calls
        with torch.autocast("cpu", dtype=torch.bfloat16):  # ZeRO-0's bf16: peft casts per adapter
            assert torch.equal(fused(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        assert not calls
        fused(input_ids=ids)
        assert len(calls) == 14
        fused.merge_adapter()
        peft_model.merge_adapter()
        torch.testing.assert_close(fused(input_ids=ids).logits, peft_model(input_ids=ids).logits)
        assert len(calls) == 14


