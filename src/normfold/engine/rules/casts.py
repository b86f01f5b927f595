"""Casts that round: why a fixed narrowing cast keeps a norm from folding exactly.

The fold is proved in float64 on a float64 copy of the model, where a cast the code writes as
``.to(x.dtype)`` is the identity but a cast to a fixed narrower dtype (``weights @ flat.float()``
inside a float64 model) still rounds. Rounding does not commute with centering: round(P·x) is
zero-mean only up to the narrower dtype's unit roundoff, so a norm whose zero-mean input passes
through such a cast cannot be made an exact RMSNorm, and the analysis refuses it with that reason
(rather than letting the float64 proof fail). Which casts round is read from the trace: a cast to
a float dtype narrower than the cast's input and than every floating parameter of the model
cannot be "the model's dtype", so it is fixed in the code and rounds in the float64 proof too.
A model traced in float32 shows ``.float()`` as a float32 -> float32 no-op: when the float64 proof of
its plan fails, ``fold`` reads the plan again from a float64 copy's trace, where the cast shows
(``pipeline._plan_in_float64``).
"""
from __future__ import annotations

import weakref

import torch
from torch import fx

from ..._text import dtype_name
from ..graph import Captured, op_name, per_graph
from ..op_kinds import CAST_OPS


_PARAMETER_DTYPES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rounding_cast(node: fx.Node, captured: Captured) -> str | None:
    """Why the cast ``node`` rounds in the float64 proof (see above), or None for every other node."""
    if getattr(node.target, "overloadpacket", None) not in CAST_OPS or not node.args:
        return None
    out, x = node.meta.get("val"), node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)
            and out.dtype.is_floating_point and x.dtype.is_floating_point):
        return None
    narrowest = per_graph(_PARAMETER_DTYPES, node.graph, lambda graph: _narrowest_parameter_dtype(captured))
    if _unit_roundoff(out.dtype) <= max(_unit_roundoff(x.dtype), _unit_roundoff(narrowest or out.dtype)):
        return None
    return (f"{op_name(node)} rounds {dtype_name(x.dtype)} to {dtype_name(out.dtype)}, narrower than the model's "
            f"{dtype_name(narrowest)} (a cast fixed in the code, which rounds in the float64 proof too): centering "
            f"upstream makes the norm's input zero-mean only up to {dtype_name(out.dtype)}'s rounding, not exactly")


def _narrowest_parameter_dtype(captured: Captured) -> torch.dtype | None:
    dtypes = [v.dtype for p in captured.param_fqn if isinstance(v := p.meta.get("val"), torch.Tensor)
              and v.dtype.is_floating_point]
    return max(dtypes, key=_unit_roundoff, default=None)


def _unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2
