"""Judging a folder against its original (``normfold verify``): a pass means "this folder, as
transformers and normfold load it, is what normfold makes from this original", and nothing less.

Nothing the folder says about itself is believed:

1. Its report must carry normfold's seal (:func:`normfold.hf.report.seal`) and a recipe
   (:mod:`normfold.hf.recipe`); the recipe only *chooses* how to re-make the folder.
2. Its weights must load from one source: a second weight file that another reader could load
   instead (a stale ``model.safetensors`` beside an index, a ``.bin`` beside safetensors) fails.
3. The folder is re-made from the original by the code that made it, into a private temporary
   folder, and the two are compared: the same files, every tensor of the files that load within
   one ulp of the stored dtype, every JSON file equal as data, every other file byte for byte, and
   the report's claims equal to the re-made report's (its measured figures are covered by the seal).
4. The folder is loaded as users load it (``normfold.from_pretrained``, and stock transformers when
   the report says stock loads it) and its outputs are compared with the original's: exact results
   in float64 against the original's own rounding error, approximate ones (``--approximate``,
   sliced rotations) against the cosine bar of the person verifying, never the folder's.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from .._text import first_line
from ..engine import verify
from ..engine.cosine_bar import DEFAULT_MIN_COSINE, check_cosine_bar
from ..engine.errors import FoldError
from .errors import CheckpointError
from .folder import fold_folder, remake_saved
from .folder_inputs import folder_example_inputs
from .load import check_model_dir, load_config, load_model, model_class_for
from .output_dir import REPORT_JSON
from .recipe import CalibrationRecord, Recipe, file_sha256
from .folder_report import FolderReport
from .report import read_folder_report, read_report_json, seal_problems
from .saved_weights import compare_weights
from .saving import DTYPES, from_pretrained
from .streaming import fold_checkpoint, verify_by_blocks
from .weight_files import other_weight_files, read_tensor, stored_tensors, weight_source

Step = Callable[[str], None]

# (the original folder, the folder to write, the recipe, the calibration file given, step, the folder judged:
# only what its recipe names there is read, checked against the recipe, e.g. a learned rotation's bases)
Remake = Callable[[Path, Path, Recipe, "str | None", Step, Path], dict]
# (original, the folder's model as loaded, the original's folder (its tokenizer), the calibration file, the cosine
# bar, the recipe) -> the result, with "ok" and "why"
MeasurePromise = Callable[[nn.Module, nn.Module, Path, Path, float, Recipe], dict]
# (the recipe) -> the map of the residual stream a streamed rotation applies (x -> x.Q), for the per-block check
StreamMapFor = Callable[[Recipe], Callable]

# Report sections that are measurements or descriptions, not claims about the result: re-made figures
# may differ in their last digits (another machine, another thread count), paths (also inside the words of why
# the processor route was not taken) and the example calls a fold made in Python was traced on differ (verify
# proves on its own inputs); the seal covers them.
# A learned rotation's learning (its calibration and losses) describes how its bases were found: the folder
# is re-made from the bases themselves, checked against the recipe's SHA-256, and judged by the result.
_MEASURED = {("verification",), ("streaming",), ("files",), ("digest",), ("model", "source"), ("traced_calls",),
             ("recipe", "calibration", "path"), ("rotation", "learning"), ("example_inputs", "why")}
_FLOAT_RTOL, _FLOAT_ATOL = 1e-6, 1e-9  # other figures the re-made report recomputes (cosines, kept energy)


def verify_folders(orig_dir: str | os.PathLike, folded_dir: str | os.PathLike, *, remake: Remake | None = None,
                  measure: MeasurePromise | None = None, stream_map_for: StreamMapFor | None = None,
                  calibration_file: str | os.PathLike | None = None, min_cosine: float | None = None,
                  trust_remote_code: bool = False, step: Step = lambda _: None) -> dict[str, Any]:
    """Judge ``folded_dir`` against ``orig_dir`` (module docstring); returns ``ok``, ``why`` (the first
    problem, None when ok), ``problems`` (every one found), ``recipe``, ``files`` (the comparison with
    the re-made folder) and ``outputs`` (the loaded folder against the original).

    ``remake`` re-makes a folder from its recipe (default :func:`remake_exact`: exact folds, streamed or
    not, and ``save_pretrained`` folds; the CLI adds approximate folds and rotations, which hf cannot
    compose itself). ``measure`` judges approximate results against the cosine bar ``min_cosine``
    (default :data:`DEFAULT_MIN_COSINE`) on ``calibration_file``, which must be the file the folder was
    made from (its SHA-256 is checked). ``stream_map_for`` gives a streamed rotation's stream map.
    """
    orig_dir, folded_dir = check_model_dir(orig_dir), check_model_dir(folded_dir)
    if min_cosine is not None:
        check_cosine_bar(min_cosine)
    remake = remake or partial_remake_exact(trust_remote_code)
    report = read_report_json(folded_dir)  # as data: nothing it says is believed, every claim is compared
    problems = seal_problems(report, folded_dir)
    try:
        if "recipe" not in report or report["recipe"] is None:
            raise CheckpointError("it records no recipe (a fold that cannot be re-made: approximate folds made in "
                                  "Python, save_pretrained without the report)")
        recipe = Recipe.from_dict(report["recipe"])
    except CheckpointError as err:
        return _result(problems + [f"{REPORT_JSON}: {err}"], None)
    _check_options_apply(recipe, calibration_file, min_cosine)
    other_model = _other_model_problem(report, orig_dir, trust_remote_code)
    if other_model:  # before anything is loaded or re-made: the folder says it comes from another model
        return _result(problems + [other_model], recipe)
    calibration = _calibration_problem(recipe, calibration_file)
    if calibration:
        return _result(problems + [calibration], recipe)
    problems += _weight_source_problems(folded_dir)
    with tempfile.TemporaryDirectory(prefix="normfold-verify-") as tmp:
        expected_dir = Path(tmp) / "remade"
        step(f"re-making the folder from the original ({describe(recipe)})")
        try:
            remake(orig_dir, expected_dir, recipe, None if calibration_file is None else str(calibration_file), step,
                   folded_dir)
            expected = read_folder_report(expected_dir)  # what normfold wrote just now, typed
        except (CheckpointError, FoldError, ValueError, TypeError, RuntimeError) as err:
            return _result(problems + [f"could not re-make the folder from the original with its recipe "
                                       f"({describe(recipe)}): {first_line(err)}"], recipe)
        step("comparing every file and tensor with the re-made folder")
        files = compare_folders(expected_dir, folded_dir)
        problems += files["problems"] + compare_reports(expected.to_json(), report)
        step("loading the folder as users load it; comparing its outputs with the original's")
        try:
            outputs = _check_outputs(orig_dir, folded_dir, expected, recipe, measure=measure,
                                     stream_map_for=stream_map_for, calibration_file=calibration_file,
                                     min_cosine=min_cosine, trust_remote_code=trust_remote_code)
        except CheckpointError as err:  # the folder does not load (normfold.from_pretrained refuses it)
            outputs = {"ok": False, "why": f"the folder does not load: {first_line(err)}"}
    if not outputs["ok"]:
        problems.append(f"outputs: {outputs.get('why') or 'outside the tolerance'}")
    return _result(problems, recipe, files=files, outputs=outputs)


def _result(problems: list[str], recipe: Recipe | None, **parts: Any) -> dict[str, Any]:
    return {"ok": not problems, "why": problems[0] if problems else None, "problems": problems,
            "recipe": None if recipe is None else recipe.to_dict(), "kind": None if recipe is None else describe(recipe),
            "files": None, "outputs": None, **parts}


def describe(recipe: Recipe) -> str:
    """The kind of folder a recipe makes, in a few words (``exact fold``, ``streamed hadamard rotation``)."""
    streamed = "streamed " if recipe.streaming else ""
    if recipe.rotation is not None:
        sliced = f", {recipe.rotation.slice_fraction:g} sliced (approximate)" if recipe.rotation.slice_fraction else ""
        return f"{streamed}{recipe.rotation.method} rotation, seed {recipe.rotation.seed}{sliced}"
    if recipe.approximate_min_cosine is not None:
        return f"approximate fold (fitted to cosine {recipe.approximate_min_cosine:g})"
    return f"{streamed}exact fold{' (normfold.save_pretrained)' if recipe.command == 'save_pretrained' else ''}"


def is_approximate(recipe: Recipe) -> bool:
    """Whether a recipe's result is approximate (judged by a cosine bar, not an exact bound)."""
    return recipe.approximate_min_cosine is not None or bool(recipe.rotation and recipe.rotation.slice_fraction)


