"""The kinds of graph ops every walk shares (``normfold.engine.op_kinds``), read on real export graphs."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from normfold.engine.batchnorm import plan_batchnorms
from normfold.engine.graph import capture, op_name
from normfold.engine.op_kinds import norm_node_kind, passes_values_on, through_value_copies


class Copies(nn.Module):
    """fc → clone → eval dropout → float64 cast → a LayerNorm, and a training-mode dropout beside them."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        y = F.dropout(self.fc(x).clone(), 0.5, training=False).double()
        return self.ln(y), F.dropout(x, 0.5, training=True)


def _nodes(model, x):
    return {op_name(n): n for n in capture(model, (x,)).graph.nodes if n.op == "call_function"}


def test_copies_and_eval_dropout_pass_values_on_and_casts_only_when_asked():
    nodes = _nodes(Copies(), torch.randn(2, 4))
    ln = next(n for n in nodes.values() if norm_node_kind(n) == "LayerNorm")
    assert op_name(through_value_copies(ln.args[0], casts=True)) == "aten.linear"
    assert op_name(through_value_copies(ln.args[0])) == "aten.to"  # a cast stops the walk by default
    training = [n for n in capture(Copies(), (torch.randn(2, 4),)).graph.nodes
                if op_name(n) == "aten.dropout" and n.args[2] is True]
    assert training and not passes_values_on(training[0], casts=True)


@pytest.mark.parametrize("norm, kind", [
    (nn.LayerNorm(4), "LayerNorm"), (nn.BatchNorm1d(4), "BatchNorm"), (nn.GroupNorm(2, 4), "GroupNorm"),
    (nn.Sequential(nn.Unflatten(1, (2, 2)), nn.InstanceNorm1d(2, affine=True)), "InstanceNorm"),
])
def test_each_norm_op_is_recognised_by_its_kind_and_nothing_else_is(norm, kind):
    model = nn.Sequential(nn.Linear(4, 4), norm).eval()
    kinds = [norm_node_kind(n) for n in capture(model, (torch.randn(3, 4),)).graph.nodes]
    assert [k for k in kinds if k is not None] == [kind]


class DropoutThenBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(F.dropout(self.fc(x), 0.5, training=True))  # random even in eval: no fixed map to merge


def test_a_batchnorm_behind_training_mode_dropout_is_not_merged():
    """BN(drop(Wx + b)) ≠ drop(W'x + b'): the merge moves the shift inside the random mask (fails on main
    4025376: it was planned)."""
    model = DropoutThenBatchNorm().eval()
    steps, entries = plan_batchnorms(model, [capture(model, (torch.randn(3, 4),))])
    assert steps == [] and not entries[0].folded and "aten.dropout" in entries[0].reason
