"""``export_onnx``: export a model with the runtime's own norm kernels, run it in ONNX Runtime, prove it
against the PyTorch model within the dtype rule, and only then write it.

The rule (``fold.verify.measured_tolerance``): the export's error against the reference in float64 (the
original model, or the model itself) must be at most 2 · e_own + u, where e_own is the error of the
original exported the same way (torch's stock export, run in ONNX Runtime) against the same float64
reference, and u the dtype's unit roundoff. Without an original model, e_own is the model's own error
in PyTorch in its dtype. Two calls are compared: the example, and one at other sizes on every dynamic
axis (twice the batch, one position fewer), so the dynamic axes are proved too. A decoder exported with
its KV cache (``kv_cache=True``, ``decoder.py``) is proved on the prompt with an empty cache and on new
tokens after the prompt's cache.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from .._deps import require
from .._text import first_line
from ..engine.errors import FoldError, FoldVerificationError, model_name
from ..engine.graph import eval_mode, split_example_inputs
from ..engine.plan import FoldConfig
from ..engine.verify import (OWN_ERROR_MULTIPLE, cast_floats, dtype_name, flatten_outputs, fresh_inputs_like,
                           measured_tolerance, output_error, own_error, rounding_error)
from . import graph_passes, runtime
from .decoder import DecoderWithCache, ExportCalls, cache_calls, check_decoder
from .translations import LAYER_NORM_NODE_TYPES, RMS_NODE_TYPES, check_target, onnx_translations

__all__ = ["export_onnx", "fold_config_for_export", "OnnxExportReport", "require_onnx_extra", "BATCH_AXIS", "SEQUENCE_AXIS"]

BATCH_AXIS, SEQUENCE_AXIS = "batch", "sequence"
_TMP_MARK = ".normfold-onnx-tmp-"


@dataclasses.dataclass(frozen=True)
class OnnxExportReport:
    """What :func:`export_onnx` wrote and proved. ``error``: the export's largest output error against the
    float64 reference; ``own_error``: e_own; ``tolerance`` = 2 · e_own + u (``rule`` in words);
    ``norm_calls``: normfold's norm calls in the program torch exported, by form (``rms``,
    ``rms_residual``, ``layer_norm``, ``layer_norm_residual``); ``node_counts`` /
    ``original_node_counts``: the norm nodes of the graph ONNX Runtime runs (after its optimizer) for
    the export and the original's; ``graph_passes``: what :func:`graph_passes.optimize_exported` did to
    the export (norms moved off 2-D views, residual adds fused); ``dynamic_axes``: per graph input,
    dim -> name."""

    path: str
    original_path: str | None
    target: str
    opset: int
    input_names: list[str]
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    error: float
    own_error: float
    tolerance: float
    rule: str
    compared: int
    norm_calls: dict[str, int]
    node_counts: dict[str, int]
    original_node_counts: dict[str, int] | None
    graph_passes: dict[str, int]
    external_data: bool
    versions: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (dynamic axes' dims as strings)."""
        out = dataclasses.asdict(self)
        out["dynamic_axes"] = {name: {str(d): a for d, a in axes.items()} for name, axes in self.dynamic_axes.items()}
        return out


