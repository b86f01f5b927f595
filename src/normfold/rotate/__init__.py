"""Rotate the residual stream of any model the fold engine makes RMSNorm-only (QuaRot / SliceGPT).

    rotated, report = normfold.rotate(model, example_inputs)                       # randomised Hadamard
    rotated, report = normfold.rotate(model, example_inputs, method="pca", calibration=calls,
                                      slice_fraction=0.2)                            # SliceGPT-style
    rotated, report = normfold.rotate(model, example_inputs, method="learned", calibration=calls,
                                      learning=LearnConfig(quantize=QuantizeConfig(weight_bits=4)))  # SpinQuant-style

Steps: the exact fold (``normfold.engine.fold``: norms → RMSNorm, γ/β into the readers), the graph
check that the stream is closed under rotation (``closure``), the basis (``hadamard``,
``orthogonal``; PCA from ``calibration``; learned for a quantized model from ``learned``), the rotation in float64 cast back once (``apply``), and
the float64 proof against the original, as for a fold (or, when sliced, the cosine on the
calibration calls). ``streaming`` states a data-free rotation per tensor, from a model's structure
alone, for checkpoints rewritten one tensor at a time (``normfold rotate`` on sharded folders).
Only torch is imported here.
"""
from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._progress import notice
from ..engine import fold_within
from ..engine.errors import FoldError
from ..engine.graph import capture, check_model_and_inputs, example_calls, split_example_calls
from ..engine.pipeline import float64_reference
from ..engine.plan import FoldConfig
from ..engine.transform import apply_plan
from ..engine.report import FoldReport, VerifyResult
from ..engine.steps import StepContext, register_step, run_steps
from ..engine.verify import FOLD_TOLERANCE, verify
from .apply import apply_rotation, rotate_along
from .calibration import OutputAgreement, output_agreement, run_error, stream_second_moments
from .closure import Stream, StreamTensor, find_streams
from .hadamard import randomized_hadamard
from .learned import ORTHOGONALITY_BOUND, LearnConfig, LearningReport, learn_rotations
from .orthogonal import haar_orthogonal, orthogonality_error, pca_basis
from .report import RotationReport, SliceReport, StreamRotation

METHODS = ("hadamard", "random", "pca", "learned")
CALIBRATED_METHODS = ("pca", "learned")  # the methods that read calibration calls


@dataclass(frozen=True, eq=False)  # eq=False: calibration holds tensors
class RotateConfig:
    """Options of the rotation (:func:`rotate`), checked when built (ValueError / TypeError).

    ``method``: "hadamard" (randomised Hadamard diag(±1)·H/√d, seeded; a width no Hadamard
    construction here reaches gets a seeded Haar matrix, said in the report), "random" (seeded
    Haar), "pca" (eigenvectors of the stream's second moment on ``calibration``: a call or a list
    of calls, like ``example_inputs``, kept as ``(args, kwargs)`` pairs), "learned" (the randomised
    Hadamard basis of ``seed`` trained on ``calibration`` to minimise the loss of the model quantized
    as ``learning`` says: :mod:`normfold.rotate.learned`; ``learning`` None: ``LearnConfig()``).
    ``slice_fraction`` in [0, 1), with "pca": drop that share of the stream's directions, the least
    used (SliceGPT). ``bases``, with "learned" only: bases learned before (:func:`learn_rotation`, or
    read back from a folder), one (d, d) matrix per stream in the order of the model's streams, each
    checked orthogonal to 1e-12 here; nothing is learned, no calibration is read.
    """

    method: str = "hadamard"
    seed: int = 0
    calibration: object = field(default=None, repr=False)
    slice_fraction: float = 0.0
    learning: LearnConfig | None = None
    bases: tuple | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.bases is not None:  # learned already: what learning would need is refused, not ignored
            object.__setattr__(self, "bases", given_bases(self.bases, self.method, self.calibration, self.learning))
        check_rotate_options(self.method, self.seed, self.slice_fraction,
                             self.calibration is not None or self.bases is not None, API_OPTIONS)
        if self.learning is not None and self.method != "learned":
            raise ValueError(f"learning is used only by method='learned', got method={self.method!r}: leave it out, "
                             "or use method='learned'")
        if self.learning is not None and not isinstance(self.learning, LearnConfig):
            raise TypeError(f"learning must be a LearnConfig, got {type(self.learning).__name__}")
        if self.method == "learned" and self.learning is None and self.bases is None:
            object.__setattr__(self, "learning", LearnConfig())
        if self.calibration is not None:
            object.__setattr__(self, "calibration", tuple(split_example_calls(example_calls(self.calibration))))


