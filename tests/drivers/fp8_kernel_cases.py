"""Triton's CPU interpreter runs finetune/perf/_fp8_triton.py's kernels in these cases. Not collected by the main test
run: tests/unit/test_fp8.py runs this file in a process started with TRITON_INTERPRET=1, which Triton reads when it is
first imported. The interpreter's own float8 cast rounds wrongly, so the quantizer writes its fp32 values here and
torch casts them (the cast the GPU kernel makes itself is checked in tests/gpu/test_gpu_fp8.py)."""

import os

import pytest
import torch

from finetune.perf import fp8

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/unit/test_fp8.py with TRITON_INTERPRET=1", allow_module_level=True)


def _kernel_quantize(t, col_scale=None):
    q32, scale = fp8.triton_quantize(t, col_scale, q_dtype=torch.float32)
    assert q32.dtype == torch.float32 and q32.abs().max() <= 448.0
    return q32.to(fp8.E4M3), scale


def _rows(dtype, shape=(6, 100), seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-2]).reshape(-1, 1)
    t[1] = 0.0  # an all-zero row: the floor's scale, zeros out
    return t.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_block", [None, 32])  # 32: rows of 100 take the two-pass loop over blocks
def test_quantizer_equals_quantize_rows(dtype, max_block, monkeypatch):
    if max_block:
        monkeypatch.setattr(fp8, "_MAX_BLOCK", max_block)
    t = _rows(dtype)
    col = torch.rand(1, 100, generator=torch.Generator().manual_seed(1)) + 0.5
    for col_scale in (None, col):
        q, scale = _kernel_quantize(t, col_scale)
        ref_q, ref_scale = fp8.quantize_rows(t, col_scale)
        assert q.shape == ref_q.shape and scale.shape == ref_scale.shape == (6, 1)
        assert torch.equal(scale, ref_scale)
        assert torch.equal(q.float(), ref_q.float())
    assert torch.equal(q[1].float(), torch.zeros(100))


def test_quantizer_keeps_leading_dims():
    t = _rows(torch.float32, shape=(2, 3, 40))
    q, scale = _kernel_quantize(t)
    ref_q, ref_scale = fp8.quantize_rows(t)
    assert scale.shape == (2, 3, 1) and torch.equal(q.float(), ref_q.float()) and torch.equal(scale, ref_scale)


@pytest.mark.parametrize("shape", [(70, 100), (64, 64), (1, 130)])
def test_transpose_equals_torch(shape):
    g = torch.Generator().manual_seed(2)
    w_q = fp8.quantize_rows(torch.randn(*shape, generator=g))[0]
    out = fp8.triton_transpose(w_q)
    assert out.dtype == fp8.E4M3 and out.is_contiguous() and out.shape == shape[::-1]
    assert torch.equal(out.view(torch.uint8), w_q.t().contiguous().view(torch.uint8))
