"""Top-level composition: the exact fold, then the optional steps on top of it.

    folded, report = normfold.convert(model, example_inputs)                      # the exact fold
    folded, report = normfold.convert(model, example_inputs, fuse=FuseConfig(),
                                      approximate=ApproximateConfig(calibration=batches))

Each step is configured by a frozen dataclass checked when it is built (``__post_init__``: typed
errors naming what was expected and what was received), so a wrong option fails before any work.
The steps run in this order, each on the previous one's output, and each writes its own section of
the one ``FoldReport``:

1. ``fold``  (:class:`FoldConfig`, ``normfold.fold``): LayerNorms → RMSNorms, proved exact in float64;
   for a transformers ``PreTrainedModel``, by default only what its own class loads from a folder
   (``stock_compatible``), and the returned model's ``save_pretrained`` writes normfold's folder.
2. ``fuse``  (:class:`FuseConfig`, ``normfold.fuse``): residual adds run inside the norm kernel;
   proved equal to step 1's model in float64 (``report.fuse``).
3. ``approximate`` (:class:`ApproximateConfig`, ``normfold.lab.approximate``): norms the exact fold
   kept become corrected RMSNorms while every output row keeps a cosine ≥ ``min_cosine`` to the
   original on the calibration batches. **Outputs change**; ``report.approximate`` measures by how much.

This module and the CLI are the only places that import every layer: the engine (``normfold.fold``)
knows nothing of fusion or of the lab (``docs/CONTRIBUTING.md``, dependency rules). ``normfold.fold``
(the function) is the one-line form of :func:`convert` with keyword arguments.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn

from .fold import FoldReport, PlanConstraints, fold_within
from .fold.graph import check_model_and_inputs
from .fold.plan import keep_patterns
from .fold.verify import FOLD_TOLERANCE, prove_or_raise
from .fold.verify import verify as verify_models
from .fuse import fuse_residual_norms
from .hf.saving import FoldedModelSaver, is_pretrained_model, stock_constraints
from .lab._common import as_batches
from .lab.approximate import approximate_fold

__all__ = ["convert", "fold", "FoldConfig", "FuseConfig", "ApproximateConfig"]


def _require_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")


# ------------------------------------------------------------------------------------------ configs

@dataclass(frozen=True)
class FoldConfig:
    """Options of the exact fold (see :func:`normfold.fold.analyze` for what each one plans).

    ``fold_affine``: move γ/β into the linear layers that read a norm. ``precompute``: bake a
    LayerNorm applied straight to an embedding lookup into the table. ``fold_batchnorm``: merge
    eval-mode BatchNorms into the Linear/Conv before them first. ``verify``: prove the result in
    float64 before returning it (``FoldVerificationError`` otherwise).

    ``stock_compatible``: plan only what the model's own transformers class loads from a folder, so
    that ``folded.save_pretrained(d)`` then stock ``from_pretrained(d)`` is the same model: no
    parameter the class lacks (GPT-2's ln_f keeps its γ/β, applied inside its RMSNorm, rather than
    creating an ``lm_head.bias``), no norm precomputed away, merged BatchNorms kept as exact
    identities; the report gives each kept γ/β's reason. ``None`` (default): on for a transformers
    ``PreTrainedModel``, off for any other module (``True`` there is a TypeError). ``False``: the
    whole plan, whose folder only ``normfold.from_pretrained`` rebuilds (saving it warns).
    ``keep``: fnmatch patterns of norm module paths left as they are (reason "kept by request").
    """

    fold_affine: bool = True
    precompute: bool = True
    fold_batchnorm: bool = True
    verify: bool = True
    stock_compatible: bool | None = None
    keep: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", keep_patterns(self.keep, "FoldConfig.keep"))
        for name in ("fold_affine", "precompute", "fold_batchnorm", "verify"):
            _require_bool("FoldConfig", name, getattr(self, name))
        if self.stock_compatible is not None:
            _require_bool("FoldConfig", "stock_compatible", self.stock_compatible)


@dataclass(frozen=True)
class FuseConfig:
    """Options of residual-add fusion (:func:`normfold.fuse.fuse_residual_norms`), inference only.

    ``norm_paths``: the norm modules to consider (default: every normfold RMSNorm, and with
    ``layer_norms`` every LayerNorm the fold kept). ``verify``: prove the fused model equal to the
    unfused one in float64 on every example call.
    """

    norm_paths: tuple[str, ...] | None = None
    layer_norms: bool = True
    verify: bool = True

    def __post_init__(self) -> None:
        if self.norm_paths is not None:
            if isinstance(self.norm_paths, str) or not isinstance(self.norm_paths, Iterable):
                raise TypeError(f"FuseConfig.norm_paths must be None or a sequence of module paths (str), "
                                f"got {type(self.norm_paths).__name__} {self.norm_paths!r}")
            paths = tuple(self.norm_paths)
            not_str = [p for p in paths if not isinstance(p, str)]
            if not_str:
                raise TypeError(f"FuseConfig.norm_paths must hold module paths (str), got {not_str!r}")
            if not paths:
                raise ValueError("FuseConfig.norm_paths must name at least one norm (None considers all of them), "
                                 "got an empty sequence")
            object.__setattr__(self, "norm_paths", paths)
        _require_bool("FuseConfig", "layer_norms", self.layer_norms)
        _require_bool("FuseConfig", "verify", self.verify)


@dataclass(frozen=True, eq=False)  # eq=False: calibration holds tensors, which do not compare to a bool
class ApproximateConfig:
    """Options of the approximate fold (:func:`normfold.lab.approximate_fold`): not exact.

    ``calibration``: a batch or a list of batches (tensor, tuple of positional or dict of keyword
    arguments) on which norms are chosen and corrected. ``min_cosine``: every output row keeps at
    least this cosine similarity to the original's, in (0, 1]. ``output_fn``: ``(model, batch) ->
    Tensor`` whose rows are compared (default: the main output, one row per real token; e.g.
    ``normfold.lab.mean_pooled`` for sentence embeddings).
    """

    calibration: object = field(repr=False)
    min_cosine: float = 0.999
    output_fn: Callable[[nn.Module, object], object] | None = None

    def __post_init__(self) -> None:
        if self.calibration is None:
            raise ValueError("ApproximateConfig.calibration must be a batch or a list of batches "
                             "(inputs like example_inputs), got None")
        as_batches(self.calibration)  # TypeError / ValueError naming what a batch may be
        if isinstance(self.min_cosine, bool) or not isinstance(self.min_cosine, (int, float)) \
                or not 0.0 < self.min_cosine <= 1.0:
            raise ValueError(f"ApproximateConfig.min_cosine must be a number in (0, 1], got {self.min_cosine!r}")
        if self.output_fn is not None and not callable(self.output_fn):
            raise TypeError(f"ApproximateConfig.output_fn must be None or a callable (model, batch) -> Tensor, "
                            f"got {type(self.output_fn).__name__}")


# ------------------------------------------------------------------------------------- composition

def _check_config(name: str, value, expected: type, optional: bool) -> None:
    if value is None and optional:
        return
    if not isinstance(value, expected):
        allowed = f"None or {expected.__name__}(...)" if optional else f"{expected.__name__}(...)"
        raise TypeError(f"convert's {name}= must be {allowed}, got {type(value).__name__}")


def convert(model: nn.Module, example_inputs, *, fold: FoldConfig = FoldConfig(), fuse: FuseConfig | None = None,
            approximate: ApproximateConfig | None = None) -> tuple[nn.Module, FoldReport]:
    """Return ``(converted_copy, report)``: the exact fold, then fusion and the approximate fold if asked.

    ``example_inputs`` as for :func:`normfold.fold.analyze` (one call, or a list of calls). The
    exact fold and fusion leave outputs unchanged (each proved in float64 when its ``verify`` is on);
    ``approximate`` changes them, by at most what ``report.approximate`` measured on the calibration
    batches. ``model`` is never modified.

    For a transformers ``PreTrainedModel`` the returned model's ``save_pretrained`` is
    ``normfold.save_pretrained`` with this report (:class:`normfold.hf.saving.FoldedModelSaver`): the
    folder it writes ``normfold.from_pretrained`` rebuilds exactly, and stock ``from_pretrained``
    loads as the same model under the stock-compatible plan (``FoldConfig.stock_compatible``).
    """
    _check_config("fold", fold, FoldConfig, optional=False)
    _check_config("fuse", fuse, FuseConfig, optional=True)
    _check_config("approximate", approximate, ApproximateConfig, optional=True)
    if approximate is not None and fold.keep:
        raise ValueError(f"keep={list(fold.keep)} does not go with the approximate fold, which would replace the kept "
                         "norms: fold exactly with keep=, or approximately without it")
    calls = check_model_and_inputs(model, example_inputs)  # TypeError before any work
    converted, report = fold_within(model, example_inputs, _plan_constraints(model, fold), verify=fold.verify)
    if fuse is not None:
        converted, report.fuse = _fuse(converted, calls, fuse)
    if approximate is not None:
        converted, report.approximate = approximate_fold(model, converted, report, approximate.calibration,
                                                         min_cosine=approximate.min_cosine,
                                                         output_fn=approximate.output_fn)
    if is_pretrained_model(converted):  # the habit: folded.save_pretrained(d) writes normfold's folder
        converted.save_pretrained = FoldedModelSaver(converted, report)
    return converted, report


def _plan_constraints(model: nn.Module, config: FoldConfig) -> PlanConstraints:
    """The fold's options as planning constraints, within what the model's transformers class loads
    under ``config.stock_compatible`` (default: for a ``PreTrainedModel``), saved in its own dtype."""
    hugging_face = is_pretrained_model(model)
    if not (hugging_face if config.stock_compatible is None else config.stock_compatible):
        return PlanConstraints(fold_affine=config.fold_affine, precompute=config.precompute,
                               fold_batchnorm=config.fold_batchnorm, keep=config.keep)
    if not hugging_face:
        raise TypeError(f"stock_compatible=True plans what a transformers PreTrainedModel's class loads, got a "
                        f"{type(model).__name__}: leave it None (or False) for other modules")
    return stock_constraints(model, model.dtype, fold_affine=config.fold_affine, fold_batchnorm=config.fold_batchnorm,
                             keep=config.keep)


def _fuse(folded: nn.Module, calls: list, config: FuseConfig):
    """Fuse ``folded`` in place; ``fuse_residual_norms`` proves the first call, this the others."""
    unfused = copy.deepcopy(folded) if config.verify and len(calls) > 1 else None
    fused, report = fuse_residual_norms(folded, calls[0], norm_paths=config.norm_paths,
                                        layer_norms=config.layer_norms, inplace=True, verify=config.verify)
    if unfused is not None:
        prove_or_raise(verify_models(unfused, fused, calls[1:], tolerance=FOLD_TOLERANCE, rms_norm_paths=[],
                                     judge_model_dtype=True), "fused model differs from the unfused one")
    return fused, report


def fold(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
         fold_batchnorm: bool = True, verify: bool = True, stock_compatible: bool | None = None, fuse: bool = False,
         approximate: bool = False, calibration=None, min_cosine: float = 0.999,
         output_fn=None, keep=()) -> tuple[nn.Module, FoldReport]:
    """Return ``(folded_copy, report)``: foldable LayerNorms become RMSNorms, outputs unchanged.

    With ``verify=True`` the plan is also applied to a float64 copy and compared with ``model`` in
    float64 (the transform, judged at ``FOLD_TOLERANCE``, 1e-9), and the returned model is run in its
    own dtype and judged against the original's own error there, on every example call;
    ``FoldVerificationError`` is raised (nothing returned) when either fails or the outputs cannot be
    compared (none, or of different structure), and ``FoldError`` before that when the plan
    overflows the model's dtype (naming the tensor). ``report.verification`` holds the numbers.
    ``example_inputs`` as for :func:`normfold.analyze` (one call, or a list of calls: only what is
    exact for all of them folds).

    A transformers ``PreTrainedModel`` is folded, by default, only as far as its own class can load
    (``stock_compatible``, see :class:`FoldConfig`: γ/β with no place in the class stay in their
    RMSNorm), and the returned model's ``save_pretrained(d)`` writes normfold's folder (with this
    report): stock ``from_pretrained(d)`` and ``normfold.from_pretrained(d)`` (the fast RMSNorms)
    both give the same model. ``stock_compatible=False`` folds every γ/β it can (GPT-2's ln_f into a
    new ``lm_head.bias``): only ``normfold.from_pretrained`` rebuilds that, and saving warns.

    The keyword form of :func:`convert` (``FoldConfig`` / ``FuseConfig`` / ``ApproximateConfig``):

    ``fuse=True`` (opt-in, inference only) then runs each residual add that feeds a new RMSNorm, or
    a LayerNorm the fold kept (post-LN), together with it in one kernel call (``normfold.fuse``),
    proved equal in float64 when ``verify``; ``report.fuse`` says which.

    ``approximate=True`` then also replaces norms the exact fold cannot touch, **changing the
    outputs**: norms are chosen and corrected on ``calibration`` batches while every output row
    keeps a cosine similarity ≥ ``min_cosine`` to the original (``normfold.lab.approximate_fold``;
    ``output_fn`` picks the rows compared, e.g. ``normfold.lab.mean_pooled``). The result is no
    longer exact: ``report.approximate`` holds the measured change, ``report.num_approximate`` the count.
    """
    fold_config = FoldConfig(fold_affine=fold_affine, precompute=precompute, fold_batchnorm=fold_batchnorm,
                             verify=verify, stock_compatible=stock_compatible, keep=keep)
    _require_bool("fold", "fuse", fuse)
    _require_bool("fold", "approximate", approximate)
    fuse_config = FuseConfig(verify=verify) if fuse else None
    approximate_config = None
    if approximate:
        if calibration is None:
            raise ValueError("approximate=True needs calibration=[batch, ...] (inputs like example_inputs), got None")
        approximate_config = ApproximateConfig(calibration, min_cosine=min_cosine, output_fn=output_fn)
    return convert(model, example_inputs, fold=fold_config, fuse=fuse_config, approximate=approximate_config)
