"""Host side of the Triton norm kernels: launch plans and the backend contract (norm_fwd, norm_bwd).

The dispatch in ``normfold.ops`` calls these for CUDA tensors, already flattened to 2-D
(M, N) row-major; under ``TRITON_INTERPRET=1`` they also run on CPU tensors (tests).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from .kernels import norm_bwd_kernel, norm_bwd_row_sums_kernel, norm_fwd_kernel

# Launch policy. These kernels are HBM-bound: what matters is how many bytes each SM has in
# flight, i.e. (programs resident on an SM) × (elements a program loads at once), and programs
# resident is set by registers (64K per SM). The tables below come from ptxas register counts of
# these kernels for sm_90 (Triton 3.9, bf16 and fp32, RMS and LN+bias+residual; printed by
# ``python tests/ops/test_triton_compile.py``, no GPU needed): they pick the warps that keep
# ~8-16K elements in flight per SM without spilling. They are not yet timed on a GPU: retune
# them from ``benchmarks/gpu_check.py`` results.
#
# Forward: ~16-32 elements a thread. Rows shorter than 2048 are stacked into 2048-element tiles
# (N=256: 8 rows a program, 4 warps, ~60-80 registers, 6-9 programs an SM). 8192 at 16 warps
# would need 74 registers (> 64: one program an SM), so it gets 8 warps; 16384 at 16 warps
# spills, at 32 warps it takes 55-64 registers.
FWD_MAX_BLOCK = 16384  # longest row a forward program holds whole; longer rows are walked
FWD_MIN_TILE = 2048
FWD_WARPS = {2048: 4, 4096: 4, 8192: 8, 16384: 32}
# Backward: dy, s, xhat, g and the dw/db accumulators are live together, ~10 registers an
# element, so 8 elements a thread: tile/256 warps (8192 at 32 warps: 63 registers, no spill).
# Rows are never stacked at 32 warps (2 × 4096 at 32 warps spills).
BWD_MAX_BLOCK = 8192
BWD_MIN_TILE = 1024
BWD_WARPS = {1024: 4, 2048: 8, 4096: 16, 8192: 32}
# Backward programs per SM: each owns a group of rows and writes one fp32 partial row of dw/db;
# more programs balance the tail better but grow the (programs, N) partial buffer.
BWD_PROGRAMS_PER_SM = 2
# Program count for the backward when there is no GPU to ask (the interpreter on CPU).
BWD_PROGRAMS_WITHOUT_GPU = 4
# 32 warps × 32 threads × 32 elements: a larger block could only spill registers.
_LARGEST_BLOCK = 32768
# Statistics are fp32, so fp64 inputs would silently lose precision: they take the reference.
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LaunchPlan:
    """How a kernel covers an (M, N) input: tiles of ``block_m`` rows × ``block_n`` columns."""

    block_m: int  # rows a program holds at once (1 when looped)
    block_n: int  # power of two; >= N unless looped
    looped: bool  # True when a row is walked in block_n chunks
    num_warps: int


@functools.lru_cache(maxsize=1024)  # a few µs of Python an eager call would pay again
def plan_launch(n: int, max_block: int, *, backward: bool = False) -> LaunchPlan:
    """One block per row when N fits ``max_block`` (short rows stacked into a tile), else chunks
    of ``max_block``; warps from the forward or backward table."""
    if max_block < 1 or max_block & (max_block - 1) or max_block > _LARGEST_BLOCK:
        raise ValueError(f"max_block must be a power of two in [1, {_LARGEST_BLOCK}], got {max_block}")
    min_tile, warps = (BWD_MIN_TILE, BWD_WARPS) if backward else (FWD_MIN_TILE, FWD_WARPS)
    if n <= max_block:
        block_n = triton.next_power_of_2(n)
        block_m = max(1, min_tile // block_n)
        looped = False
    else:
        block_n, block_m, looped = max_block, 1, True
    tile = block_m * block_n
    # tiles outside the table (small max_block in tests): 8 elements a thread, 1 to 32 warps
    num_warps = warps.get(tile, min(32, max(1, tile // 256)))
    return LaunchPlan(block_m, block_n, looped, num_warps)


def _device_guard(t: Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_matrix(name: str, t: Tensor | None, shape: tuple[int, int], dtype: torch.dtype | None = None) -> None:
    if t is None:
        return
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major), got strides {t.stride()}")


def _check_vector(name: str, t: Tensor | None, n: int) -> None:
    if t is not None and tuple(t.shape) != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(t.shape)}")


def norm_fwd(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    residual: Tensor | None,
    eps: float,
    offset: float,
    is_rms: bool,
    out: Tensor | None = None,
    residual_out: Tensor | None = None,
    *,
    max_block: int = FWD_MAX_BLOCK,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """RMSNorm / LayerNorm of the rows of x (+ residual); returns (y, s, mean, rstd).

    y in x's dtype (into ``out`` when given); s = x + residual summed in fp32, stored in x's
    dtype (into ``residual_out`` when given; None without residual); mean (M,) fp32 (None for
    RMS); rstd (M,) fp32. ``max_block`` caps the one-block path (tests force the looped one).
    """
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"x must be 2-D (rows, hidden) with hidden >= 1, got shape {tuple(x.shape)}")
    if x.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take {', '.join(map(str, KERNEL_DTYPES))} (float64 belongs to the "
                        f"reference path), got {x.dtype}")
    m, n = x.shape
    x = x.contiguous()
    _check_vector("weight", weight, n)
    _check_vector("bias", bias, n)
    _check_matrix("residual", residual, (m, n))
    _check_matrix("out", out, (m, n), x.dtype)
    _check_matrix("residual_out", residual_out, (m, n), x.dtype)
    plan = plan_launch(n, max_block)

    y = torch.empty_like(x) if out is None else out
    s = None
    if residual is not None:
        s = torch.empty_like(x) if residual_out is None else residual_out
    mean = None if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return y, s, mean, rstd

    grid = (m if plan.looped else triton.cdiv(m, plan.block_m),)
    with _device_guard(x):
        norm_fwd_kernel[grid](
            x, residual if residual is not None else x,
            weight.contiguous() if weight is not None else x,
            bias.contiguous() if bias is not None else x,
            y, s if s is not None else y,
            mean if mean is not None else rstd, rstd,
            m, n, float(eps), float(offset),
            IS_RMS=is_rms, HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            LOOPED=plan.looped, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            num_warps=plan.num_warps,
        )
    return y, s, mean, rstd


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _target_programs(t: Tensor) -> int:
    if t.is_cuda:
        return _multiprocessors(t.device) * BWD_PROGRAMS_PER_SM
    return BWD_PROGRAMS_WITHOUT_GPU


def norm_bwd(
    dy: Tensor,
    ds: Tensor | None,
    s: Tensor,
    weight: Tensor | None,
    mean: Tensor | None,
    rstd: Tensor,
    offset: float,
    is_rms: bool,
    has_bias: bool,
    *,
    max_block: int = BWD_MAX_BLOCK,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Gradients of norm_fwd: (dx, dweight, dbias). dx includes ds and equals d(residual).

    dweight/dbias are summed in fp32 and cast to the weight's dtype (dbias without a weight:
    to s's dtype); None when there is no weight / no bias.
    """
    if s.dim() != 2 or s.shape[1] == 0:
        raise ValueError(f"s must be 2-D (rows, hidden) with hidden >= 1, got shape {tuple(s.shape)}")
    if s.dtype not in KERNEL_DTYPES:
        raise TypeError(f"the Triton kernels take {', '.join(map(str, KERNEL_DTYPES))}, got {s.dtype}")
    m, n = s.shape
    if tuple(dy.shape) != (m, n) or (ds is not None and tuple(ds.shape) != (m, n)):
        raise ValueError(f"dy and ds must have s's shape {(m, n)}, got {tuple(dy.shape)} and "
                         f"{None if ds is None else tuple(ds.shape)}")
    if not is_rms and mean is None:
        raise ValueError("LayerNorm backward needs the saved mean, got None")
    _check_vector("weight", weight, n)
    _check_vector("rstd", rstd, m)
    dy, s = dy.contiguous(), s.contiguous()
    ds = ds.contiguous() if ds is not None else None
    plan = plan_launch(n, max_block, backward=True)
    grad_dtype = weight.dtype if weight is not None else s.dtype

    dx = torch.empty_like(s)
    col_blocks = triton.cdiv(n, plan.block_n)
    row_tiles = triton.cdiv(m, plan.block_m)
    programs_m = max(1, min(row_tiles, _target_programs(s) // col_blocks))
    rows_per_program = triton.cdiv(row_tiles, programs_m) * plan.block_m
    programs_m = max(1, triton.cdiv(m, rows_per_program))
    dw_partial = torch.empty((programs_m, n), dtype=torch.float32, device=s.device) if weight is not None else None
    db_partial = torch.empty((programs_m, n), dtype=torch.float32, device=s.device) if has_bias else None
    if m == 0:
        zeros = torch.zeros(n, dtype=grad_dtype, device=s.device)
        return dx, (zeros if weight is not None else None), (zeros.clone() if has_bias else None)

    w = weight.contiguous() if weight is not None else s
    mean_arg = mean if mean is not None else rstd
    sum_g_xhat = sum_g = rstd  # placeholders, unread when the kernel computes the row sums
    with _device_guard(s):
        if plan.looped:
            sum_g_xhat = torch.empty(m, dtype=torch.float32, device=s.device)
            sum_g = torch.empty(m, dtype=torch.float32, device=s.device) if not is_rms else sum_g_xhat
            norm_bwd_row_sums_kernel[(m,)](
                dy, s, w, mean_arg, rstd, sum_g_xhat, sum_g,
                n, float(offset),
                IS_RMS=is_rms, HAS_WEIGHT=weight is not None, BLOCK_N=plan.block_n,
                num_warps=plan.num_warps,
            )
        norm_bwd_kernel[(programs_m, col_blocks)](
            dy, ds if ds is not None else dy, s, w, mean_arg, rstd, sum_g_xhat, sum_g,
            dx, dw_partial if dw_partial is not None else dx, db_partial if db_partial is not None else dx,
            m, n, rows_per_program, float(offset),
            IS_RMS=is_rms, HAS_DS=ds is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias,
            ROW_SUMS_GIVEN=plan.looped, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
            num_warps=plan.num_warps,
        )
    dweight = dw_partial.sum(0).to(grad_dtype) if dw_partial is not None else None
    dbias = db_partial.sum(0).to(grad_dtype) if db_partial is not None else None
    return dx, dweight, dbias
