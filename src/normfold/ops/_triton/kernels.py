"""Triton kernels for RMSNorm and LayerNorm, forward and backward.

One kernel family covers both norms (``IS_RMS`` switches the centering off) with optional
weight, bias, residual add and weight offset (Gemma's ``1 + w``). Statistics are always fp32.

Notation (per row of length N):
    s    = x (+ residual)                      the normalized input: the sum is taken in fp32
                                               and rounded once to x's dtype (stored, returned)
    mean = sum(s) / N                          (RMS: 0)
    rstd = 1 / sqrt(sum((s - mean)²) / N + eps)
    xhat = (s - mean) · rstd
    y    = xhat · (offset + w) + b             (no weight: y = xhat + b; offset unused)

Layouts: every tensor is 2-D contiguous row-major (M, N); per-row statistics are (M,) fp32.
Row offsets are computed in int64 so tensors above 2³¹ elements index correctly.

Two shapes of work:
- the row fits one block (``BLOCK_N >= N``): a program owns a tile of ``BLOCK_M`` whole rows,
  reads x once and writes y once;
- the row does not fit (``LOOPED``): a program owns one row and walks it in ``BLOCK_N`` chunks,
  a statistics pass then a normalize pass (the second read mostly hits L2).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def norm_fwd_kernel(
    X, R, W, B, Y, S, MEAN, RSTD,  # pointers; R/W/B/S/MEAN unused when their flag is off
    M, N,
    eps, offset,
    IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    LOOPED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """y = xhat · (offset + w) + b; also stores s (with residual), mean (LN) and rstd."""
    pid = tl.program_id(0)
    if not LOOPED:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
        cols = tl.arange(0, BLOCK_N)  # (BN,)
        row_mask = rows < M
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]  # (BM, BN)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]  # (BM, BN)

        s = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
            s_stored = s.to(S.dtype.element_ty)  # rounded once; the norm normalizes this s
            tl.store(S + offs, s_stored, mask=mask)
            s = s_stored.to(tl.float32)
        if IS_RMS:
            centered = s
        else:
            mean = tl.sum(s, axis=1) / N  # (BM,)
            centered = tl.where(mask, s - mean[:, None], 0.0)
            tl.store(MEAN + rows, mean, mask=row_mask)
        # var from the centered values (two-pass in registers), never E[s²] - mean²
        var = tl.sum(centered * centered, axis=1) / N  # (BM,)
        rstd = 1.0 / tl.sqrt(var + eps)
        tl.store(RSTD + rows, rstd, mask=row_mask)

        y = centered * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y * (offset + w)[None, :]
        if HAS_BIAS:
            b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = y + b[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    else:
        row_start = pid.to(tl.int64) * N
        # pass 1: statistics. LN merges per-chunk (count, mean, M2) with Chan et al.'s update
        #   delta = mean_c − mean;  mean += delta·n_c/n;  M2 += M2_c + delta²·n_prev·n_c/n
        # which stays exact where sum(s²)/N − mean² would cancel catastrophically.
        mean = tl.zeros([1], dtype=tl.float32)
        m2 = tl.zeros([1], dtype=tl.float32)
        sumsq = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            s = tl.load(X + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s += tl.load(R + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
                s_stored = s.to(S.dtype.element_ty)
                tl.store(S + row_start + cols, s_stored, mask=col_mask)
                s = s_stored.to(tl.float32)
            if IS_RMS:
                sumsq += s * s
            else:
                n_chunk = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                n_total = start + n_chunk
                chunk_mean = tl.sum(s, axis=0) / n_chunk
                d = tl.where(col_mask, s - chunk_mean, 0.0)
                delta = chunk_mean - mean
                mean += delta * (n_chunk / n_total)
                m2 += tl.sum(d * d, axis=0) + delta * delta * (start * (n_chunk / n_total))
        if IS_RMS:
            var = tl.sum(sumsq, axis=0) / N
            rstd = 1.0 / tl.sqrt(var + eps)  # mean stays 0: no centering
        else:
            rstd = 1.0 / tl.sqrt(m2 / N + eps)
            tl.store(MEAN + pid + tl.arange(0, 1), mean)
        tl.store(RSTD + pid + tl.arange(0, 1), rstd + tl.zeros([1], dtype=tl.float32))

        # pass 2: normalize, re-reading s (the stored sum with a residual: one read, not two);
        # the barrier makes pass 1's stores of s visible to every thread of the program.
        if HAS_RESIDUAL:
            tl.debug_barrier()
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            if HAS_RESIDUAL:
                s = tl.load(S + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
            else:
                s = tl.load(X + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
            y = (s - mean) * rstd
            if HAS_WEIGHT:
                w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
                y = y * (offset + w)
            if HAS_BIAS:
                y += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
            tl.store(Y + row_start + cols, y.to(Y.dtype.element_ty), mask=col_mask)


# Backward. With g = dy · (offset + w) and xhat as above, the input gradient per row is
#     dx = rstd · (g − (sum(g) + xhat · sum(g · xhat)) / N)        (LN)
#     dx = rstd · (g − xhat · sum(g · xhat) / N)                   (RMS: no sum(g) term)
# plus ds, the gradient flowing into the returned residual stream s. Over the rows,
#     dw = sum(dy · xhat),  db = sum(dy),
# which each program accumulates in fp32 registers over its group of rows and stores as one
# partial row; the host sums the (programs, N) partials (Liger / flash-attn's scheme).


@triton.jit
def norm_bwd_row_sums_kernel(
    DY, S, W, MEAN, RSTD, SUM_G_XHAT, SUM_G,
    N,
    offset,
    IS_RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """sum(g · xhat) and (LN) sum(g) of one row too long for one block, walked in chunks."""
    row = tl.program_id(0)
    row_start = row.to(tl.int64) * N
    rstd = tl.load(RSTD + row)
    if IS_RMS:
        mean = 0.0
    else:
        mean = tl.load(MEAN + row)
    acc_g_xhat = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        dy = tl.load(DY + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        s = tl.load(S + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        xhat = tl.where(col_mask, (s - mean) * rstd, 0.0)
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
            g = dy * (offset + w)
        else:
            g = dy
        acc_g_xhat += g * xhat
        acc_g += g
    tl.store(SUM_G_XHAT + row, tl.sum(acc_g_xhat, axis=0))
    if not IS_RMS:
        tl.store(SUM_G + row, tl.sum(acc_g, axis=0))


@triton.jit
def norm_bwd_kernel(
    DY, DS, S, W, MEAN, RSTD, SUM_G_XHAT, SUM_G,  # inputs; DS/W/MEAN/SUM_* unused when off
    DX, DW_PARTIAL, DB_PARTIAL,  # outputs: dx (M, N), partials (programs along M, N) fp32
    M, N, rows_per_program,
    offset,
    IS_RMS: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROW_SUMS_GIVEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dx for a group of rows (one column block of them) and that group's partial dw, db.

    Without ``ROW_SUMS_GIVEN`` the block holds whole rows and the row sums are computed here;
    with it they come from ``norm_bwd_row_sums_kernel`` and the grid also splits columns.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    col_mask = cols < N
    if HAS_WEIGHT:
        w_eff = offset + tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    acc_dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_db = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    row_begin = pid_m * rows_per_program
    row_end = tl.minimum(row_begin + rows_per_program, M)
    for first in range(row_begin, row_end, BLOCK_M):
        rows = first + tl.arange(0, BLOCK_M)  # (BM,)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]  # (BM, BN)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            xhat = tl.where(mask, s * rstd[:, None], 0.0)
        else:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            g = dy * w_eff[None, :]
        else:
            g = dy
        if ROW_SUMS_GIVEN:
            sum_g_xhat = tl.load(SUM_G_XHAT + rows, mask=row_mask, other=0.0)
        else:
            sum_g_xhat = tl.sum(g * xhat, axis=1)
        if IS_RMS:
            dx = (g - xhat * (sum_g_xhat / N)[:, None]) * rstd[:, None]
        else:
            if ROW_SUMS_GIVEN:
                sum_g = tl.load(SUM_G + rows, mask=row_mask, other=0.0)
            else:
                sum_g = tl.sum(g, axis=1)
            dx = (g - (sum_g[:, None] + xhat * sum_g_xhat[:, None]) / N) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            acc_dw += dy * xhat
        if HAS_BIAS:
            acc_db += dy
    partial_offs = pid_m.to(tl.int64) * N + cols
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + partial_offs, tl.sum(acc_dw, axis=0), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + partial_offs, tl.sum(acc_db, axis=0), mask=col_mask)