def export_onnx(model: nn.Module, example_inputs, path: str | os.PathLike, *, original: nn.Module | None = None,
                original_path: str | os.PathLike | None = None, target: str = "onnxruntime", opset: int | None = None,
                dynamic: bool = True, overwrite: bool = False, threads: int = 1,
                kv_cache: bool = False) -> OnnxExportReport:
    """Export ``model`` (folded, fused or any model with normfold norms) to ONNX at ``path``, proved.

    ``example_inputs``: a tuple of positional or a dict of keyword arguments. ``target``:
    ``"onnxruntime"`` (ONNX Runtime's ``SimplifiedLayerNormalization`` / ``Skip*`` kernels) or ``"onnx"``
    (standard ``RMSNormalization``, opset >= 23); ``opset``: default 20 / 23. ``dynamic``: batch (dim 0
    of every tensor input) and sequence (dim 1 of 2-D integer inputs: token ids, masks) are dynamic
    axes named ``batch`` / ``sequence``. ``original``: the model ``model`` was made from; the proof's
    reference and e_own are then the original's (its stock export is written to ``original_path`` if
    given). Nothing is written unless the proof passes (FoldVerificationError); existing files are
    replaced only with ``overwrite``. Models over 2 GB get external data (``<name>.data``). The export (not
    the original's stock file) goes through :mod:`normfold.export.graph_passes` first: norms off normfold's
    2-D views, residual adds into ``SkipSimplifiedLayerNormalization`` (``report.graph_passes``). Fold
    the model with :func:`fold_config_for_export` to keep a β out of a new vocabulary-wide bias.

    ``kv_cache=True`` (a transformers causal LM of a type in ``KV_CACHE_MODEL_TYPES``; ``example_inputs``
    its ``input_ids`` and optional ``attention_mask``): the graph takes and returns the KV cache with
    optimum's names (``past_key_values.{i}.key`` / ``present.{i}.key``, ``normfold.export.decoder``), so
    :func:`~normfold.export.generate_greedy_ort` generates with it.
    """
    for name, m in (("model", model), ("original", original)):
        if m is not None and not isinstance(m, nn.Module):
            raise TypeError(f"{name} must be a torch.nn.Module, got {type(m).__name__}")
    opset = check_target(target, opset)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    if original_path is not None and original is None:
        raise ValueError("original_path needs original= (the model whose stock export it is)")
    if not isinstance(kv_cache, bool):
        raise TypeError(f"kv_cache must be a bool, got {type(kv_cache).__name__}")
    if kv_cache:
        if not dynamic:
            raise ValueError("kv_cache=True needs dynamic=True: the cache grows by one position a call")
        for m in (model, original):
            if m is not None:
                check_decoder(m)
    path = _check_destination(path, overwrite)
    if original_path is not None:
        original_path = _check_destination(original_path, overwrite)
        if original_path == path:
            raise ValueError(f"path and original_path are the same file: {path}")
    args, kwargs = split_example_inputs(example_inputs)
    require_onnx_extra()

    if kv_cache:  # the models with their cache as flat tensors
        model, original = (None if m is None else DecoderWithCache(m) for m in (model, original))
    reference = original if original is not None else model
    plan = cache_calls(reference, {**dict(zip(("input_ids", "attention_mask"), args)), **kwargs}) if kv_cache \
        else _plain_calls(model, args, kwargs, dynamic)
    with contextlib.ExitStack() as stack:
        staged = stack.enter_context(_staging(path))
        norm_calls, passes = _export(model, plan, staged, target, opset, fuse_graph=True)
        staged_original = None
        if original is not None:
            staged_original = stack.enter_context(_staging(original_path)) if original_path else \
                staged.with_name(f"original-{staged.name}")
            _export(original, plan, staged_original, target, opset, fuse_graph=False)
        proof = _prove(model, reference, staged, staged_original, plan.calls, threads)
        counts = _norm_counts(staged, threads)
        original_counts = None if staged_original is None else _norm_counts(staged_original, threads)
        sess = runtime.session(staged, threads=threads)
        input_names = [i.name for i in sess.get_inputs()]
        output_names = [o.name for o in sess.get_outputs()]
        external = staged.with_name(staged.name + ".data").exists()
        _publish(staged, path, overwrite)
        if original_path is not None:
            _publish(staged_original, original_path, overwrite)
    return OnnxExportReport(
        path=str(path), original_path=None if original_path is None else str(original_path), target=target,
        opset=opset, input_names=input_names, output_names=output_names,
        dynamic_axes={n: a for n, a in zip(input_names, plan.axes) if a}, **proof, norm_calls=norm_calls, node_counts=counts,
        original_node_counts=original_counts, graph_passes=passes, external_data=external, versions=_versions())


def fold_config_for_export(model: nn.Module) -> FoldConfig:
    """The exact fold's options for a model to export: the whole plan (``stock_compatible=False``: the ONNX
    file, not a transformers class, runs it) without creating a parameter the model lacks. A γ/β with no
    bias to go into stays in its RMSNorm: ln_f's β folded into a new ``lm_head.bias`` would add a
    vocabulary-wide ``Add`` to every call (6 of 214 ms of a 128-token GPT-2 prefill in ONNX Runtime's
    profile), the RMSNorm's bias a width-wide one."""
    return FoldConfig(stock_compatible=False, loadable_keys=frozenset(model.state_dict()))


