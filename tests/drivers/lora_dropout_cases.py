"""Triton's CPU interpreter runs finetune/perf/lora_dropout.py's kernels in these cases (fp32). Not collected by the main
test run: tests/integration/test_lora_dropout.py runs this file in a process started with TRITON_INTERPRET=1, which Triton reads
when it is first imported (its own random functions included)."""

import os

import pytest
import torch

from finetune.perf import lora_dropout
from finetune.perf.fused_lora import LoraLinearFunction
from tests.fixtures.fused_lora_checks import (check_against_autograd_over_mask, loss_and_grads, rel_err,
                                              with_and_without_recomputation)

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/integration/test_lora_dropout.py with TRITON_INTERPRET=1", allow_module_level=True)


def _seed(value: int) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int64)


@pytest.mark.parametrize("rank,tiles", [(8, None), (16, {"low_rank": (16, 32, 4, 2), "backward": (16, 16, 4, 1)})])
def test_each_kernel_equals_torch_on_the_mask_it_draws(rank, tiles, monkeypatch):
    """Each kernel, at its own tile (the mask of an element depends on its row and column only), against torch over
    the mask that keep_mask draws."""
    if tiles:
        monkeypatch.setattr(lora_dropout, "TILES", {**lora_dropout.TILES, **tiles})
    g = torch.Generator().manual_seed(0)
    m, k, p = 70, 100, 0.3  # neither a multiple of the 64-wide blocks
    x, a = torch.randn(m, k, generator=g), torch.randn(rank, k, generator=g)
    grad_low, grad_x = torch.randn(m, rank, generator=g), torch.randn(m, k, generator=g)
    seed = _seed(1234)
    keep = lora_dropout.keep_mask(seed, (m, k), p, x.device)
    assert keep.dtype == torch.bool and abs(keep.float().mean().item() - (1 - p)) < 0.03  # 7,000 draws
    assert torch.equal(lora_dropout.keep_mask(seed, (m, k), p, x.device), keep)  # a seed is one mask
    assert (lora_dropout.keep_mask(_seed(1235), (m, k), p, x.device) != keep).float().mean() > 0.2
    assert lora_dropout.drawn_p(p) == 19661 / 2**16  # p in steps of 2⁻¹⁶
    scale = 1 / (1 - lora_dropout.drawn_p(p))
    dropped = x * keep * scale
    torch.testing.assert_close(lora_dropout.dropped_low_rank(x, a, seed, p), dropped @ a.t(), rtol=1e-5, atol=1e-5)
    expected_grad_x, expected_grad_a = grad_x + (grad_low @ a) * keep * scale, grad_low.t() @ dropped
    both = grad_x.clone()  # the backward, as the fused function calls it: both products, one draw of the mask
    grad_a = lora_dropout.dropped_backward(grad_low, a, seed, p, grad_x=both, x=x)
    torch.testing.assert_close(both, expected_grad_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad_a, expected_grad_a, rtol=1e-5, atol=1e-4)
    only_input = grad_x.clone()  # the first layer's A needs no input gradient; a frozen A would need no A gradient
    assert lora_dropout.dropped_backward(grad_low, a, seed, p, grad_x=only_input) is None
    torch.testing.assert_close(only_input, expected_grad_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora_dropout.dropped_backward(grad_low, a, seed, p, x=x), expected_grad_a,
                               rtol=1e-5, atol=1e-4)


def test_masks_are_uniform_over_the_eight_columns_of_a_draw():
    """One Philox draw decides eight neighbouring columns: each of the eight keeps 1-p of its elements, and
    neighbours are independent (a column sharing another's bits would show)."""
    m, k, p = 256, 512, 0.5
    keep = lora_dropout.keep_mask(_seed(99), (m, k), p, torch.device("cpu")).float()
    by_lane = keep.view(m, k // 8, 8).mean((0, 1))
    assert (by_lane - 0.5).abs().max() < 0.03, by_lane  # 16,384 draws each: 4 sigma is 0.016
    both = (keep[:, :-1] * keep[:, 1:]).mean()
    assert abs(both.item() - 0.25) < 0.01, both  # 130,816 pairs
    rows_agree = (keep[:-1] == keep[1:]).float().mean()
    assert abs(rows_agree.item() - 0.5) < 0.01


def test_fused_function_equals_autograd_over_the_drawn_mask():
    """The function's output and gradients, with m the mask of the seed it drew (its first random draw)."""
    check_against_autograd_over_mask((3, 25), 48, 40, 8, _drawn_mask, seeded=True)


def _drawn_mask(x2: torch.Tensor) -> torch.Tensor:
    return lora_dropout.keep_mask(lora_dropout.new_seed(x2.device), tuple(x2.shape), 0.25, x2.device)


def test_recomputation_redraws_the_same_masks():
    """Inside a Mistral with dropout 0.3 on every projection: checkpointing (torch's RNG restored, so the same seeds
    drawn again) gives the gradients of no checkpointing; eval mode (no dropout) another loss."""
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))
    ((loss_plain, plain), (loss_ckpt, ckpt)), model = with_and_without_recomputation(ids, dropout_kernel="triton")
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert rel_err(ckpt, plain) < 1e-5
    model.eval()
    assert abs(loss_and_grads(model, ids)[0] - loss_plain) > 1e-4


def test_keeps_a_seed_instead_of_a_bool_per_element():
    x = torch.randn(64, 96, requires_grad=True)
    w, a, b = torch.randn(32, 96), torch.randn(8, 96, requires_grad=True), torch.randn(32, 8, requires_grad=True)

    def saved_bytes(seeded: bool) -> int:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            LoraLinearFunction.apply(x, w, None, a, b, 2.0, 0.1, seeded)
        return sum(t.numel() * t.element_size() for t in saved)

    assert saved_bytes(False) - saved_bytes(True) == 64 * 96 * 1 - 8  # the bool mask, against one int64 seed
