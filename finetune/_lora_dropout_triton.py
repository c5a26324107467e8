"""The Triton kernels of finetune/lora_dropout.py, at module level: Triton resolves the helpers a kernel calls by
global name. Element (row, col) of a [rows, n_cols] input is kept when Philox(seed, row·n_cols + col) >= p, in every
kernel."""

import triton
import triton.language as tl


@triton.jit
def keep_scaled(values, seed, rows, cols, n_cols, p, scale):
    """values with element (row, col) dropped (zero) or kept and scaled, in fp32."""
    keep = tl.rand(seed, rows[:, None] * n_cols + cols[None, :]) >= p
    return tl.where(keep, values.to(tl.float32) * scale, 0.0)


@triton.jit
def low_rank_kernel(x_ptr, a_ptr, out_ptr, seed_ptr, M, K, R, p, scale, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < K),
                    other=0.0)
        # rounded to x's dtype before the product, as torch's dropout output is
        dropped = keep_scaled(x, seed, rows, cols, K, p, scale).to(x_ptr.dtype.element_ty)
        a_t = tl.load(a_ptr + ranks[None, :] * K + cols[:, None], mask=(ranks[None, :] < R) & (cols[:, None] < K),
                      other=0.0)
        acc += tl.dot(dropped, a_t, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * R + ranks[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (ranks[None, :] < R))


@triton.jit
def input_grad_kernel(gx_ptr, g_ptr, a_ptr, seed_ptr, M, K, R, p, scale, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    g = tl.load(g_ptr + rows[:, None] * R + ranks[None, :], mask=(rows[:, None] < M) & (ranks[None, :] < R),
                other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * K + cols[None, :], mask=(ranks[:, None] < R) & (cols[None, :] < K),
                other=0.0)
    lora = keep_scaled(tl.dot(g, a, input_precision=PRECISION), seed, rows, cols, K, p, scale)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    where = gx_ptr + rows[:, None] * K + cols[None, :]
    base = tl.load(where, mask=inside, other=0.0)
    tl.store(where, (base.to(tl.float32) + lora).to(gx_ptr.dtype.element_ty), mask=inside)


@triton.jit
def weight_grad_kernel(g_ptr, x_ptr, part_ptr, seed_ptr, M, K, R, p, scale, rows_per_split,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    ranks = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    first = split * rows_per_split
    for m0 in range(first, tl.minimum(first + rows_per_split, M), BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        g_t = tl.load(g_ptr + rows[None, :] * R + ranks[:, None], mask=(rows[None, :] < M) & (ranks[:, None] < R),
                      other=0.0)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < K),
                    other=0.0)
        dropped = keep_scaled(x, seed, rows, cols, K, p, scale).to(x_ptr.dtype.element_ty)
        acc += tl.dot(g_t, dropped, input_precision=PRECISION)
    tl.store(part_ptr + split * R * K + ranks[:, None] * K + cols[None, :], acc,
             mask=(ranks[:, None] < R) & (cols[None, :] < K))


@triton.jit
def mask_kernel(out_ptr, seed_ptr, M, K, p, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    seed = tl.load(seed_ptr)
    keep = tl.rand(seed, rows[:, None] * K + cols[None, :]) >= p
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], keep, mask=(rows[:, None] < M) & (cols[None, :] < K))
