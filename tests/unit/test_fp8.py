"""FP8 GEMMs for the frozen base weight (finetune/perf/fp8.py), on CPU: the row-wise quantizer's error bound, the
autograd function against a plain-PyTorch reference that quantizes the same way (within 1e-6 in fp32), against the
unquantized layer (within a stated bound), the gradients it gives and the tensors it keeps, and torch's CPU
_scaled_mm against the fp32 reference (which also checks the operand layout the CUDA call is given).
"""

import pytest
import torch

from finetune.perf import fp8
from finetune.perf.fp8 import Fp8BaseLinearFunction, quantize_rows, quantize_weight, scaled_matmul
from tests.helpers import run_under_triton_interpreter

IN, OUT = 64, 48


def _reference_quantize(t):
    """Row-wise e4m3, written apart from the module: scale = amax·(1/448) (amax at least 1e-12), q = t/scale."""
    t = t.float()
    scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) * (1 / 448.0)
    return (t / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def _layer(seed=0, dtype=torch.float32, batch=(2, 16)):
    """x [*batch, IN], W [OUT, IN] (so x·Wᵀ has unit-scale entries), bias [OUT], grad_y [*batch, OUT]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*batch, IN, generator=g)
    w = torch.randn(OUT, IN, generator=g) / IN ** 0.5
    bias = torch.randn(OUT, generator=g)
    grad_y = torch.randn(*batch, OUT, generator=g)
    return x.to(dtype), w.to(dtype), bias.to(dtype), grad_y.to(dtype)


def _loss(y, grad_y):
    """A scalar whose gradient for y is grad_y, bit for bit. (y.backward(grad_y) gives the same, but its first call
    in a process makes torch import its symbolic-shapes module, sympy with it: seconds, in whichever test is first.)"""
    return (y * grad_y).sum()


def _run(x, w_q, w_scale, bias, grad_y):
    """y and grad_x of the FP8 function."""
    x = x.detach().requires_grad_()
    y = Fp8BaseLinearFunction.apply(x, w_q, w_scale, bias)
    _loss(y, grad_y).backward()
    return y.detach(), x.grad


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _assert_close(actual, expected, rtol=1e-6, atol=1e-6):
    """torch.allclose with the largest difference in the message. (torch.testing.assert_close imports
    torch.distributed.tensor on its first call: seconds, in whichever test is first.)"""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.allclose(actual, expected, rtol=rtol, atol=atol), (actual - expected).abs().max().item()


def test_quantize_rows_shapes_dtypes_and_error_bound():
    """e4m3 keeps 3 mantissa bits: rounding t/scale to the nearest e4m3 value moves it by half a unit in the last place,
    at most 2^-4 of its magnitude among the normals (|t/scale| >= 2^-6), and at most 2^-10 (half the subnormal step
    2^-9) below them. Times the scale: |q·scale - t| <= 2^-4·|t| + scale·2^-10, which is below 2^-4·amax. Rows spread
    over six orders of magnitude, so each row's own scale is what keeps the bound."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(3, 32, 256, generator=g) * torch.logspace(-3, 3, 32).reshape(1, 32, 1)
    q, scale = quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 32, 1)
    error = (q.float() * scale - t).abs()
    amax = t.abs().amax(-1, keepdim=True)
    fp32_slack = 1e-6 * t.abs()  # t/scale and q·scale each round once in fp32
    assert (error <= 2 ** -4 * t.abs() + scale * 2 ** -10 + fp32_slack).all()
    assert (error <= 2 ** -4 * amax).all()
    # each row's largest magnitude lands on e4m3's largest finite value, so no row wastes range
    assert torch.equal(q.float().abs().amax(-1), torch.full((3, 32), 448.0))
    assert torch.equal(q, _reference_quantize(t)[0])
    q16, scale16 = quantize_rows(t.bfloat16())  # bf16 in: computed in fp32 all the same
    assert q16.dtype == torch.float8_e4m3fn and scale16.dtype == torch.float32


def test_zero_rows_quantize_to_zeros():
    t = torch.randn(4, 32)
    t[1] = 0.0
    q, scale = quantize_rows(t)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(q[1].float(), torch.zeros(32))
    assert torch.equal((q.float() * scale)[1], torch.zeros(32))
    assert not q.float().isnan().any()


def test_a_column_scale_is_applied_before_quantizing():
    t, col_scale = torch.randn(8, 32), torch.rand(1, 32) + 0.5
    q, scale = quantize_rows(t, col_scale)
    ref_q, ref_scale = _reference_quantize(t * col_scale)
    assert torch.equal(q, ref_q) and torch.equal(scale, ref_scale)


def test_quantize_weight_is_rowwise_per_output_row():
    _, w, _, _ = _layer()
    w_q, w_scale = quantize_weight(w.t().contiguous().t())  # a non-contiguous view comes back contiguous
    assert w_q.shape == (OUT, IN) and w_q.is_contiguous() and w_scale.shape == (OUT, 1)
    ref_q, ref_scale = _reference_quantize(w)
    assert torch.equal(w_q, ref_q) and torch.equal(w_scale, ref_scale)
    assert not w_q.requires_grad and not w_scale.requires_grad


