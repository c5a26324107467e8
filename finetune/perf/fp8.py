"""FP8 GEMMs for LoRA's frozen base weight, W kept as float8_e4m3fn with one fp32 scale per output row, and for a
trained weight (full fine-tuning), quantized at each use.

    w_q, w_scale = quantize_weight(layer.weight)                   # once, at load time
    y = Fp8BaseLinearFunction.apply(x, w_q, w_scale, layer.bias)   # x·Wᵀ (+ bias); backward gives x its gradient
    y = Fp8LinearFunction.apply(x, layer.weight, layer.bias)       # full fine-tuning: W's gradient too, in bf16

The base GEMM of the forward (x·Wᵀ) and of the input gradient (grad_y·W) run in FP8; the adapters stay in the
activations' dtype. x and grad_y are quantized per token and W per output row, each scale spanning the dimension
its GEMM reduces, so one outlier costs the precision of its own row only. A frozen W gets no gradient, so x is not
kept; a trained W's gradient is a GEMM in the activations' dtype over the kept x, so the optimizer's gradients keep
bf16's precision.
"""

from __future__ import annotations

import functools
import weakref

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448: the largest finite e4m3fn value (it has no inf)
# The smallest row amax a scale is built from: an all-zero row gets a finite scale and quantizes to zeros.
_AMAX_FLOOR = 1e-12
# scale = amax·(1/448): a product, not amax/448, because torch on CUDA divides by a scalar as a product with its
# reciprocal (and on CPU by true division): written as the product, quantize_rows gives the same scales on both, and
# the Triton kernel (_fp8_triton.py) the same again.
_INV_E4M3_MAX = 1.0 / E4M3_MAX


