"""FP8 on CUDA (finetune/perf/fp8.py): the Triton quantizer and transpose that FP8 GPU runs use, compiled for the GPU,
against quantize_rows and torch's transpose bit for bit at Mistral-7B's widths, and the FP8 linear function with them
against the same function with quantize_rows. The interpreter's checks of the same kernels:
tests/drivers/fp8_kernel_cases.py. CI (CPU) skips it; benchmarks/gpu_vs_peer.sh runs it with the other GPU parity
tests."""

import pytest
import torch

from finetune.perf import fp8

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a GPU with FP8 tensor cores")


@pytest.mark.parametrize("tokens,width", [(4096, 1024), (4096, 4096), (2000, 14336), (300, 20000), (77, 200)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantizer_equals_quantize_rows_bit_for_bit(tokens, width, dtype):
    """20,000 is wider than a block (two passes over the row); the others are read once."""
    g = torch.Generator(device="cuda").manual_seed(0)
    t = (torch.randn(tokens, width, device="cuda", generator=g)
         * torch.logspace(-3, 3, tokens, device="cuda").reshape(-1, 1)).to(dtype)
    t[1] = 0
    col = torch.rand(1, width, device="cuda", generator=g) + 0.5
    for col_scale in (None, col):
        q, scale = fp8.triton_quantize(t, col_scale)
        ref_q, ref_scale = fp8.quantize_rows(t, col_scale)
        assert q.dtype == fp8.E4M3 and torch.equal(scale, ref_scale)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("shape", [(4096, 14336), (14336, 4096), (1024, 4096), (70, 100)])
def test_transpose_equals_torch(shape):
    w_q = fp8.quantize_rows(torch.randn(*shape, device="cuda"))[0]
    out = fp8.transposed(w_q)
    assert out.is_contiguous() and torch.equal(out.view(torch.uint8), w_q.t().contiguous().view(torch.uint8))


def test_linear_function_with_the_gpu_quantizer_equals_quantize_rows():
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2, 1024, 4096, device="cuda", generator=g).bfloat16()
    w = (torch.randn(14336, 4096, device="cuda", generator=g) / 64).bfloat16()
    grad_y = torch.randn(2, 1024, 14336, device="cuda", generator=g).bfloat16()
    assert fp8.quantizer(x.device) is fp8.triton_quantize
    results = []
    for quantize in (fp8.triton_quantize, fp8.quantize_rows):
        fp8.LAST_INPUT.clear()
        xi = x.clone().requires_grad_()
        w_q, w_scale = fp8.quantize_weight(w, quantize)
        y = fp8.Fp8BaseLinearFunction.apply(xi, w_q, w_scale, None, quantize)
        y.backward(grad_y)
        results.append((y, xi.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
