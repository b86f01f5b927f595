"""Folding a checkpoint end to end: plan, rewrite every shard into a private temporary folder,
prove the result there, and only then publish it as the output folder in one atomic exchange."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..._progress import progress
from ...engine.errors import FoldVerificationError
from ...engine.plan import FoldPlan
from ...engine.report import FoldReport
from ..folder import write_report_files
from ..load import CheckpointError, check_model_dir
from ..normfold_only import mark_normfold_only
from ..output_dir import atomic_output_dir
from ..recipe import Recipe, Rotation
from ..folder_report import FolderReport, Layout, NamedShape, SkippedFile, SwappedNorm
from ..report import describe_model, folder_report, require_norms
from ..inputs import example_inputs_for
from ..saving import DTYPES, stock_parameter_shapes
from ..side_files import copy_side_files
from ..weight_files import SAFE_INDEX as INDEX
from .checkpoint import stored_dtype_name, write_safetensors
from .planning import plan_for_checkpoint, untied_config
from .rewrite import AfterFold, CheckpointRewrite, Prefetcher
from .verification import failure_summary, verify_by_blocks


# (skeleton, its fold report, example inputs) -> the step after the fold, planned from the structure alone
PlanAfterFold = Callable[[nn.Module, FoldReport, dict], AfterFold]


def fold_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike, *, fold_affine: bool = True,
                    dtype: str | None = None, overwrite: bool = False, trust_remote_code: bool = False,
                    after_fold: PlanAfterFold | None = None,
                    step: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Fold a safetensors folder shard by shard without loading the model, verify the result
    piece by piece (:func:`~normfold.hf.streaming.verify_by_blocks`), and only then publish it as ``out_dir``.

    Everything is written into a temporary sibling of ``out_dir`` (:func:`~normfold.hf.output_dir.atomic_output_dir`):
    a failed check raises ``FoldVerificationError`` and leaves ``out_dir`` as it was (with
    ``overwrite``, the previous output stays). Output shards mirror the input shards (same names
    and keys; an untied copy goes into its source's shard). Returns the report dict
    (``streaming`` holds bytes and seconds, ``verification`` the checks).

    ``after_fold`` (``normfold rotate``): planned on the skeleton after the fold's plan, which may then
    create parameters the class lacks (the folder is for ``normfold.from_pretrained`` only); its
    tensors are rewritten after the fold's math, and every block is proved against the original's
    stream mapped by its ``stream``.
    """
    model_dir = check_model_dir(model_dir)
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    with atomic_output_dir(out_dir, overwrite=overwrite, protect=(model_dir,)) as tmp:
        report, stream = _write_folded_checkpoint(model_dir, tmp, fold_affine=fold_affine, dtype=dtype,
                                                  trust_remote_code=trust_remote_code, after_fold=after_fold,
                                                  step=step)
        report = report.with_verification(verify_by_blocks(model_dir, tmp, report, dtype=dtype,
                                                           trust_remote_code=trust_remote_code, stream_map=stream,
                                                           step=step))
        if not report.verification["ok"]:
            raise FoldVerificationError(f"{failure_summary(report.verification)}; nothing was written to {out_dir}")
        step("writing the report")
        written = write_report_files(report, tmp)
    return {**written, "out_dir": str(Path(out_dir).absolute())}


