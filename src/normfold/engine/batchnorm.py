"""Plan BatchNorm merging: an eval-mode BatchNorm right after a Linear or Conv becomes part of that layer.

In eval mode BatchNorm is a fixed per-channel affine map,

    BN(y) = γ · (y − μ_run) / sqrt(σ²_run + ε) + β = s · y + (β − s · μ_run),   s = γ / sqrt(σ²_run + ε),

so with y = W x + b it folds exactly into the producer: W' = s · W (scaling each output channel),
b' = s · (b − μ_run) + β (``normfold.engine.math.fold_batchnorm_into_producer``), and the BatchNorm
becomes ``Identity``. The steps are the first section of the ``FoldPlan`` (``apply_plan`` runs them
first); the LayerNorm analysis then runs on the model with its BatchNorms merged.

Refused (reported, model left as is): a BatchNorm in train mode (its statistics come from each
batch, there is nothing fixed to fold), one without running statistics, one whose producer's
output is also read elsewhere (scaling W would change that reader too), a producer whose weight
or bias is shared with another module, a transposed convolution, a BatchNorm that does not read a
Linear/Conv directly, and one that not every example call runs the same way.

Like torch.fx's ``fuse`` but every skipped match is reported with its reason; the pairs are found
in the ``torch.export`` graph (``normfold.engine.graph.capture``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import fx, nn

from .._text import dtype_name
from .graph import Captured, op_name, op_packet, owner_path
from .math import identity_batchnorm_variance
from .op_kinds import BATCH_NORM_OPS, LINEAR_PRODUCER_OPS, passes_values_on
from .plan import BatchNormFoldStep, PlanConstraints

_PRODUCER_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class BatchNormEntry:
    """One BatchNorm module: merged into its producer (a Linear/Conv) or kept, and why (``FoldReport.batchnorms``)."""

    path: str
    folded: bool
    producer: str | None
    reason: str


def has_batchnorms(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def plan_batchnorms(model: nn.Module, captures: list[Captured], constraints: PlanConstraints = PlanConstraints()
                    ) -> tuple[list[BatchNormFoldStep], list[BatchNormEntry]]:
    """Steps for the BatchNorms that every captured call allows to merge, and an entry per BatchNorm.

    Under ``constraints.keep_modules_in`` (a loader needs the BatchNorms' keys, stored in that
    dtype) merged BatchNorms stay as exact identities, and one that cannot be exact there is kept;
    a producer without a bias is merged only if ``constraints`` allow creating it.
    """
    steps, entries = _plan_one_call(model, captures[0], constraints)
    for j, captured in enumerate(captures[1:], start=1):
        other_steps, other_entries = _plan_one_call(model, captured, constraints)
        why = {e.path: e.reason for e in other_entries if not e.folded}
        for i, entry in enumerate(entries):
            step = next((s for s in steps if s.norm_path == entry.path), None)
            if step is not None and step not in other_steps:
                steps.remove(step)
                entries[i] = dataclasses.replace(entry, folded=False, reason=(
                    f"not foldable in example call {j}: {why.get(entry.path, 'that call does not run it')}"))
    return steps, entries


def _plan_one_call(model: nn.Module, captured: Captured, constraints: PlanConstraints):
    steps, entries, seen = [], [], set()
    for node in captured.graph.nodes:
        if op_packet(node) not in BATCH_NORM_OPS:
            continue
        path = _bn_path(captured, node)
        if path is None or path in seen:
            continue
        seen.add(path)
        bn = model.get_submodule(path)
        producer_node, producer, private = _producer(captured, node)
        reason = _refusal(model, bn, producer, private, captured, producer_node, constraints)
        if reason:
            entries.append(BatchNormEntry(path, False, producer, reason))
            continue
        steps.append(_step(model, path, bn, producer, constraints.keep_modules_in is not None))
        entries.append(BatchNormEntry(path, True, producer, f"folded into {producer}"))
    return steps, entries


def _producer(captured: Captured, node: fx.Node) -> tuple[fx.Node, str | None, bool]:
    """(the node the BatchNorm reads through pass-through ops, the module owning it if it is a
    Linear/Conv op, whether the BatchNorm is the only reader of that output)."""
    x, private = node.args[0], True
    while passes_values_on(x, casts=True):
        private &= len(x.users) == 1
        x = x.args[0]
    producer = owner_path(captured, x.args[1]) if op_packet(x) in LINEAR_PRODUCER_OPS and len(x.args) > 1 else None
    return x, producer, private and len(x.users) == 1


def _refusal(model, bn, producer, private, captured, x, constraints: PlanConstraints) -> str | None:
    """Why the BatchNorm ``bn`` reading ``producer`` cannot merge into it, or None."""
    if bn.training:
        return "in train mode: it normalizes with batch statistics, nothing fixed to fold (call model.eval())"
    if getattr(bn, "running_mean", None) is None or getattr(bn, "running_var", None) is None:
        return "no running statistics (track_running_stats=False): it always uses batch statistics"
    if producer is None:
        return f"its input is not a Linear/Conv output but {op_name(x) if x.op == 'call_function' else x.op}"
    if op_packet(x) == torch.ops.aten.convolution and len(x.args) > 6 and x.args[6]:
        return f"{producer} is a transposed convolution (output channels are not on weight dim 0)"
    if not private:
        return f"the output of {producer} is also used elsewhere: scaling its weights would change that use"
    if not isinstance(model.get_submodule(producer), _PRODUCER_MODULES):
        return f"{producer} is not an nn.Linear/nn.ConvNd module"
    shared = [a for a in x.args[1:3] if isinstance(a, fx.Node) and a in captured.param_fqn
              and (len(a.users) != 1 or len(captured.aliases.get(captured.param_fqn[a], ())) > 1)]
    if shared:
        return f"{captured.param_fqn[shared[0]]} is shared with another use: scaling it would change that use"
    if model.get_submodule(producer).bias is None and not constraints.may_create(f"{producer}.bias"):
        return f"the stock architecture has no {producer}.bias to absorb its shift"
    stored = constraints.keep_modules_in
    if stored is not None and identity_batchnorm_variance(float(bn.eps), stored) is None:
        return (f"the checkpoint keeps this BatchNorm's keys, and in {dtype_name(stored)} no stored "
                f"running variance makes it an exact identity (1 − eps + eps ≠ 1 there, eps={bn.eps})")
    return None


def _step(model: nn.Module, path: str, bn: nn.Module, producer: str, keep_module: bool) -> BatchNormFoldStep:
    has_bias = model.get_submodule(producer).bias is not None
    return BatchNormFoldStep(
        norm_path=path, producer_path=producer, weight_fqn=f"{producer}.weight", bias_fqn=f"{producer}.bias",
        create_bias=not has_bias, mean_fqn=f"{path}.running_mean", var_fqn=f"{path}.running_var",
        gamma_fqn=f"{path}.weight" if bn.weight is not None else None,
        beta_fqn=f"{path}.bias" if bn.bias is not None else None, eps=float(bn.eps), keep_module=keep_module)


def _bn_path(captured: Captured, node: fx.Node) -> str | None:
    """The BatchNorm module that owns this node: via its weight, else its running mean."""
    return owner_path(captured, node.args[1]) or owner_path(captured, node.args[3] if len(node.args) > 3 else None)