def _other_model_problem(report: dict[str, Any], orig_dir: Path, trust_remote_code: bool) -> str | None:
    """Why ORIG cannot be the folder's original by what the report says it was folded from (its class
    and model type against ORIG's config), or None. Only a fast refusal: a report that names ORIG's
    class falsely is caught by the comparison with the re-made folder."""
    model = report.get("model")
    if not isinstance(model, dict):
        return None
    config = load_config(orig_dir, trust_remote_code=trust_remote_code)
    cls = None if trust_remote_code else model_class_for(config).__name__  # the class normfold builds ORIG as
    said = (model.get("architecture"), model.get("model_type"))
    if said[1] == config.model_type and (cls is None or said[0] == cls):
        return None
    return (f"the folder was folded from a {said[0]} ({said[1]}), but {orig_dir} holds a {cls or 'model'} "
            f"({config.model_type}): it is not the folder's original")


def _check_options_apply(recipe: Recipe, calibration_file, min_cosine: float | None) -> None:
    """CheckpointError for an option this folder has no use for: silently ignoring it would let the
    person verifying believe it was applied."""
    if calibration_file is not None and recipe.calibration is None:
        raise CheckpointError(f"--calibration applies only to folders made from a calibration text (approximate "
                              f"folds, PCA rotations), not to this one ({describe(recipe)}): leave it out")
    if min_cosine is not None and not is_approximate(recipe):
        raise CheckpointError(f"--min-cosine applies only to approximate results (--approximate folds, sliced "
                              f"rotations), which are judged by a cosine, not to this one ({describe(recipe)}), judged "
                              "exactly: leave it out")