def given_bases(bases, method: str, calibration, learning) -> tuple[Tensor, ...]:
    """``RotateConfig.bases`` checked (ValueError / TypeError naming the basis): only with
    method="learned" and without calibration or learning; a list or tuple of square floating
    matrices, each orthogonal to 1e-12 (max |QᵀQ − I|). Returns them in float64."""
    if method != "learned":
        raise ValueError(f"bases are given only for method='learned' (bases learned before), got method={method!r}")
    if calibration is not None or learning is not None:
        raise ValueError("bases are the learned result: leave out calibration and learning, which only learning reads")
    if not isinstance(bases, (list, tuple)) or not bases:
        raise TypeError(f"bases must be a non-empty list of (d, d) tensors, one per stream, got {type(bases).__name__}")
    checked = []
    for i, q in enumerate(bases):
        if not isinstance(q, Tensor) or not q.is_floating_point() or q.dim() != 2 or q.shape[0] != q.shape[1]:
            shape = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
            raise TypeError(f"bases[{i}] must be a square floating tensor (d, d), got {shape}")
        q = q.detach().to(device="cpu", dtype=torch.float64)
        error = orthogonality_error(q)
        if not error <= ORTHOGONALITY_BOUND:  # also refuses NaN
            raise ValueError(f"bases[{i}] is not orthogonal: max|QᵀQ − I| = {error:.3g} > {ORTHOGONALITY_BOUND:g}")
        checked.append(q)
    return tuple(checked)


@dataclass(frozen=True)
class OptionNames:
    """How a caller spells the rotation's options in its messages (the API's keywords, or a command's flags)."""

    slice_fraction: str
    method: Callable[[object], str]   # method=... as the caller writes it
    calibration: str                  # the calibration option's name
    calibration_needed: str           # the calibration option, saying what it holds


API_OPTIONS = OptionNames("slice_fraction", lambda method: f"method={method!r}", "calibration",
                          "calibration: a call (tuple or dict of inputs) or a list of calls whose stream the principal "
                          "directions are taken from")


def check_rotate_options(method, seed, slice_fraction, has_calibration: bool, names: OptionNames) -> None:
    """The rotation's argument rules, the one definition (``RotateConfig`` and the ``normfold rotate``
    command): ValueError / TypeError naming the option as ``names`` spells it, before any work."""
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if not isinstance(slice_fraction, numbers.Real) or isinstance(slice_fraction, bool):
        raise TypeError(f"{names.slice_fraction} must be a number in [0, 1), got {slice_fraction!r}")
    if not 0.0 <= slice_fraction < 1.0:  # also refuses NaN
        raise ValueError(f"{names.slice_fraction} must be in [0, 1) (the share of the stream's directions to drop), "
                         f"got {slice_fraction!r}")
    pca = names.method("pca")
    if slice_fraction > 0 and method != "pca":
        raise ValueError(f"slicing keeps the stream's most used directions, so it needs {pca} (with "
                         f"{names.calibration}), got {names.method(method)}")
    if method not in CALIBRATED_METHODS and has_calibration:
        raise ValueError(f"{names.calibration} is used only by {pca} (to find the stream's principal directions) and "
                         f"by learned rotations, got {names.method(method)}: leave it out, or use {pca}")
    if method == "pca" and not has_calibration:
        raise ValueError(f"{pca} needs {names.calibration_needed}")
    if method == "learned" and not has_calibration:
        raise ValueError(f"{names.method(method)} needs {names.calibration}: a call or a list of calls on which the "
                         "quantized model's loss is minimised")


