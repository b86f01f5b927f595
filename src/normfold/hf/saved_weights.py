"""Compare the tensors a folder stores with the fold re-derived from the original, element by element.

Output comparison cannot see a change smaller than the model's own error in its stored dtype (a
1.5x MLP weight in a bf16 post-LN BERT moves the output less than bf16 itself does). The stored
weights can be checked exactly instead: re-running the fold on the original is the same float32
code on the same numbers, so each stored tensor must equal the re-derived one, rounded to the
stored dtype, up to the bound of :func:`allowed_difference`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._progress import progress
from .._text import dtype_name

# Measured: tiny GPT-2 and BERT folded in fp32/fp16/bf16, re-derived with 1 and 2 threads and by the
# streaming fold: every tensor bit-identical. What may still differ on another machine is the order
# of a float32 reduction (a centering mean, W·β): that moves the float32 result by a few float32
# ulps of the summed terms, so (a) its rounding to the stored dtype can land one stored-dtype ulp
# away, and (b) a float32 element that cancels to near zero can move by a few float32 ulps of the
# tensor's scale rather than of its own value. Allowed per element (d: stored dtype):
#   |stored − derived| ≤ STORED_DTYPE_ULPS · ulp_d(max(|stored|, |derived|))
#                        + FLOAT32_REDUCTION_ULPS · ulp_float32(max |derived| over the tensor)
# A 1.1x tensor is ~25 bf16 ulps off at its largest element; a zeroed one is off by its whole value.
STORED_DTYPE_ULPS = 1
FLOAT32_REDUCTION_ULPS = 4


def ulp(magnitude: Tensor, dtype: torch.dtype) -> Tensor:
    """The spacing of ``dtype``'s values at ``|magnitude|`` (float64): eps · 2^floor(log2 |m|),
    never less than the subnormal spacing tiny · eps."""
    info = torch.finfo(dtype)
    m = magnitude.double().abs().clamp_min(info.tiny)
    _, exponent = torch.frexp(m)  # m = f · 2^exponent with f in [0.5, 1): floor(log2 m) = exponent − 1
    return torch.ldexp(torch.full_like(m, info.eps), exponent - 1)


def allowed_difference(derived: Tensor, stored: Tensor) -> Tensor:
    """Per-element bound on |stored − derived| for a floating tensor (see the module constants)."""
    d, s = (t.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) for t in (derived, stored))  # finite magnitudes
    scale = d.abs().max() if d.numel() else d.new_zeros(())
    return (STORED_DTYPE_ULPS * ulp(torch.maximum(d.abs(), s.abs()), stored.dtype)
            + FLOAT32_REDUCTION_ULPS * ulp(scale, torch.float32))


def tensor_difference(name: str, derived: Tensor, stored: Tensor) -> dict[str, Any]:
    """How far ``stored`` is from ``derived``: ``max_abs_error``, ``max_ulps`` (of the stored dtype,
    at each element's magnitude), ``num_differing`` (elements not bit-equal), ``ok`` (every element
    within :func:`allowed_difference`) and ``why`` (set when not ok)."""
    row: dict[str, Any] = {"name": name, "num_elements": stored.numel(), "max_abs_error": 0.0, "max_ulps": 0.0,
                           "num_differing": 0, "ok": True, "why": None}
    if tuple(stored.shape) != tuple(derived.shape):
        return {**row, "ok": False, "max_abs_error": float("inf"), "max_ulps": float("inf"),
                "why": f"{name} has shape {tuple(stored.shape)}, the re-derived fold {tuple(derived.shape)}"}
    if stored.dtype != derived.dtype:
        return {**row, "ok": False, "max_abs_error": float("inf"), "max_ulps": float("inf"),
                "why": f"{name} is stored as {dtype_name(stored.dtype)}, the fold saves {dtype_name(derived.dtype)}"}
    same = stored == derived
    if stored.is_floating_point():
        same |= stored.isnan() & derived.isnan()
    differing = ~same
    row["num_differing"] = int(differing.sum())
    if not row["num_differing"]:
        return row
    if not stored.is_floating_point():
        return {**row, "ok": False, "max_abs_error": float("inf"), "max_ulps": float("inf"),
                "why": f"{name}: {row['num_differing']} of {stored.numel()} values differ from the re-derived fold"}
    diff = (stored.double() - derived.double()).abs()
    diff = torch.where(differing, diff.nan_to_num(nan=float("inf")), torch.zeros_like(diff))  # NaN vs number: inf
    ulps = diff / ulp(torch.maximum(stored.double().abs(), derived.double().abs()).nan_to_num(), stored.dtype)
    row.update(max_abs_error=diff.max().item(), max_ulps=ulps.max().item(),
               ok=bool((diff <= allowed_difference(derived, stored))[differing].all()))
    if not row["ok"]:
        row["why"] = (f"{name} differs from the fold re-derived from the original by up to {row['max_ulps']:.3g} "
                      f"ulp of {dtype_name(stored.dtype)} (max abs {row['max_abs_error']:.2e}; {row['num_differing']} "
                      f"of {row['num_elements']} elements differ; allowed: {STORED_DTYPE_ULPS} ulp)")
    return row


def compare_weights(derived: Mapping[str, Tensor], stored_names: Iterable[str], read_stored: Callable[[str], Tensor],
                    aliases: Mapping[str, list[str]]) -> dict[str, Any]:
    """Every stored tensor against the re-derived state dict ``derived`` (already in the stored dtype).

    The key sets must match, except that a derived tensor may be stored under one of its tied names
    only (``aliases``: name -> every name of the same parameter). Returns ``ok``, ``num_tensors``
    (compared), ``num_differing_tensors`` (not bit-identical), ``worst`` (the tensor furthest off,
    out-of-bound ones first; None when all are bit-identical), ``bound`` (the rule) and ``why`` (one
    line naming the worst offending tensor, None when ok).
    """
    stored_names = list(stored_names)
    stored_set = set(stored_names)
    extra = sorted(stored_set - set(derived))
    missing = sorted(k for k in derived if k not in stored_set and not stored_set & set(aliases.get(k, ())))
    result: dict[str, Any] = {"ok": False, "num_tensors": 0, "num_differing_tensors": 0, "worst": None,
                              "bound": f"{STORED_DTYPE_ULPS} ulp of the stored dtype at each element + "
                                       f"{FLOAT32_REDUCTION_ULPS} float32 ulp at the tensor's largest value",
                              "why": None}
    if extra or missing:
        parts = ([f"holds {_few(extra)}, which the fold does not write"] if extra else []) + \
                ([f"lacks {_few(missing)}, which the fold writes"] if missing else [])
        return {**result, "why": "the folder " + " and ".join(parts)}
    if not stored_names:
        return {**result, "why": "compared nothing: the folder stores no tensors (a check that compared nothing "
                                 "cannot pass)"}
    rows = [tensor_difference(name, derived[name], read_stored(name))
            for name in progress(stored_names, desc="comparing stored tensors", unit="tensor")]
    bad = [r for r in rows if not r["ok"]]
    differing = [r for r in rows if r["num_differing"] or not r["ok"]]  # a shape or dtype mismatch counts
    worst = max(differing, key=lambda r: (not r["ok"], r["max_ulps"]), default=None)  # out of bounds first
    why = None if not bad else worst["why"] + (f"; {len(bad) - 1} more tensor(s) off" if len(bad) > 1 else "")
    return {**result, "ok": not bad, "num_tensors": len(rows), "num_differing_tensors": len(differing),
            "worst": None if worst is None else {k: v for k, v in worst.items() if k not in ("ok", "why")}, "why": why}


def _few(names: list[str], limit: int = 4) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")

