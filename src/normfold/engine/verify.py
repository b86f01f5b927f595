"""Prove a fold: run the original and the folded model on the same inputs and compare outputs.

A comparison that compared nothing, or compared outputs of different structure, is a failure
(``VerifyResult.why``), never a pass: outputs are flattened as pytrees (tuples, lists, dicts,
namedtuples, registered pytrees such as Hugging Face ``ModelOutput``) and plain dataclasses by
their fields, and both sides must give the same names, shapes and kinds of values.

Fresh inputs are built from the user's example (its integers permuted, its floats perturbed), so
structured integers (token ids, bounding boxes) stay valid. A model that cannot run in float64
(it raises, or gives inf/nan where its own dtype is finite) is checked in its own dtype instead,
against a tolerance measured from its own rounding error, and the result says so
(``VerifyResult.compared_in``, ``.fallback``): never a silent pass.

The metric (:func:`output_error`) is elementwise and per output, so that no value can hide another's
error: |a − b| ≤ tol · (typical + |a|), typical being the output's median magnitude, and places
holding inf, nan or a finfo extreme (a mask's ``finfo.min``) must hold the same kind of value in
both. The steps that return a model (fold, fusion, rotation) also judge that model as returned, in
its own dtype (``judge_model_dtype``), and a failed proof raises through :func:`prove_or_raise`.

Every model run of a proof starts from the same seed of torch's random number generators
(:func:`model_outputs`), the caller's generator state restored after: a forward that draws random
numbers in eval mode (VITS's noise, ViLT's patch sampling) gets the same draws in the original and
in the fold, so the comparison is of the same function of input and noise; the result says that the
forward draws (``VerifyResult.random_draws``).

One idea, about 640 lines: the inputs, the runs, the metric, the comparison and the tolerance rule
of a proof are kept together so the rule a result was judged by is readable in one file.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from .._text import dtype_name, first_line
from ..nn import PermutedRMSNorm, RMSNorm
from .errors import FoldVerificationError, failures_as_fold_error, invalid_example_inputs, model_name
from .graph import eval_mode, split_example_calls
from .math import mean_over_rms
from .report import JUMP_MULTIPLE, ModelDtypeCheck, VerifyResult, WorstElement

FOLD_TOLERANCE = 1e-9  # the transform itself: float64 relative error allowed between original and fold

PROOF_SEED = 0  # every model run of a proof draws its random numbers from this seed (see model_outputs)

# Weights stored in a low-precision dtype: the folded model's float64 error may be this many times
# the error the original itself makes when run in that dtype on the same inputs, plus one unit
# roundoff of the dtype. Measured with output_error (bundled GPT-2, tiny GPT-2, BERT, OPT, ViT;
# fp32/fp16/bf16): a correct fold is 0.07-0.76x the own error; a 1.1x head, a 1.5x last MLP
# weight, a zeroed last attention output are 11-300x in fp16, 2-27x in bf16 (GPT-2s).
OWN_ERROR_MULTIPLE = 2.0

# A model run in its own dtype, against the original in float64 (the model a step returns) or in
# that dtype (the fallback check): besides the transform, its error holds its own rounding, an
# independent rounding of the same function, so its ratio to the original's own error spreads
# around 1. Measured (the 11 models of tests/engine's zoo in fp32/bf16/fp16, folded, and fused from
# their LayerNorms): a correct result is 0.73-2.34x (the largest: a fused post-LN BERT in float32);
# the fallback's correct float32 folds of tiny GPT-2, OPT, BLOOM, ViT, BERT, Phi are up to 2.2x its
# estimate; a float32 fold whose weights were rounded to bfloat16 is 1e4-5e4x; an overflow to inf
# fails as a different kind of value, whatever the bar.
MODEL_DTYPE_OWN_ERROR_MULTIPLE = 4.0


def verify(original: nn.Module, folded: nn.Module, example_inputs, *, dtype: torch.dtype = torch.float64,
           num_random: int = 2, tolerance: float | None = None, seed: int = 0, rms_norm_paths=None,
           folded_exact: nn.Module | None = None, stored_dtype: torch.dtype | None = None,
           exact_transform: Callable[[nn.Module], nn.Module] | None = None,
           judge_model_dtype: bool = False,
           reference_transform: Callable[[nn.Module], nn.Module] | None = None) -> VerifyResult:
    """Compare outputs on the example call(s) and ``num_random`` fresh inputs of the same shapes each
    (:func:`fresh_inputs_like`: the example's integers permuted, its floats perturbed).

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments, or a list of
    such calls (each is compared). Both models run as float64 copies (float inputs cast too); the
    error of each output is :func:`output_error` (elementwise, against the output's typical
    magnitude; inf/nan/finfo extremes must sit in the same places). ``folded`` also runs in the
    model's own dtype: its error there against the original in float64 is reported
    (``model_dtype_max_rel_error``) and, with ``judge_model_dtype`` (``fold``, fusion and rotation
    judge the model they return), judged (``model_dtype_check``): at most
    ``MODEL_DTYPE_OWN_ERROR_MULTIPLE`` (4) x the original's own error in that dtype plus one rounding
    (:func:`measured_tolerance`), and no inf/nan where the original in that dtype is finite. Forward pre-hooks measure how far from zero-mean the inputs of
    the folded model's RMSNorms at ``rms_norm_paths`` (default: every normfold RMSNorm) are, as max
    |mean|/rms. ``folded_exact``: the same fold built in float64 (``fold`` passes its plan applied
    to a float64 copy), used for the float64 comparison so that rounding the folded weights to the
    model's dtype does not count against the transform. ``exact_transform`` instead: a function that
    turns a model into its fold in place (``prove_fold`` passes the plan's ``apply_plan``); it is
    applied to verify's own float64 copy of ``original`` once that copy's outputs are recorded, so
    one float64 copy of the model serves both sides. A float64 model judged in its own dtype is
    compared as it is (``folded`` itself; it is its own exact fold).

    ``tolerance`` (default 1e-9): the largest float64 error that passes. ``stored_dtype``
    instead: the folded weights were rounded to that dtype, so the tolerance is measured
    (:func:`measured_tolerance`) from the original's own error in that dtype on these inputs.

    When the original cannot run in float64 (it raises, or gives inf/nan where it is finite in its
    own dtype) the comparison runs in the model's own dtype: original against ``folded``, with the
    tolerance measured the same way from the original's own error, estimated as the change of its
    outputs when every weight moves by one unit in the last place (:func:`perturbed_own_error`);
    the result's ``compared_in`` and ``fallback`` say so.

    ``reference_transform``: applied (in place) to the float64 copy of ``original`` before it runs,
    e.g. ``norm_forms.without_downcasts`` (the original's math without its float32 casts); the
    model-dtype check always compares against ``original`` as it is.
    """
    calls = split_example_calls(example_inputs)
    if num_random < 0:
        raise ValueError(f"num_random must be >= 0, got {num_random}")
    if tolerance is not None and stored_dtype is not None:
        raise ValueError("give tolerance or stored_dtype, not both: with stored_dtype the tolerance is measured")
    if folded_exact is not None and exact_transform is not None:
        raise ValueError("give folded_exact or exact_transform, not both: each says what the float64 fold is")
    if stored_dtype is not None and (not isinstance(stored_dtype, torch.dtype) or not stored_dtype.is_floating_point):
        raise TypeError(f"stored_dtype must be a floating torch.dtype, got {stored_dtype!r}")
    with failures_as_fold_error(model_name(original), "verifying (running both models)"):
        return _verify(original, folded, calls, dtype=dtype, num_random=num_random, tolerance=tolerance, seed=seed,
                       rms_norm_paths=rms_norm_paths, folded_exact=folded_exact, stored_dtype=stored_dtype,
                       exact_transform=exact_transform, judge_model_dtype=judge_model_dtype,
                       reference_transform=reference_transform)


def prove_or_raise(result: VerifyResult, what: str, context: str = "") -> VerifyResult:
    """``result`` when it is ok, else ``FoldVerificationError("<what>: <why it failed>")`` (the reason
    the outputs could not be compared first, else every failed check with its worst element), with
    ``context`` (a report) on the lines after. The one way a step that proves its result fails."""
    if not result.ok:
        raise FoldVerificationError(f"{what}: {result.failure()}" + (f"\n{context}" if context else ""))
    return result


def _verify(original, folded, calls, *, dtype, num_random, tolerance, seed, rms_norm_paths, folded_exact,
            stored_dtype, exact_transform, judge_model_dtype, reference_transform) -> VerifyResult:
    """:func:`verify` once its arguments are checked."""
    generator = torch.Generator().manual_seed(seed)
    model_dtype = float_dtype(original)
    inputs, own_outputs, integers_kept, random_draws = _inputs_the_original_runs(original, calls, num_random,
                                                                                 generator, model_dtype or dtype)
    if model_dtype is None or model_dtype == dtype:
        own_outputs = None  # the original in its own dtype: the returned model's bar, the stored own error, the fallback
    runs = [cast_floats(run, dtype) for run in inputs]

    # Each model runs once per input: the original's outputs are recorded before its copy is folded.
    reference = cast_copy(original, dtype)
    if reference_transform is not None:
        reference = reference_transform(reference)
    ref_outputs, unusable = _outputs_if_usable(reference, runs, own_outputs, dtype)
    if unusable is not None:
        del reference
        result = _verify_in_own_dtype(original, folded, inputs, own_outputs, unusable, rms_norm_paths=rms_norm_paths,
                                      rounding_dtype=stored_dtype or model_dtype, generator=generator)
        result.integers_kept, result.random_draws = integers_kept, random_draws
        return result
    if judge_model_dtype and model_dtype == dtype:
        candidate = folded  # the returned model is itself in the comparison's dtype: judged as it is
    elif exact_transform is not None:
        candidate = exact_transform(reference)
    else:
        candidate = _in_dtype(folded if folded_exact is None else folded_exact, dtype)
    del reference
    outputs, why, ratio = _compare_watched(ref_outputs, candidate, runs, dtype, rms_norm_paths)
    max_rel = max((o["max_rel"] for o in outputs), default=0.0)
    max_abs = max((o["max_abs"] for o in outputs), default=0.0)
    worst = _worst(outputs)

    own_rel, own_error_in_model_dtype, check, measured_as = None, None, None, None
    if why is None and own_outputs is not None:
        returned = [model_outputs(folded, *cast_floats(run, model_dtype)) for run in inputs]
        # A forward that draws random numbers draws other ones in float64 than in its own dtype (a float64
        # rand is no float32 one rounded: ViT-MAE masks other patches): the returned model is then judged
        # against the original in its own dtype, on the same draws.
        same_draws = own_outputs if random_draws else ref_outputs
        own_rows, returned_why = _compare_returned(same_draws, own_outputs, returned, model_dtype)
        outputs += own_rows
        own_rel = max((o["max_rel"] for o in own_rows), default=0.0)
        if judge_model_dtype:
            why = None if returned_why is None else f"in {dtype_name(model_dtype)}: {returned_why}"
            if why is None:
                own_error_in_model_dtype, measured_as = _own_error_in_dtype(
                    original, inputs, ref_outputs, own_outputs, model_dtype, dtype, random_draws, generator)
                if own_error_in_model_dtype is None:
                    why = f"in {dtype_name(model_dtype)}: {measured_as}"
            if why is None:
                bar, bar_rule = measured_tolerance(own_error_in_model_dtype, model_dtype,
                                                   multiple=MODEL_DTYPE_OWN_ERROR_MULTIPLE, measured_as=measured_as)
                if own_rel > bar and not random_draws:
                    own_error_in_model_dtype, measured_as = _own_error_measured_twice(
                        original, inputs, own_outputs, own_error_in_model_dtype, model_dtype, generator)
                    bar, bar_rule = measured_tolerance(own_error_in_model_dtype, model_dtype,
                                                       multiple=MODEL_DTYPE_OWN_ERROR_MULTIPLE, measured_as=measured_as)
                check = ModelDtypeCheck(dtype_name(model_dtype), own_rel, own_error_in_model_dtype, bar, bar_rule,
                                        _worst(own_rows))

    rule, stored_own = "fixed", None
    if stored_dtype is None:
        tolerance = FOLD_TOLERANCE if tolerance is None else tolerance
    elif why is None:
        if stored_dtype == model_dtype and own_error_in_model_dtype is not None:
            stored_own, stored_as = own_error_in_model_dtype, measured_as
        else:
            low = original if stored_dtype == model_dtype else cast_copy(original, stored_dtype)
            low_outputs = own_outputs if stored_dtype == model_dtype else None
            if low_outputs is None:
                low_outputs = [model_outputs(low, *cast_floats(run, stored_dtype)) for run in inputs]
            stored_own, stored_as = _own_error_in_dtype(low, inputs, ref_outputs, low_outputs, stored_dtype, dtype,
                                                        random_draws, generator)
        if stored_own is None:
            why, tolerance, rule = f"in {dtype_name(stored_dtype)}: {stored_as}", 0.0, "not measured"
        else:
            tolerance, rule = measured_tolerance(stored_own, stored_dtype, measured_as=stored_as)
    else:
        tolerance, rule = 0.0, "not measured: the outputs could not be compared"
    jump = None
    if why is None and max_rel > tolerance and worst is not None and not random_draws:
        jump = original_jump(original, runs[worst.input], ref_outputs[worst.input], worst, dtype, tolerance,
                             generator, reference_transform)
    result = VerifyResult(outputs, max_rel, max_abs, own_rel, ratio, tolerance=tolerance, num_runs=len(inputs),
                          tolerance_rule=rule, stored_dtype_own_error=stored_own, why=why, worst=worst,
                          model_dtype_check=check, integers_kept=integers_kept, random_draws=random_draws,
                          original_jump=jump)
    return result


def _own_error_in_dtype(original: nn.Module, inputs, ref_outputs, own_outputs, low_dtype: torch.dtype,
                        dtype: torch.dtype, random_draws: bool, generator) -> tuple[float | None, str | None]:
    """The original's own error in ``low_dtype`` and how it was measured (None: the usual words): its
    outputs there against its float64 self; for a forward that draws random numbers (other draws in
    float64), the change of its outputs there when every weight moves by one unit in the last place
    (:func:`perturbed_own_error`), on the same draws. (None, why) when that change is no rounding error
    (VITS: its waveform's length changes), so no bar can be measured."""
    if not random_draws:
        return outputs_own_error(ref_outputs, own_outputs, low_dtype, dtype), None
    runs = [cast_floats(run, low_dtype) for run in inputs]
    try:
        own = perturbed_own_error(original, runs, own_outputs, low_dtype, generator)
    except ValueError as err:  # outputs of another shape or kind
        return None, (f"the original's own error cannot be measured: its forward draws random numbers (other ones "
                      f"in float64), and moving every weight by one unit in the last place changes its outputs "
                      f"({first_line(err, 160).split(': ', 1)[-1]})")
    return own, (f"the original's own error in {dtype_name(low_dtype)}, its forward drawing random numbers (other "
                 f"ones in float64): the change of its outputs when every weight moves by one unit in the last "
                 f"place, same draws")


def _own_error_measured_twice(original: nn.Module, inputs, own_outputs, against_float64: float,
                              model_dtype: torch.dtype, generator) -> tuple[float, str | None]:
    """The original's own error in ``model_dtype`` where the returned model failed the bar it sets: the larger of
    its error against float64 (``against_float64``) and the change of its outputs when every weight moves by one
    unit in the last place (:func:`perturbed_own_error`), the rounding a transform's re-rounded weights make. Over
    outputs of a few values (a classifier's 2 x 2 logits) the first is the largest of few samples, small by chance
    (MPNet's multiple-choice head: a fold whose float64 proof passes was 4.9 x it); (error, how it was measured,
    None: the usual words)."""
    runs = [cast_floats(run, model_dtype) for run in inputs]
    try:
        moved = perturbed_own_error(original, runs, own_outputs, model_dtype, generator)
    except ValueError:  # its outputs change kind or shape under the move: no second measure
        return against_float64, None
    if moved <= against_float64:
        return against_float64, None
    name = dtype_name(model_dtype)
    return moved, (f"the original's own error in {name}, the larger of two measures: the change of its outputs when "
                   f"every weight moves by one unit in the last place, over its error against float64 "
                   f"({against_float64:.2e})")


def _inputs_the_original_runs(original: nn.Module, calls, num_random: int, generator: torch.Generator,
                              run_dtype: torch.dtype) -> tuple[list, list, str | None, bool]:
    """Each example call followed by ``num_random`` fresh inputs like it (:func:`fresh_inputs_like`), every
    one run on ``original`` in ``run_dtype`` (its own) first: a fresh input it rejects (permuted integers
    that are sizes or positions: Qwen2-VL's ``image_grid_thw``) is made again with the example's integers,
    its floats varied. Returns (inputs, the original's outputs on them, what was remade in words or None,
    whether its forward drew random numbers); an example the original rejects is an ExampleInputsError."""
    inputs, outputs, remade, draws = [], [], [], []

    def run(call):
        flat, drew = _seeded_outputs(original, *cast_floats(call, run_dtype))
        outputs.append(flat)
        draws.append(drew)

    for call in calls:
        inputs.append(call)
        try:
            run(call)
        except Exception as err:  # noqa: BLE001  the model's own code, whatever it raises: the inputs are wrong
            raise invalid_example_inputs(original, err) from err
        for _ in range(num_random):
            fresh = fresh_inputs_like(call, generator)
            try:
                run(fresh)
            except Exception as err:  # noqa: BLE001  the model's own code: it rejects these integers, whatever it raises
                remade.append((len(inputs), f"{type(err).__name__}: {first_line(err, 120)}"))
                fresh = fresh_inputs_like(call, generator, keep_integers=True)
                run(fresh)
            inputs.append(fresh)
    if not remade:
        return inputs, outputs, None, any(draws)
    which = ", ".join(str(i) for i, _ in remade)
    return inputs, outputs, (f"input {which}: the original rejects the example's integers permuted "
                             f"({remade[0][1]}): made again with them kept, floats varied"), any(draws)


def _outputs_if_usable(reference: nn.Module, runs, own_outputs, dtype: torch.dtype):
    """(the float64 reference outputs, None), or (None, why float64 is unusable for this model): running
    it raised, or an output is inf/nan in float64 where it is finite in the model's own dtype
    (``own_outputs``; a model whose own dtype is float64 has no fallback, so its errors propagate)."""
    try:
        ref_outputs = [model_outputs(reference, *run) for run in runs]
    except Exception as err:  # noqa: BLE001  any failure of the model's own code in float64
        if own_outputs is None:
            raise
        return None, f"it raises {type(err).__name__} in {dtype_name(dtype)}: {first_line(err, 200)}"
    for i, (ref, own) in enumerate(zip(ref_outputs, own_outputs or ())):
        for (name, r), (_, o) in zip(ref, own):
            if isinstance(r, Tensor) and isinstance(o, Tensor) and r.is_floating_point() and r.shape == o.shape:
                lost = int((torch.isfinite(o) & ~torch.isfinite(r)).sum())
                if lost:
                    return None, (f"input {i}: {name} has {lost} inf/nan elements in {dtype_name(dtype)} that are "
                                  f"finite in {dtype_name(o.dtype)}")
    return ref_outputs, None


def _verify_in_own_dtype(original: nn.Module, folded: nn.Module, inputs, own_outputs, unusable: str, *,
                         rms_norm_paths, rounding_dtype: torch.dtype, generator) -> VerifyResult:
    """The fallback check of a model that cannot run in float64: ``folded`` against the original's
    outputs in the model's own dtype (``own_outputs``), judged by :func:`measured_tolerance` of the
    original's own error estimated by :func:`perturbed_own_error` (weights moved by one unit of
    ``rounding_dtype``, the dtype the folded weights were rounded to), with the multiple of a model
    run in its own dtype (``MODEL_DTYPE_OWN_ERROR_MULTIPLE``: both sides carry their own rounding)."""
    model_dtype = float_dtype(original)
    runs = [cast_floats(run, model_dtype) for run in inputs]
    rows, why, ratio = _compare_watched(own_outputs, folded, runs, model_dtype, rms_norm_paths)
    fallback = f"the model cannot run in float64 ({unusable}): checked in {dtype_name(model_dtype)} instead"
    max_rel = max((o["max_rel"] for o in rows), default=0.0)
    max_abs = max((o["max_abs"] for o in rows), default=0.0)
    if why is not None:
        tolerance, rule, own = 0.0, "not measured: the outputs could not be compared", None
    else:
        own = perturbed_own_error(original, runs, own_outputs, rounding_dtype, generator)
        tolerance, rule = measured_tolerance(own, rounding_dtype, multiple=MODEL_DTYPE_OWN_ERROR_MULTIPLE, measured_as=(
            f"the original's own error in {dtype_name(model_dtype)}: the change of its outputs when every weight "
            f"moves by one {dtype_name(rounding_dtype)} unit in the last place"))
    return VerifyResult(rows, max_rel, max_abs, max_rel, ratio, tolerance=tolerance,
                        num_runs=len(inputs), tolerance_rule=rule, stored_dtype_own_error=own, why=why,
                        compared_in=dtype_name(model_dtype), fallback=fallback, worst=_worst(rows))


def perturbed_own_error(model: nn.Module, runs, outputs, rounding_dtype: torch.dtype, generator) -> float:
    """The model's own rounding error where no float64 reference exists: the largest relative change of
    its ``outputs`` on ``runs`` when every floating weight w becomes w·(1 ± eps) (eps of
    ``rounding_dtype``, random signs), i.e. what one rounding of every weight does to the outputs
    (elements finite in both count)."""
    perturbed = _perturb_weights(copy.deepcopy(model), torch.finfo(rounding_dtype).eps, generator)
    return outputs_own_error(outputs, [model_outputs(perturbed, *run) for run in runs], rounding_dtype, rounding_dtype)


def _perturb_weights(model: nn.Module, eps: float, generator) -> nn.Module:
    """``model`` (returned) with every floating weight w made w·(1 ± ``eps``), random signs (eps of a dtype: one
    rounding of every weight)."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                signs = torch.randint(0, 2, t.shape, generator=generator).double() * 2 - 1
                t.copy_((t.double() * (1 + eps * signs)).to(t.dtype))
    return model


JUMP_DRAWS = 3  # weight perturbations tried when a failed comparison asks whether the original itself jumps


def original_jump(original: nn.Module, run, ref_outputs, worst: WorstElement, dtype: torch.dtype, move: float,
                  generator, reference_transform=None) -> float | None:
    """How far the original's own output at a failed comparison's worst place (``worst``: its output, on input
    ``run``) moves, in the comparison's metric, when every weight moves by ``move`` of itself (the comparison's
    tolerance: the scale of the differences a correct transform makes), the largest of JUMP_DRAWS random draws.
    Past ``JUMP_MULTIPLE`` x ``move``, the output jumps there (a top-k, sort or argmax over tied or nearly tied
    values): no transform of the model can be proved on that input. None when it cannot be measured."""
    ref = dict(ref_outputs).get(worst.output)
    if not (isinstance(ref, Tensor) and ref.is_floating_point()):
        return None
    largest = 0.0
    for _ in range(JUMP_DRAWS):
        model = cast_copy(original, dtype)
        if reference_transform is not None:
            model = reference_transform(model)
        try:
            out = dict(model_outputs(_perturb_weights(model, move, generator), *run)).get(worst.output)
        except Exception:  # noqa: BLE001  the model's own code: nothing measured
            return None
        if not (isinstance(out, Tensor) and out.shape == ref.shape):
            return None
        largest = max(largest, output_error(ref, out.to(ref.dtype)).error)
    return largest


def measured_tolerance(own: float, stored_dtype: torch.dtype, *, measured_as: str | None = None,
                       multiple: float = OWN_ERROR_MULTIPLE) -> tuple[float, str]:
    """(tolerance, the rule in words) for a model whose weights are stored in ``stored_dtype``.

    tolerance = ``multiple`` · own + u, where ``own`` is the original's own error (:func:`rounding_error`)
    when run in ``stored_dtype`` against its float64 self on the inputs compared (:func:`own_error`)
    and u = eps/2 is the dtype's unit roundoff (one rounding is always allowed, so a model that
    happens to compute exactly in the dtype is not held to exactness). ``measured_as``: how ``own``
    was measured, in words, when not against float64 (the fallback check). ``multiple``:
    ``OWN_ERROR_MULTIPLE`` for rounded weights run in float64, ``MODEL_DTYPE_OWN_ERROR_MULTIPLE`` for
    a model run in that dtype.
    """
    unit_roundoff = torch.finfo(stored_dtype).eps / 2
    tolerance = multiple * own + unit_roundoff
    name = dtype_name(stored_dtype)
    measured_as = measured_as or f"the original's own error in {name}: run in {name} vs float64 on the same inputs"
    rule = f"{multiple:g} x {own:.2e} ({measured_as}) + {unit_roundoff:.1e} ({name} unit roundoff)"
    return tolerance, rule


def own_error(model: nn.Module, inputs: list[tuple[tuple, dict]], low_dtype: torch.dtype, *,
              reference: nn.Module | None = None, dtype: torch.dtype = torch.float64) -> float:
    """Max error (:func:`rounding_error`) of ``model`` run in ``low_dtype`` (weights and float inputs
    cast) against the same model in ``dtype`` (``reference``: that copy, if the caller has one), over
    ``inputs``."""
    reference = cast_copy(model, dtype) if reference is None else reference
    low = cast_copy(model, low_dtype)
    ref = [model_outputs(reference, *cast_floats(run, dtype)) for run in inputs]
    return outputs_own_error(ref, [model_outputs(low, *cast_floats(run, low_dtype)) for run in inputs], low_dtype, dtype)


def outputs_own_error(ref_outputs, low_outputs, low_dtype: torch.dtype, dtype: torch.dtype) -> float:
    """Max :func:`rounding_error` of the low-precision outputs against the reference ones, per run."""
    worst = 0.0
    for ref, out in zip(ref_outputs, low_outputs):
        pairs, why = _pair(ref, out)
        if why is not None:
            raise ValueError(f"the model returns different outputs in {dtype_name(low_dtype)} and {dtype_name(dtype)}: {why}")
        worst = max([worst] + [rounding_error(r, o, low_dtype) for _, r, o, _ in pairs])
    return worst


# ------------------------------------------------------------------------------------------ the metric

EXTREME_FRACTION = 0.5  # |a| ≥ this · finfo(dtype).max: a finfo extreme (a mask's finfo.min, a clamp to finfo.max)


@dataclasses.dataclass(frozen=True)
class OutputError:
    """How far one output is from the reference (:func:`output_error`): the judged error, the largest
    absolute difference, and the index of the element where the error is largest (None: no element
    judged)."""

    error: float
    max_abs: float
    index: tuple[int, ...] | None = None


def output_error(ref: Tensor, out: Tensor, *, out_dtype: torch.dtype | None = None,
                 skip: Tensor | None = None) -> OutputError:
    """The error of ``out`` against ``ref`` (one output, same shape), elementwise, so that no element
    can hide another's: max over the ordinary elements of |a − b| / (typical + |a|), a the reference,
    typical its :func:`typical_magnitude`; a tolerance tol on it is |a − b| ≤ atol + rtol·|a| with
    atol = tol·typical and rtol = tol. Where either holds another kind of value (:func:`value_classes`:
    inf, nan, a finfo extreme) both must hold the same kind (nan matches nan, a mask's finfo.min in
    float64 matches one in float16), else the error is inf, at the first such element. Integer and
    bool outputs must be equal. ``out_dtype``: the dtype ``out`` was computed in, when it was cast
    since (its extremes are that dtype's); ``skip``: elements not judged.
    """
    judged = torch.ones(ref.shape, dtype=torch.bool, device=ref.device) if skip is None else ~skip
    if not ref.is_floating_point():
        differ = (ref != out) & judged
        return OutputError(math.inf, math.inf, _first(differ)) if differ.any() else OutputError(0.0, 0.0)
    ref_kind, out_kind = value_classes(ref), value_classes(out, out_dtype)
    mismatch = (ref_kind != out_kind) & judged
    if mismatch.any():
        return OutputError(math.inf, math.inf, _first(mismatch))
    a, b = ref.detach().double(), out.detach().double()
    ordinary = (ref_kind == 0) & judged
    if not ordinary.any():
        return OutputError(0.0, 0.0)
    diff = torch.where(ordinary, a - b, 0.0).abs()
    errors = diff / (typical_magnitude(a[ref_kind == 0]) + a.abs().nan_to_num(posinf=0.0, neginf=0.0))
    flat = int(errors.flatten().argmax())
    return OutputError(errors.flatten()[flat].item(), diff.max().item(), _unravel(flat, ref.shape))


def rounding_error(reference: Tensor, low: Tensor, low_dtype: torch.dtype) -> float:
    """The rounding error of ``low``, an output computed in ``low_dtype`` (maybe cast since), against
    ``reference``, the same output in float64: :func:`output_error` over the elements ordinary in
    both. Where either overflows, or masks with its own finfo.min, there is no rounding error to
    measure (the judged comparisons hold those places to the same kind of value); nor in an integer or
    bool output (a length, a mask), which the judged comparisons hold equal."""
    if not reference.is_floating_point():
        return 0.0
    skip = (value_classes(reference) != 0) | (value_classes(low, low_dtype) != 0)
    return output_error(reference, low, out_dtype=low_dtype, skip=skip).error


def value_classes(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """The kind of value of each element of a floating tensor, as int8: 0 an ordinary number, ±1 a
    finfo extreme of ``dtype`` (default: ``t``'s, the dtype it was computed in; |value| ≥
    ``EXTREME_FRACTION`` · finfo.max), ±2 ±inf, 3 nan. A mask's ``finfo.min`` differs from dtype to
    dtype and carries no rounding error: only its kind is compared."""
    x = t.detach().double()
    extreme = EXTREME_FRACTION * torch.finfo(dtype or t.dtype).max
    size = (x.abs() >= extreme).to(torch.int8) + x.isinf().to(torch.int8)  # 0 ordinary, 1 extreme, 2 inf
    return torch.where(x.isnan(), torch.full_like(size, 3), size * x.sign().nan_to_num().to(torch.int8))


def typical_magnitude(values: Tensor) -> float:
    """The scale an output's errors are judged against, from its ordinary values: the median of |a|.
    Not the maximum (one large value, such as a mask of -1e4, would hide every other error) nor the
    RMS (dominated by those same values): the median stays put with up to half the elements
    outliers. Where more than half are zero (ReLU outputs, one-hot rows) the mean of |a|; an all-zero
    output has no scale of its own: 1, so its error is absolute."""
    magnitudes = values.abs()
    if not magnitudes.numel():
        return 1.0
    median = magnitudes.median().item()
    if median > 0:
        return median
    mean = magnitudes.mean().item()
    return mean if mean > 0 else 1.0


def _first(mask: Tensor) -> tuple[int, ...]:
    """The index of the first True element of ``mask``."""
    return _unravel(int(mask.flatten().nonzero()[0]), mask.shape)


def _unravel(flat: int, shape) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        index.append(i)
    return tuple(reversed(index))


def flatten_outputs(value, prefix: str = "out") -> list[tuple[str, object]]:
    """(name, leaf) pairs of a nested output, leaves being tensors or other values (None, numbers).

    Pytrees (tuples, lists, dicts, namedtuples, registered classes such as Hugging Face
    ``ModelOutput``) flatten with ``torch.utils._pytree``; plain dataclasses, which are not
    pytrees, flatten by their fields.
    """
    leaves, _ = pytree.tree_flatten_with_path(value, is_leaf=_is_plain_dataclass)
    pairs = []
    for path, leaf in leaves:
        name = prefix + pytree.keystr(path)
        if _is_plain_dataclass(leaf):
            for f in dataclasses.fields(leaf):
                pairs.extend(flatten_outputs(getattr(leaf, f.name), f"{name}.{f.name}"))
        else:
            pairs.append((name, leaf))
    return pairs


def _is_plain_dataclass(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value) not in pytree.SUPPORTED_NODES


@contextlib.contextmanager
def default_dtype_of(model: nn.Module):
    """torch's default dtype set to float64 while a float64 ``model`` runs (restored after): tensors its
    forward makes without a dtype (XGLM's and Kosmos-2's sinusoidal positions, ProphetNet's masks) are
    then float64 like its weights, as they are float32 beside float32 weights; without it those models
    raise or overflow in float64 and a proof could only fall back to float32."""
    if float_dtype(model) != torch.float64 or torch.get_default_dtype() == torch.float64:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def float_dtype(model: nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` with its floating parameters and buffers in ``dtype``, each cast straight
    from the original (the deep copy's memo maps it to its cast, keeping ties): no intermediate copy
    in the model's own dtype."""
    memo = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point() and t.dtype != dtype and id(t) not in memo:
            cast = t.detach().to(dtype)
            memo[id(t)] = nn.Parameter(cast, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else cast
    return copy.deepcopy(model, memo).to(dtype)


def _in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` itself when every floating parameter and buffer is already ``dtype`` (it is only run,
    in eval mode and without gradients), else a copy cast to ``dtype``."""
    tensors = (*model.parameters(), *model.buffers())
    if all(t.dtype == dtype for t in tensors if t.is_floating_point()):
        return model
    return cast_copy(model, dtype)


def cast_floats(value, dtype):
    """``value`` with every floating tensor cast to ``dtype`` (containers rebuilt as pytrees)."""
    return pytree.tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


FRESH_FLOAT_NOISE = 0.1  # fresh float inputs: the example plus this fraction of its RMS times normal noise


def fresh_inputs_like(value, generator: torch.Generator, *, keep_integers: bool = False):
    """Fresh inputs of the same shapes built from the user's example ``value`` (a call or any pytree),
    each keeping its set of valid values.

    Integer tensors: the example's own values permuted over the leading (batch, position) dims, each
    trailing row kept whole, so token ids stay in the vocabulary and structured integers (a bounding
    box's ordered corners) stay valid, which independent random integers would break; tensors with as
    many rows share one permutation, so related inputs (ids, token types, an integer mask) move
    together. Float tensors: x + 0.1·rms(x)·z, z ~ N(0, 1), on finite elements (inf/nan kept), except
    0/1 masks, which stay as they are (noise would make them something no model was given). Bools,
    complex and other values: copied. ``keep_integers``: integer tensors copied too (for a model that
    rejects permuted ones: grid sizes such as Qwen2-VL's ``image_grid_thw``, which the proof then
    varies through the floats only).
    """
    permutations: dict[int, Tensor] = {}  # number of rows -> its one permutation

    def permuted(t: Tensor) -> Tensor:
        rows = t.reshape(-1, *t.shape[2:]) if t.dim() > 1 else t
        if rows.shape[0] not in permutations:
            permutations[rows.shape[0]] = torch.randperm(rows.shape[0], generator=generator, device="cpu")
        return rows[permutations[rows.shape[0]].to(t.device)].reshape(t.shape).clone()

    def fresh(t: Tensor) -> Tensor:
        if t.is_floating_point():
            return t.clone() if is_binary_mask(t) else _perturbed(t, generator)
        if t.dtype != torch.bool and not t.is_complex() and t.dim() and not keep_integers:
            return permuted(t)
        return t.clone()

    return pytree.tree_map_only(Tensor, fresh, value)


def is_binary_mask(t: Tensor) -> bool:
    """A floating tensor holding only 0 and 1, some 1 (an attention or padding mask given as floats;
    all zeros is an ordinary example, perturbed like any other)."""
    return bool(((t == 0) | (t == 1)).all()) and bool((t == 1).any())


def _perturbed(t: Tensor, generator: torch.Generator) -> Tensor:
    """``t`` + FRESH_FLOAT_NOISE · rms · z on its finite elements (rms 1 when the example is all zeros)."""
    x = t.detach().double()
    finite = torch.isfinite(x)
    rms = x[finite].pow(2).mean().sqrt().item() if finite.any() else 0.0
    noise = torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.device)
    fresh = torch.where(finite, x + FRESH_FLOAT_NOISE * (rms or 1.0) * noise, x)
    return fresh.to(t.dtype)


def model_outputs(model: nn.Module, args, kwargs) -> list[tuple[str, object]]:
    """``model(*args, **kwargs)`` in eval mode without gradients, flattened (:func:`flatten_outputs`),
    its random numbers drawn from ``PROOF_SEED`` (:func:`_seeded_outputs`)."""
    return _seeded_outputs(model, args, kwargs)[0]


def _seeded_outputs(model: nn.Module, args, kwargs) -> tuple[list[tuple[str, object]], bool]:
    """(:func:`model_outputs`, whether the forward drew from torch's random number generators). Every run
    starts from ``PROOF_SEED`` on the CPU generator and on each initialised CUDA device's, so two models that
    draw the same numbers in the same order get the same draws; the caller's generator states are restored
    (``torch.random.fork_rng``), and a CUDA that is not initialised is left so."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda), default_dtype_of(model), eval_mode(model), torch.no_grad():
        generators = [torch.default_generator] + [torch.cuda.default_generators[d] for d in cuda]
        for g in generators:
            g.manual_seed(PROOF_SEED)
        before = [g.get_state() for g in generators]
        outputs = flatten_outputs(model(*args, **kwargs))
        drew = any(not torch.equal(state, g.get_state()) for state, g in zip(before, generators))
    return outputs, drew


def _compare_watched(ref_outputs, model, runs, dtype, rms_norm_paths):
    """:func:`_compare_runs` with the inputs of ``model``'s RMSNorms at ``rms_norm_paths`` watched:
    (rows, why, the largest |mean|/rms seen or None)."""
    hooks, ratios = watch_rms_inputs(model, rms_norm_paths)
    try:
        rows, why = _compare_runs(ref_outputs, model, runs, dtype)
    finally:
        for h in hooks:
            h.remove()
    return rows, why, max(ratios) if ratios else None


def _compare_runs(ref_outputs, model, runs, dtype) -> tuple[list[dict], str | None]:
    """Per-output error rows of ``model`` on ``runs`` against the reference outputs recorded on the
    same runs, and why the comparison is void (None when it is not)."""
    rows, compared = [], 0
    for i, (ref_run, (args, kwargs)) in enumerate(zip(ref_outputs, runs)):
        pairs, why = _pair(ref_run, model_outputs(model, args, kwargs))
        if why is not None:
            return rows, f"input {i}: {why}"
        for name, ref, out, is_tensor in pairs:
            rows.append(_row(i, name, dtype, ref, out, output_error(ref, out)))
            if is_tensor and ref.is_floating_point():  # NaN matching NaN proves nothing, nor do equal integers
                compared += int(torch.isfinite(ref).sum())  # (an argmax or a length): only finite floats count
    if not compared:
        names = sorted({r["name"] for r in rows}) or "none"
        return rows, (f"compared nothing: the outputs hold no finite floating-point elements (tensor outputs: "
                      f"{names}); a check that compared nothing cannot pass")
    return rows, None


def _compare_returned(ref_outputs, own_outputs, returned_outputs, model_dtype) -> tuple[list[dict], str | None]:
    """Per-output error rows of the returned model run in ``model_dtype`` against the original in float64,
    and why they cannot be compared (None when they can). Where the original run in ``model_dtype``
    (``own_outputs``) itself gives another kind of value than in float64 (it overflows, a mask in its
    own finfo.min shows as an ordinary number) only one thing is judged: the returned model may not
    give inf/nan where the original in its dtype is finite."""
    rows = []
    for i, (ref_run, own_run, out_run) in enumerate(zip(ref_outputs, own_outputs, returned_outputs)):
        pairs, why = _pair(ref_run, out_run)
        own_pairs, own_why = _pair(ref_run, own_run)
        if why is not None or own_why is not None:
            return rows, f"input {i}: {why or own_why}"
        for (name, ref, out, _), (_, _, own, _) in zip(pairs, own_pairs):
            rows.append(_row(i, name, model_dtype, ref, out, _returned_error(ref, own, out)))
    return rows, None


def _returned_error(ref: Tensor, own: Tensor, out: Tensor) -> OutputError:
    """:func:`output_error` of ``out`` (the returned model in its dtype) against ``ref`` (the original in
    float64), where ``own`` (the original in that dtype) gives the same kind of value as ``ref``; where
    it does not, inf at the first element that is inf/nan in ``out`` but finite in ``own``."""
    if not ref.is_floating_point():
        return output_error(ref, out)
    differs = value_classes(own) != value_classes(ref)
    lost = differs & ~torch.isfinite(out) & torch.isfinite(own)
    if lost.any():
        return OutputError(math.inf, math.inf, _first(lost))
    return output_error(ref, out, skip=differs)


def _row(i: int, name: str, dtype: torch.dtype, ref: Tensor, out: Tensor, error: OutputError) -> dict:
    """One output's row: its error, and where it is largest with both values there."""
    values = {} if error.index is None else {"original": ref[error.index].item(), "folded": out[error.index].item()}
    return {"input": i, "name": name, "dtype": dtype_name(dtype), "max_abs": error.max_abs, "max_rel": error.error,
            "argmax_agreement": _argmax_agreement(ref, out), "index": error.index, **values}


def _worst(rows: list[dict]) -> WorstElement | None:
    """The element of the rows' largest error (None when no row has one)."""
    row = max((r for r in rows if r["index"] is not None), key=lambda r: r["max_rel"], default=None)
    if row is None:
        return None
    return WorstElement(row["name"], list(row["index"]), row["original"], row["folded"], row["max_rel"], row["input"])


def _pair(ref: list[tuple[str, object]], out: list[tuple[str, object]]):
    """([(name, ref tensor, out tensor, was a tensor)], None), or (_, why) when the outputs differ in
    structure. Numbers compare as tensors (but alone do not make a comparison count); None and
    strings must be equal; other objects only match in type.
    """
    ref_names, out_names = [n for n, _ in ref], [n for n, _ in out]
    if ref_names != out_names:
        return [], f"the models return different outputs: original {_short(ref_names)}, folded {_short(out_names)}"
    pairs = []
    for (name, a), (_, b) in zip(ref, out):
        was_tensor = isinstance(a, Tensor)
        a, b = _as_tensor_if_number(a), _as_tensor_if_number(b)
        a_tensor, b_tensor = isinstance(a, Tensor), isinstance(b, Tensor)
        if a_tensor != b_tensor or (not a_tensor and type(a) is not type(b)):
            return [], f"{name} is a {type(a).__name__} in the original but a {type(b).__name__} in the folded model"
        if not a_tensor:
            if (a is None or isinstance(a, str)) and a != b:
                return [], f"{name} differs: {a!r} vs {b!r}"
            continue
        if a.shape != b.shape:
            return [], f"{name} has shape {tuple(a.shape)} in the original but {tuple(b.shape)} in the folded model"
        if _kind(a) != _kind(b):
            return [], f"{name} is {_kind(a)} ({a.dtype}) in the original but {_kind(b)} ({b.dtype}) in the folded model"
        pairs.append((name, a, b, was_tensor))
    return pairs, None


def _as_tensor_if_number(value):
    return torch.tensor(value) if isinstance(value, (bool, int, float)) else value


def _kind(t: Tensor) -> str:
    return ("bool" if t.dtype == torch.bool else "complex" if t.is_complex() else
            "floating" if t.is_floating_point() else "integer")


def _short(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")
    return f"[{shown}]"


def _argmax_agreement(ref: Tensor, out: Tensor) -> float | None:
    if ref.dim() < 2 or not ref.is_floating_point() or not ref.numel():
        return None
    return (ref.argmax(-1) == out.argmax(-1)).double().mean().item()


def watch_rms_inputs(model: nn.Module, paths):
    """Forward pre-hooks on normfold RMSNorms recording max |mean(x)| / rms(x) over the rows they
    normalize (a ``PermutedRMSNorm``'s after its permute: a channels-first norm's rows are channels); a call
    with no rows (an audio segment of no tokens: HiggsAudio v2) records nothing."""
    ratios: list[float] = []

    def hook(module, inputs):
        rows = inputs[0].permute(module.order) if isinstance(module, PermutedRMSNorm) else inputs[0]
        if rows.numel():
            ratios.append(mean_over_rms(rows).max().item())

    wanted = None if paths is None else set(paths)
    hooks = [m.register_forward_pre_hook(hook) for path, m in model.named_modules()
             if isinstance(m, RMSNorm) and (wanted is None or path in wanted)]
    return hooks, ratios

