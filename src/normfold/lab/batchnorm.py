"""BatchNorm folding: an eval-mode BatchNorm right after a Linear or Conv becomes part of that layer.

In eval mode BatchNorm is a fixed per-channel affine map,

    BN(y) = γ · (y − μ_run) / sqrt(σ²_run + ε) + β = s · y + (β − s · μ_run),   s = γ / sqrt(σ²_run + ε),

so with y = W x + b it folds exactly into the producer: W' = s · W (scaling each output channel),
b' = s · (b − μ_run) + β, and the BatchNorm becomes ``Identity``.

Refused (reported, model left as is): a BatchNorm in train mode (its statistics come from each
batch, there is nothing fixed to fold), one without running statistics, one whose producer's
output is also read elsewhere (scaling W would change that reader too), a transposed convolution,
and a BatchNorm that does not read a Linear/Conv directly.

Like torch.fx's ``fuse`` but every skipped match is reported with its reason. The pairs are
found in the ``torch.export`` graph (``normfold.fold.graph.capture``); the steps are plain data
and the math is a pure function, as in the exact fold's plan.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, fx, nn

from ._common import as_batches, call, first_tensor

_PASSTHROUGH = {"aten.dropout", "aten.clone", "aten.alias", "aten._to_copy", "aten.contiguous", "aten.feature_dropout"}
_PRODUCER_OPS = {"aten.linear", "aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution"}
_BATCH_NORM_OPS = {"aten.batch_norm", "aten._native_batch_norm_legit_no_training", "aten._native_batch_norm_legit",
                   "aten.native_batch_norm", "aten._batch_norm_with_update", "aten._batch_norm_no_update"}


@dataclass(frozen=True)
class BatchNormFoldStep:
    """Fold the BatchNorm at ``norm_path`` into the producer module at ``producer_path`` (weight
    output channels on dim 0; a zero bias is created when the producer has none)."""

    norm_path: str
    producer_path: str
    eps: float


@dataclass
class BatchNormEntry:
    path: str
    folded: bool
    producer: str | None
    reason: str


def fold_batchnorm_into_producer(weight: Tensor, bias: Tensor | None, running_mean: Tensor, running_var: Tensor,
                                 gamma: Tensor | None, beta: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """(W', b') with W'x + b' = BN_eval(Wx + b); output channels on dim 0 of ``weight``. Computed in float64."""
    dtype = weight.dtype
    mean, var = running_mean.double(), running_var.double()
    scale = torch.rsqrt(var + eps)  # (C,)
    if gamma is not None:
        scale = scale * gamma.double()
    b = torch.zeros_like(mean) if bias is None else bias.double()
    new_bias = (b - mean) * scale + (beta.double() if beta is not None else 0.0)
    new_weight = weight.double() * scale.reshape(-1, *([1] * (weight.dim() - 1)))
    return new_weight.to(dtype), new_bias.to(dtype)


def _op(node) -> str:
    from ..fold.graph import op_name

    return op_name(node) if isinstance(node, fx.Node) and node.op == "call_function" else ""


def _owner(captured, node) -> str | None:
    fqn = (captured.param_fqn.get(node) or captured.buffer_fqn.get(node)) if isinstance(node, fx.Node) else None
    return fqn.rpartition(".")[0] if fqn else None


def _bn_path(captured, node: fx.Node) -> str | None:
    """The BatchNorm module that owns this node: via its weight, else its running mean."""
    return _owner(captured, node.args[1]) or _owner(captured, node.args[3] if len(node.args) > 3 else None)


def plan_batchnorm_folds(model: nn.Module, example_inputs) -> tuple[list[BatchNormFoldStep], list[BatchNormEntry]]:
    """Which BatchNorms fold into their producer, and why the others do not (model untouched)."""
    from ..fold.graph import capture

    captured = capture(model, example_inputs)
    steps, entries, seen = [], [], set()
    for node in captured.graph.nodes:
        if _op(node) not in _BATCH_NORM_OPS:
            continue
        path = _bn_path(captured, node)
        if path is None or path in seen:
            continue
        seen.add(path)
        bn = model.get_submodule(path)
        x, chain_users_ok = node.args[0], True
        while _op(x) in _PASSTHROUGH:
            chain_users_ok &= len(x.users) == 1
            x = x.args[0]
        producer = _owner(captured, x.args[1]) if _op(x) in _PRODUCER_OPS and len(x.args) > 1 else None
        reason = None
        if bn.training:
            reason = "in train mode: it normalizes with batch statistics, nothing fixed to fold (call model.eval())"
        elif getattr(bn, "running_mean", None) is None or getattr(bn, "running_var", None) is None:
            reason = "no running statistics (track_running_stats=False): it always uses batch statistics"
        elif producer is None:
            reason = f"its input is not a Linear/Conv output but {_op(x) or x.op}"
        elif _op(x) == "aten.convolution" and len(x.args) > 6 and x.args[6]:
            reason = f"{producer} is a transposed convolution (output channels are not on weight dim 0)"
        elif len(x.users) != 1 or not chain_users_ok:
            reason = f"the output of {producer} is also used elsewhere: scaling its weights would change that use"
        elif not isinstance(model.get_submodule(producer), (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            reason = f"{producer} is not an nn.Linear/nn.ConvNd module"
        if reason:
            entries.append(BatchNormEntry(path, False, producer, reason))
        else:
            steps.append(BatchNormFoldStep(path, producer, float(bn.eps)))
            entries.append(BatchNormEntry(path, True, producer, f"folded into {producer}"))
    return steps, entries


@torch.no_grad()
def apply_batchnorm_folds(model: nn.Module, steps: list[BatchNormFoldStep]) -> nn.Module:
    """Apply the steps to ``model`` in place (producers rescaled, BatchNorms become Identity); returns it."""
    for step in steps:
        bn, producer = model.get_submodule(step.norm_path), model.get_submodule(step.producer_path)
        weight, bias = fold_batchnorm_into_producer(producer.weight, producer.bias, bn.running_mean, bn.running_var,
                                                    bn.weight, bn.bias, step.eps)
        producer.weight.copy_(weight)
        if producer.bias is None:
            producer.bias = nn.Parameter(bias)
        else:
            producer.bias.copy_(bias)
        model.set_submodule(step.norm_path, nn.Identity())
    return model


def fold_batchnorms(model: nn.Module, example_inputs, *, verify: bool = True,
                    tolerance: float = 1e-9) -> tuple[nn.Module, list[BatchNormEntry]]:
    """Return ``(folded_copy, entries)``: every foldable eval-mode BatchNorm merged into its producer.

    With ``verify=True`` the same steps are applied to a float64 copy, whose outputs are compared
    with ``model``'s in float64 on ``example_inputs`` (so float32 rounding of the new weights does
    not hide a wrong fold); ``ValueError`` if the relative error exceeds ``tolerance``.
    """
    steps, entries = plan_batchnorm_folds(model, example_inputs)
    folded = apply_batchnorm_folds(copy.deepcopy(model), steps)
    if verify and steps:
        batch = as_batches(example_inputs)[0]
        with torch.no_grad():
            ref = first_tensor(call(copy.deepcopy(model).double(), _to_double(batch)))
            exact = apply_batchnorm_folds(copy.deepcopy(model).double(), steps)
            out = first_tensor(call(exact, _to_double(batch)))
        err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item()
        if err > tolerance:
            raise ValueError(f"BatchNorm folding changed the outputs: float64 relative error {err:.3e} > {tolerance:.0e}")
    return folded, entries


def _to_double(batch):
    if isinstance(batch, Tensor):
        return batch.double() if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _to_double(v) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_to_double(v) for v in batch)
    return batch


def entries_to_dict(entries: list[BatchNormEntry]) -> list[dict]:
    return [asdict(e) for e in entries]


__all__ = ["fold_batchnorms", "plan_batchnorm_folds", "apply_batchnorm_folds", "fold_batchnorm_into_producer",
           "BatchNormFoldStep", "BatchNormEntry"]