def rotate(model: nn.Module, example_inputs, *, method: str = "hadamard", seed: int = 0, calibration=None,
           slice_fraction: float = 0.0, learning: LearnConfig | None = None,
           bases=None) -> tuple[nn.Module, RotationReport]:
    """``(rotated copy, report)``: the model folded exactly, then its residual stream rotated by an
    orthogonal Q (writers W ↦ Qᵀ·W, readers W ↦ W·Q), the same function, proved in float64.

    ``method``, ``seed``, ``calibration``, ``slice_fraction``, ``learning``, ``bases``: see :class:`RotateConfig`; with
    ``slice_fraction`` > 0 the result is approximate, and the report gives its cosine (and any loss
    the model returns) on the calibration calls. The step a ``RotateConfig`` names, alone.

    Raises ``FoldError`` naming what blocks rotation (a norm the fold keeps as a LayerNorm, a γ that
    stays, a stream read by anything but a weightless RMSNorm, a stream that is a model output),
    ``FoldVerificationError`` if the rotated model is not equal in float64, or, as returned, in its
    own dtype within the tolerance measured from the original's own error there (nothing returned), and
    ValueError / TypeError for bad arguments, before any work.
    """
    config = RotateConfig(method=method, seed=seed, calibration=calibration, slice_fraction=slice_fraction,
                          learning=learning, bases=bases)
    rotated, sections = run_steps(model, example_inputs, [config])
    return rotated, sections[RotateConfig]


def rotate_step(model: nn.Module, calls: list, config: RotateConfig,
                context: StepContext) -> tuple[nn.Module, RotationReport]:
    """The registered step of a :class:`RotateConfig`: ``model`` (the previous step's output, or the
    original) folded and rotated, with ``report.verification`` against ``model`` for the runner to
    prove (when sliced: of the whole rotation, before slicing)."""
    method, slice_fraction, calibration_calls = config.method, config.slice_fraction, list(config.calibration or ())
    folded, fold_report, streams = _folded_streams(model, calls)
    if slice_fraction > 0:
        _check_sliceable(streams, slice_fraction)
    folded64 = apply_plan(copy.deepcopy(model).to(torch.float64), fold_report.plan)  # the fold, exact
    moments = stream_second_moments(folded64, streams, calibration_calls) if method == "pca" else None
    learning = None
    if config.bases is not None:
        rotations, energies = _given(streams, config.bases), None
    else:
        rotations, energies = bases(streams, "hadamard" if method == "learned" else method, config.seed, moments)
    if method == "learned" and config.bases is None:  # the Hadamard basis is the start
        rotations, learning = _learned(folded, streams, rotations, calibration_calls, config)
    report = RotationReport(method, config.seed, fold_report, rotations, learning=learning)
    kept = [kept_directions(stream.width, slice_fraction) for stream in streams]
    if all(k == stream.width for k, stream in zip(kept, streams)):
        qs = [r.basis for r in rotations]
        rotated = apply_rotation(folded, streams, qs)  # our own copy: rotated in place
        report.verification = _proof(model, rotated, apply_rotation(folded64, streams, qs), calls, fold_report)
        return rotated, report
    return _slice(model, folded, folded64, calls, report, kept, energies, calibration_calls, slice_fraction)


def _folded_streams(model: nn.Module, calls: list) -> tuple[nn.Module, FoldReport, list[Stream]]:
    """The exact fold (proved later, with the rotation; a γ read by a tied head folds into its own copy,
    untied, in the report) and its closed streams."""
    folded, fold_report = fold_within(model, calls, FoldConfig(verify=False, move_every_gamma=True))
    return folded, fold_report, closed_streams(folded, calls, fold_report)


def _learned(folded: nn.Module, streams: list[Stream], starts: list[StreamRotation], calibration_calls: list,
             config: RotateConfig) -> tuple[list[StreamRotation], LearningReport]:
    """Each stream's basis learned from its start (or the start, when learning ended no lower) and the learning."""
    qs, learning = learn_rotations(folded, streams, [r.basis for r in starts], calibration_calls, config.learning,
                                   config.seed)
    if learning.returned != "learned":  # the start, unchanged: learning did not lower the calibration loss
        return [_rotation(r.stream, r.basis, f"{r.how} (the learning's start: {learning.returned_why})")
                for r in starts], learning
    how = f"learned for {config.learning.quantize.scheme} ({config.learning.steps} Cayley-Adam steps) from the "
    return [_rotation(r.stream, q, how + r.how) for r, q in zip(starts, qs)], learning


