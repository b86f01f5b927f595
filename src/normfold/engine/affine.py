"""Where a norm's γ/β can go: into the linear layers that read its output (W·diag(γ), b + W·β).

A norm's affine folds when it runs once, its γ/β are parameters of its own, and every reader of
its output (through row-preserving views, copies and eval dropout) is a linear map with a private
2-D weight; β needs a bias to land in, which a bias-less ``nn.Linear`` may be given unless the
planning constraints forbid new parameters. Anything else keeps the affine, with the reason.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import fx, nn

from ..nn.kinds import RMS_NORM_TYPES
from .analyzed_norm import AnalyzedNorm
from .graph import Captured, describe, op_packet, shape, single_use_param, static_size, use_alias
from .op_kinds import passes_values_on
from .plan import AffineFoldStep, PlanConstraints

_aten = torch.ops.aten

# views between a norm and the linear layers reading it that keep each row's features as they are (when the
# last dim keeps its width); value copies, casts and eval dropout (``op_kinds.passes_values_on``) do too
_ROW_VIEWS = {_aten.view, _aten.reshape, _aten._unsafe_view, _aten.flatten}
_TRANSPOSES = {_aten.t, _aten.numpy_T, _aten.transpose}


def _private_weight(node, user: fx.Node, captured: Captured, untied: frozenset) -> str | None:
    """The name of a consumer's weight if that weight belongs to this use alone (after untying)."""
    fqn = single_use_param(node, captured)
    if fqn is not None or not isinstance(node, fx.Node) or node not in captured.param_fqn:
        return fqn
    name = use_alias(captured, node, user)
    others = [u for u in node.users if u is not user]
    if name in untied and all(use_alias(captured, node, u) != name for u in others):
        return name
    return None


def affine_steps(norm: AnalyzedNorm, model: nn.Module, captured: Captured, untied: frozenset = frozenset(),
                 constraints: PlanConstraints = PlanConstraints()) -> tuple[list[AffineFoldStep], str]:
    """Steps folding the norm's γ/β into every linear consumer, or ([], why not)."""
    if norm.module is None:
        return [], "no module to replace"
    if len(norm.calls) != 1:
        return [], "module runs more than once"
    call = norm.calls[0]
    if call.weight is None and call.bias is None:
        return [], "no affine"
    if norm.form is not None and norm.form.offset:  # γ' = γ + offset would have to move, not the parameter γ
        return [], f"it scales by γ + {norm.form.offset:g}, not by its parameter γ"
    if call.num_dims != 1:  # γ/β span several dims: no per-feature scale to move into a linear layer
        return [], f"γ/β span {call.num_dims} dims {tuple(norm.module.normalized_shape)}, not one feature dim"
    if call.is_rms and (call.eps is None or not isinstance(norm.module, RMS_NORM_TYPES)):
        return [], "RMSNorm without an explicit eps"
    if call.offset and not constraints.move_every_gamma:
        return [], (f"it scales by ({call.offset:g} + γ), whose stored γ a stock reload would read as 1 once moved "
                    "(normfold.rotate moves it)")
    gamma_fqn = single_use_param(call.weight, captured) if call.weight is not None else None
    beta_fqn = single_use_param(call.bias, captured) if call.bias is not None else None
    if (call.weight is not None and gamma_fqn is None) or (call.bias is not None and beta_fqn is None):
        return [], "its γ/β are shared or not parameters"
    if call.output is None or static_size(call.output, -1) is None:
        return [], "output not used"
    width = static_size(call.output, -1)  # the rows may be counted by the input (a mask), the width is not
    steps, frontier = [], [call.output]
    while frontier:
        current = frontier.pop()
        for user in current.users:
            keeps_rows = op_packet(user) in _ROW_VIEWS or passes_values_on(user, casts=True)
            if keeps_rows and user.args[0] is current and static_size(user, -1) == width:
                frontier.append(user)
                continue
            if user.op == "output":
                return [], "its output is a model output"
            step = _consumer_step(norm, user, current, gamma_fqn, beta_fqn, model, captured, untied, constraints)
            if isinstance(step, str):
                return [], step
            steps.append(step)
    return [replace(step, gamma_offset=call.offset) for step in steps], ""


def _consumer_step(norm, user, x, gamma_fqn, beta_fqn, model, captured, untied, constraints: PlanConstraints):
    packet = op_packet(user)
    if packet == _aten.linear and user.args[0] is x:
        w, b, in_dim = user.args[1], (user.args[2] if len(user.args) > 2 else None), 1
    elif packet == _aten.addmm and user.args[1] is x and len(user.args) == 3 and not user.kwargs:
        w, b, in_dim = user.args[2], user.args[0], 0
    elif packet in (_aten.mm, _aten.matmul) and user.args[0] is x:
        w, b, in_dim = user.args[1], None, 0
    else:
        return f"its output feeds {describe(user)}, not a linear layer"
    if in_dim == 0 and op_packet(w) in _TRANSPOSES and len(w.users) == 1 and shape(w.args[0]) and len(shape(w.args[0])) == 2:
        w, in_dim = w.args[0], 1  # matmul(x, Wᵀ) with W (out, in), e.g. Falcon's linear
    w_fqn = _private_weight(w, user, captured, untied)
    if w_fqn is None or len(shape(w)) != 2:
        return f"consumer {describe(user)} has no private 2-D weight parameter"
    if b is not None:
        b_fqn = single_use_param(b, captured)
        if b_fqn is None or len(shape(b)) != 1:
            return f"consumer {describe(user)} has a shared or non-parameter bias"
        return AffineFoldStep(norm.path, gamma_fqn, beta_fqn, w_fqn, in_dim, b_fqn)
    owner_path = w_fqn.rpartition(".")[0]
    owner = model.get_submodule(owner_path)
    beta_zero = beta_fqn is None or not torch.any(model.get_parameter(beta_fqn) != 0)
    if beta_zero:
        return AffineFoldStep(norm.path, gamma_fqn, None, w_fqn, in_dim, "", create_bias=False)
    if isinstance(owner, nn.Linear) and owner.bias is None:  # nn.Linear (and subclasses) read self.bias
        if not constraints.may_create(f"{owner_path}.bias"):  # e.g. GPT-2's lm_head: stock drops a new bias
            return f"the stock architecture has no {owner_path}.bias"
        return AffineFoldStep(norm.path, gamma_fqn, beta_fqn, w_fqn, in_dim, f"{owner_path}.bias", create_bias=True)
    return f"consumer {describe(user)} has no bias to absorb β and cannot hold one"
