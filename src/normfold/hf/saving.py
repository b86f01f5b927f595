"""Saving a folded model as a Hugging Face folder and reloading it exactly.

A folded folder is a plain ``save_pretrained`` folder: every norm the fold turned into an RMSNorm
keeps its LayerNorm keys (explicit ones / zeros where the affine part was folded away), and an LN
on a zero-mean input computes exactly the RMSNorm. ``normfold_report.json`` records what a stock
model of the class lacks (:func:`folded_layout`: the swapped norms, norms precomputed away,
parameters the fold created), so :func:`from_pretrained` rebuilds the folded model exactly, with
the fast :class:`normfold.nn.RMSNorm` modules; stock transformers loads the same model only when
nothing but swapped norms is recorded (``"stock_compatible"``), which ``normfold fold`` and
``normfold.fold``'s default plan for a ``PreTrainedModel`` ensure. The model ``normfold.fold``
returns saves itself this way (:class:`FoldedModelSaver`: ``folded.save_pretrained(d)``).

One idea, about 570 lines: the folded folder's layout, written and read back in one file, so what a
save records (``folded_layout``) and what a reload requires of it (``read_layout``) are checked side by side.
"""
from __future__ import annotations

import copy
import os
from dataclasses import replace
import reprlib
import sys
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..engine.plan import FoldConfig
from ..engine.report import FoldReport
from ..engine.transform import norm_like, untie_config
from ..nn import PermutedRMSNorm, RMSNorm
from ..nn.resize import replace_parameter
from .._text import dtype_name, first_line
from .card import write_model_card
from .load import CheckpointError, check_model_dir, load_model_and_info, resolve_model
from .normfold_only import mark_normfold_only
from .output_dir import REPORT_JSON, replaceable, atomic_output_dir
from .folder_report import FolderReport, Layout, NamedShape, SkippedFile, SwappedNorm
from .recipe import Recipe
from .report import folder_report, read_report_json, seal_problems, write_sealed_report
from .side_files import copy_side_files
from .weight_files import read_tensor, saved_names, stored_tensors, weight_source

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def swapped_norms(model: nn.Module) -> tuple[SwappedNorm, ...]:
    """Where ``model`` holds normfold RMSNorms and which affine parameters they kept (with the
    ``offset`` of (offset + γ), e.g. Nemotron's LayerNorm1P, and the ``permute`` around a
    channels-first one, e.g. ConvNeXt's)."""
    return tuple(SwappedNorm(name, tuple(m.normalized_shape), m.eps, m.weight is not None, m.bias is not None,
                             m.offset, tuple(m.order) if isinstance(m, PermutedRMSNorm) else ())
                 for name, m in model.named_modules() if isinstance(m, RMSNorm))


