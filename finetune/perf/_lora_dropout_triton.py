"""The Triton kernels of finetune/perf/lora_dropout.py, at module level: Triton resolves the helpers a kernel calls by
global name. Every kernel draws the keep/drop decision of element (row, col) of a [rows, n_cols] input the same way
(keep_tile): one Philox call at counter row·⌈n_cols/8⌉ + col/8 gives four 32-bit words, that is eight 16-bit
uniforms, one for each of the eight columns of that group, and an element is kept when its uniform >= threshold
(p·2¹⁶, rounded). A draw per element, as tl.rand makes, cost more than the bytes the kernels save."""

import triton
import triton.language as tl


@triton.jit
def keep_tile(seed, rows, col0, n_cols, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_K] keep mask of columns col0 .. col0+BLOCK_K-1 (col0 a multiple of 8) of `rows`."""
    groups = col0 // 8 + tl.arange(0, BLOCK_K // 8)
    w0, w1, w2, w3 = tl.randint4x(seed, rows[:, None] * tl.cdiv(n_cols, 8) + groups[None, :])
    words = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # [BLOCK_M, BLOCK_K/8, 2, 2]
    halves = tl.join(words & 0xFFFF, words >> 16)  # [BLOCK_M, BLOCK_K/8, 2, 2, 2]: 16-bit uniforms
    return tl.reshape(halves, (BLOCK_M, BLOCK_K)).to(tl.int32) >= threshold


@triton.jit
def keep_scaled(values, seed, rows, col0, n_cols, threshold, scale, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """values (a [BLOCK_M, BLOCK_K] tile at rows, col0) with each element dropped (zero) or kept and scaled, fp32."""
    keep = keep_tile(seed, rows, col0, n_cols, threshold, BLOCK_M, BLOCK_K)
    return tl.where(keep, values.to(tl.float32) * scale, 0.0)


@triton.jit
def low_rank_kernel(x_ptr, a_ptr, out_ptr, seed_ptr, M, K, R, threshold, scale, PRECISION: tl.constexpr,
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
        dropped = keep_scaled(x, seed, rows, k0, K, threshold, scale, BLOCK_M, BLOCK_K).to(x_ptr.dtype.element_ty)
        a_t = tl.load(a_ptr + ranks[None, :] * K + cols[:, None], mask=(ranks[None, :] < R) & (cols[:, None] < K),
                      other=0.0)
        acc += tl.dot(dropped, a_t, input_precision=PRECISION)
    tl.store(out_ptr + rows[:, None] * R + ranks[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (ranks[None, :] < R))


@triton.jit
def backward_kernel(gx_ptr, x_ptr, g_ptr, a_ptr, part_ptr, seed_ptr, M, K, R, threshold, scale, rows_per_split,
                    INPUT_GRAD: tl.constexpr, WEIGHT_GRAD: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (column block, row split): over its rows, gx += drop'(g·A) (INPUT_GRAD) and A's gradient partial sum
    gᵀ·drop(x) (WEIGHT_GRAD), with one draw of the mask for both."""
    col0 = tl.program_id(0) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    split = tl.program_id(1)
    ranks = tl.arange(0, BLOCK_R)
    seed = tl.load(seed_ptr)
    a = tl.load(a_ptr + ranks[:, None] * K + cols[None, :], mask=(ranks[:, None] < R) & (cols[None, :] < K),
                other=0.0)
    acc = tl.zeros((BLOCK_R, BLOCK_K), tl.float32)
    first = split * rows_per_split
    for m0 in range(first, tl.minimum(first + rows_per_split, M), BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        inside = (rows[:, None] < M) & (cols[None, :] < K)
        g = tl.load(g_ptr + rows[:, None] * R + ranks[None, :], mask=(rows[:, None] < M) & (ranks[None, :] < R),
                    other=0.0)
        keep = keep_tile(seed, rows, col0, K, threshold, BLOCK_M, BLOCK_K)
        if INPUT_GRAD:
            lora = tl.where(keep, tl.dot(g, a, input_precision=PRECISION) * scale, 0.0)
            where = gx_ptr + rows[:, None] * K + cols[None, :]
            base = tl.load(where, mask=inside, other=0.0)
            tl.store(where, (base.to(tl.float32) + lora).to(gx_ptr.dtype.element_ty), mask=inside)
        if WEIGHT_GRAD:
            x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=inside, other=0.0)
            # rounded to x's dtype before the product, as torch's dropout output is
            dropped = tl.where(keep, x.to(tl.float32) * scale, 0.0).to(x_ptr.dtype.element_ty)
            acc += tl.dot(tl.trans(g), dropped, input_precision=PRECISION)
    if WEIGHT_GRAD:
        tl.store(part_ptr + split * R * K + ranks[:, None] * K + cols[None, :], acc,
                 mask=(ranks[:, None] < R) & (cols[None, :] < K))


@triton.jit
def mask_kernel(out_ptr, seed_ptr, M, K, threshold, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    seed = tl.load(seed_ptr)
    keep = keep_tile(seed, rows, col0, K, threshold, BLOCK_M, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], keep, mask=(rows[:, None] < M) & (cols[None, :] < K))
