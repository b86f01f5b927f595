"""Correctness check of the Triton kernels against the fp64 reference, shared by the tests
(on the CPU, under ``TRITON_INTERPRET=1``) and ``benchmarks/gpu_check.py`` (on a GPU).

The rule: for every output and gradient, the kernel's max abs error vs the fp64 oracle is at
most twice the error of torch computing the same thing in the input dtype (its native
``rms_norm`` / ``layer_norm`` plus plain adds, on the same device), + atol · max(1, |oracle|).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from ..reference import layer_norm_ref, rms_norm_ref
from .launch import BWD_MAX_BLOCK, FWD_MAX_BLOCK, norm_bwd, norm_fwd

ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GRADIENTS = ("dx", "dresidual", "dweight", "dbias")


@dataclasses.dataclass(frozen=True)
class Case:
    """One norm configuration: which optional inputs are present."""

    is_rms: bool
    weight: bool = True
    bias: bool = False
    residual: bool = False
    offset: float = 0.0
    eps: float = 1e-6

    def __str__(self) -> str:
        parts = ["rms" if self.is_rms else "ln"]
        parts += [name for name in ("weight", "bias", "residual") if getattr(self, name)]
        if self.offset:
            parts.append(f"offset{self.offset:g}")
        return "-".join(parts)


@dataclasses.dataclass
class Inputs:
    x: Tensor  # (M, N)
    weight: Tensor | None  # (N,)
    bias: Tensor | None  # (N,)
    residual: Tensor | None  # (M, N)
    dy: Tensor  # (M, N) upstream gradient of y
    ds: Tensor | None  # (M, N) upstream gradient of the returned stream s (None: s unused)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """An output whose kernel error broke the rule."""

    output: str
    kernel_error: float
    torch_error: float
    allowed: float

    def __str__(self) -> str:
        return (f"{self.output}: kernel error {self.kernel_error:.3g} > allowed {self.allowed:.3g} "
                f"(torch's own error {self.torch_error:.3g})")


def make_inputs(case: Case, shape: tuple[int, int], dtype: torch.dtype, device="cpu",
                weight_dtype: torch.dtype | None = None, seed: int = 0) -> Inputs:
    """Random inputs with a non-zero row mean (so LayerNorm's centering matters)."""
    g = torch.Generator().manual_seed(seed)
    m, n = shape

    def randn(*size, dt=dtype, scale=1.0, shift=0.0):
        return (torch.randn(*size, generator=g, dtype=torch.float64) * scale + shift).to(device=device, dtype=dt)

    wdt = weight_dtype or dtype
    return Inputs(
        x=randn(m, n, scale=2.0, shift=0.5),
        weight=randn(n, dt=wdt, scale=0.5, shift=1.0) if case.weight else None,
        bias=randn(n, dt=wdt, scale=0.3) if case.bias else None,
        residual=randn(m, n, shift=-0.3) if case.residual else None,
        dy=randn(m, n),
        ds=randn(m, n) if case.residual else None,
    )


def _leaf(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if t is None else t.detach().to(dtype).requires_grad_(True)


def _outputs_and_grads(y: Tensor, s: Tensor | None, inp: Inputs, leaves: dict) -> dict:
    """{y, s, dx, dresidual, dweight, dbias} for loss = <y, dy> + <s, ds>."""
    loss = (y.double() * inp.dy.double()).sum()
    if s is not None and inp.ds is not None:
        loss = loss + (s.double() * inp.ds.double()).sum()
    present = {k: v for k, v in leaves.items() if v is not None}
    grads = torch.autograd.grad(loss, list(present.values()))
    return {"y": y.detach(), "s": None if s is None else s.detach(), **dict(zip(present, grads))}


def oracle(case: Case, inp: Inputs) -> dict:
    """Outputs and gradients of ``normfold.ops.reference`` in fp64."""
    x, w, b, r = (_leaf(t, torch.float64) for t in (inp.x, inp.weight, inp.bias, inp.residual))
    norm_ref = rms_norm_ref if case.is_rms else layer_norm_ref
    out = norm_ref(x, w, b, case.eps, residual=r, offset=case.offset)
    y, s = out if r is not None else (out, None)
    return _outputs_and_grads(y, s, inp, {"dx": x, "dresidual": r, "dweight": w, "dbias": b})


def torch_in_dtype(case: Case, inp: Inputs) -> dict:
    """The same outputs and gradients from torch's native ops run in the input dtype."""
    dtype = inp.x.dtype
    x, w, b, r = (_leaf(t, dtype) for t in (inp.x, inp.weight, inp.bias, inp.residual))
    s = x + r if r is not None else x
    n = x.shape[-1]
    w_eff = None if w is None else case.offset + w
    if case.is_rms:
        y = F.rms_norm(s, (n,), w_eff, case.eps)
        y = y + b if b is not None else y
    else:
        y = F.layer_norm(s, (n,), w_eff, b, case.eps)
    return _outputs_and_grads(y, s if r is not None else None, inp,
                              {"dx": x, "dresidual": r, "dweight": w, "dbias": b})


def run_kernels(case: Case, inp: Inputs, fwd_block: int = FWD_MAX_BLOCK, bwd_block: int = BWD_MAX_BLOCK) -> dict:
    """The kernels' outputs, saved statistics and gradients (the same keys as ``oracle``)."""
    y, s, mean, rstd = norm_fwd(inp.x, inp.weight, inp.bias, inp.residual, case.eps, case.offset, case.is_rms,
                                max_block=fwd_block)
    saved = s if s is not None else inp.x
    dx, dweight, dbias = norm_bwd(inp.dy, inp.ds, saved, inp.weight, mean, rstd, case.offset, case.is_rms,
                                  inp.bias is not None, max_block=bwd_block)
    return {"y": y, "s": s, "dx": dx, "dresidual": dx if inp.residual is not None else None,
            "dweight": dweight, "dbias": dbias, "mean": mean, "rstd": rstd}


def max_abs_error(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def compare(case: Case, inp: Inputs, got: dict) -> list[Mismatch]:
    """Every output and gradient of ``got`` that breaks the rule (empty list: all pass).

    A missing, extra, misshapen, wrongly typed or non-finite output is reported with inf error.
    """
    want, baseline = oracle(case, inp), torch_in_dtype(case, inp)
    expected_dtype = {"y": inp.x.dtype, "s": inp.x.dtype, "dx": inp.x.dtype, "dresidual": inp.x.dtype,
                      "dweight": None if inp.weight is None else inp.weight.dtype,
                      "dbias": inp.x.dtype if inp.weight is None else inp.weight.dtype}
    atol = ATOL[inp.x.dtype]
    bad = []
    for name, ref in want.items():
        out = got.get(name)
        if ref is None or out is None:
            if (ref is None) != (out is None):
                bad.append(Mismatch(f"{name} (present: kernel {out is not None}, oracle {ref is not None})",
                                    float("inf"), 0.0, 0.0))
            continue
        if out.shape != ref.shape or (expected_dtype[name] and out.dtype != expected_dtype[name]):
            bad.append(Mismatch(f"{name} (shape {tuple(out.shape)} {out.dtype})", float("inf"), 0.0, 0.0))
            continue
        ours = max_abs_error(out, ref) if out.numel() else 0.0
        theirs = max_abs_error(baseline[name], ref) if out.numel() else 0.0
        allowed = 2 * theirs + atol * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
        if not ours <= allowed:  # also catches NaN
            bad.append(Mismatch(name, ours, theirs, allowed))
    return bad