def require_onnx_extra() -> None:
    """ImportError naming the ``onnx`` extra unless onnx, onnxscript and onnxruntime all import."""
    for module in ("onnx", "onnxscript", "onnxruntime"):
        require(module)


# ------------------------------------------------------------------------------------------ export

def _dynamic_axes(t: Tensor) -> dict[int, str]:
    """The dynamic axes of one input: batch on dim 0, sequence on dim 1 of a 2-D integer tensor."""
    axes = {0: BATCH_AXIS} if t.dim() >= 1 else {}
    if t.dim() == 2 and not t.is_floating_point() and not t.is_complex():
        axes[1] = SEQUENCE_AXIS
    return axes


def _dynamic_shapes(model: nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """torch.export's ``dynamic_shapes`` for the call: every argument by name, tensors' axes from
    :func:`_dynamic_axes`, None for other values."""
    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: pytree.tree_map(lambda v: _dynamic_axes(v) if isinstance(v, Tensor) else None, value)
            for name, value in bound.arguments.items()}


def _plain_calls(model: nn.Module, args: tuple, kwargs: dict, dynamic: bool) -> ExportCalls:
    """A model exported as called: the example traced, proved on it and at other sizes; dynamic axes
    from :func:`_dynamic_axes`."""
    tensors = runtime.call_tensors(args, kwargs)
    return ExportCalls(traced=(args, kwargs), calls=[(args, kwargs), _other_sizes(args, kwargs, dynamic)],
                       axes=[_dynamic_axes(t) if dynamic else {} for t in tensors],
                       dynamic_shapes=_dynamic_shapes(model, args, kwargs) if dynamic else None, input_names=None)


def _export(model: nn.Module, plan: ExportCalls, file: Path, target: str, opset: int,
            fuse_graph: bool) -> tuple[dict[str, int], dict[str, int]]:
    """``torch.onnx.export(dynamo=True)`` of ``plan``'s traced call into ``file``, normfold's norms through
    :func:`onnx_translations` (an original without them is torch's stock export), and with ``fuse_graph``
    :func:`graph_passes.optimize_exported` (the original stays stock); FoldError naming what failed.
    Returns the norm calls of the exported program (:func:`_norm_calls`) and what the passes did."""
    table = onnx_translations(target, opset)
    args, kwargs = plan.traced
    try:
        with eval_mode(model), torch.no_grad(), warnings.catch_warnings():
            # the exporter names the axes only when every argument is a tensor (and warns when two inputs
            # share one); _name_axes does it
            warnings.filterwarnings("ignore", message=".*dynamic axes will not be renamed")
            warnings.filterwarnings("ignore", message=".*will not be used, since it shares the same shape")
            program = torch.onnx.export(model, args, kwargs=kwargs, dynamo=True, opset_version=opset,
                                        custom_translation_table=table, verbose=False, optimize=True,
                                        output_names=_output_names(model, args, kwargs),
                                        input_names=plan.input_names, dynamic_shapes=plan.dynamic_shapes)
    except Exception as err:  # noqa: BLE001  torch's exporter raises many kinds; the user needs its innermost reason
        raise FoldError(f"torch.onnx.export could not export {model_name(model)} (opset {opset}): "
                        f"{_export_failure(err)}") from err
    if plan.dynamic_shapes is not None:
        _name_axes(program.model, plan.axes)
    passes = graph_passes.optimize_exported(program.model, target) if fuse_graph else {}
    program.save(file)
    return _norm_calls(program.exported_program.graph), passes


def _norm_calls(graph) -> dict[str, int]:
    """normfold's norm calls in a traced graph, by form: what the translations turn into ONNX nodes."""
    counts = dict.fromkeys(("rms", "rms_residual", "layer_norm", "layer_norm_residual"), 0)
    for node in graph.nodes:
        if node.target is torch.ops.normfold.norm_fwd.default:
            _, _, _, residual, _, _, is_rms = node.args
            counts[("rms" if is_rms else "layer_norm") + ("_residual" if residual is not None else "")] += 1
    return counts


