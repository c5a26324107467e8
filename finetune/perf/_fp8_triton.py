"""The Triton kernels of finetune/perf/fp8.py: the row-wise e4m3 quantizer and the transpose of an FP8 weight.

quantize_rows_kernel computes, per row, what fp8.quantize_rows computes (the same fp32 operations in the same
order: t·col_scale, amax, amax·(1/448), t/scale rounded as IEEE division (div_rn: Triton's `/` is an approximate
division), clamp to ±448), reading the row once where it fits one block and
writing the quantized row and its scale: one kernel where torch.compile's fusion of quantize_rows made two passes
over each row and was 2-4x the bytes' time. transpose_kernel copies [M, N] bytes to [N, M], a tile at a time, for the
input gradient's GEMM, which reads the weight with its other dimension innermost."""

import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)  # fp8.E4M3_MAX; Triton reads globals only as constexpr
AMAX_FLOOR = tl.constexpr(1e-12)  # fp8._AMAX_FLOOR
INV_E4M3_MAX = tl.constexpr(1.0 / 448.0)  # fp8._INV_E4M3_MAX


@triton.jit
def _row_block(x_row, col_ptr, cols, K, HAS_COL: tl.constexpr):
    """Elements `cols` of a row as fp32, times their column factors with HAS_COL (zeros past K)."""
    inside = cols < K
    t = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_COL:
        t = t * tl.load(col_ptr + cols, mask=inside, other=0.0)
    return t


@triton.jit
def quantize_rows_kernel(x_ptr, col_ptr, q_ptr, scale_ptr, K, HAS_COL: tl.constexpr, BLOCK: tl.constexpr,
                         ONE_BLOCK: tl.constexpr):
    """Row program_id(0) of x [M, K] (contiguous): q = clamp(t/scale, ±448) stored in q's dtype, scale =
    max(amax|t|, 1e-12)·(1/448), for t = x (times col [K] with HAS_COL), all in fp32."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    q_row = q_ptr + row * K
    if ONE_BLOCK:  # the whole row in registers: read once
        cols = tl.arange(0, BLOCK)
        t = _row_block(x_row, col_ptr, cols, K, HAS_COL)
        scale = tl.maximum(tl.max(tl.abs(t), axis=0), AMAX_FLOOR) * INV_E4M3_MAX
        q = tl.minimum(tl.maximum(tl.math.div_rn(t, scale), -E4M3_MAX), E4M3_MAX)
        tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    else:  # a row wider than a block: its amax first, then the quantized values
        amax = tl.zeros((BLOCK,), tl.float32)
        for k0 in range(0, K, BLOCK):
            amax = tl.maximum(amax, tl.abs(_row_block(x_row, col_ptr, k0 + tl.arange(0, BLOCK), K, HAS_COL)))
        scale = tl.maximum(tl.max(amax, axis=0), AMAX_FLOOR) * INV_E4M3_MAX
        for k0 in range(0, K, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            q = tl.minimum(tl.maximum(tl.math.div_rn(_row_block(x_row, col_ptr, cols, K, HAS_COL), scale), -E4M3_MAX),
                          E4M3_MAX)
            tl.store(q_row + cols, q.to(q_ptr.dtype.element_ty), mask=cols < K)
    tl.store(scale_ptr + row, scale)


@triton.jit
def transpose_kernel(src_ptr, dst_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dst [N, M] = src [M, N]ᵀ for one [BLOCK_M, BLOCK_N] tile of src (both contiguous)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    tile = tl.load(src_ptr + rows[:, None] * N + cols[None, :], mask=inside)
    tl.store(dst_ptr + cols[None, :] * M + rows[:, None], tile, mask=inside)
