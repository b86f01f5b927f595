"""Column-based weight centering (CBWC): train a LayerNorm model as an RMSNorm model, exactly.

    report = normfold.cbwc_(model, example_inputs)   # in place; returns the fold engine's FoldReport
    ... train as usual ...
    normfold.cbwc.bake_(model)                        # plain centered weights, no parametrizations

Every producer that the fold engine (``normfold.analyze``) would center is reparametrized as
V = W − mean(W, dim) — for a linear weight, V = (I − 11ᵀ/m)·W — with W the free parameter, and every
foldable LayerNorm becomes a ``normfold.nn.RMSNorm`` holding the same γ/β Parameters. The producers'
outputs are then zero-mean for every W, and RMSNorm(x) = LayerNorm(x) for zero-mean x. A model in
which some LayerNorm's input cannot be proved zero-mean (Post-LN, a sandwich's pre-norms, per-head QK
norms) is refused with ``PartialCBWCError``, each kept norm with the engine's reason, unless
``allow_partial=True``: a "CBWC model" that trains LayerNorms must not pass unnoticed.

Why training is identical, AdamW weight decay included. LayerNorm ignores a shift of its input:
LN(h) = LN(P·h) with P = I − 11ᵀ/m, and for the zero-mean P·h, LN = RMSNorm with the same eps, γ, β.
The residual stream of the CBWC model is P times the LayerNorm model's stream, and it only reaches
the model's outputs through the (now RMS) norms. So the CBWC loss is the *same function* of the
free parameters as the LayerNorm loss, L_cbwc(W) = L_ln(W) for every W — not just at one point —
and both models see the same gradient ∂L/∂W at every step. AdamW's update depends only on W, the
gradient and the step, so the trajectories coincide; decoupled weight decay acts on the free W in
both models alike. (The gradient is zero-mean along the centered dim, yet the free W's mean does
drift: Adam scales each element separately and weight decay shrinks it. Neither model can see that
component.) Training a once-centered plain RMSNorm model instead loses the equivalence, because
that drift then reaches the norm inputs.

Tied tables (``lm_head`` ↔ ``wte``): the plan's untie steps name the uses that must keep the
uncentered tensor. CBWC keeps the tie — the lookup sees V, the head sees W, one Parameter gets both
gradients — which is exactly the LayerNorm model's gradient. ``bake_`` unties them at the end.

Cost. ``normfold train`` runs CBWC by projection (:func:`project_centering_`): the centered tensors are plain
Parameters held at V = P·W, the step centers their gradients before clipping and the tensors after AdamW, and
only a tied table keeps its parametrization (its V computed once per step for all micro-batches,
:func:`centered_once`). The forward then reads plain Parameters. A :class:`CenteringIndex`, built once per run,
holds the tensors, and each projection is one C++ call for all of them (``normfold.ops.centering.center_``):
on the experiments' 3 × 64 GPT (13 tensors) 43 µs instead of 500 µs of per-tensor ops and module walks
(a step is ~100 ms). Under FSDP2 the parametrization stays (the mean runs along the sharded dim) and V is
computed in every forward (see ``trainer.accumulate_gradients``).

Where the equivalence breaks: dropout on a producer's output in training (residual / embedding
dropout) rescales elements at random, so the stream is no longer zero-mean and the RMSNorm sees a
different input from the LayerNorm. Attention-probability dropout (before ``c_proj``) is harmless.
Measured in ``experiments/cbwc_equivalence.py`` (2-layer GPT, 150 AdamW steps, weight decay 0.1,
one seed; ``experiments/results/cbwc_equivalence.md``), largest relative gap of the training loss to
the LayerNorm run over all steps:

    dropout 0,   float64   5.0e-14     (rounding)
    dropout 0,   float32   5.8e-05     (rounding, grows with steps)
    dropout 0.1, either    3.0e-02     final validation loss 2.474 vs 2.529 (dropout off in eval)
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from ..engine import FoldError, FoldReport, analyze
from ..ops import centering
from ..engine.transform import swap_norm, untie_config

__all__ = ["cbwc_", "bake_", "Centered", "PartialCBWCError", "centered_once", "project_centering_",
           "center_gradients_", "center_parameters_", "CenteringIndex"]


class PartialCBWCError(FoldError):
    """A CBWC model was asked for but some LayerNorms would stay LayerNorms (their input is not provably
    zero-mean); raised before anything changes. ``allow_partial=True`` trains them as they are."""


class Centered(nn.Module):
    """Parametrization V = W − mean(W) along ``dim``, per contiguous ``group`` elements (None: whole dim).

    ``normfold.ops.centering.center`` in a module (``normfold.engine.math.center`` detaches and works in
    float64 for one-off folding); here the gradient must flow to W, in W's dtype.
    """

    def __init__(self, dim: int, group: int | None = None) -> None:
        super().__init__()
        self.dim, self.group = dim, group

        self.ready: Tensor | None = None  # V set by ``centered_once`` for the duration of its block

    def forward(self, w: Tensor) -> Tensor:
        if self.ready is not None:
            return self.ready
        return self.center(w)

    def center(self, w: Tensor) -> Tensor:
        """P·w; P is symmetric, so this is also the backward's map from ∂L/∂V to ∂L/∂W."""
        return centering.center(w, self.dim, self.group)

    def extra_repr(self) -> str:
        return f"dim={self.dim}" + (f", group={self.group}" if self.group is not None else "")


