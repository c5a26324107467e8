"""The fused (chunked) linear cross-entropy equals the loss on materialised logits: value and both gradients, fp32
and bf16, with ignored targets, inside a Mistral model; and the estimator's logits term shrinks with it.

ZeRO 0-3 training with the fused loss (the default) against a plain-PyTorch loop on materialised logits is
tests/integration/test_parity.py; fused on vs off under ZeRO-3 on 2 ranks is test_fused_loss_matches_unfused_under_zero3 below.
"""


import pytest
import torch

from finetune.model.loss import token_loss_sum
from finetune.perf.fused_loss import fused_loss, install_fused_loss, linear_cross_entropy_sum
from tests.helpers import TINY_RECIPE, save_tiny_model


def _case(dtype, rows=37, hidden=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (rows,), generator=g)
    t[::4] = -100  # prompts and padding
    return h, w, t


@pytest.mark.parametrize("chunk_rows", [1, 8, 37, 1000])
def test_fp32_value_and_gradients_equal_materialised_logits(chunk_rows):
    h, w, t = _case(torch.float32)
    ref, n = token_loss_sum(h @ w.t(), t)
    ref.backward()
    ref_h, ref_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    got = linear_cross_entropy_sum(h, w, t, chunk_rows=chunk_rows)
    (got * 3.0).backward()  # the training loop scales the sum before backward
    assert n == int((t != -100).sum())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(h.grad, 3.0 * ref_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.grad, 3.0 * ref_w, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(h.grad[::4]) == 0  # ignored rows get no gradient


def test_rows_without_a_target_never_enter_a_gemm():
    """Only target rows are projected: a non-finite value in an ignored row (whatever a prompt position holds) changes
    nothing, where a GEMM over all rows would carry it into the weight gradient; with no target at all the loss and
    both gradients are zero."""
    h, w, t = _case(torch.float32)
    ref = linear_cross_entropy_sum(h, w, t)
    ref.backward()
    ref_h, ref_w = h.grad.clone(), w.grad.clone()
    poisoned = h.detach().clone()
    poisoned[::4] = float("nan")
    poisoned.requires_grad_()
    w.grad = None
    got = linear_cross_entropy_sum(poisoned, w, t)
    got.backward()
    assert torch.equal(got, ref) and torch.equal(w.grad, ref_w) and torch.equal(poisoned.grad, ref_h)
    h.grad = w.grad = None
    none = linear_cross_entropy_sum(h, w, torch.full_like(t, -100))
    none.backward()
    assert none.item() == 0 and torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_bf16_error_is_of_the_plain_bf16_path_order():
    """Against the fp32 truth, the fused bf16 loss and gradients are off by the same order as the plain bf16 path (the
    weight gradient is summed over chunks of 16-bit GEMMs, so within 2x of the plain path's single rounding)."""
    h, w, t = _case(torch.bfloat16, rows=64, hidden=32, vocab=200)
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    truth, _ = token_loss_sum(h32 @ w32.t(), t)
    truth.backward()
    ref, _ = token_loss_sum(h @ w.t(), t)
    ref.backward()
    plain = (ref.detach(), h.grad.float(), w.grad.float())
    h.grad = w.grad = None
    got = linear_cross_entropy_sum(h, w, t, chunk_rows=16)
    got.backward()
    assert got.dtype == torch.float32 and h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    for fused_value, plain_value, exact in zip((got.detach(), h.grad.float(), w.grad.float()), plain,
                                               (truth.detach(), h32.grad, w32.grad)):
        plain_error = (plain_value - exact).abs().max()
        assert 0 < plain_error < 0.05 * exact.abs().max()
        assert (fused_value - exact).abs().max() <= 2 * plain_error


@pytest.mark.parametrize("chunk_rows", [16, 1000])
def test_bf16_gemms_in_fp32_equal_the_bf16_gemms(chunk_rows):
    """upcast (a CPU without native bf16): fp32 GEMMs rounded to bf16 once give the 16-bit GEMMs' values, up to
    summation order (a bf16 GEMM accumulates in fp32 too): the loss within 1e-5 relative, gradients within one bf16
    rounding step (2^-8 relative)."""
    results = []
    for upcast in (False, True):
        h, w, t = _case(torch.bfloat16, rows=64, hidden=32, vocab=200)
        loss = linear_cross_entropy_sum(h, w, t, chunk_rows=chunk_rows, upcast=upcast)
        loss.backward()
        results.append((loss.detach(), h.grad.float(), w.grad.float()))
    (loss16, gh16, gw16), (loss32, gh32, gw32) = results
    torch.testing.assert_close(loss32, loss16, rtol=1e-5, atol=0)
    torch.testing.assert_close(gh32, gh16, rtol=2 ** -8, atol=1e-6)
    torch.testing.assert_close(gw32, gw16, rtol=2 ** -8, atol=1e-6)
    assert gw32.dtype == torch.float32 and torch.count_nonzero(gh32[::4]) == 0


def test_upcast_is_chosen_where_bf16_would_be_emulated():
    from finetune.ds_config import native_cpu_bf16
    from finetune.perf.fused_loss import emulated_bf16

    assert emulated_bf16(torch.zeros(2, dtype=torch.bfloat16)) is not native_cpu_bf16()
    assert not emulated_bf16(torch.zeros(2))  # fp32 is never emulated


def test_no_gradient_work_without_grad():
    h, w, t = _case(torch.float32)
    with torch.no_grad():
        got = linear_cross_entropy_sum(h, w, t)
    assert not got.requires_grad
    torch.testing.assert_close(got, token_loss_sum(h @ w.t(), t)[0])


def test_inside_a_mistral_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = save_tiny_model(str(tmp_path / "m"))
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fused = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    install_fused_loss(fused)
    ids = torch.randint(0, plain.config.vocab_size, (2, 24))
    targets = torch.roll(ids, -1, 1)
    targets[:, :5] = -100
    ref, _ = token_loss_sum(plain(input_ids=ids).logits, targets)
    ref.backward()
    with fused_loss(fused, targets):
        got = fused(input_ids=ids).logits
    got.backward()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters()):
        assert (b.grad - a.grad).abs().max() <= 1e-5 * a.grad.abs().max(), name
    # Outside the block the head is the plain projection again (generation, eval), and the names are unchanged.
    torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert list(fused.state_dict()) == list(plain.state_dict())


def test_lora_on_lm_head_is_refused():
    from finetune.config import ConfigError, load_recipe

    with pytest.raises(ConfigError, match="model.fused_loss=false or drop lm_head"):
        load_recipe(TINY_RECIPE, ["lora.enabled=true", "lora.target_modules=[q_proj,lm_head]"])


def test_estimator_logits_term_is_one_chunk():
    from finetune.memory.estimate import estimate_activations
    from tests.fixtures.model_shapes import MISTRAL

    plain = estimate_activations(MISTRAL, None, 2048, 4, "full")
    fused = estimate_activations(MISTRAL, None, 2048, 4, "full", fused_loss=True)
    vocab, h = MISTRAL["vocab_size"], MISTRAL["hidden_size"]
    assert plain["logits"] == 8192 * 10 * vocab  # 16-bit logits, their fp32 copy, the fp32 log-softmax
    assert fused["logits"] == 8192 * 2 * h + 2 * vocab * h + 1024 * vocab * 10 + 4 * vocab * h
    assert plain["total"] - fused["total"] > 1.4 * 2**30  # of 2.4 GiB of logits terms at 4 rows of 2,048