def stock_state_dict(folded: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The folded weights under the keys the stock architecture expects.

    A weightless RMSNorm where the stock model has a LayerNorm gets weight = 1 and bias = 0:
    LN(x)·1 + 0 on a zero-mean x is exactly the weightless RMSNorm. So does a LayerNorm the fold kept
    but whose γ/β it moved into the next layer (:func:`_affine_moved_away`): LN(x)·1 + 0 is that LN.
    """
    with torch.device("meta"):
        stock = type(folded)._from_config(folded.config)
    stock_keys = {k: v.shape for k, v in stock.state_dict().items()}
    state = _separate_what_stock_keeps_apart(folded.state_dict(), shared_names(stock))
    norms = {s.path for s in swapped_norms(folded)}
    for key, shape in stock_keys.items():
        if key in state:
            continue
        path, _, leaf = key.rpartition(".")
        if (path in norms and leaf in ("weight", "bias")) or _affine_moved_away(folded, key):
            fill = torch.ones if leaf == "weight" else torch.zeros
            state[key] = fill(shape, dtype=dtype or next(folded.parameters()).dtype)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    # save_pretrained shares storage between tied tensors; untied ones must not alias
    return {k: v.contiguous() for k, v in state.items()}


def shared_names(model: nn.Module) -> set[frozenset[str]]:
    """The groups of parameter names ``model`` ties to one tensor (input and output embeddings, BERT's
    ``cls.predictions.decoder.bias`` and ``cls.predictions.bias``)."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return {frozenset(names) for names in groups.values() if len(names) > 1}


def _separate_what_stock_keeps_apart(state: dict[str, torch.Tensor],
                                     stock_shared: set[frozenset[str]]) -> dict[str, torch.Tensor]:
    """``state`` with a copy of its own for every tensor it shares under several names that the stock
    model, built from the folded config, keeps apart. ``save_pretrained`` stores a shared tensor once,
    and the stock class re-ties only what its config ties: once a fold unties the word embeddings
    (``tie_word_embeddings=False``), transformers no longer ties BERT's decoder bias to
    ``cls.predictions.bias`` either, and a bias stored once would load at random."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)),
                          []).append(name)
    state = dict(state)
    for names in groups.values():
        if len(names) > 1 and frozenset(names) not in stock_shared:
            for name in names[1:]:
                state[name] = state[name].clone()
    return state


def _affine_moved_away(model: nn.Module, name: str) -> bool:
    """True when parameter ``name`` is the γ or β of a LayerNorm of ``model`` that no longer has it:
    the fold kept that norm a LayerNorm and moved its affine into the next layer, so a stock model
    holding γ = 1, β = 0 there computes exactly the same."""
    path, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return False
    return isinstance(module, nn.LayerNorm) and leaf in ("weight", "bias") and getattr(module, leaf, None) is None


def stock_parameter_shapes(config, cls: type) -> dict[str, torch.Size]:
    """State-dict keys and shapes of the stock model for ``config`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        stock = cls._from_config(config)
    return {k: v.shape for k, v in stock.state_dict().items()}


def save_folded(folded: nn.Module, out_dir: Path, *, dtype: torch.dtype | None = None,
                normfold_only: bool = False) -> None:
    """``save_pretrained`` (safetensors) of the folded model in stock-loadable form, into ``out_dir``.

    Parameters the stock class lacks (``folded_layout(folded).extra_parameters``) are stored too.
    ``normfold_only``: stock transformers would load another model (the layout is not stock-compatible),
    so the folder is written for ``normfold.from_pretrained`` only (:mod:`normfold.hf.normfold_only`).
    """
    untie_config(folded)
    state = stock_state_dict(folded, dtype)
    config_dtype = getattr(folded.config, "dtype", None)
    if dtype is not None:
        folded.config.dtype = dtype
    try:  # the class's method: a model normfold.fold returned has its own (FoldedModelSaver), which calls this
        type(folded).save_pretrained(folded, out_dir, state_dict=state, safe_serialization=True)
    finally:  # the caller's model keeps its own config
        folded.config.dtype = config_dtype
    if normfold_only:
        mark_normfold_only(out_dir)


def folded_layout(folded: nn.Module) -> Layout:
    """How ``folded`` differs from a stock model of its class built from its config, recorded in
    ``normfold_report.json`` so that :func:`from_pretrained` can rebuild it exactly:

    - ``swapped``: the normfold RMSNorms (:func:`swapped_norms`);
    - ``identity``: norms the fold precomputed into a table, now ``nn.Identity``;
    - ``extra_parameters``: parameters the fold created where the stock class has none (``lm_head.bias``
      when ``normfold.fold`` moved GPT-2's ln_f γ/β into the head);
    - ``resized``: parameters of another shape than the stock class's (a sliced residual stream,
      ``normfold rotate --slice``);
    - ``stock_compatible``: no identity and no extra parameters, so stock ``from_pretrained`` builds the
      same model (each swapped RMSNorm comes back as the LayerNorm it equals on its zero-mean input).

    Raises ValueError for any other difference (a module of another class, a parameter the stock model
    has and ``folded`` lacks): :func:`from_pretrained` could not rebuild it.
    """
    with torch.device("meta"):
        stock = type(folded)._from_config(folded.config)
    stock_modules = dict(stock.named_modules())
    swapped = swapped_norms(folded)
    swapped_paths = {s.path for s in swapped}
    identity, problems = [], []
    for path, module in folded.named_modules():
        ref = stock_modules.get(path)
        if ref is not None and path in swapped_paths:
            continue
        if ref is not None and isinstance(module, nn.Identity) and not isinstance(ref, nn.Identity):
            identity.append(path)
        elif ref is None or _module_class(ref) is not _module_class(module):
            problems.append(f"{path or 'the model'} is a {type(module).__name__} where {type(stock).__name__} has "
                            f"{'nothing' if ref is None else 'a ' + type(ref).__name__}")
    stock_params = {name for name, _ in stock.named_parameters(remove_duplicate=False)}
    params = dict(folded.named_parameters(remove_duplicate=False))
    extra = tuple(NamedShape(name, tuple(p.shape)) for name, p in params.items() if name not in stock_params)
    rebuilt_away = tuple(f"{path}." for path in (*identity, *swapped_paths))  # from_pretrained drops these
    problems += [f"{name} is missing" for name in sorted(stock_params - set(params))
                 if not name.startswith(rebuilt_away) and not _affine_moved_away(folded, name)]
    stock_state = set(stock.state_dict())
    problems += [f"buffer {name} is new" for name in folded.state_dict() if name not in stock_state and name not in params]
    if problems:
        raise ValueError(f"cannot save {type(folded).__name__} so that normfold.from_pretrained rebuilds it: "
                         f"{'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}")
    stock_shapes = dict(stock.named_parameters(remove_duplicate=False))
    resized = tuple(NamedShape(name, tuple(p.shape)) for name, p in params.items()
                    if name in stock_shapes and p.shape != stock_shapes[name].shape)
    return Layout(swapped, tuple(identity), extra, resized, stock_compatible=not identity and not extra and not resized)


def _module_class(module: nn.Module) -> type:
    """The class of ``module``; for a parametrized one (weight norm: Wav2Vec2's positional conv), the class it
    was made from, since torch makes a new class for each parametrized module (its parametrizations show in
    the parameter names, which are compared on their own)."""
    return type(module).__bases__[0] if parametrize.is_parametrized(module) else type(module)


def save_pretrained(folded: nn.Module, out_dir: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    source_dir: str | os.PathLike | None = None, report=None,
                    overwrite: bool = False) -> dict[str, Any]:
    """Save a folded Hugging Face model so that :func:`normfold.from_pretrained` rebuilds exactly it.

    ``out_dir`` becomes a ``save_pretrained`` folder (safetensors) plus ``normfold_report.json``,
    which records what a stock model of the class lacks (:func:`folded_layout`: the RMSNorms, norms
    precomputed away, parameters the fold created such as ``lm_head.bias``; those are in the weights).
    Stock ``from_pretrained`` loads the same model when the fold fits the stock class (``normfold
    fold``, :func:`normfold.hf.folder.fold_for_stock` and ``normfold.fold``'s default plan for a
    ``PreTrainedModel`` make such folds); otherwise a ``UserWarning`` says what stock transformers
    would drop or rebuild. ``folded.save_pretrained(out_dir)`` on the model ``normfold.fold``
    returned calls this with its report (:class:`FoldedModelSaver`).

    Args:
        dtype: storage dtype (``torch.float32`` / ``float16`` / ``bfloat16`` or its name); default: as is.
        source_dir: the folder the original model came from: its other files (tokenizer, generation
            config, sentence-transformers modules, README, ...) are carried over by
            :func:`copy_side_files`; links and other skipped files are warned about.
        report: the ``FoldReport`` of ``normfold.fold``, written into ``normfold_report.json``
            (approximately replaced norms are marked, and counted as not stock-compatible).
        overwrite: replace an existing ``out_dir`` (only an empty folder or a previous normfold output).

    The folder is written beside ``out_dir`` and renamed into place when complete: on any error
    nothing appears. Returns the report written.
    """
    if not isinstance(folded, nn.Module) or not callable(getattr(folded, "save_pretrained", None)) \
            or not hasattr(folded, "config"):
        raise TypeError(f"folded must be a Hugging Face model (a transformers PreTrainedModel), got "
                        f"{type(folded).__name__}; save other models with torch.save(folded.state_dict(), ...)")
    save_dtype = _storage_dtype(dtype)
    if report is not None and not isinstance(report, FoldReport):
        raise TypeError(f"report must be the FoldReport of normfold.fold, got {type(report).__name__}")
    source = None if source_dir is None else check_model_dir(source_dir)
    record = folder_report(report, folded_layout(folded),
                           saved_dtype=dtype_name(save_dtype or next(folded.parameters()).dtype),
                           approximate=None if report is None else report.approximate)
    record = replace(record, recipe=_saved_recipe(report, record, side_files=source is not None))
    if not record.layout.stock_compatible:
        warnings.warn(_stock_incompatibility(type(folded).__name__, record), UserWarning, stacklevel=2)
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=() if source is None else (source,)) as tmp:
        save_folded(folded, tmp, dtype=save_dtype, normfold_only=not record.layout.stock_compatible)
        if source is not None:
            record = replace(record, skipped_files=SkippedFile.listed(copy_side_files(source, tmp)))
            if record.skipped_files:
                listed = ", ".join(f"{s.path} ({s.reason})" for s in record.skipped_files)
                warnings.warn(f"not copied from {source}: {listed}", UserWarning, stacklevel=2)
        write_model_card(record, tmp)
        written = write_sealed_report(record.to_json(), tmp)
    return written


def _saved_recipe(report: FoldReport | None, record: FolderReport, *, side_files: bool) -> Recipe | None:
    """The recipe ``normfold verify`` re-makes a ``save_pretrained`` folder from (None when it cannot:
    no FoldReport, or an approximate fold, whose calibration batches are the caller's): γ/β folding
    and the plan for stock loading as the fold was planned (``report.constraints``; a report without
    them: as it shows, γ/β folding where some norm moved its γ/β, the stock plan where the result
    loads as stock). Other options or example calls re-make as another plan, and verify says so."""
    if report is None or report.approximate is not None:
        return None
    planned = report.constraints
    fold_affine = any(n.affine_folded for n in report.norms) if planned is None else planned.fold_affine
    stock_plan = record.layout.stock_compatible if planned is None else planned.loadable_keys is not None
    return Recipe(command="save_pretrained", streaming=False, fold_affine=fold_affine, dtype=record.saved_dtype,
                  stock_plan=stock_plan, side_files=side_files, keep=() if planned is None else planned.keep)


def _storage_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as one of :data:`DTYPES`, or ValueError naming the accepted ones."""
    if dtype is None or dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype_name(dtype) in DTYPES:
        return DTYPES[dtype_name(dtype)]
    raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or None: as stored), got {dtype!r}")


def _stock_incompatibility(cls_name: str, record: FolderReport) -> str:
    """The warning for a folded model that stock ``from_pretrained`` would load as another model."""
    what = []
    layout = record.layout
    if layout.extra_parameters:
        what.append(f"drop {', '.join(e.name for e in layout.extra_parameters)} ({cls_name} has no such parameter)")
    if layout.identity:
        what.append(f"rebuild {', '.join(layout.identity)} as norms (the fold precomputed them into a table)")
    if record.num_approximate:
        what.append(f"rebuild the approximate RMSNorms {', '.join(record.approximate.norms)} as LayerNorms")
    return (f"stock transformers would {' and '.join(what)}, so the folder is written for normfold.from_pretrained "
            f"only ({cls_name}.from_pretrained refuses it); for a folder stock transformers loads, fold with the "
            "stock-compatible plan (normfold.fold(model, example_inputs)'s default for a transformers model, and "
            "what `normfold fold` does)")


# --------------------------------------------------------------------- the folded model's save_pretrained

_ABSENT = object()  # a keyword the caller did not pass

# transformers' save_pretrained keywords that normfold.save_pretrained has no equivalent for:
# keyword -> (the one value that changes nothing, or _ABSENT: none does; what to do instead)
_TRANSFORMERS_ONLY = {
    "state_dict": (None, "load it into the model first (model.load_state_dict(state_dict)), then save"),
    "push_to_hub": (False, "save, then upload the folder (huggingface_hub.upload_folder)"),
    "token": (None, "it is for push_to_hub: save, then upload the folder (huggingface_hub.upload_folder)"),
    "variant": (None, "normfold.from_pretrained reads model.safetensors; pass dtype= to store another dtype"),
    "max_shard_size": (_ABSENT, "the weights are written with transformers' default shard size"),
    "safe_serialization": (True, "the weights are written as safetensors only"),
    "save_function": (_ABSENT, "the weights are written as safetensors only"),
}
_SUPPORTED = ("it takes save_directory, source_dir=, dtype=, overwrite= and is_main_process= "
              "(normfold.save_pretrained's options)")


class FoldedModelSaver:
    """``model.save_pretrained`` of a Hugging Face model ``normfold.fold`` / ``normfold.convert``
    returned: :func:`save_pretrained` with that fold's report, so the habit
    ``folded.save_pretrained(d)`` writes a folder :func:`from_pretrained` rebuilds exactly (and
    ``normfold verify ORIG d`` re-makes), which stock ``from_pretrained`` loads as the same model when
    the fold fits the stock class (``stock_compatible``, the default plan), and otherwise warns.

    ``save_pretrained(save_directory, *, source_dir=None, dtype=None, overwrite=True,
    is_main_process=True)``: like transformers' it writes into an existing folder, but as
    :func:`save_pretrained` with ``overwrite``: the folder is replaced whole, and only when it is empty
    or a normfold output (files saved into it since, such as a tokenizer, go with it: save those
    after the model, or pass ``source_dir``, the folder the model came from, to copy them).
    ``is_main_process=False`` writes nothing, as transformers does. transformers' other keywords
    are refused (ValueError saying what to do instead) unless at the value that changes nothing;
    unknown keywords are a TypeError. Returns None, as transformers' does (a notebook shows nothing);
    the report written is the folder's ``normfold_report.json``. An attribute of the instance, not a
    method; it holds its model weakly, so that ``del model`` frees the model at once, as without
    normfold (no reference cycle waiting for the garbage collector), and ``copy.deepcopy`` and
    pickling of the model give the copy a saver of its own.
    """

    def __init__(self, model: nn.Module, report: FoldReport) -> None:
        self._model = weakref.ref(model)
        self.report = report

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise ReferenceError("the model this save_pretrained belongs to no longer exists")
        return model

    def __deepcopy__(self, memo: dict) -> "FoldedModelSaver":
        # inside a deep copy of the model, memo already maps the model to its copy
        return FoldedModelSaver(copy.deepcopy(self.model, memo), copy.deepcopy(self.report, memo))

    def __reduce__(self):
        return FoldedModelSaver, (self.model, self.report)  # pickle stores the model once, with the saver in it

    def __repr__(self) -> str:
        return f"<save_pretrained of a {type(self.model).__name__} folded by normfold: normfold.save_pretrained>"

    def __call__(self, save_directory: str | os.PathLike, *, source_dir: str | os.PathLike | None = None,
                 dtype: torch.dtype | str | None = None, overwrite: bool = True, is_main_process: bool = True,
                 **transformers_options: Any) -> None:
        for name, value in transformers_options.items():
            if name not in _TRANSFORMERS_ONLY:
                raise TypeError(f"save_pretrained() of a model folded by normfold got an unexpected keyword "
                                f"argument {name!r}: {_SUPPORTED}")
            harmless, instead = _TRANSFORMERS_ONLY[name]
            if value is not harmless:
                raise ValueError(f"save_pretrained() of a model folded by normfold cannot honour "
                                 f"{name}={reprlib.repr(value)}: {instead}; {_SUPPORTED}")
        for name, value in (("overwrite", overwrite), ("is_main_process", is_main_process)):
            if not isinstance(value, bool):
                raise TypeError(f"save_pretrained()'s {name} must be a bool, got {type(value).__name__} {value!r}")
        if not is_main_process:
            return
        out = Path(save_directory)
        if overwrite and out.is_dir() and not out.is_symlink() and not replaceable(out):
            held = sorted(p.name for p in out.iterdir())
            raise CheckpointError(f"save_pretrained() of a model folded by normfold replaces a folder only when it "
                                  f"is empty or a normfold output, and {out} holds {', '.join(held[:4])}"
                                  f"{' ...' if len(held) > 4 else ''}: save into a new folder, and a tokenizer "
                                  "after the model (or pass source_dir=, the model's original folder, to copy its "
                                  "files)")
        save_pretrained(self.model, save_directory, dtype=dtype, source_dir=source_dir, report=self.report,
                        overwrite=overwrite)


# ---------------------------------------------------------------------------------------- reloading

def from_pretrained(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                    trust_remote_code: bool = False, revision: str | None = None) -> nn.Module:
    """Load a folder written by ``normfold fold`` or :func:`save_pretrained`, rebuilt as it was folded.

    ``normfold_report.json`` says what stock transformers would build differently
    (:func:`folded_layout`): :class:`normfold.nn.RMSNorm` goes back where the fold swapped one
    (approximate replacements, ``--approximate``, included: stock transformers would load those as
    LayerNorms, which is a different model), ``nn.Identity`` where a norm was precomputed away, and
    the parameters the fold created (``lm_head.bias``) are read from the folder's weights.

    The report is believed only about the weights it was written with: raises CheckpointError when its
    seal is broken (:func:`normfold.hf.report.seal_problems`: weights saved over the folder, e.g. a stock
    fine-tune, or an edited report), when an entry is malformed, when the weights lack a tensor the
    rebuilt model needs, or hold one of another shape than it (stock transformers would initialise
    such tensors at random and only log it). ``path`` may be a Hugging Face model id, at ``revision``
    (:func:`normfold.hf.load.resolve_model`: the hub cache and ``HF_HUB_OFFLINE`` honoured).
    """
    path = check_model_dir(resolve_model(path, revision))
    data = read_report_json(path)
    broken = seal_problems(data, path)
    if broken:
        raise CheckpointError(f"{path} is not as normfold wrote it: {broken[0]}. Its report describes other weights, "
                              "so the folded layout cannot be rebuilt around them: load it with transformers' "
                              "from_pretrained if it was saved over by a stock model, or fold it again")
    layout = FolderReport.from_json(data, path / REPORT_JSON).layout
    stored = stored_tensors(weight_source(path))
    # resized (sliced) tensors do not fit the class built from the config: loaded below, once it is built;
    # transformers' own load report is not shown: what it would say is judged below (_check_load)
    model, info = load_model_and_info(path, dtype=dtype, trust_remote_code=trust_remote_code,
                                      ignore_mismatched_sizes=bool(layout.resized), quiet=True, normfold_only=True)
    try:
        for module_path in layout.identity:
            parent_path, _, attr = module_path.rpartition(".")
            setattr(model.get_submodule(parent_path), attr, nn.Identity())
        for entry in layout.swapped:
            swap_in_rmsnorm(model, entry)
    except AttributeError as err:
        raise CheckpointError(f"{path / REPORT_JSON} names a module {type(model).__name__} does not have: "
                              f"{first_line(err)}") from err
    stored = {name: (stored[key], key) for name, key in _stored_names(model, layout).items() if key in stored}
    missing = [e.name for e in (*layout.extra_parameters, *layout.resized) if e.name not in stored]
    if missing:
        raise CheckpointError(f"{path / REPORT_JSON} lists parameters the weights in {path} do not hold: "
                              f"{', '.join(missing)}")
    for entry in layout.extra_parameters:
        _restore_parameter(model, entry, stored)
    for entry in layout.resized:
        _restore_resized(model, entry, stored)
    _check_load(info, layout, path)
    return model


def _restore_parameter(model: nn.Module, entry: NamedShape, stored: Mapping[str, tuple[Path, str]]) -> None:
    """Give ``model`` the parameter ``entry.name`` that its class lacks, with the stored values."""
    owner_path, _, attr = entry.name.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError as err:
        raise CheckpointError(f"{type(model).__name__} has no module {owner_path!r} to hold {entry.name}") from err
    like = next(model.parameters())
    value = _recorded_tensor(entry, stored)
    owner.register_parameter(attr, nn.Parameter(value.to(device=like.device, dtype=like.dtype)))


def _restore_resized(model: nn.Module, entry: NamedShape, stored: Mapping[str, tuple[Path, str]]) -> None:
    """Give ``model``'s parameter ``entry.name`` the stored values of the recorded shape (a sliced
    stream), its layer's shape attributes following (:func:`normfold.nn.resize.replace_parameter`)."""
    try:
        old = model.get_parameter(entry.name)
    except AttributeError as err:
        raise CheckpointError(f"{type(model).__name__} has no parameter {entry.name} to resize") from err
    replace_parameter(model, old, _recorded_tensor(entry, stored).to(device=old.device, dtype=old.dtype))


def _recorded_tensor(entry: NamedShape, stored: Mapping[str, tuple[Path, str]]) -> torch.Tensor:
    """The stored tensor of parameter ``entry.name`` (``stored``: name -> (file, key it is stored
    under)), CheckpointError unless it has the shape the report records."""
    value = read_tensor(*stored[entry.name])
    if tuple(value.shape) != entry.shape:
        raise CheckpointError(f"{entry.name}: the report says shape {list(entry.shape)}, the weights hold "
                              f"{list(value.shape)}")
    return value


def _stored_names(model: nn.Module, layout: Layout) -> dict[str, str]:
    """The layout's created and resized parameters -> the names their tensors are stored under
    (:func:`normfold.hf.weight_files.saved_names`), which the tensors normfold restores itself must follow."""
    return saved_names(model, [e.name for e in (*layout.extra_parameters, *layout.resized)])


def _check_load(info: Mapping[str, Any], layout: Layout, path: Path) -> None:
    """CheckpointError when transformers left a tensor of the model initialised at random: one the
    weights lack (a norm precomputed away needs none, a created or resized parameter is restored from
    the weights by name), or one stored in another shape than the model's (loading allows that for the
    resized tensors of a sliced folder only). Names are the model's, after transformers' renaming."""
    restored = {e.name for e in (*layout.extra_parameters, *layout.resized)}
    rebuilt_away = tuple(f"{p}." for p in layout.identity)
    missing = sorted(k for k in info["missing_keys"] if k not in restored and not k.startswith(rebuilt_away))
    if missing:
        raise CheckpointError(f"the weights in {path} lack {len(missing)} tensor(s) the model needs: "
                              f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} (stock transformers "
                              "would initialise them at random)")
    resized = {e.name for e in layout.resized}
    wrong = [f"{name} {list(model_shape)} (stored {list(stored_shape)})"
             for name, stored_shape, model_shape in sorted(info["mismatched_keys"]) if name not in resized]
    if wrong:
        raise CheckpointError(f"the weights in {path} hold tensors of other shapes than the model built from its "
                              f"report: {', '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}")


def swap_in_rmsnorm(model: nn.Module, entry: SwappedNorm) -> None:
    """Replace the LayerNorm at ``entry.path`` by an RMSNorm holding the γ/β the entry keeps
    (γ = 1 where the fold moved it into the next layer)."""
    old = model.get_submodule(entry.path)
    model.set_submodule(entry.path, norm_like(old, RMSNorm, list(entry.normalized_shape), entry.eps,
                                              weight=getattr(old, "weight", None) if entry.weight else None,
                                              bias=getattr(old, "bias", None) if entry.bias else None,
                                              offset=float(entry.offset), permute=entry.permute))


# ------------------------------------------------------------------------------ stock-compatible plans

def stock_constraints(model, stored_dtype: torch.dtype, config: FoldConfig = FoldConfig()) -> FoldConfig:
    """``config`` within what a folder that stock transformers loads can hold, saved in ``stored_dtype``:
    no precompute (every norm module stays), no parameter the architecture lacks (e.g. GPT-2's
    ``lm_head.bias``: folding ln_f's β into the head would write it, stock drops it; ln_f keeps γ/β),
    and merged BatchNorms kept as exact identities (the architecture loads their keys)."""
    return config.for_stock_checkpoint(stock_parameter_shapes(model.config, type(model)), stored_dtype)


def is_pretrained_model(model: object) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (importing nothing: one exists only once
    transformers' modeling module is loaded)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)