def _calibration_problem(recipe: Recipe, calibration_file: str | os.PathLike | None) -> str | None:
    """Why the calibration file given cannot re-make this folder (None when it can, or none is needed)."""
    record = recipe.calibration
    if record is None:
        return None
    if calibration_file is None:
        return (f"this folder was made from a calibration text ({_recorded(record)}): pass it with --calibration "
                "FILE, so that the folder can be re-made and its promise measured")
    if not Path(calibration_file).is_file():
        return f"calibration file not found: {calibration_file}"
    if file_sha256(calibration_file) != record.sha256:
        return (f"the calibration file {calibration_file} is not the one this folder was made from "
                f"({_recorded(record)}): its SHA-256 differs")
    return None


def _recorded(record: CalibrationRecord) -> str:
    return f"{record.num_sentences} sentences read from {record.path}, SHA-256 {record.sha256[:12]}..."


def _weight_source_problems(folder: Path) -> list[str]:
    """A folder must load its weights from exactly one source (module docstring, point 2)."""
    try:
        source = weight_source(folder)
    except CheckpointError as err:
        return [str(err)]
    others = other_weight_files(source)
    if not others:
        return []
    return [f"two weight sources: transformers loads {source.entry} ({source.chosen_by}), but the folder also holds "
            f"{', '.join(others)}, which another reader (or transformers with other options) could load instead"]


# ------------------------------------------------------------------------------------------ the files

def compare_folders(expected_dir: Path, folder: Path) -> dict[str, Any]:
    """Compare ``folder`` with the re-made ``expected_dir``: the same files (links are never files
    normfold writes), the tensors of the files that load (:func:`normfold.hf.saved_weights.compare_weights`),
    JSON files as data (but the ``transformers_version`` each records), the rest byte for byte; the
    report is left to :func:`compare_reports`, its renderings to the seal. Returns ``problems``,
    ``num_files``, ``weights`` (the tensor comparison, None when the weight files could not be read)."""
    expected_files, actual_files = _listing(expected_dir), _listing(folder)
    problems = [f"{name} is a symbolic link (normfold writes none)" for name, is_link in actual_files.items() if is_link]
    problems += [f"the folder holds {name}, which the fold does not write" for name in sorted(actual_files.keys() - expected_files.keys())]
    problems += [f"the folder lacks {name}, which the fold writes" for name in sorted(expected_files.keys() - actual_files.keys())]
    weights = None
    try:
        expected_source, source = weight_source(expected_dir), weight_source(folder)
        expected_tensors, tensors = stored_tensors(expected_source), stored_tensors(source)
    except CheckpointError as err:
        problems.append(f"weights: {err}")
        expected_source = source = None
    if source is not None:
        if source.entry != expected_source.entry:
            problems.append(f"the weights load from {source.entry}; the fold writes {expected_source.entry}")
        weights = compare_weights(_Lazy(expected_tensors), tensors, lambda name: read_tensor(tensors[name], name), {})
        if not weights["ok"]:
            problems.append(f"stored weights: {weights['why']}")
    compared_as_tensors = set() if expected_source is None else set(expected_source.files)
    for name in sorted(expected_files.keys() & actual_files.keys()):
        if name in compared_as_tensors or name in _SEALED or actual_files[name]:
            continue
        why = _file_difference(expected_dir / name, folder / name)
        if why:
            problems.append(f"{name}: {why}")
    return {"problems": problems, "num_files": len(actual_files), "weights": weights}