def _output_names(model: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    """The graph's output names: the model's own (``logits``, ``last_hidden_state``) where its outputs are
    named and distinct, else ``output_0``, ``output_1``, ..."""
    with eval_mode(model), torch.no_grad():
        leaves, _ = pytree.tree_flatten_with_path(model(*args, **kwargs))
    paths = [path for path, leaf in leaves if isinstance(leaf, Tensor)]
    names = [getattr(path[-1], "key", None) if path else None for path in paths]
    if all(isinstance(n, str) for n in names) and len(set(names)) == len(names):
        return names
    return [f"output_{i}" for i in range(len(paths))]


def _export_failure(err: BaseException) -> str:
    """The innermost cause of an exporter error, with the node it was translating when there is one."""
    node, seen = None, err
    while seen.__cause__ is not None:
        if "Error when translating node" in str(seen):
            node = first_line(seen)
        seen = seen.__cause__
    innermost = first_line(seen)
    return innermost if node is None else f"{node}: {innermost}"


def _name_axes(model_ir, axes: list[dict[int, str]]) -> None:
    """Rename the graph inputs' symbolic dims to the axes' names (``batch``, ``sequence``) everywhere in
    the graph (the exporter does it only when every call argument is a tensor)."""
    ir = require("onnxscript").ir
    renamed: dict[str, str] = {}
    for value, input_axes in zip(model_ir.graph.inputs, axes):
        for dim, name in input_axes.items():
            symbol = value.shape[dim] if value.shape is not None else None
            if isinstance(symbol, ir.SymbolicDim) and symbol.value is not None:
                renamed[symbol.value] = name

    def rename(value) -> None:
        if value.shape is not None and any(isinstance(d, ir.SymbolicDim) and d.value in renamed for d in value.shape):
            value.shape = ir.Shape([ir.SymbolicDim(renamed[d.value]) if isinstance(d, ir.SymbolicDim)
                                    and d.value in renamed else d for d in value.shape])

    for value in (*model_ir.graph.inputs, *model_ir.graph.outputs):
        rename(value)
    for node in ir.traversal.RecursiveGraphIterator(model_ir.graph):
        for value in node.outputs:
            rename(value)


# ------------------------------------------------------------------------------------------ proof

def _other_sizes(args: tuple, kwargs: dict, dynamic: bool) -> tuple[tuple, dict]:
    """A second call: twice the batch (the example's rows and fresh ones) and one position fewer
    (sequences longer than 2) on the dynamic axes; with fixed axes, fresh inputs of the same shapes."""
    generator = torch.Generator().manual_seed(0)
    if not dynamic:
        return fresh_inputs_like((args, kwargs), generator)

    def resize(t: Tensor) -> Tensor:
        axes = _dynamic_axes(t)
        if SEQUENCE_AXIS in axes.values() and t.shape[1] > 2:
            t = t[:, :-1]
        if BATCH_AXIS in axes.values():
            t = torch.cat([t, fresh_inputs_like(t, generator)], dim=0)
        return t

    return pytree.tree_map_only(Tensor, resize, (args, kwargs))


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _tensor_outputs(model: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    with eval_mode(model), torch.no_grad():
        return [(n, v) for n, v in flatten_outputs(model(*args, **kwargs)) if isinstance(v, Tensor)]


def _prove(model: nn.Module, reference: nn.Module, file: Path, original_file: Path | None, calls: list,
           threads: int) -> dict[str, Any]:
    """The export's error against ``reference`` in float64 on ``calls``, e_own, the tolerance; or
    FoldVerificationError. Refuses to pass having compared nothing."""
    dtype = _model_dtype(model)
    reference64 = copy.deepcopy(reference).to(torch.float64)
    refs = [_tensor_outputs(reference64, *cast_floats(call, torch.float64)) for call in calls]
    error, compared, worst = 0.0, 0, ""
    sess = runtime.session(file, threads=threads)
    for ref, call in zip(refs, calls):
        got = runtime.run(sess, *call)
        for (name, r), g in _paired(ref, got, "the export"):
            e = output_error(r, g, out_dtype=dtype).error
            compared += r.is_floating_point()
            if e >= error:
                error, worst = e, name
    if compared == 0:
        raise FoldVerificationError(f"the ONNX export of {model_name(model)} returns no floating output to compare")
    if original_file is not None:
        own_sess = runtime.session(original_file, threads=threads)
        own = max(rounding_error(r, g, dtype) for ref, call in zip(refs, calls)
                  for (_, r), g in _paired(ref, runtime.run(own_sess, *call), "the original's export")
                  if r.is_floating_point())
        measured_as = (f"the original's stock ONNX export run in ONNX Runtime in {dtype_name(dtype)} vs the original "
                       "in float64 on the same inputs")
    else:
        own = own_error(model, calls, dtype, reference=reference64)
        measured_as = f"the model's own error in PyTorch in {dtype_name(dtype)} vs float64 on the same inputs"
    tolerance, rule = measured_tolerance(own, dtype, measured_as=measured_as, multiple=OWN_ERROR_MULTIPLE)
    if not error <= tolerance:  # nan fails too
        raise FoldVerificationError(
            f"the ONNX export of {model_name(model)} differs from the PyTorch model: error {error:.3e} in {worst} > "
            f"tolerance {tolerance:.3e} = {rule}")
    return {"error": error, "own_error": own, "tolerance": tolerance, "rule": rule, "compared": compared}


def _paired(ref: list[tuple[str, Tensor]], got: list[Tensor], what: str):
    """(name, reference) with the ONNX output at the same place; ValueError if count or shapes differ."""
    if len(ref) != len(got):
        raise FoldVerificationError(f"{what} returns {len(got)} outputs, the PyTorch model {len(ref)} "
                                    f"({', '.join(n for n, _ in ref)})")
    for (name, r), g in zip(ref, got):
        if tuple(r.shape) != tuple(g.shape):
            raise FoldVerificationError(f"{what}'s output {name} has shape {tuple(g.shape)}, the PyTorch model's "
                                        f"{tuple(r.shape)}")
    return zip(ref, got)


def _norm_counts(file: Path, threads: int) -> dict[str, int]:
    """How many nodes of each norm type the graph ONNX Runtime optimized for ``file`` holds."""
    counts = runtime.optimized_node_counts(file, file.with_name(f"optimized-{file.name}"), threads=threads)
    return {t: counts.get(t, 0) for t in (*RMS_NODE_TYPES, *LAYER_NORM_NODE_TYPES)}


# ------------------------------------------------------------------------------------------ files

def _check_destination(path: str | os.PathLike, overwrite: bool) -> Path:
    """``path`` as an absolute path, or an error before any work: its folder must exist, and an existing
    file there is replaced only with ``overwrite`` (never a folder or a link)."""
    path = Path(os.path.abspath(path))
    if path.suffix != ".onnx":
        raise ValueError(f"the ONNX file's name must end in .onnx, got {path.name}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"the folder to write {path.name} into does not exist: {path.parent}")
    if path.is_symlink() or path.is_dir():
        raise FileExistsError(f"{path} is a {'link' if path.is_symlink() else 'folder'}: pick another path")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists (pass overwrite=True to replace it)")
    return path


@contextlib.contextmanager
def _staging(path: Path) -> Iterator[Path]:
    """A file name in a temporary folder next to ``path`` (removed at the end, whatever happens)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}{_TMP_MARK}", dir=path.parent))
    try:
        yield tmp / path.name
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(staged: Path, path: Path, overwrite: bool) -> None:
    """Move the staged model (and its external data, first) to ``path``; the model file appears last, so
    a reader never finds it without its data. Checked again: a file that appeared meanwhile is kept."""
    data = staged.with_name(staged.name + ".data")
    for src, dst in ((data, path.with_name(path.name + ".data")), (staged, path)):
        if not src.exists():
            continue
        if dst.exists() and not overwrite:
            raise FileExistsError(f"{dst} appeared while exporting; nothing was replaced")
        os.replace(src, dst)


def _versions() -> dict[str, str]:
    return {name: getattr(require(name), "__version__", "?") for name in ("onnx", "onnxscript", "onnxruntime")} | \
        {"torch": torch.__version__}