def _write_folded_checkpoint(model_dir: Path, folder: Path, *, fold_affine: bool, dtype: str | None,
                             trust_remote_code: bool, after_fold: PlanAfterFold | None,
                             step: Callable[[str], None]) -> tuple[FolderReport, Callable | None]:
    """Plan, then rewrite every shard into ``folder`` (config and side files too); returns the
    report without verification, and the after-fold step's stream map (None without one).
    ``folder`` is private: nothing here is checked yet."""
    out_dtype = DTYPES[dtype] if dtype else None
    t0 = time.perf_counter()
    step("planning (no weights loaded)")
    report, skeleton, checkpoint = plan_for_checkpoint(model_dir, fold_affine=fold_affine,
                                                      trust_remote_code=trust_remote_code, stored_dtype=out_dtype,
                                                      stock_loadable=after_fold is None)
    require_norms(report, type(skeleton).__name__)
    after = None if after_fold is None else after_fold(skeleton, report, example_inputs_for(skeleton))
    t_plan = time.perf_counter() - t0
    rewrite = CheckpointRewrite(report.plan, skeleton, checkpoint, out_dtype, after)
    layout = {name: list(keys) for name, keys in checkpoint.files.items()}
    for new, src in rewrite.new_keys.items():
        layout[checkpoint.file_of.get(src) or checkpoint.file_of[rewrite.new_keys[src]]].append(new)
    keys = {k for ks in layout.values() for k in ks}
    unwritten = sorted(name for name in (after.dims if after is not None else ()) if rewrite.key_of[name] not in keys)
    if unwritten:  # a tensor it would change, never written: nothing proved
        raise CheckpointError(f"the step after the fold changes {unwritten[:3]}, which the checkpoint does not store "
                              "under those names")
    written, weight_map = 0, {}
    step(f"rewriting {len(layout)} shard{'s' if len(layout) != 1 else ''}")
    with Prefetcher(rewrite, [k for keys in layout.values() for k in keys]) as tensors:
        for name, keys in progress(layout.items(), desc="rewriting shards", total=len(layout), unit="shard"):
            entries = [(k, *rewrite.output_meta(k)) for k in keys]
            written += write_safetensors(folder / name, entries, tensors.get)
            weight_map.update(dict.fromkeys(keys, name))
    if len(layout) > 1 or (model_dir / INDEX).is_file():
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": written}, "weight_map": weight_map},
                                               indent=2) + "\n")
    _write_config(skeleton.config, folder, untied=bool(report.plan.untie), dtype=out_dtype)
    if after is not None:  # a rotation: stock transformers would load another model
        mark_normfold_only(folder)
    skipped_files = copy_side_files(model_dir, folder)
    streaming = {"bytes_read": checkpoint.bytes_read, "bytes_written": written, "plan_seconds": round(t_plan, 2),
                 "read_seconds": round(checkpoint.read_seconds, 2), "math_seconds": round(rewrite.math_seconds, 2),
                 "seconds": round(time.perf_counter() - t0, 2)}
    layout = Layout(swapped_from_plan(report.plan))  # planned within what the stock class loads
    if after is not None:  # parameters the class lacks (a created lm_head.bias): normfold.from_pretrained adds them
        stock = stock_parameter_shapes(skeleton.config, type(skeleton))
        layout = Layout(layout.swapped, extra_parameters=tuple(
            NamedShape(name, tuple(rewrite.output_meta(key)[1]))
            for name, key in sorted(rewrite.created.items()) if name not in stock), stock_compatible=False)
    saved_dtype = dtype or stored_dtype_name(model_dir)
    rotation = None if after is None else after.sections.get("rotation")
    out = folder_report(report, layout, saved_dtype=saved_dtype,
                        model=describe_model(skeleton, model_dir), fold_affine=fold_affine,
                        skipped_files=SkippedFile.listed(skipped_files), streaming=streaming,
                        stock_warning=None if after is None else after.stock_warning,
                        recipe=Recipe(command="fold" if rotation is None else "rotate", streaming=True,
                                      fold_affine=fold_affine, dtype=dtype, rotation=None if rotation is None else
                                      Rotation(rotation["method"], int(rotation["seed"]))))
    if after is not None:
        for name, section in after.sections.items():
            out = out.with_section(name, section)
    return out, None if after is None else after.stream


def swapped_from_plan(plan: FoldPlan) -> tuple[SwappedNorm, ...]:
    """The report's ``swapped`` entries (what ``normfold.from_pretrained`` swaps back in) read from the
    plan: the in-memory fold reads them from the folded model (``normfold.hf.saving.swapped_norms``)."""
    return tuple(SwappedNorm(s.path, (s.normalized_shape,), s.eps, s.elementwise_affine,
                             s.elementwise_affine and s.bias, s.offset or 0.0)
                 for s in plan.swap if s.to == "RMSNorm")


def _write_config(config, folder: Path, *, untied: bool, dtype: torch.dtype | None) -> None:
    """The checkpoint's config, untied where the fold gave the output embedding its own tensor, and
    recording the saved dtype."""
    if untied:
        config = untied_config(config)
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(folder)