_SEALED = {REPORT_JSON, "normfold_report.md", "normfold_zero_mean_graph.png"}  # the report and its renderings


def _listing(folder: Path) -> dict[str, bool]:
    """Every file under ``folder`` (relative POSIX path -> whether it is a symbolic link), without following links."""
    found = {}
    for root, dirs, files in os.walk(folder, followlinks=False):
        rel = Path(root).relative_to(folder)
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            found[(rel / name).as_posix()] = os.path.islink(os.path.join(root, name))
    return found


def _file_difference(expected: Path, actual: Path) -> str | None:
    """Why two files differ (JSON compared as data, but the ``transformers_version`` it records), or None."""
    a, b = expected.read_bytes(), actual.read_bytes()
    if a == b:
        return None
    if expected.suffix != ".json":
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"differs from the file the fold writes (from byte {at}; {len(b)} bytes, the fold's {len(a)})"
    try:
        want, got = json.loads(a), json.loads(b)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"is not the JSON the fold writes: {first_line(err)}"
    if isinstance(want, dict) and isinstance(got, dict):
        want, got = ({k: v for k, v in d.items() if k != "transformers_version"} for d in (want, got))
    if want == got:
        return None
    return f"differs from the JSON the fold writes at {_first_json_difference(want, got) or 'the top'}"


class _Lazy(Mapping):
    """Tensors read on access from the files that hold them (name -> file)."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files

    def __getitem__(self, name: str):
        return read_tensor(self.files[name], name)

    def __iter__(self):
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


# ----------------------------------------------------------------------------------------- the report

def compare_reports(expected: dict[str, Any], report: dict[str, Any]) -> list[str]:
    """Where the folder's report claims something the re-made report does not: every field but the
    measured ones (``_MEASURED``, sealed instead), figures equal to 1e-6 relative; and the files the
    seal covers must be the re-made report's (a rendering dropped from the seal would go unchecked)."""
    expected = json.loads(json.dumps(expected, default=str))  # as the folder's was written and read back
    problems = []
    sealed, remade = sorted(report.get("files") or {}), sorted(expected.get("files") or {})
    if sealed != remade:  # which files the seal covers is normfold's to say, not the folder's
        problems.append(f"{REPORT_JSON} seals {', '.join(sealed) or 'no file'}; the re-made folder seals "
                        f"{', '.join(remade)}")
    where = _first_json_difference(expected, report, skip=_MEASURED)
    if where is not None:
        problems.append(f"{REPORT_JSON} differs from the report of the re-made folder at {where}")
    return problems


def _first_json_difference(want: Any, got: Any, path: tuple = (), skip: set[tuple] = frozenset()) -> str | None:
    """The first path (``a.b[3]``) where two JSON values differ, or None; ``skip``: paths not compared."""
    if path in skip:
        return None
    here = ".".join(str(p) for p in path) or "the top"
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(want.keys() | got.keys(), key=str):
            if (*path, key) in skip:
                continue
            if key not in want or key not in got:
                where = ".".join(str(p) for p in (*path, key))
                return f"{where} ({'not in the re-made report' if key not in want else 'missing'})"
            found = _first_json_difference(want[key], got[key], (*path, key), skip)
            if found:
                return found
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{here} ({len(got)} entries, the re-made report has {len(want)})"
        for i, (a, b) in enumerate(zip(want, got)):
            found = _first_json_difference(a, b, (*path, i), skip)
            if found:
                return found
        return None
    if isinstance(want, float) and isinstance(got, float):
        same = math.isclose(want, got, rel_tol=_FLOAT_RTOL, abs_tol=_FLOAT_ATOL) or (math.isnan(want) and math.isnan(got))
        return None if same else f"{here} ({got!r}, re-made {want!r})"
    if type(want) is not type(got) or want != got:
        return f"{here} ({got!r:.60}, re-made {want!r:.60})"
    return None


