"""Triton norm kernels (normfold.ops._triton) against the fp64 reference, run on the CPU
through Triton's interpreter. Small shapes: the interpreter executes each program in numpy.

Tolerance rule: the kernel's max error vs the fp64 oracle is at most twice the error of torch
computing the same thing in the same dtype (its native rms_norm / layer_norm + adds), + atol.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest
import torch

pytest.importorskip("triton")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from normfold.ops import layer_norm_ref, rms_norm_ref  # noqa: E402
from normfold.ops._triton import BWD_MAX_BLOCK, FWD_MAX_BLOCK, norm_bwd, norm_fwd, plan_launch  # noqa: E402
from normfold.ops._triton import launch, selfcheck  # noqa: E402
from normfold.ops._triton.selfcheck import Case, Inputs, run_kernels  # noqa: E402

if not os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need a GPU or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def make_inputs(case, shape, dtype, weight_dtype=None, seed=0):
    return selfcheck.make_inputs(case, shape, dtype, DEVICE, weight_dtype=weight_dtype, seed=seed)


def assert_matches_oracle(case, inp, got):
    mismatches = selfcheck.compare(case, inp, got)
    assert not mismatches, f"{case} {tuple(inp.x.shape)} {inp.x.dtype}: " + "; ".join(map(str, mismatches))


def statistics_oracle(case: Case, inp: Inputs, stored_s=None):
    """fp64 mean and rstd of what the kernel normalizes: x, or the stream s it returned.

    (s itself is checked against the oracle elsewhere; it is the fp32 sum rounded once to x's
    dtype. Triton's interpreter rounds fp32 -> bf16 toward zero where GPUs round to nearest.)
    """
    s = (stored_s if stored_s is not None else inp.x).double()
    mean = torch.zeros_like(s[:, 0]) if case.is_rms else s.mean(-1)
    var = (s - mean[:, None]).square().mean(-1)
    return mean, torch.rsqrt(var + case.eps)


# (shape, forward max block, backward max block): small blocks force the looped path.
SHAPES = [
    pytest.param((1, 1), FWD_MAX_BLOCK, BWD_MAX_BLOCK, id="1x1"),
    pytest.param((21, 7), FWD_MAX_BLOCK, BWD_MAX_BLOCK, id="21x7"),
    pytest.param((37, 130), FWD_MAX_BLOCK, BWD_MAX_BLOCK, id="37x130-multi-program"),
    pytest.param((5, 1023), FWD_MAX_BLOCK, BWD_MAX_BLOCK, id="5x1023"),
    pytest.param((2, 1500), FWD_MAX_BLOCK, BWD_MAX_BLOCK, id="2x1500-one-block"),
    pytest.param((2, 1500), 256, 256, id="2x1500-looped"),
]
CASES = [
    Case(is_rms=True, weight=False),
    Case(is_rms=True),
    Case(is_rms=True, bias=True, residual=True, offset=1.0),
    Case(is_rms=False, weight=False),
    Case(is_rms=False, bias=True),
    Case(is_rms=False, bias=True, residual=True, offset=0.25),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("shape,fwd_block,bwd_block", SHAPES)
def test_forward_and_gradients_match_fp64_reference_fp32(case, shape, fwd_block, bwd_block):
    inp = make_inputs(case, shape, torch.float32)
    assert_matches_oracle(case, inp, run_kernels(case, inp, fwd_block, bwd_block))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", [CASES[2], CASES[5]], ids=str)
@pytest.mark.parametrize("shape,fwd_block,bwd_block", [SHAPES[1], SHAPES[3], SHAPES[5]])
def test_forward_and_gradients_match_fp64_reference_half(case, shape, fwd_block, bwd_block, dtype):
    inp = make_inputs(case, shape, dtype)
    assert_matches_oracle(case, inp, run_kernels(case, inp, fwd_block, bwd_block))


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("fwd_block,bwd_block", [(FWD_MAX_BLOCK, BWD_MAX_BLOCK), (128, 64)], ids=["one-block", "looped"])
def test_saved_statistics_are_fp32_mean_and_rstd(is_rms, fwd_block, bwd_block):
    case = Case(is_rms=is_rms, residual=True)
    inp = make_inputs(case, (6, 300), torch.bfloat16)
    got = run_kernels(case, inp, fwd_block, bwd_block)
    mean, rstd = statistics_oracle(case, inp, got["s"])
    assert got["rstd"].dtype == torch.float32 and got["rstd"].shape == (6,)
    torch.testing.assert_close(got["rstd"].double(), rstd, rtol=1e-5, atol=0)
    if is_rms:
        assert got["mean"] is None
    else:
        assert got["mean"].dtype == torch.float32
        torch.testing.assert_close(got["mean"].double(), mean, rtol=1e-5, atol=1e-6)


def test_layernorm_statistics_survive_a_large_mean_in_looped_path():
    # mean 1e4, std 1: E[s²] − mean² would lose every digit of the variance in fp32.
    case = Case(is_rms=False, weight=False)
    x = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 1e4)
    inp = Inputs(x.float().to(DEVICE), None, None, None, torch.zeros(3, 1000, device=DEVICE), None)
    for block in (FWD_MAX_BLOCK, 128):
        _, _, _, rstd = norm_fwd(inp.x, None, None, None, case.eps, 0.0, False, max_block=block)
        _, want = statistics_oracle(case, inp)
        torch.testing.assert_close(rstd.double(), want, rtol=1e-3, atol=0)


def test_residual_without_stream_gradient():
    # the returned stream s unused downstream: ds is None and dx is the norm's gradient alone
    case = Case(is_rms=False, bias=True, residual=True)
    inp = dataclasses.replace(make_inputs(case, (5, 64), torch.float32), ds=None)
    assert_matches_oracle(case, inp, run_kernels(case, inp))


def test_checker_reports_corrupted_outputs():
    # the oracle comparison itself must be able to fail
    case = Case(is_rms=True, bias=True, residual=True)
    inp = make_inputs(case, (3, 50), torch.bfloat16)
    got = run_kernels(case, inp)
    assert selfcheck.compare(case, inp, got) == []
    got["dweight"] = got["dweight"] * 1.05
    got["s"] = None
    reported = {m.output.split(" ")[0] for m in selfcheck.compare(case, inp, got)}
    assert reported == {"dweight", "s"}


def test_mixed_precision_bf16_input_fp32_weight():
    case = Case(is_rms=True, bias=True, residual=True)
    inp = make_inputs(case, (5, 1023), torch.bfloat16, weight_dtype=torch.float32)
    got = run_kernels(case, inp)
    assert got["dweight"].dtype == torch.float32 and got["dbias"].dtype == torch.float32
    assert_matches_oracle(case, inp, got)


@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
def test_offset_without_weight_is_ignored_like_the_reference(is_rms):
    case = Case(is_rms=is_rms, weight=False, bias=True, offset=0.5)
    inp = make_inputs(case, (4, 33), torch.float32)
    got = run_kernels(case, inp)
    assert_matches_oracle(case, inp, got)
    plain = run_kernels(dataclasses.replace(case, offset=0.0), inp)
    assert torch.equal(got["y"], plain["y"]) and torch.equal(got["dx"], plain["dx"])


def test_hidden_size_above_one_block_takes_the_looped_path_by_default():
    n = FWD_MAX_BLOCK + 3
    assert plan_launch(n, FWD_MAX_BLOCK).looped and not plan_launch(FWD_MAX_BLOCK, FWD_MAX_BLOCK).looped
    case = Case(is_rms=False, bias=True, residual=True)
    inp = make_inputs(case, (2, n), torch.float32)
    assert_matches_oracle(case, inp, run_kernels(case, inp))


def test_looped_backward_splits_rows_across_programs(monkeypatch):
    # many target programs: the looped backward grid gets several row groups (partial dw sums)
    monkeypatch.setattr(launch, "BWD_PROGRAMS_WITHOUT_GPU", 64)
    case = Case(is_rms=False, bias=True)
    inp = make_inputs(case, (40, 300), torch.float32)
    assert_matches_oracle(case, inp, run_kernels(case, inp, fwd_block=128, bwd_block=128))


def test_out_and_residual_out_are_written_in_place():
    case = Case(is_rms=True, residual=True)
    inp = make_inputs(case, (3, 40), torch.float16)
    out = torch.full_like(inp.x, float("nan"))
    residual_out = torch.full_like(inp.x, float("nan"))
    y, s, _, _ = norm_fwd(inp.x, inp.weight, None, inp.residual, 1e-6, 0.0, True, out=out, residual_out=residual_out)
    assert y.data_ptr() == out.data_ptr() and s.data_ptr() == residual_out.data_ptr()
    want_y, want_s = rms_norm_ref(inp.x, inp.weight, None, 1e-6, residual=inp.residual)
    torch.testing.assert_close(out, want_y, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(residual_out, want_s, atol=0, rtol=0)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter, on NaN arithmetic
@pytest.mark.parametrize("is_rms", [True, False], ids=["rms", "ln"])
@pytest.mark.parametrize("fwd_block,bwd_block", [(FWD_MAX_BLOCK, BWD_MAX_BLOCK), (64, 32)], ids=["one-block", "looped"])
def test_nonfinite_row_stays_in_its_row(is_rms, fwd_block, bwd_block):
    case = Case(is_rms=is_rms, bias=True)
    inp = make_inputs(case, (6, 100), torch.float32)
    bad = inp.x.clone()
    bad[1, 7] = float("nan")
    bad[4, 50] = float("inf")
    dirty = run_kernels(case, dataclasses.replace(inp, x=bad), fwd_block, bwd_block)
    clean = run_kernels(case, inp, fwd_block, bwd_block)
    good_rows = [0, 2, 3, 5]
    for name in ("y", "dx"):
        assert not torch.isfinite(dirty[name][[1, 4]]).all(dim=1).any(), f"{name}: a bad row came out finite"
        # rows are independent: the good rows are bit-identical to a run without the bad ones
        assert torch.equal(dirty[name][good_rows], clean[name][good_rows]), name


@given(
    m=st.integers(1, 9),
    n=st.integers(1, 300),
    block_log2=st.integers(4, 9),
    is_rms=st.booleans(),
    bias=st.booleans(),
    residual=st.booleans(),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=15, deadline=None)
def test_random_shapes_and_blocks_match_reference(m, n, block_log2, is_rms, bias, residual, seed):
    case = Case(is_rms=is_rms, bias=bias, residual=residual)
    inp = make_inputs(case, (m, n), torch.float32, seed=seed)
    block = 2**block_log2
    assert_matches_oracle(case, inp, run_kernels(case, inp, block, block))


@given(n=st.integers(1, 1 << 20), max_block_log2=st.integers(0, 15), backward=st.booleans())
def test_launch_plan_covers_any_hidden_size(n, max_block_log2, backward):
    max_block = 1 << max_block_log2
    plan = plan_launch(n, max_block, backward=backward)
    assert plan.looped == (n > max_block)
    assert plan.block_n & (plan.block_n - 1) == 0 and plan.block_n <= max_block
    assert plan.block_n >= n or plan.looped
    assert plan.block_m & (plan.block_m - 1) == 0 and (plan.block_m == 1 or not plan.looped)
    assert plan.num_warps in (1, 2, 4, 8, 16, 32)
    # 8 to 32 elements a thread: registers bound it above, idle lanes below (one warp may idle)
    tile = plan.block_m * plan.block_n
    assert tile <= 32 * 32 * plan.num_warps
    assert plan.num_warps == 1 or tile >= 8 * 32 * plan.num_warps


def test_default_hidden_sizes_use_the_tuned_warp_tables():
    for n in (256, 1024, 4096, 8192, 16384, 131072):
        fwd, bwd = plan_launch(n, FWD_MAX_BLOCK), plan_launch(n, BWD_MAX_BLOCK, backward=True)
        assert fwd.num_warps == launch.FWD_WARPS[fwd.block_m * fwd.block_n]
        assert bwd.num_warps == launch.BWD_WARPS[bwd.block_m * bwd.block_n]
    assert plan_launch(256, FWD_MAX_BLOCK).block_m == launch.FWD_MIN_TILE // 256


# ---- refused inputs -------------------------------------------------------------------------

@pytest.mark.parametrize("max_block", [96, 0, 65536])
def test_rejects_max_block_not_a_power_of_two_up_to_32768(max_block):
    with pytest.raises(ValueError, match=rf"power of two in \[1, 32768\], got {max_block}"):
        plan_launch(100, max_block)


@pytest.mark.parametrize("shape", [(2, 3, 4), (3, 0)])
def test_rejects_input_not_2d_with_a_hidden_dimension(shape):
    with pytest.raises(ValueError, match=r"2-D.*got shape " + re.escape(str(shape))):
        norm_fwd(torch.randn(shape), None, None, None, 1e-6, 0.0, True)
    with pytest.raises(ValueError, match=r"2-D.*got shape " + re.escape(str(shape))):
        norm_bwd(torch.randn(shape), None, torch.randn(shape), None, None, torch.ones(shape[0]), 0.0, True, False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32])
def test_rejects_dtypes_the_kernels_do_not_compute_exactly(dtype):
    x = torch.ones(3, 4, dtype=dtype)
    with pytest.raises(TypeError, match=f"got {dtype}"):
        norm_fwd(x, None, None, None, 1e-6, 0.0, True)
    with pytest.raises(TypeError, match=f"got {dtype}"):
        norm_bwd(x, None, x, None, None, torch.ones(3), 0.0, True, False)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"weight": torch.randn(5)}, r"weight must have shape \(4,\), got \(5,\)"),
        ({"bias": torch.randn(4, 1)}, r"bias must have shape \(4,\), got \(4, 1\)"),
        ({"residual": torch.randn(3, 5)}, r"residual must have shape \(3, 4\), got \(3, 5\)"),
        ({"out": torch.empty(3, 4, dtype=torch.float16)}, "out must have dtype torch.float32, got torch.float16"),
        ({"out": torch.empty(4, 3).t()}, "out must be contiguous"),
    ],
    ids=["weight-shape", "bias-shape", "residual-shape", "out-dtype", "out-strides"],
)
def test_rejects_mismatched_arguments_before_launch(kwargs, match):
    args = {"weight": None, "bias": None, "residual": None, "out": None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        norm_fwd(torch.randn(3, 4), args["weight"], args["bias"], args["residual"], 1e-6, 0.0, True, out=args["out"])


def test_layernorm_backward_refuses_missing_mean():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="mean"):
        norm_bwd(x, None, x, None, None, torch.ones(3), 0.0, False, False)


def test_missing_triton_raises_importerror_naming_the_extra():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "try:\n"
        "    import normfold.ops._triton\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install 'normfold[triton]'" in done.stdout, done.stdout + done.stderr
