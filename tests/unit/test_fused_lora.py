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
from tests.fixtures.fused_lora_checks import (TARGETS, check_against_autograd_over_mask, loss_and_grads, peft_mistral,
                                             rel_err, with_and_without_recomputation)


def test_installs_on_every_adapted_projection_and_only_there():
    model = peft_mistral(torch.float32)
    assert install_fused_lora(model, zero_stage=2) == 2 * len(TARGETS)
    swapped = [n for n, m in model.named_modules() if type(m) is fused_class()]
    assert len(swapped) == 14 and all(n.split(".")[-1] in TARGETS for n in swapped)
    assert not any(hasattr(m, "_external_params") for m in model.modules())  # ZeRO-3 only
    model3 = peft_mistral(torch.float32)
    install_fused_lora(model3, zero_stage=3)
    for m in model3.modules():  # ZeRO-3 gathers base weight and adapters in the fused layer's hooks
        if type(m) is fused_class():
            assert {id(p) for p in m._external_params.values()} == {
                id(m.base_layer.weight), id(m.lora_A["default"].weight), id(m.lora_B["default"].weight)}
    # parameter names (checkpoints, adapter export) are peft's
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in peft_mistral(torch.float32).named_parameters()]


def test_fp32_loss_and_gradients_equal_peft():
    peft_model = peft_mistral(torch.float32)
    fused = copy.deepcopy(peft_model)
    install_fused_lora(fused, zero_stage=0)
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref_loss, ref = loss_and_grads(peft_model, ids)
    loss, got = loss_and_grads(fused, ids)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert set(got) == set(ref) and len(got) == 2 * 2 * len(TARGETS) + 1
    assert rel_err(got, ref) < 1e-5


def test_bf16_error_is_of_peft_bf16_order():
    """Against an fp32 oracle: the fused bf16 path rounds once per addmm where peft rounds the scaled product and the sum."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(2))
    _, oracle = loss_and_grads(peft_mistral(torch.float32), ids)
    _, peft_bf16 = loss_and_grads(peft_mistral(torch.bfloat16), ids)
    fused = peft_mistral(torch.bfloat16)
    install_fused_lora(fused, zero_stage=2)
    _, fused_bf16 = loss_and_grads(fused, ids)
    assert rel_err(fused_bf16, oracle) < 2 * rel_err(peft_bf16, oracle)


def test_dropout_mask_is_one_for_forward_and_backward():
    """torch's dropout: the mask of the function's first random draw, used by forward and backward alike."""
    check_against_autograd_over_mask((3, 5), 16, 24, 4, lambda x2: torch.native_dropout(x2, 0.25, True)[1])


def test_recomputation_rebuilds_the_same_masks():
    """Dropout on, training: activation checkpointing (non-reentrant, RNG state restored) gives the gradients of no
    checkpointing, so each recomputed forward drew the mask its backward uses."""
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    ((loss_plain, plain), (loss_ckpt, ckpt)), _ = with_and_without_recomputation(ids)
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert rel_err(ckpt, plain) < 1e-5
    # and dropout did act: eval mode (no dropout) gives another loss
    model = peft_mistral(torch.float32, dropout=0.3)
    install_fused_lora(model, zero_stage=0)
    model.eval()
    assert abs(loss_and_grads(model, ids)[0] - loss_plain) > 1e-4


def test_falls_back_to_peft_where_it_does_not_apply(monkeypatch):
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    peft_model = peft_mistral(torch.float32)
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