# ----------------------------------------------------------------------------------------- the outputs

def _check_outputs(orig_dir: Path, folded_dir: Path, expected: FolderReport, recipe: Recipe, *,
                   measure: MeasurePromise | None, stream_map_for: StreamMapFor | None,
                   calibration_file, min_cosine: float | None, trust_remote_code: bool) -> dict[str, Any]:
    """The folder as users load it, against the original (module docstring, point 4)."""
    if recipe.streaming:
        stream_map = None if recipe.rotation is None or stream_map_for is None else stream_map_for(recipe)
        if recipe.rotation is not None and stream_map is None:
            return {"ok": False, "why": "a streamed rotation needs its stream map (normfold verify composes it)"}
        # the tolerance from the re-made folder's dtype: a tensor stored in another dtype must not loosen it
        return verify_by_blocks(orig_dir, folded_dir, expected, dtype=expected.saved_dtype,
                                trust_remote_code=trust_remote_code, stream_map=stream_map)
    original = load_model(orig_dir, trust_remote_code=trust_remote_code)
    loaded = from_pretrained(folded_dir, trust_remote_code=trust_remote_code)
    if is_approximate(recipe):
        if measure is None:
            return {"ok": False, "why": "an approximate folder is judged by a cosine bar that normfold verify measures"}
        return measure(original, loaded, orig_dir, Path(calibration_file),
                       DEFAULT_MIN_COSINE if min_cosine is None else min_cosine, recipe)
    stored = DTYPES[expected.saved_dtype]
    rms_paths = [s.path for s in expected.layout.swapped if not s.approximate]
    inputs = folder_example_inputs(original, orig_dir, trust_remote_code=trust_remote_code).inputs  # as fold made them
    result = verify(original, loaded, inputs, stored_dtype=stored, rms_norm_paths=rms_paths).to_dict()
    if result["ok"] and expected.layout.stock_compatible:  # what stock transformers loads must be the same model
        stock = verify(original, load_model(folded_dir, trust_remote_code=trust_remote_code), inputs,
                       stored_dtype=stored).to_dict()
        result["stock_load"] = {k: stock[k] for k in ("ok", "max_rel_error", "tolerance", "why")}
        if not stock["ok"]:
            result.update(ok=False, why=f"loaded by stock transformers: {stock['why'] or 'outside the tolerance'}")
    return result


# ------------------------------------------------------------------------------------------ re-making

def partial_remake_exact(trust_remote_code: bool) -> Remake:
    """:func:`remake_exact` with ``trust_remote_code``."""
    def remake(orig_dir, out, recipe, calibration_file, step, folder):
        return remake_exact(orig_dir, out, recipe, trust_remote_code=trust_remote_code, step=step)
    return remake


def remake_exact(orig_dir: Path, out: Path, recipe: Recipe, *, trust_remote_code: bool = False,
                 step: Step = lambda _: None) -> dict[str, Any]:
    """Re-make an exact fold from its recipe into the new folder ``out``, by the code that made it:
    ``normfold fold`` (in memory or streamed) and ``normfold.save_pretrained`` folds. Other recipes
    (approximate folds, rotations) need steps hf does not compose: ValueError naming the command."""
    if recipe.rotation is not None or recipe.approximate_min_cosine is not None:
        raise ValueError(f"a {describe(recipe)} is re-made by `normfold verify`, which composes its steps")
    if recipe.command == "save_pretrained":
        return remake_saved(orig_dir, out, recipe, trust_remote_code=trust_remote_code, step=step)
    if recipe.streaming:
        return fold_checkpoint(orig_dir, out, fold_affine=recipe.fold_affine, dtype=recipe.dtype,
                               trust_remote_code=trust_remote_code, step=step)
    return fold_folder(orig_dir, out, fold_affine=recipe.fold_affine, dtype=recipe.dtype, keep=recipe.keep,
                       calls=recipe.calls, trust_remote_code=trust_remote_code, step=step)
