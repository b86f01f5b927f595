"""Top-level composition: the exact fold, then the optional steps on top of it.

    folded, report = normfold.convert(model, example_inputs)                      # the exact fold
    folded, report = normfold.convert(model, example_inputs, FuseConfig(),
                                      ApproximateConfig(calibration=batches))

Each step is configured by a frozen dataclass checked when it is built (``__post_init__``: typed
errors naming what was expected and what was received), defined by the layer that owns the step,
which registers its handler (``normfold.engine.steps``). :func:`convert` runs them through the one
runner (:func:`normfold.engine.steps.run_steps`), in the order given, each on the previous one's
output, and files each step's section in the one ``FoldReport``:

- :class:`FoldConfig` (``normfold.engine``), always first (added when not given): LayerNorms →
  RMSNorms, proved exact in float64; for a transformers ``PreTrainedModel``, by default only what its
  own class loads from a folder (``stock_compatible``), and the returned model's ``save_pretrained``
  writes normfold's folder.
- :class:`FuseConfig` (``normfold.fuse``): residual adds run inside the norm kernel; proved equal to
  the previous step's model in float64 (``report.fuse``).
- :class:`ApproximateConfig` (``normfold.lab.approximate``): norms the exact fold kept become
  corrected RMSNorms while every output row keeps a cosine ≥ ``min_cosine`` to the original on the
  calibration batches. **Outputs change**; ``report.approximate`` measures by how much.
- :class:`RotateConfig` (``normfold.rotate``): the residual stream rotated, proved equal
  (``report.sections["rotation"]``).
- :class:`QuantizeConfig` (``normfold.quantize``): linear layers fake-quantized. **Outputs change**;
  ``report.sections["quantization"]`` gives the loss before and after when the calls return one.

This module and the CLI are the only places that import every layer: the engine (``normfold.engine``)
knows nothing of fusion or of the lab (``docs/CONTRIBUTING.md``, dependency rules). ``normfold.fold``
(the function) is the one-line form of :func:`convert` with keyword arguments.
"""
from __future__ import annotations

from torch import nn

from .engine import FoldConfig, FoldReport
from .engine.cosine_bar import DEFAULT_MIN_COSINE
from .engine.steps import run_steps, step_for
from .fuse import FuseConfig
from .hf.saving import FoldedModelSaver, is_pretrained_model, stock_constraints
from .lab.approximate import ApproximateConfig
from .quantize import QuantizeConfig
from .rotate import RotateConfig

__all__ = ["convert", "fold", "FoldConfig", "FuseConfig", "ApproximateConfig", "RotateConfig", "QuantizeConfig"]


def _require_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")


def _keyword_config(name: str, value, expected: type, optional: bool):
    """A step given by keyword (``fold=``, ``fuse=``, ``approximate=``), checked to be its config."""
    if value is None and optional:
        return None
    if not isinstance(value, expected):
        allowed = f"None or {expected.__name__}(...)" if optional else f"{expected.__name__}(...)"
        raise TypeError(f"convert's {name}= must be {allowed}, got {type(value).__name__}")
    return value


_NOT_GIVEN = object()  # fold= not given: FoldConfig() unless a FoldConfig comes first among the steps


def convert(model: nn.Module, example_inputs, *configs, fold: FoldConfig = _NOT_GIVEN,
            fuse: FuseConfig | None = None,
            approximate: ApproximateConfig | None = None) -> tuple[nn.Module, FoldReport]:
    """Return ``(converted_copy, report)``: the exact fold, then the steps ``configs`` name, in order.

    ``configs``: step configs (:class:`FuseConfig`, :class:`ApproximateConfig`, :class:`RotateConfig`,
    any registered step), each section filed in the report under the name its step registered
    (``report.fuse``, ``report.approximate``, ``report.sections["rotation"]``). The exact fold runs
    first: a :class:`FoldConfig` first among ``configs``, or ``fold=``, else ``FoldConfig()``. The
    keywords ``fuse=`` and ``approximate=`` run after ``configs``, in that order. ``example_inputs``
    as for :func:`normfold.engine.analyze` (one call, or a list of calls). The exact fold and fusion
    leave outputs unchanged (each proved in float64 when its ``verify`` is on); ``approximate``
    changes them, by at most what ``report.approximate`` measured on the calibration batches.
    ``model`` is never modified. A config that names no registered step, a step given twice or a
    FoldConfig after another step is a TypeError / ValueError before any work.

    For a transformers ``PreTrainedModel`` the returned model's ``save_pretrained`` is
    ``normfold.save_pretrained`` with this report (:class:`normfold.hf.saving.FoldedModelSaver`): the
    folder it writes ``normfold.from_pretrained`` rebuilds exactly, and stock ``from_pretrained``
    loads as the same model under the stock-compatible plan (``FoldConfig.stock_compatible``).
    """
    given = [] if fold is _NOT_GIVEN else [_keyword_config("fold", fold, FoldConfig, optional=False)]
    steps = [*given, *configs, *(c for c in (_keyword_config("fuse", fuse, FuseConfig, optional=True),
                                            _keyword_config("approximate", approximate, ApproximateConfig,
                                                            optional=True)) if c is not None)]
    for config in steps:
        step_for(config)  # TypeError naming the registered configs, before any work
    if not steps or not isinstance(steps[0], FoldConfig):
        steps.insert(0, FoldConfig())
    late = [i for i, config in enumerate(steps) if i and isinstance(config, FoldConfig)]
    if late:
        raise ValueError(f"the exact fold runs first, once: one FoldConfig, before the other steps (or fold=), got "
                         f"another FoldConfig at step {late[0]}")
    if steps[0].keep and any(isinstance(config, ApproximateConfig) for config in steps):
        raise ValueError(f"keep={list(steps[0].keep)} does not go with the approximate fold, which would replace the "
                         "kept norms: fold exactly with keep=, or approximately without it")
    steps[0] = _within_stock(model, steps[0])
    converted, sections = run_steps(model, example_inputs, steps)
    report = sections[FoldConfig]
    for config in steps[1:]:
        report.sections[step_for(config).section] = sections[type(config)]
    if is_pretrained_model(converted):  # the habit: folded.save_pretrained(d) writes normfold's folder
        converted.save_pretrained = FoldedModelSaver(converted, report)
    return converted, report


def _within_stock(model: nn.Module, config: FoldConfig) -> FoldConfig:
    """``config`` within what the model's transformers class loads under ``config.stock_compatible``
    (default: for a ``PreTrainedModel``), saved in its own dtype; else ``config`` as it is."""
    hugging_face = is_pretrained_model(model)
    if not (hugging_face if config.stock_compatible is None else config.stock_compatible) \
            or config.loadable_keys is not None:
        return config
    if not hugging_face:
        raise TypeError(f"stock_compatible=True plans what a transformers PreTrainedModel's class loads, got a "
                        f"{type(model).__name__}: leave it None (or False) for other modules")
    return stock_constraints(model, model.dtype, config)


def fold(model: nn.Module, example_inputs, *, fold_affine: bool = True, precompute: bool = True,
         fold_batchnorm: bool = True, verify: bool = True, stock_compatible: bool | None = None, fuse: bool = False,
         approximate: bool = False, calibration=None, min_cosine: float = DEFAULT_MIN_COSINE,
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

    ``keep``: fnmatch patterns of norm module paths (``["transformer.h.0.*"]``) left exactly as they are,
    reported "kept by request"; a pattern matching no norm is a ValueError listing some norm paths.

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