class _CenterAll(torch.autograd.Function):
    """V_i = P_i·W_i for all centered tensors of a model as one autograd node; backward g_i ↦ P_i·g_i.

    One node instead of a mean, an expand and a subtraction per tensor forward and backward: at the
    experiments' widths the autograd bookkeeping of 18 small centerings cost more than their arithmetic.
    The node saves no tensors, so micro-batches can each walk it (no ``retain_graph``).
    """

    @staticmethod
    def forward(ctx, centerings: tuple[Centered, ...], *weights: Tensor) -> tuple[Tensor, ...]:
        ctx.centerings = centerings
        return tuple(c.center(w) for c, w in zip(centerings, weights))

    @staticmethod
    def backward(ctx, *grads: Tensor | None):
        return (None, *(None if g is None else c.center(g) for c, g in zip(ctx.centerings, grads)))


def centered_once(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Inside the block, every CBWC weight of ``model`` reads one V = P·W computed on entry, all by one
    autograd node (gradients still reach W through it). W must not change inside: use it around the
    forwards and backwards of one optimizer step, not around ``optimizer.step()``. Not for
    ``torch.compile``d forwards (they would trace the precomputed tensors) nor FSDP2 (see
    ``trainer.accumulate_gradients``): there ``parametrize.cached()`` or plain reads apply.
    (:meth:`CenteringIndex.centered_once` without the search for the tensors.)
    """
    return CenteringIndex(model).centered_once()


# A module whose Parameters CBWC keeps centered by projection holds {attribute: Centered} here (see
# project_centering_). On the module, not the Parameter: ``copy.deepcopy`` keeps a module's __dict__ but not a
# Parameter's, and a copy that lost the mark would train uncentered tensors without a word.
_PROJECTED_ATTR = "_cbwc_projected"


def _remove_parametrization(module: nn.Module, attr: str, leave_parametrized: bool) -> None:
    """``parametrize.remove_parametrizations`` on a class of the module's own first: ``copy.deepcopy`` shares
    the generated ``Parametrized…`` class between a model and its copy, and removing the property from
    that shared class would break the other model's reads of ``attr``."""
    cls = module.__class__
    module.__class__ = type(cls.__name__, cls.__bases__,
                            {k: v for k, v in cls.__dict__.items() if k not in ("__dict__", "__weakref__")})
    parametrize.remove_parametrizations(module, attr, leave_parametrized=leave_parametrized)


def project_centering_(model: nn.Module) -> int:
    """Train CBWC's centered tensors as plain Parameters held at V = P·W, instead of through the
    parametrization (in place); returns how many were converted. The training step must then center
    their gradients before clipping (:func:`center_gradients_`) and the tensors again after the
    optimizer step (:func:`center_parameters_`), as ``normfold.train``'s ``apply_gradients`` does.

    Why the trajectory is the parametrized one, for AdamW and SGD: the parametrized model's free W
    receives the gradient P·g and its output depends on P·W only. Both optimizers move W by an update
    built elementwise from the gradient history plus a decay linear in W, W ← (1 − lr·wd)·W − lr·u; P is
    linear and idempotent, so re-centering after every step gives P·W_{t+1} = (1 − lr·wd)·P·W_t − lr·P·u:
    the projected tensor *is* P·W at every step, and the gradients (P·g) and optimizer states agree.
    Not exact for updates that read W nonlinearly (Adam's L2 decay through the second moment, LAMB's
    trust ratio): use the parametrization there.

    Why: the forward then reads plain Parameters. The parametrization's property reads and per-step
    centering cost 2–4% of a training step of the experiments' 64-wide GPT; two in-place means per tensor
    and step cost a tenth of that. A tensor shared with an uncentered use (a tied ``lm_head``) keeps its
    parametrization: the head must read the free W. Not for FSDP2-sharded tensors (the mean runs along the
    sharded dim); the trainer keeps the parametrization there.
    """
    converted = 0
    for module in list(model.modules()):
        if not parametrize.is_parametrized(module):
            continue
        for attr in list(module.parametrizations):
            plist = module.parametrizations[attr]
            if len(plist) != 1 or not isinstance(plist[0], Centered):
                continue
            original, centering = plist.original, plist[0]
            if len(_holders(model, original)) > 1:
                continue  # another use reads the free W (a tied head) or an alias: keep V = P·W computed
            _remove_parametrization(module, attr, leave_parametrized=True)  # the same Parameter, now holding V
            assert module._parameters[attr] is original, "remove_parametrizations must keep the Parameter object"
            module.__dict__.setdefault(_PROJECTED_ATTR, {})[attr] = centering
            converted += 1
    return converted


class CenteringIndex:
    """Where a model's CBWC tensors are, found once: the Parameters trained by projection
    (:func:`project_centering_`) and the parametrized ones (a tied table), with what a training step does
    to them. A walk over a small model's modules costs about as much as centering its tensors, and a step
    needs them three times: a training loop builds one index and keeps it. It describes the model as it
    was: build a new one after ``cbwc_``, ``project_centering_`` or ``bake_``.
    """

    def __init__(self, model: nn.Module) -> None:
        self.projected: list[tuple[nn.Module, str, Centered]] = [
            (module, attr, c) for module in model.modules()
            for attr, c in module.__dict__.get(_PROJECTED_ATTR, {}).items()]
        self.parametrized: list[tuple[Centered, Tensor]] = [
            (plist[0], plist.original) for module in model.modules() if parametrize.is_parametrized(module)
            for plist in module.parametrizations.values() if len(plist) == 1 and isinstance(plist[0], Centered)]
        self._tensors = [module._parameters[attr] for module, attr, _ in self.projected]
        self._dims = [c.dim for _, _, c in self.projected]
        self._groups = [c.group for _, _, c in self.projected]

    def parameters(self) -> list[Tensor]:
        """The Parameters trained by projection (each holds V = P·W)."""
        return list(self._tensors)

    def center_gradients_(self) -> None:
        """Replace each projected Parameter's gradient g by P·g (the parametrized model's gradient of W)."""
        grads = [p.grad for p in self._tensors]
        if any(g is None for g in grads):  # a tensor the loss did not reach this step
            kept = [i for i, g in enumerate(grads) if g is not None]
            centering.center_([grads[i] for i in kept], [self._dims[i] for i in kept], [self._groups[i] for i in kept])
        else:
            centering.center_(grads, self._dims, self._groups)

    def center_parameters_(self) -> None:
        """Project each projected Parameter back onto the centered subspace (after an optimizer step)."""
        centering.center_(self._tensors, self._dims, self._groups)

    @contextlib.contextmanager
    def centered_once(self) -> Iterator[None]:
        """:func:`centered_once` for the parametrized tensors of this index."""
        held = self.parametrized
        if any(c.ready is not None for c, _ in held):
            raise RuntimeError("centered_once is already active for this model")
        if len(held) > 2:  # one autograd node for all: cheaper than a mean and a subtraction per tensor
            values = _CenterAll.apply(tuple(c for c, _ in held), *(w for _, w in held))
        else:  # a tied table alone: two recorded ops cost less than a Python autograd.Function
            values = tuple(c.center(w) for c, w in held)
        try:
            for (c, _), v in zip(held, values):
                c.ready = v
            yield
        finally:
            for c, _ in held:
                c.ready = None


def center_gradients_(model: nn.Module) -> None:
    """Replace each projected Parameter's gradient g by P·g (the parametrized model's gradient of W).
    (:meth:`CenteringIndex.center_gradients_` without the search for the tensors.)"""
    CenteringIndex(model).center_gradients_()


def center_parameters_(model: nn.Module) -> None:
    """Project each projected Parameter back onto the centered subspace (after an optimizer step).
    (:meth:`CenteringIndex.center_parameters_` without the search for the tensors.)"""
    CenteringIndex(model).center_parameters_()


def _holders(model: nn.Module, tensor: Tensor) -> list[tuple[str, nn.Module, str]]:
    """Every (module path, module, attribute) whose own parameter is ``tensor`` (aliases included)."""
    found = []
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is tensor:
                found.append((path, module, attr))
    return found


def _check_group(tensor: Tensor, fqn: str, dim: int, group: int | None) -> None:
    try:
        centering.check_centering(tensor, dim, group)
    except ValueError as exc:
        raise ValueError(f"plan step for {fqn!r}: {exc}") from None


def _check_complete(report: FoldReport, allow_partial: bool) -> None:
    """PartialCBWCError naming every kept LayerNorm with the engine's reason, or (``allow_partial``) a
    warning with the count: a CBWC model that is secretly (partly) a LayerNorm model must not go unnoticed."""
    kept = [entry for entry in report.norms if entry.kind == "LayerNorm" and not entry.foldable]
    if not kept:
        return
    total = sum(entry.kind == "LayerNorm" for entry in report.norms)
    summary = f"{len(kept)} of {total} LayerNorms would stay LayerNorms (input not provably zero-mean)"
    if allow_partial:
        warnings.warn(f"cbwc_: {summary}; training them as LayerNorms (allow_partial=True)", stacklevel=3)
        return
    reasons = "; ".join(f"{entry.path}: {entry.reason}" for entry in kept)
    raise PartialCBWCError(f"cbwc_: {summary}: {reasons}. Pass allow_partial=True "
                           "(normfold train: --allow-partial-cbwc) to train with them kept")


def _keeping_partly_centered_norms(report: FoldReport) -> FoldReport:
    """The report with the norms whose producers the plan centers only in part (``center_groups``: the
    q/k rows of a fused projection) kept as LayerNorms, their swaps and partial centerings dropped:
    CBWC trains whole centered tensors. Dropping them keeps the rest exact (a norm kept as a
    LayerNorm only absorbs more); ``_check_complete`` then names them."""
    partial = {step.fqn for step in report.plan.center_groups}
    if not partial:
        return report
    why = "kept for CBWC: centered only in part (some groups of a fused projection), CBWC trains whole tensors"
    norms = [dataclasses.replace(e, foldable=False, reason=why, producers=()) if e.foldable and partial & set(e.producers)
             else e for e in report.norms]
    kept = {e.path for e in norms} - {e.path for e in norms if e.foldable}
    plan = dataclasses.replace(report.plan, center_groups=[], swap=[s for s in report.plan.swap if s.path not in kept])
    return dataclasses.replace(report, norms=norms, plan=plan)


def cbwc_(model: nn.Module, example_inputs, *, report=None, allow_partial: bool = False):
    """Make ``model``'s foldable LayerNorms RMSNorms and keep their producers centered (in place).

    ``example_inputs`` as for ``normfold.analyze`` (a tuple of positional args or a dict of kwargs).
    Pass ``report`` (a ``FoldReport`` from ``normfold.analyze(model, ..., fold_affine=False)``) to
    skip the analysis. Every LayerNorm the engine proves foldable is converted; if any other
    LayerNorm would remain, raises ``PartialCBWCError`` (each kept norm with the engine's reason)
    before changing anything, unless ``allow_partial`` (then a warning with the count). Parameter
    objects are kept, so an optimizer built before the call still works. Returns the ``FoldReport``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if any(isinstance(m, Centered) for m in model.modules()):
        raise ValueError("cbwc_ was already applied to this model (it holds Centered parametrizations)")
    if report is None:
        report = analyze(model, example_inputs, fold_affine=False)
    plan = report.plan
    if plan.affine_fold:
        raise ValueError("cbwc_ needs a plan without affine folding (γ/β stay trainable): "
                         "analyze with fold_affine=False")
    report = _keeping_partly_centered_norms(report)
    plan = report.plan
    _check_complete(report, allow_partial)
    # names that must keep seeing the uncentered tensor (the plan would untie them)
    keep_original = {f"{u.module_path}.{u.attr}".lstrip(".") for u in plan.untie}
    targets = []
    for step in plan.center:  # validate every step before changing anything
        tensor = model.get_parameter(step.fqn)
        _check_group(tensor, step.fqn, step.dim, step.group)
        holders = [(path, module, attr) for path, module, attr in _holders(model, tensor)
                   if f"{path}.{attr}".lstrip(".") not in keep_original]
        targets.extend((module, attr, step) for _, module, attr in holders)
    for step in plan.swap:
        if step.to != "RMSNorm":
            raise ValueError(f"cbwc_ only swaps LayerNorms for RMSNorms; plan step for {step.path!r} swaps to {step.to!r}")
    for module, attr, step in targets:
        parametrize.register_parametrization(module, attr, Centered(step.dim, step.group))
    for step in plan.swap:
        swap_norm(model, step, share_parameters=True)  # γ/β stay the trained Parameters
    return report


def bake_(model: nn.Module) -> nn.Module:
    """Replace every CBWC parametrization by a plain Parameter holding V = centered W (in place).

    Tensors trained by projection (:func:`project_centering_`) already are such Parameters; they lose their
    mark. Uses that kept the uncentered tensor (a tied ``lm_head``) keep the free W; the centered side
    gets a new Parameter, and a Hugging Face / normfold GPT config is marked untied. The baked
    model computes the same function as before.
    """
    centered = [(module, attr) for module in model.modules() if parametrize.is_parametrized(module)
                for attr, plist in module.parametrizations.items() if any(isinstance(p, Centered) for p in plist)]
    projected = [m for m in model.modules() if _PROJECTED_ATTR in m.__dict__]
    if not centered and not projected:
        raise ValueError("bake_ found no CBWC parametrizations: call normfold.cbwc_(model, example_inputs) first")
    for module in projected:  # already plain Parameters holding V (project_centering_): only the mark goes
        del module.__dict__[_PROJECTED_ATTR]
    untied = False
    for module, attr in centered:
        value = getattr(module, attr).detach().clone()
        original = module.parametrizations[attr].original
        _remove_parametrization(module, attr, leave_parametrized=False)
        if any(p is original for m in model.modules() for p in m._parameters.values() if m is not module):
            # shared with a use that keeps W (or with another centered alias): give this one its own V
            setattr(module, attr, nn.Parameter(value, requires_grad=original.requires_grad))
            untied = True
        else:
            original.data.copy_(value)
    if untied:
        untie_config(model)
    return model
