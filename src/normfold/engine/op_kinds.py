"""Kinds of graph ops that several walks over a captured graph share, each defined once here.

- ops that pass their first input's values on unchanged: value copies, eval-mode dropout, and (where
  a walk allows them) dtype casts. The rules table (``rules/``), the embedding precompute
  (``analysis.py``), γ/β's consumers (``affine.py``), the BatchNorm and layer-scale producers
  (``batchnorm.py``, ``layer_scale.py``) and the lab's checks all see through the same ops;
- the Linear/Conv ops whose output channels are weight dim 0 (what a BatchNorm or a layer scale merges into);
- norm ops, by kind: :func:`norm_node_kind` is the one recognizer of a norm in a graph.
"""
from __future__ import annotations

import torch
from torch import fx

from .graph import node_arg, op_packet

_aten = torch.ops.aten


def aten_packets(*names: str) -> list:
    """The aten overload packets of ``names`` that this torch has (``aten.linear`` for "linear")."""
    return [getattr(_aten, n) for n in names if hasattr(_aten, n)]


# ops that return their first input's values bitwise unchanged
COPY_OP_NAMES = ("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "positive")
# ops that return their first input's values in another dtype (the same values when the dtype does not change)
CAST_OP_NAMES = ("_to_copy", "to", "type_as")
# dropout: the identity in eval mode (train=False), random in training
DROPOUT_OP_NAMES = ("dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout")

COPY_OPS = frozenset(aten_packets(*COPY_OP_NAMES))
CAST_OPS = frozenset(aten_packets(*CAST_OP_NAMES))
DROPOUT_OPS = frozenset(aten_packets(*DROPOUT_OP_NAMES))

# Linear/Conv ops: output channel o is row o of the weight (dim 0) plus bias[o] (transposed convolutions aside)
LINEAR_PRODUCER_OPS = frozenset(aten_packets("linear", "conv1d", "conv2d", "conv3d", "convolution"))

BATCH_NORM_OPS = frozenset(aten_packets(
    "batch_norm", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "native_batch_norm",
    "_batch_norm_with_update", "_batch_norm_no_update"))


def is_training_dropout(node: fx.Node) -> bool:
    """A dropout op that runs in training mode (random: not the identity)."""
    return op_packet(node) in DROPOUT_OPS and bool(node_arg(node, 2, "train", False))


def passes_values_on(node, *, casts: bool = False) -> bool:
    """``node`` returns its first input's values unchanged: a copy or eval-mode dropout, and with
    ``casts`` a dtype cast too."""
    packet = op_packet(node)
    if packet in COPY_OPS or (casts and packet in CAST_OPS):
        return True
    return packet in DROPOUT_OPS and not is_training_dropout(node)


def through_value_copies(node, *, casts: bool = False):
    """The node a chain of :func:`passes_values_on` ops reads (``node`` itself when it is none)."""
    while passes_values_on(node, casts=casts) and node.args:
        node = node.args[0]
    return node


def norm_node_kind(node) -> str | None:
    """The kind of norm a graph node computes: "LayerNorm", "RMSNorm" (normfold's op by its ``is_rms``
    argument), "BatchNorm", "InstanceNorm", "GroupNorm"; None for any other node."""
    packet = op_packet(node)
    if packet is None:
        return None
    if packet == _aten.layer_norm:
        return "LayerNorm"
    if packet == getattr(_aten, "rms_norm", None):
        return "RMSNorm"
    if str(packet) == "normfold.norm_fwd":  # (x, weight, bias, residual, eps, offset, is_rms) -> (y, s, mean, rstd)
        return "RMSNorm" if node.args[6] else "LayerNorm"
    if packet in BATCH_NORM_OPS:
        return "BatchNorm"
    if packet == _aten.instance_norm:
        return "InstanceNorm"
    if packet == _aten.group_norm:
        return "GroupNorm"
    return None


__all__ = ["BATCH_NORM_OPS", "CAST_OPS", "CAST_OP_NAMES", "COPY_OPS", "COPY_OP_NAMES", "DROPOUT_OPS", "DROPOUT_OP_NAMES",
           "LINEAR_PRODUCER_OPS", "aten_packets", "is_training_dropout", "norm_node_kind", "passes_values_on",
           "through_value_copies"]