def _given(streams: list[Stream], given: tuple[Tensor, ...]) -> list[StreamRotation]:
    """The streams' rotations by bases learned before (``RotateConfig.bases``): ValueError unless there
    is one per stream, of its width."""
    widths = [s.width for s in streams]
    if [q.shape[0] for q in given] != widths:
        raise ValueError(f"bases must be one (d, d) matrix per residual stream, of widths {widths}; got "
                         f"{[tuple(q.shape) for q in given]}")
    return [_rotation(stream, q, "learned before, given as bases") for stream, q in zip(streams, given)]


def learn_rotation(model: nn.Module, example_inputs, *, calibration, seed: int = 0,
                   learning: LearnConfig | None = None) -> tuple[list[Tensor], LearningReport]:
    """The bases ``method="learned"`` would rotate by (one float64 (d, d) matrix per stream, orthogonal to
    1e-12) and how they were learned, without rotating or proving: ``rotate(..., method="learned",
    bases=...)`` then rotates by them and proves the result, as a folder stores them beside its
    weights. Arguments and errors as :func:`rotate`'s."""
    config = RotateConfig(method="learned", seed=seed, calibration=calibration, learning=learning)
    calls = check_model_and_inputs(model, example_inputs)
    folded, _, streams = _folded_streams(model, calls)
    starts, _ = bases(streams, "hadamard", seed)
    rotations, report = _learned(folded, streams, starts, list(config.calibration), config)
    return [r.basis for r in rotations], report


def _slice(model, folded, folded64, example_inputs, report: RotationReport, kept: list[int], energies,
           calibration_calls, slice_fraction: float) -> tuple[nn.Module, RotationReport]:
    """Prove the whole rotation equal first, then drop the least used directions of that basis and
    measure on the calibration calls what that costs."""
    reference = copy.deepcopy(model).to(torch.float64)
    streams = [r.stream for r in report.streams]
    whole = apply_rotation(copy.deepcopy(folded64), streams, [r.basis for r in report.streams])
    report.verification = _proof(reference, whole, whole, example_inputs, report.fold)
    del whole
    report.streams = [_sliced(r, k, e) for r, k, e in zip(report.streams, kept, energies)]
    qs = [r.basis for r in report.streams]
    sliced64 = apply_rotation(folded64, streams, qs)
    _check_runs_sliced(sliced64, calibration_calls[0], kept)
    report.slicing = SliceReport(slice_fraction, len(calibration_calls),
                                 output_agreement(reference, sliced64, calibration_calls))
    return apply_rotation(folded, streams, qs), report


def _check_runs_sliced(sliced64: nn.Module, call, kept: list[int]) -> None:
    """``FoldError`` when the sliced model's own code fails at the narrower stream."""
    error = run_error(sliced64, call)
    if error is not None:
        message = (str(error).strip().splitlines() or [""])[0][:200]
        raise FoldError(f"cannot slice: the sliced model does not run ({type(error).__name__}: {message}); its code "
                        f"probably takes a size from the stream's width (e.g. splits q, k, v by x.shape[-1]), which "
                        f"slicing shrinks to {', '.join(map(str, kept))}. The rotation itself is exact: use "
                        "slice_fraction=0, or a model whose layers take their sizes from their config") from error


def _proof(original: nn.Module, rotated: nn.Module, rotated64: nn.Module, example_inputs,
           fold_report: FoldReport) -> VerifyResult:
    """The float64 comparison, as for a fold (FOLD_TOLERANCE, the original run as the fold's proof runs
    it), and the rotated model as returned judged in its own dtype: the verification the runner proves
    (``FoldVerificationError``)."""
    with notice("rotate: proving the rotated model equal to the original in float64"):
        return verify(original, rotated, example_inputs, tolerance=FOLD_TOLERANCE, rms_norm_paths=[],
                      folded_exact=rotated64, judge_model_dtype=True,
                      reference_transform=float64_reference(fold_report.plan))


