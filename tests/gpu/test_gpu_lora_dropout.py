"""LoRA dropout drawn from a seed in Triton kernels (finetune/perf/lora_dropout.py) on CUDA: the interpreter's checks of
tests/drivers/lora_dropout_cases.py compiled for the GPU, at Mistral-7B's widths and in bf16, and the memory one adapted
projection keeps against torch's dropout (times: benchmarks/lora_dropout_kernels.py). CI (CPU) skips it;
benchmarks/gpu_vs_peer.sh runs it with the other GPU parity tests."""

import pytest
import torch

from finetune.perf import lora_dropout
from finetune.perf.fused_lora import LoraLinearFunction
from tests.fixtures.fused_lora_checks import check_against_autograd_over_mask, rel_err, with_and_without_recomputation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,width", [(4096, 4096), (2000, 14336), (77, 200)])
def test_kernels_equal_torch_on_the_drawn_mask(dtype, tokens, width):
    """Each kernel against an fp32 computation over the mask it draws; bf16 within bf16's rounding of the result."""
    g = torch.Generator(device="cuda").manual_seed(0)
    p, r = 0.05, 16
    x = torch.randn(tokens, width, device="cuda", generator=g).to(dtype)
    a = (torch.randn(r, width, device="cuda", generator=g) / width**0.5).to(dtype)
    grad_low = torch.randn(tokens, r, device="cuda", generator=g).to(dtype)
    grad_x = torch.randn(tokens, width, device="cuda", generator=g).to(dtype)
    seed = lora_dropout.new_seed(x.device)
    keep = lora_dropout.keep_mask(seed, (tokens, width), p, x.device)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.01
    scale = 1 / (1 - lora_dropout.drawn_p(p))
    dropped = (x.float() * keep * scale).to(dtype).float()  # torch's dropout output is rounded to x's dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lora_dropout.dropped_low_rank(x, a, seed, p).float(), dropped @ a.float().t(), **tol)
    expected = grad_x.float() + (grad_low.float() @ a.float()) * keep * scale
    got_x = grad_x.clone()
    got_a = lora_dropout.dropped_backward(grad_low, a, seed, p, grad_x=got_x, x=x).float()
    torch.testing.assert_close(got_x.float(), expected, **tol)
    ref = grad_low.float().t() @ dropped
    assert ((got_a - ref).abs().max() / ref.abs().max()).item() < (1e-5 if dtype == torch.float32 else 1e-2)


def test_function_equals_autograd_over_the_drawn_mask_on_cuda():
    assert not torch.backends.cuda.matmul.allow_tf32  # torch's default: fp32 GEMMs in full precision, as the kernels
    def drawn_mask(x2):  # the function's first random draw is its seed
        return lora_dropout.keep_mask(lora_dropout.new_seed(x2.device), tuple(x2.shape), 0.25, x2.device)

    check_against_autograd_over_mask((3, 700), 256, 320, 16, drawn_mask, seeded=True, device="cuda", tol=1e-3)


def test_recomputation_redraws_the_same_masks_on_cuda():
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(4))
    ((loss_plain, plain), (loss_ckpt, ckpt)), _ = with_and_without_recomputation(ids, "cuda", "triton")
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-6)
    assert rel_err(ckpt, plain) < 1e-5


def test_one_projection_keeps_no_mask():
    """Mistral-7B's gate_proj (4,096 -> 14,336, r 16, dropout 0.05) at 8 rows of 2,048 tokens, bf16: what forward
    keeps for backward, torch's dropout against the Triton kernels: the bool mask less. Their time is
    benchmarks/lora_dropout_kernels.py's (variants taking turns: a GPU under a power cap slows as it heats)."""
    tokens, width, out, r = 16384, 4096, 14336, 16
    x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(out, width, device="cuda", dtype=torch.bfloat16) / width**0.5
    a = (torch.randn(r, width, device="cuda", dtype=torch.bfloat16) / width**0.5).requires_grad_()
    b = (torch.randn(out, r, device="cuda", dtype=torch.bfloat16) * 0.01).requires_grad_()
    grad = torch.randn(tokens, out, device="cuda", dtype=torch.bfloat16)
    kept = {}
    for seeded in (False, True):
        LoraLinearFunction.apply(x, w, None, a, b, 2.0, 0.05, seeded).backward(grad)  # Triton compiles here
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        y = LoraLinearFunction.apply(x, w, None, a, b, 2.0, 0.05, seeded)
        kept[seeded] = (torch.cuda.memory_allocated() - base - y.numel() * y.element_size()) / 2**20
        y.backward(grad)
        del y
    print(f"\ngate_proj forward keeps, 16,384 tokens: torch dropout {kept[False]:.0f} MiB, Triton dropout "
          f"{kept[True]:.0f} MiB")
    assert kept[False] - kept[True] == pytest.approx(tokens * width / 2**20, rel=0.01)  # the bool mask