def quantize_rows(t: torch.Tensor, col_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise e4m3 quantization over the last dim: (q, scale) with t ≈ q·scale, computed in fp32. With col_scale
    (fp32, [1, cols]) it quantizes t·diag(col_scale), each column times its factor: inside the quantizer, so that
    triton_quantize does the product in the same pass over t.

    scale = amax(|row|)·(1/448), shape [..., 1], fp32, so each row's largest element maps to e4m3's largest finite value.
    e4m3 keeps 3 mantissa bits, so rounding moves an element by at most 2^-4 of its magnitude (half a unit in the last
    place), or by scale·2^-10 where t/scale falls among the subnormals (below 2^-6): |q·scale - t| <= 2^-4·amax.
    """
    t = t.float() if col_scale is None else t.float() * col_scale
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=_AMAX_FLOOR) * _INV_E4M3_MAX
    # t/scale can round a hair past 448 in fp32, and e4m3fn turns what lies past its range into NaN: clamp first.
    q = (t / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale


def quantize_weight(weight: torch.Tensor, quantize=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An [out, in] weight as (w_q [out, in] e4m3, w_scale [out, 1] fp32): one scale per output row, the rows that
    the forward's GEMM reduces over `in`. Under no_grad (no gradient flows through the copy: a trained weight's is
    computed apart, Fp8LinearFunction); once at load time for a frozen weight, or at each use of a ZeRO-3 layer's
    gathered or a trained weight, there through `quantize` (triton_quantize on a GPU: eager,
    quantizing every weight twice a step cost LoRA ZeRO-3 more than its FP8 GEMMs saved)."""
    with torch.no_grad():
        w_q, w_scale = (quantize or quantize_rows)(weight.detach())
    return w_q.contiguous(), w_scale  # contiguous: scaled_matmul reads w_q as a row-major [N, K]


def frozen_weight(weight: torch.Tensor, w_scale: torch.Tensor | None, quantize=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen base's (w_q, w_scale): with w_scale, `weight` is its kept FP8 copy (ZeRO-0/1/2), as given; without,
    `weight` is a ZeRO-3 layer's gathered weight, quantized now (finetune/perf/precision.py)."""
    return (weight, w_scale) if w_scale is not None else quantize_weight(weight, quantize)


def _dequantized_matmul(a_q, a_scale, b_q, b_scale, out_dtype: torch.dtype) -> torch.Tensor:
    """The reference: (a_q·a_scale) @ (b_q·b_scale)ᵀ in fp32, rounded once to out_dtype. Widening e4m3 to fp32 is
    exact, so the operands differ from the exact dequantized values by one fp32 rounding (of the product with the
    scale), and the GEMM accumulates in fp32."""
    return ((a_q.float() * a_scale) @ (b_q.float() * b_scale).t()).to(out_dtype)


def _scaled_mm(a_q, a_scale, b_q, b_scale, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales: a_q row-major [M, K] with scale [M, 1]; mat2 column-major [K, N], which
    b_q.t() of a contiguous [N, K] is, with scale [1, N]. cuBLAS and CUTLASS take K and N in multiples of 16."""
    return torch._scaled_mm(a_q, b_q.t(), scale_a=a_scale, scale_b=b_scale.t(), out_dtype=out_dtype)


def fp8_gemm_runs(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether this device has an FP8 tensor-core GEMM with row-wise scales for out_dtype.

    FP8 tensor cores start at compute capability 8.9 (Ada, Hopper). Row-wise scaling has a bf16 output on every such
    GPU, and fp32 only through cuBLAS on 9.0 with CUDA 12.9+: bf16 (the training dtype) takes the kernel, any other
    out_dtype the reference (an fp32 run is there for exactness). The CPU takes the reference too: it has no FP8
    arithmetic, torch's CPU _scaled_mm gives the reference's result at no gain, and the reference stays the one CPU
    path that tests compare against (tests/unit/test_fp8.py checks torch's CPU _scaled_mm against it, which also
    checks the operand layout the CUDA call is given).
    """
    return device.type == "cuda" and out_dtype == torch.bfloat16 and _capability(device) >= (8, 9)


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once: every FP8 projection asks it at every call."""
    return torch.cuda.get_device_capability(device)


def scaled_matmul(a_q: torch.Tensor, a_scale: torch.Tensor, b_q: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """(a_q·a_scale) @ (b_q·b_scale)ᵀ in out_dtype, for a_q [M, K] and b_q [N, K] e4m3 (both contiguous) with fp32
    row scales a_scale [M, 1] and b_scale [N, 1]: FP8 tensor cores where they run, the fp32 reference elsewhere."""
    if fp8_gemm_runs(a_q.device, out_dtype):
        return _scaled_mm(a_q, a_scale, b_q, b_scale, out_dtype)
    return _dequantized_matmul(a_q, a_scale, b_q, b_scale, out_dtype)


def quantizer(device: torch.device):
    """The row-wise quantizer for a device: on an FP8 GPU triton_quantize (one kernel, one read of each row: eager
    torch ops cost more than the FP8 GEMM saves, docs/benchmarks/2026-12-03-h200-fp8-linear.md, and torch.compile's
    fusion of them read each row twice), elsewhere quantize_rows itself (the same values)."""
    return triton_quantize if fp8_gemm_runs(device, torch.bfloat16) else quantize_rows


@functools.cache
def _kernels():
    """finetune/perf/_fp8_triton.py, imported on first use: only FP8 GPU runs and the kernels' tests import triton."""
    from finetune.perf import _fp8_triton

    return _fp8_triton


_MAX_BLOCK = 16_384  # the widest row a program holds in registers (Mistral-7B's 14,336); wider rows take two passes


def triton_quantize(t: torch.Tensor, col_scale: torch.Tensor | None = None,
                    q_dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows(t, col_scale) by _fp8_triton.quantize_rows_kernel: the same fp32 operations, one program per
    row. q_dtype: e4m3, or fp32 for Triton's CPU interpreter, whose float8 cast rounds wrongly (the tests cast its fp32
    values with torch; on a GPU the kernel's own cast is checked against quantize_rows, tests/gpu/test_gpu_fp8.py)."""
    k = t.shape[-1]
    x = t.reshape(-1, k).contiguous()
    q = torch.empty(x.shape, dtype=q_dtype, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    col = x if col_scale is None else col_scale.reshape(-1).float().contiguous()
    block = min(1 << (k - 1).bit_length(), _MAX_BLOCK)
    if x.shape[0]:
        _kernels().quantize_rows_kernel[(x.shape[0],)](x, col, q, scale, k, HAS_COL=col_scale is not None,
                                                       BLOCK=block, ONE_BLOCK=block >= k,
                                                       num_warps=max(4, min(16, block // 1024)))
    return q.view(t.shape), scale.view(*t.shape[:-1], 1)


def transposed(w_q: torch.Tensor) -> torch.Tensor:
    """w_q [N, K] as a contiguous [K, N]: the input gradient's GEMM reads W with `out` innermost. On CUDA by
    _fp8_triton.transpose_kernel, a tile at a time: .t().contiguous()'s element-wise strided copy of 1-byte values
    took 40 ms of a 0.84 s Mistral-7B LoRA step on an H200 (224 weights a step)."""
    return triton_transpose(w_q) if w_q.is_cuda else w_q.t().contiguous()


_TRANSPOSE_TILE = 64


def triton_transpose(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor of 1-byte elements transposed into a new contiguous tensor, by the Triton kernel (bytes: the
    kernel moves uint8, so no float8 arithmetic is involved)."""
    m, n = t.shape
    out = torch.empty(n, m, dtype=t.dtype, device=t.device)
    if t.numel():
        grid = (-(-m // _TRANSPOSE_TILE), -(-n // _TRANSPOSE_TILE))
        _kernels().transpose_kernel[grid](t.contiguous().view(torch.uint8), out.view(torch.uint8), m, n,
                                          BLOCK_M=_TRANSPOSE_TILE, BLOCK_N=_TRANSPOSE_TILE)
    return out


class _LastInput:
    """The last input the forward quantized, with its quantization: q, k and v (and gate and up) are given the same
    tensor, which is then quantized once for the three (twice). The tensor is held by a weak reference, so the cache
    never keeps an activation alive (a long row's MLP input is many GiB), and its quantization goes with it; while it
    lives its identity is its own, and its version counter tells an in-place change apart."""

    def __init__(self):
        self.ref = self.version = self.value = None

    def quantize(self, x: torch.Tensor, quantize) -> tuple[torch.Tensor, torch.Tensor]:
        hit = self.ref is not None and self.ref() is x and self.version == x._version and self.value[2] is quantize
        if not hit:
            x_q, x_scale = quantize(x.reshape(-1, x.shape[-1]))
            self.ref, self.version, self.value = weakref.ref(x, self._dropped), x._version, (x_q, x_scale, quantize)
        return self.value[0], self.value[1]

    def _dropped(self, ref) -> None:
        if ref is self.ref:
            self.clear()

    def clear(self) -> None:
        self.ref = self.version = self.value = None


LAST_INPUT = _LastInput()


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, quantize=quantize_rows) -> torch.Tensor:
    """x·Wᵀ as a [tokens, out] tensor in x's dtype, for W = diag(w_scale)·w_q; x of any leading dims (no autograd)."""
    x_q, x_scale = LAST_INPUT.quantize(x, quantize)
    return scaled_matmul(x_q, x_scale, w_q, w_scale, x.dtype)


def fp8_input_grad(grad_y2: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, quantize=quantize_rows):
    """grad_y·W for W = diag(w_scale)·w_q and a [tokens, out] grad_y: the input gradient of x·Wᵀ, [tokens, in].

    grad_y·W = (grad_y·diag(s))·W_q: column j of grad_y times s[j]. The fold is needed, not only allowed: this GEMM
    reduces over `out`, and a row-wise scaled GEMM takes scales along M and N only, never along K. Folded,
    grad_y·diag(s) is quantized row-wise (per token) and W_q, now [in, out] (K = out), takes unit scales."""
    g_q, g_scale = quantize(grad_y2, w_scale.t())
    w_t = transposed(w_q)  # the FP8 GEMM reads mat2 column-major: one copy of the 1-byte weight
    return scaled_matmul(g_q, g_scale, w_t, _unit_scale(w_t.shape[0], w_t.device), grad_y2.dtype)


@functools.lru_cache(maxsize=64)
def _unit_scale(n: int, device: torch.device) -> torch.Tensor:
    """ones [n, 1] fp32: the scales of an operand that carries none (made once per width, not at every call)."""
    return torch.ones(n, 1, dtype=torch.float32, device=device)


class Fp8BaseLinearFunction(torch.autograd.Function):
    """y = x·Wᵀ (+ bias) for a frozen W = diag(w_scale)·w_q; x of any leading dims, bf16 or fp32, y in x's dtype.

    Gradients: x's, and bias's when it requires one; W gets none. `quantize` is the row-wise quantizer both directions
    use: quantize_rows, or triton_quantize (the same values, one kernel). Given `weight` (a
    ZeRO-3 layer's gathered weight) instead of w_q and w_scale, W is quantized from it in forward and again in
    backward, so no FP8 copy outlives the layer's use.
    """

    @staticmethod
    def forward(ctx, x, w_q, w_scale, bias=None, quantize=quantize_rows, weight=None):
        base = (weight, None) if weight is not None else (w_q, w_scale)  # what frozen_weight takes
        w_q, w_scale = frozen_weight(*base, quantize)
        y = fp8_linear(x, w_q, w_scale, quantize)
        if bias is not None:
            y = y + bias.to(y.dtype)
        # Kept: the weight (held by its layer anyway) and x's shape. Not x: only W's gradient would read it.
        ctx.save_for_backward(*base)
        ctx.x_shape, ctx.quantize = x.shape, quantize
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.reshape(*x.shape[:-1], w_q.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        w_q, w_scale = frozen_weight(*ctx.saved_tensors, ctx.quantize)
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_input_grad(g, w_q, w_scale, ctx.quantize).reshape(ctx.x_shape)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[3]:
            grad_bias = g.sum(0).to(ctx.bias_dtype)
        return grad_x, None, None, grad_bias, None, None


class Fp8LinearFunction(torch.autograd.Function):
    """y = x·Wᵀ (+ bias) for a trained W (full fine-tuning): the forward's and the input gradient's GEMMs in FP8, W's
    gradient gᵀ·x in the activations' dtype from the kept x, as F.linear's. W changes every step (and under ZeRO-3 it
    is the gathered weight), so it is quantized at each use, in forward and again in backward: one read of W each,
    where keeping the forward's FP8 copy for backward would hold a byte per parameter of every layer whose activations
    are kept."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, quantize=quantize_rows):
        y = fp8_linear(x, *quantize_weight(weight, quantize), quantize)
        if bias is not None:
            y = y + bias.to(y.dtype)
        ctx.save_for_backward(x, weight)
        ctx.quantize, ctx.has_bias = quantize, bias is not None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        g = grad_y.reshape(-1, grad_y.shape[-1])
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_input_grad(g, *quantize_weight(weight, ctx.quantize), ctx.quantize).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x.reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = g.sum(0)
        return grad_x, grad_w, grad_bias, None