def closed_streams(folded: nn.Module, calls: list, fold_report: FoldReport) -> list[Stream]:
    """The folded model's streams, the same for every example call (else ``FoldError``). A model the
    fold captured through submodules is refused: the closure check must see every reader and writer
    of the stream in one graph of the whole model, which export could not make."""
    if fold_report.captured_through:
        raise FoldError(f"cannot rotate: the fold was {fold_report.capture_line}; a rotation must see every layer "
                        "that reads or writes the residual stream in one graph of the whole model. Fold it without "
                        "rotating (normfold fold), or rotate a model torch.export captures whole")
    found = [find_streams(folded, capture(folded, call), fold_report) for call in calls]
    for i, other in enumerate(found[1:], start=1):
        if other != found[0]:
            raise FoldError(f"cannot rotate: example call {i} reads the residual stream differently from call 0")
    return found[0]


def kept_directions(width: int, slice_fraction: float) -> int:
    """Directions kept when slicing ``slice_fraction`` of a stream of ``width``: ⌊(1 − f)·d⌋, as SliceGPT."""
    return int(math.floor((1.0 - slice_fraction) * width + 1e-9))


def _check_sliceable(streams: list[Stream], slice_fraction: float) -> None:
    for stream in streams:
        kept = kept_directions(stream.width, slice_fraction)
        if kept < 1:
            raise ValueError(f"slice_fraction {slice_fraction} leaves {kept} of the {stream.width} directions of the "
                             "stream: at least one must stay")
        both = [t.fqn for t in stream.tensors if t.role == "writer+reader"]
        if both:
            raise FoldError(f"cannot slice: {both[0]} both writes the stream and reads its norm (a tied table), so it "
                            "cannot take the readers' √(d/k) norm scale; untie it first")


def bases(streams: list[Stream], method: str, seed: int,
          moments: list[Tensor] | None = None) -> tuple[list[StreamRotation], list[Tensor | None]]:
    """Each stream's whole basis and, for PCA (``moments``: each stream's second moment), the energy of
    each direction. One seeded generator draws the streams' bases in order, so the same streams,
    method and seed give the same Q wherever they are built (in memory or streaming a checkpoint)."""
    generator = torch.Generator().manual_seed(seed)
    built = [_basis(stream, method, generator, None if moments is None else moment)
             for stream, moment in zip(streams, moments or [None] * len(streams))]
    return [rotation for rotation, _ in built], [energy for _, energy in built]


def _basis(stream: Stream, method: str, generator: torch.Generator,
           moment: Tensor | None) -> tuple[StreamRotation, Tensor | None]:
    """The stream's whole orthogonal basis Q (d, d) and how it was made; for PCA also the energy of
    each direction (the eigenvalues, decreasing)."""
    width, energies = stream.width, None
    if method == "pca":
        q, energies = pca_basis(moment)
        how = "PCA of the stream's second moment on the calibration calls"
    elif method == "hadamard" and (built := randomized_hadamard(width, generator)) is not None:
        q, how = built
    else:
        q = haar_orthogonal(width, generator)
        how = ("seeded Haar-random orthogonal" if method == "random" else
               f"seeded Haar-random orthogonal: no Hadamard matrix of order {width} is built here (fallback)")
    return _rotation(stream, q, how), energies


def _rotation(stream: Stream, q: Tensor, how: str, kept_energy: float | None = None) -> StreamRotation:
    identity = torch.eye(stream.width, q.shape[1], dtype=torch.float64)
    return StreamRotation(stream, q, how, orthogonality_error(q), (q - identity).abs().max().item(), q.shape[1],
                          kept_energy)


def _sliced(rotation: StreamRotation, kept: int, energies: Tensor) -> StreamRotation:
    """The leading ``kept`` directions of a PCA basis, with the share of the calibration energy they hold."""
    total = energies.clamp_min(0).sum().item()
    kept_energy = energies[:kept].clamp_min(0).sum().item() / total if total > 0 else 1.0
    return _rotation(rotation.stream, rotation.basis[:, :kept], rotation.how, kept_energy)


register_step(RotateConfig, rotate_step, section="rotation", section_type=RotationReport,
              proof="rotated model differs from the original")


__all__ = ["rotate", "learn_rotation", "RotateConfig", "LearnConfig", "LearningReport", "check_rotate_options", "OptionNames", "API_OPTIONS", "RotationReport",
           "StreamRotation", "SliceReport", "Stream", "StreamTensor", "OutputAgreement",
           "rotate_along", "kept_directions", "bases", "METHODS", "CALIBRATED_METHODS"]