def test_forward_and_grad_x_equal_the_dequantized_reference():
    """fp32 in, 3-D x, with a bias: y = deq(q(x))·deq(W_q)ᵀ + b and grad_x = deq(q(grad_y ⊙ sᵀ))·W_q, in fp32."""
    x, w, bias, grad_y = _layer()
    w_q, w_scale = quantize_weight(w)
    y, grad_x = _run(x, w_q, w_scale, bias, grad_y)

    x_q, x_scale = _reference_quantize(x.reshape(-1, IN))
    y_ref = (x_q.float() * x_scale) @ (w_q.float() * w_scale).t() + bias
    g_q, g_scale = _reference_quantize(grad_y.reshape(-1, OUT) * w_scale.t())
    grad_x_ref = (g_q.float() * g_scale) @ w_q.float()
    _assert_close(y, y_ref.reshape(2, 16, OUT))
    _assert_close(grad_x, grad_x_ref.reshape(2, 16, IN))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_close_to_the_unquantized_layer(dtype):
    """Against x·Wᵀ and grad_y·W in fp32 from the unquantized fp32 values, relative Frobenius error.

    Each GEMM has two rounded operands (x and W forward; grad_y⊙sᵀ and W backward). Rounding to 3 mantissa bits
    leaves an element with mantissa m in [1, 2) a relative error spread evenly within ±2^-4/m: root mean square
    2^-4/√3 times that of 1/m, which is near 0.74 for Gaussian data, so near 0.027 per operand; two independent
    operands give √2 times that, near 0.038, whatever the layer's size. With this seed it is 0.035 forward and 0.037
    backward, in fp32 and in bf16 alike (bf16's own roundings of x, W and y, 2^-9 each, add little). The bound, 0.05,
    leaves a third of margin, and a quantizer one mantissa bit short, or a scale lost, would double the error or more.
    """
    x, w, bias, grad_y = _layer(dtype=torch.float32)
    w_q, w_scale = quantize_weight(w.to(dtype))
    y, grad_x = _run(x.to(dtype), w_q, w_scale, None, grad_y.to(dtype))
    assert y.dtype == dtype and grad_x.dtype == dtype
    assert _rel(y, x @ w.t()) < 0.05
    assert _rel(grad_x, grad_y @ w) < 0.05


def test_only_x_and_bias_get_gradients_and_x_is_not_kept():
    x, w, bias, grad_y = _layer(batch=(3, 5))
    w_q, w_scale = quantize_weight(w)
    x = x.requires_grad_()
    bias = bias.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = Fp8BaseLinearFunction.apply(x, w_q, w_scale, bias)
    assert y.shape == (3, 5, OUT)
    # only the weight is kept, never x (W's gradient, the one reader of x, is never computed)
    assert len(saved) == 2 and saved[0] is w_q and saved[1] is w_scale
    grad_x, grad_bias = torch.autograd.grad(_loss(y, grad_y), (x, bias))
    assert grad_x.shape == x.shape and grad_x.dtype == x.dtype
    _assert_close(grad_bias, grad_y.sum((0, 1)))
    assert w_q.grad is None and w_scale.grad is None

    # a bias that requires no gradient, and none at all: y differs by the bias, grad_x not at all
    y_frozen, grad_frozen = _run(x, w_q, w_scale, bias.detach(), grad_y)
    y_none, grad_none = _run(x, w_q, w_scale, None, grad_y)
    _assert_close(y_frozen, y_none + bias.detach())
    assert torch.equal(grad_frozen, grad_x) and torch.equal(grad_none, grad_x)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_scaled_mm_equals_the_reference(out_dtype):
    """torch's CPU _scaled_mm takes e4m3 with row-wise scales and gives the fp32 reference's result: the call the
    CUDA path makes (b_q.t() column-major, scale_b [1, N]) is right. scaled_matmul on CPU is the reference itself."""
    g = torch.Generator().manual_seed(0)
    a_q, a_scale = quantize_rows(torch.randn(40, 128, generator=g))
    b_q, b_scale = quantize_rows(torch.randn(32, 128, generator=g) * 3)
    reference = fp8._dequantized_matmul(a_q, a_scale, b_q, b_scale, out_dtype)
    # the same products, maybe summed in another order: within fp32 rounding of entries of order √128
    _assert_close(fp8._scaled_mm(a_q, a_scale, b_q, b_scale, out_dtype), reference, atol=1e-5)
    assert torch.equal(scaled_matmul(a_q, a_scale, b_q, b_scale, out_dtype), reference)
    assert reference.dtype == out_dtype and reference.shape == (40, 32)


def test_the_shared_input_quantization_keeps_no_activation_alive():
    """q/k/v share one quantization of their input (fp8.LAST_INPUT), held only while that input lives: a long row's
    activation is not kept past its layer by the cache, and a new tensor never reuses an old one's quantization."""
    import gc
    import weakref

    x, w, _, _ = _layer()
    w_q, w_scale = quantize_weight(w)
    first = fp8.fp8_linear(x, w_q, w_scale)
    assert torch.equal(fp8.fp8_linear(x, w_q, w_scale), first)
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None and fp8.LAST_INPUT.value is None
    x2 = _layer(seed=1)[0]
    assert not torch.equal(fp8.fp8_linear(x2, w_q, w_scale), first)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, tests/gpu/test_gpu_fp8.py runs the compiled kernels")
def test_triton_kernels_under_the_interpreter_equal_quantize_rows_and_torchs_transpose():
    """The GPU's quantizer and transpose (finetune/perf/_fp8_triton.py) in Triton's CPU interpreter:
    tests/drivers/fp8_kernel_cases.py, in a process of its own (Triton reads TRITON_INTERPRET at its import)."""
    run_under_triton_interpreter("tests/drivers/fp8_kernel_cases.py", passed=8)
