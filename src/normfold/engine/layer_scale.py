"""Layer scale: an elementwise parameter γ multiplying a Linear/Conv output merges into that layer.

BEiT, DINOv2, data2vec-vision and ConvNeXt scale each residual branch by a learned per-channel γ,

    t = γ ⊙ (W h + b) = (diag(γ)·W) h + γ ⊙ b,

so W ← diag(γ)·W, b ← γ ⊙ b and γ ← 1 leave every output unchanged
(``normfold.engine.math.scale_output_channels``). The multiply then passes a zero-mean input through
unchanged, which the rules table cannot know from the graph (γ varies along the features): the
analysis walks through a mergeable multiply to the producer, whose weight the fold then centers.
A merge is planned only where a folded norm's zero-mean graph runs through it; a layer scale whose
γ or whose producer's output has another reader is refused, with the reason the analysis reports.

Like the BatchNorm merge (``normfold.engine.batchnorm``), the plan's step names only parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

from .graph import Captured, describe, op_packet, shape
from .op_kinds import LINEAR_PRODUCER_OPS, passes_values_on  # the same producers and pass-through ops as BatchNorm's
from .plan import LayerScaleStep

_aten = torch.ops.aten


@dataclass(frozen=True)
class LayerScale:
    """A multiply by γ after a producer: ``step`` when it can merge (``input`` is then what the
    multiply equals after the plan), else ``refused`` saying why."""

    mul: fx.Node
    input: fx.Node
    step: LayerScaleStep | None
    refused: str = ""


def find_layer_scales(captured: Captured) -> dict[fx.Node, LayerScale]:
    """Every ``γ ⊙ producer(h)`` in the graph (γ a parameter with one value per output channel), by
    multiply node."""
    found = {}
    for node in captured.graph.nodes:
        scale = _layer_scale(node, captured)
        if scale is not None:
            found[node] = scale
    return found


def _layer_scale(node: fx.Node, captured: Captured) -> LayerScale | None:
    if op_packet(node) != _aten.mul or len(node.args) != 2 or shape(node) is None:
        return None
    for gamma, x in (node.args, node.args[::-1]):
        if isinstance(gamma, fx.Node) and gamma in captured.param_fqn and isinstance(x, fx.Node) \
                and shape(x) == shape(node):
            break
    else:
        return None
    producer, private = x, len(x.users) == 1
    while passes_values_on(producer, casts=True):
        producer = producer.args[0]
        private &= len(producer.users) == 1
    if op_packet(producer) not in LINEAR_PRODUCER_OPS or not _per_output_channel(shape(gamma), producer):
        return None  # not a layer scale: the rules table judges the multiply
    fqn = captured.param_fqn[gamma]
    weight, bias = producer.args[1], producer.args[2] if len(producer.args) > 2 else None
    refused = _refusal(captured, gamma, producer, private, weight, bias)
    if refused:
        return LayerScale(node, x, None, f"layer scale {fqn} cannot merge into {describe(producer)}: {refused}")
    step = LayerScaleStep(fqn, captured.param_fqn[weight], captured.param_fqn[bias] if bias is not None else None)
    return LayerScale(node, x, step)


def _per_output_channel(gamma_shape, producer: fx.Node) -> bool:
    """γ holds one value per output channel of the producer and broadcasts over nothing else:
    (C,) on a Linear's last dim, (C, 1, ..., 1) on a Conv's channel dim."""
    out = shape(producer)
    if gamma_shape is None or out is None or len(gamma_shape) == 0:
        return False
    if op_packet(producer) == _aten.linear:
        return tuple(gamma_shape) == (out[-1],) and out[-1] > 1
    return tuple(gamma_shape) == (out[1], *[1] * (len(out) - 2)) and out[1] > 1


def _refusal(captured: Captured, gamma: fx.Node, producer: fx.Node, private: bool, weight, bias) -> str:
    """Why γ cannot move into the producer ('' when it can)."""
    if op_packet(producer) == _aten.convolution and len(producer.args) > 6 and producer.args[6]:
        return "a transposed convolution (output channels are not on weight dim 0)"
    if len(gamma.users) != 1 or len(captured.aliases.get(captured.param_fqn[gamma], ())) > 1:
        return "γ is also read elsewhere (setting it to 1 would change that use)"
    if not private:
        return "the producer's output is also read elsewhere (scaling its weights would change that use)"
    for tensor in (weight, bias):
        if tensor is None:
            continue
        if tensor not in captured.param_fqn:
            return f"its weight or bias is computed ({describe(tensor)}), not a parameter"
        if len(tensor.users) != 1 or len(captured.aliases.get(captured.param_fqn[tensor], ())) > 1:
            return f"{captured.param_fqn[tensor]} is shared with another use (scaling it would change that use)"
    return ""
