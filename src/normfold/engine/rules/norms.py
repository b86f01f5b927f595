"""Norm calls in the graph: what a norm op reads (``norm_call``), and the one norm output that is a source.

Which nodes are norms is ``op_kinds.norm_node_kind``'s to say; this reads the arguments of the
LayerNorm and RMSNorm ops (aten's and normfold's) into one ``NormCall``. A LayerNorm without γ/β
returns rows that are zero-mean already: a source that centering leaves unchanged.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from ..graph import node_arg as _arg  # the short name reads better in the calls below
from ..graph import op_name
from ..op_kinds import norm_node_kind
from .answers import Break, Source, rank

_aten = torch.ops.aten


@dataclass(frozen=True)
class NormCall:
    """A norm op in the graph, whatever op spells it (aten.layer_norm, aten.rms_norm, normfold's op)."""

    node: fx.Node
    x: fx.Node                 # the normalized input
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float | None
    is_rms: bool
    output: fx.Node | None     # the node holding the normalized output
    num_dims: int              # number of trailing dims normalized
    offset: float = 0.0        # the norm scales by (offset + weight): normfold's RMSNorm(offset=1), Gemma's


def norm_call(node: fx.Node) -> NormCall | None:
    """Recognize a norm over trailing dims (a LayerNorm or RMSNorm by ``op_kinds.norm_node_kind``);
    fused-residual variants are not norms here."""
    if norm_node_kind(node) not in ("LayerNorm", "RMSNorm"):
        return None
    packet = node.target.overloadpacket
    if packet == _aten.layer_norm:
        return NormCall(node, node.args[0], _arg(node, 2, "weight"), _arg(node, 3, "bias"), _arg(node, 4, "eps", 1e-5),
                        False, node, len(node.args[1]))
    if packet == _aten.rms_norm:
        return NormCall(node, node.args[0], _arg(node, 2, "weight"), None, _arg(node, 3, "eps"), True, node,
                        len(node.args[1]))
    if str(packet) == "normfold.norm_fwd":  # (x, weight, bias, residual, eps, offset, is_rms) -> (y, s, mean, rstd)
        x, weight, bias, residual, eps, offset, is_rms = node.args[:7]
        if residual is not None:
            return None
        output = next((u for u in node.users if u.target is operator.getitem and u.args[1] == 0), None)
        return NormCall(node, x, weight, bias, eps, bool(is_rms), output, 1, float(offset))
    return None


def layer_norm_source(node, dim, group):
    return norm_output_source(norm_call(node), node, dim, group)


def norm_output_source(call: NormCall, out: fx.Node, dim, group):
    """A LayerNorm without affine returns zero-mean rows: a source that centering leaves unchanged."""
    name = op_name(call.node)
    if call.is_rms:
        return Break(f"{name}: an RMSNorm output is not zero-mean")
    if call.weight is not None or call.bias is not None:
        return Break(f"{name} output with an affine transform is not zero-mean")
    last = rank(out) - 1
    covers_last = dim == last or (isinstance(dim, tuple) and last in dim)  # a block holding whole rows
    if call.num_dims != 1 or not covers_last or group is not None:
        return Break(f"{name} output is zero-mean only over its whole last dim")
    return Source("normalized")
