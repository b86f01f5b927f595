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

One idea, about 460 lines: the inputs, the runs, the comparison and the tolerance rule of a proof
are kept together so the rule a result was judged by is readable in one file.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..nn import RMSNorm
from .errors import failures_as_fold_error, model_name
from .graph import eval_mode, split_example_calls
from .math import mean_over_rms
from .report import VerifyResult

FOLD_TOLERANCE = 1e-9  # the transform itself: float64 relative error allowed between original and fold

# Weights stored in a low-precision dtype: the folded model's float64 error may be this many times
# the error the original itself makes when run in that dtype on the same inputs, plus one unit
# roundoff of the dtype. Measured (bundled GPT-2, tiny GPT-2 and BERT; fp32/fp16/bf16): a correct
# fold is at most 0.5x the own error; a 1.1x head, a 1.5x MLP weight, a zeroed attention output
# in a GPT-2 are 10-230x.
OWN_ERROR_MULTIPLE = 2.0


def verify(original: nn.Module, folded: nn.Module, example_inputs, *, dtype: torch.dtype = torch.float64,
           num_random: int = 2, tolerance: float | None = None, seed: int = 0, rms_norm_paths=None,
           folded_exact: nn.Module | None = None, stored_dtype: torch.dtype | None = None,
           exact_transform: Callable[[nn.Module], nn.Module] | None = None) -> VerifyResult:
    """Compare outputs on the example call(s) and ``num_random`` fresh inputs of the same shapes each
    (:func:`fresh_inputs_like`: the example's integers permuted, its floats perturbed).

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments, or a list of
    such calls (each is compared). Both models run as float64 copies (float inputs cast too); the
    relative error of each output is ‖a−b‖∞ / ‖a‖∞. The same comparison runs in the model's own
    dtype (reported, not judged). Forward pre-hooks measure how far from zero-mean the inputs of
    the folded model's RMSNorms at ``rms_norm_paths`` (default: every normfold RMSNorm) are, as max
    |mean|/rms. ``folded_exact``: the same fold built in float64 (``fold`` passes its plan applied
    to a float64 copy), used for the float64 comparison so that rounding the folded weights to the
    model's dtype does not count against the transform. ``exact_transform`` instead: a function that
    turns a model into its fold in place (``prove_fold`` passes the plan's ``apply_plan``); it is
    applied to verify's own float64 copy of ``original`` once that copy's outputs are recorded, so
    one float64 copy of the model serves both sides.

    ``tolerance`` (default 1e-9): the largest float64 relative error that passes. ``stored_dtype``
    instead: the folded weights were rounded to that dtype, so the tolerance is measured
    (:func:`measured_tolerance`) from the original's own error in that dtype on these inputs.

    When the original cannot run in float64 (it raises, or gives inf/nan where it is finite in its
    own dtype) the comparison runs in the model's own dtype: original against ``folded``, with the
    tolerance measured the same way from the original's own error, estimated as the change of its
    outputs when every weight moves by one unit in the last place (:func:`perturbed_own_error`);
    the result's ``compared_in`` and ``fallback`` say so.
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
                       exact_transform=exact_transform)


def _verify(original, folded, calls, *, dtype, num_random, tolerance, seed, rms_norm_paths, folded_exact,
            stored_dtype, exact_transform) -> VerifyResult:
    """:func:`verify` once its arguments are checked."""
    generator = torch.Generator().manual_seed(seed)
    inputs = [run for call in calls for run in [call] + [fresh_inputs_like(call, generator) for _ in range(num_random)]]
    runs = [cast_floats(run, dtype) for run in inputs]
    model_dtype = _float_dtype(original)
    own_outputs = None  # the original in its own dtype: reported, the stored dtype's own error, the fallback
    if model_dtype is not None and model_dtype != dtype:
        own_outputs = [model_outputs(original, *cast_floats(run, model_dtype)) for run in inputs]

    # Each model runs once per input: the original's outputs are recorded before its copy is folded.
    reference = _cast_copy(original, dtype)
    ref_outputs, unusable = _outputs_if_usable(reference, runs, own_outputs, dtype)
    if unusable is not None:
        del reference
        return _verify_in_own_dtype(original, folded, inputs, own_outputs, unusable, rms_norm_paths=rms_norm_paths,
                                    rounding_dtype=stored_dtype or model_dtype, generator=generator)
    if exact_transform is not None:
        candidate = exact_transform(reference)
    else:
        candidate = _in_dtype(folded if folded_exact is None else folded_exact, dtype)
    del reference
    outputs, why, ratio = _compare_watched(ref_outputs, candidate, runs, dtype, rms_norm_paths)
    max_rel = max((o["max_rel"] for o in outputs), default=0.0)
    max_abs = max((o["max_abs"] for o in outputs), default=0.0)

    own_rel = None
    if why is None and own_outputs is not None:
        own_rows, _ = _compare_runs(own_outputs, folded, [cast_floats(run, model_dtype) for run in inputs], model_dtype)
        outputs += own_rows
        own_rel = max((o["max_rel"] for o in own_rows), default=0.0)

    rule, stored_own = "fixed", None
    if stored_dtype is None:
        tolerance = FOLD_TOLERANCE if tolerance is None else tolerance
    elif why is None:
        low_outputs = own_outputs if stored_dtype == model_dtype else None
        if low_outputs is None:
            low = _cast_copy(original, stored_dtype)
            low_outputs = [model_outputs(low, *cast_floats(run, stored_dtype)) for run in inputs]
        stored_own = _own_error(ref_outputs, low_outputs, stored_dtype, dtype)
        tolerance, rule = measured_tolerance(stored_own, stored_dtype)
    else:
        tolerance, rule = 0.0, "not measured: the outputs could not be compared"
    return VerifyResult(outputs, max_rel, max_abs, own_rel, ratio, tolerance=tolerance, num_runs=len(inputs),
                        tolerance_rule=rule, stored_dtype_own_error=stored_own, why=why)


def _outputs_if_usable(reference: nn.Module, runs, own_outputs, dtype: torch.dtype):
    """(the float64 reference outputs, None), or (None, why float64 is unusable for this model): running
    it raised, or an output is inf/nan in float64 where it is finite in the model's own dtype
    (``own_outputs``; a model whose own dtype is float64 has no fallback, so its errors propagate)."""
    try:
        ref_outputs = [model_outputs(reference, *run) for run in runs]
    except Exception as err:  # noqa: BLE001  any failure of the model's own code in float64
        if own_outputs is None:
            raise
        return None, f"it raises {type(err).__name__} in {_name(dtype)}: {_first_line(err)}"
    for i, (ref, own) in enumerate(zip(ref_outputs, own_outputs or ())):
        for (name, r), (_, o) in zip(ref, own):
            if isinstance(r, Tensor) and isinstance(o, Tensor) and r.is_floating_point() and r.shape == o.shape:
                lost = int((torch.isfinite(o) & ~torch.isfinite(r)).sum())
                if lost:
                    return None, (f"input {i}: {name} has {lost} inf/nan elements in {_name(dtype)} that are "
                                  f"finite in {_name(o.dtype)}")
    return ref_outputs, None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


def _verify_in_own_dtype(original: nn.Module, folded: nn.Module, inputs, own_outputs, unusable: str, *,
                         rms_norm_paths, rounding_dtype: torch.dtype, generator) -> VerifyResult:
    """The fallback check of a model that cannot run in float64: ``folded`` against the original's
    outputs in the model's own dtype (``own_outputs``), judged by :func:`measured_tolerance` of the
    original's own error estimated by :func:`perturbed_own_error` (weights moved by one unit of
    ``rounding_dtype``, the dtype the folded weights were rounded to)."""
    model_dtype = _float_dtype(original)
    runs = [cast_floats(run, model_dtype) for run in inputs]
    rows, why, ratio = _compare_watched(own_outputs, folded, runs, model_dtype, rms_norm_paths)
    fallback = f"the model cannot run in float64 ({unusable}): checked in {_name(model_dtype)} instead"
    max_rel = max((o["max_rel"] for o in rows), default=0.0)
    max_abs = max((o["max_abs"] for o in rows), default=0.0)
    if why is not None:
        tolerance, rule, own = 0.0, "not measured: the outputs could not be compared", None
    else:
        own = perturbed_own_error(original, runs, own_outputs, rounding_dtype, generator)
        tolerance, rule = measured_tolerance(own, rounding_dtype, measured_as=(
            f"the original's own error in {_name(model_dtype)}: the change of its outputs when every weight "
            f"moves by one {_name(rounding_dtype)} unit in the last place"))
    return VerifyResult(rows, max_rel, max_abs, max_rel, ratio, tolerance=tolerance,
                        num_runs=len(inputs), tolerance_rule=rule, stored_dtype_own_error=own, why=why,
                        compared_in=_name(model_dtype), fallback=fallback)


def perturbed_own_error(model: nn.Module, runs, outputs, rounding_dtype: torch.dtype, generator) -> float:
    """The model's own rounding error where no float64 reference exists: the largest relative change of
    its ``outputs`` on ``runs`` when every floating weight w becomes w·(1 ± eps) (eps of
    ``rounding_dtype``, random signs), i.e. what one rounding of every weight does to the outputs
    (elements finite in both count)."""
    eps = torch.finfo(rounding_dtype).eps
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for t in (*perturbed.parameters(), *perturbed.buffers()):
            if t.is_floating_point():
                signs = torch.randint(0, 2, t.shape, generator=generator).double() * 2 - 1
                t.copy_((t.double() * (1 + eps * signs)).to(t.dtype))
    return _own_error(outputs, [model_outputs(perturbed, *run) for run in runs], rounding_dtype, rounding_dtype)


def measured_tolerance(own: float, stored_dtype: torch.dtype, *, measured_as: str | None = None) -> tuple[float, str]:
    """(tolerance, the rule in words) for a model whose weights are stored in ``stored_dtype``.

    tolerance = OWN_ERROR_MULTIPLE · own + u, where ``own`` is the original's own relative error
    when run in ``stored_dtype`` against its float64 self on the inputs compared (:func:`own_error`)
    and u = eps/2 is the dtype's unit roundoff (one rounding is always allowed, so a model that
    happens to compute exactly in the dtype is not held to exactness). ``measured_as``: how ``own``
    was measured, in words, when not against float64 (the fallback check).
    """
    unit_roundoff = torch.finfo(stored_dtype).eps / 2
    tolerance = OWN_ERROR_MULTIPLE * own + unit_roundoff
    name = _name(stored_dtype)
    measured_as = measured_as or f"the original's own error in {name}: run in {name} vs float64 on the same inputs"
    rule = f"{OWN_ERROR_MULTIPLE:g} x {own:.2e} ({measured_as}) + {unit_roundoff:.1e} ({name} unit roundoff)"
    return tolerance, rule


def own_error(model: nn.Module, inputs: list[tuple[tuple, dict]], low_dtype: torch.dtype, *,
              reference: nn.Module | None = None, dtype: torch.dtype = torch.float64) -> float:
    """Max relative error of ``model`` run in ``low_dtype`` (weights and float inputs cast) against
    the same model in ``dtype`` (``reference``: that copy, if the caller has one), over ``inputs``.

    Only elements finite in both runs count: where one dtype overflows, or masks with its own
    finfo.min, there is no rounding error to measure (the judged comparison stays strict there).
    """
    reference = _cast_copy(model, dtype) if reference is None else reference
    low = _cast_copy(model, low_dtype)
    ref = [model_outputs(reference, *cast_floats(run, dtype)) for run in inputs]
    return _own_error(ref, [model_outputs(low, *cast_floats(run, low_dtype)) for run in inputs], low_dtype, dtype)


def _own_error(ref_outputs, low_outputs, low_dtype: torch.dtype, dtype: torch.dtype) -> float:
    """Max relative error of the low-precision outputs against the reference ones, per run (:func:`own_error`)."""
    worst = 0.0
    for ref, out in zip(ref_outputs, low_outputs):
        pairs, why = _pair(ref, out)
        if why is not None:
            raise ValueError(f"the model returns different outputs in {_name(low_dtype)} and {_name(dtype)}: {why}")
        worst = max([worst] + [max_errors(r, o, where_finite=True)[0] for _, r, o, _ in pairs])
    return worst


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


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
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
    return _cast_copy(model, dtype)


def cast_floats(value, dtype):
    """``value`` with every floating tensor cast to ``dtype`` (containers rebuilt as pytrees)."""
    return pytree.tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


FRESH_FLOAT_NOISE = 0.1  # fresh float inputs: the example plus this fraction of its RMS times normal noise


def fresh_inputs_like(value, generator: torch.Generator):
    """Fresh inputs of the same shapes built from the user's example ``value`` (a call or any pytree).

    Integer tensors: the example's own values permuted over the leading (batch, position) dims, each
    trailing row kept whole, so token ids stay in the vocabulary and structured integers (a bounding
    box's ordered corners) stay valid, which independent random integers would break. Float tensors:
    x + 0.1·rms(x)·z, z ~ N(0, 1), on finite elements (inf/nan, e.g. masks, kept). Bools, complex
    and other values: copied.
    """
    def fresh(t: Tensor) -> Tensor:
        if t.is_floating_point():
            return _perturbed(t, generator)
        if t.dtype != torch.bool and not t.is_complex() and t.dim():
            return _permuted_rows(t, generator)
        return t.clone()

    return pytree.tree_map_only(Tensor, fresh, value)


def _permuted_rows(t: Tensor, generator: torch.Generator) -> Tensor:
    """``t`` with its rows over the first two dims (every element for a 1-D tensor) shuffled."""
    rows = t.reshape(-1, *t.shape[2:]) if t.dim() > 1 else t
    order = torch.randperm(rows.shape[0], generator=generator, device="cpu").to(t.device)
    return rows[order].reshape(t.shape).clone()


def _perturbed(t: Tensor, generator: torch.Generator) -> Tensor:
    """``t`` + FRESH_FLOAT_NOISE · rms · z on its finite elements (rms 1 when the example is all zeros)."""
    x = t.detach().double()
    finite = torch.isfinite(x)
    rms = x[finite].pow(2).mean().sqrt().item() if finite.any() else 0.0
    noise = torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.device)
    fresh = torch.where(finite, x + FRESH_FLOAT_NOISE * (rms or 1.0) * noise, x)
    return fresh.to(t.dtype)


def model_outputs(model: nn.Module, args, kwargs) -> list[tuple[str, object]]:
    """``model(*args, **kwargs)`` in eval mode without gradients, flattened (:func:`flatten_outputs`)."""
    with eval_mode(model), torch.no_grad():
        return flatten_outputs(model(*args, **kwargs))


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
            rel, abs_ = max_errors(ref, out)
            rows.append({"input": i, "name": name, "dtype": _name(dtype), "max_abs": abs_, "max_rel": rel,
                         "argmax_agreement": _argmax_agreement(ref, out)})
            if is_tensor:  # NaN matching NaN proves nothing: only finite (or integer) elements count
                compared += int(torch.isfinite(ref).sum()) if ref.is_floating_point() else ref.numel()
    if not compared:
        names = sorted({r["name"] for r in rows}) or "none"
        return rows, (f"compared nothing: the outputs hold no finite tensor elements (tensor outputs: {names}); "
                      "a check that compared nothing cannot pass")
    return rows, None


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


def max_errors(ref: Tensor, out: Tensor, *, where_finite: bool = False) -> tuple[float, float]:
    """(max relative, max absolute) error; inf when inf/nan sit in different places, unless
    ``where_finite``: then only elements finite in both count."""
    if not ref.is_floating_point():
        bad = float((ref != out).any())
        return bad, bad
    ref, out = ref.double(), out.double()
    finite = torch.isfinite(ref)
    if where_finite:
        finite &= torch.isfinite(out)
    elif not torch.equal(finite, torch.isfinite(out)) or not torch.equal(ref[~finite].nan_to_num(), out[~finite].nan_to_num()):
        return float("inf"), float("inf")
    if not finite.any():
        return 0.0, 0.0
    diff = (ref[finite] - out[finite]).abs().max().item()
    scale = ref[finite].abs().max().item()
    return (diff / scale if scale > 0 else diff), diff


def _argmax_agreement(ref: Tensor, out: Tensor) -> float | None:
    if ref.dim() < 2 or not ref.is_floating_point() or not ref.numel():
        return None
    return (ref.argmax(-1) == out.argmax(-1)).double().mean().item()


def watch_rms_inputs(model: nn.Module, paths):
    """Forward pre-hooks on normfold RMSNorms recording max |mean(x)| / rms(x) over rows."""
    ratios: list[float] = []

    def hook(module, inputs):
        ratios.append(mean_over_rms(inputs[0]).max().item())

    wanted = None if paths is None else set(paths)
    hooks = [m.register_forward_pre_hook(hook) for path, m in model.named_modules()
             if isinstance(m, RMSNorm) and (wanted is None or path in wanted)]
    return hooks, ratios

