"""``normfold export DIR -o OUT``: fold (and fuse) a Hugging Face folder, export it to ONNX with the runtime's
own RMS kernels, prove it in ONNX Runtime against the original, and write a folder atomically:

    OUT/model.onnx        the folded (fused) model        OUT/original.onnx   torch's stock export of the original
    OUT/config.json       the original's config           OUT/normfold_report.json   opset, targets, the proof's figures

(plus ``*.onnx.data`` external data for models over 2 GB, and the folder's tokenizer and other side
files). ``--kv-cache``: both files take and return a decoder's KV cache (optimum's names), for a
generation loop in ONNX Runtime (``normfold.export.generate_greedy_ort``). Composed here: hf loads, the top level folds, ``normfold.export`` exports and proves.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..convert import FuseConfig, convert
from ..export import (DEFAULT_OPSET, KV_CACHE_MODEL_TYPES, TARGETS, check_decoder, check_target, export_onnx,
                      fold_config_for_export, require_onnx_extra)
from ..hf.inputs import example_inputs_for
from ..hf.load import load_model
from ..hf.output_dir import REPORT_JSON, atomic_output_dir
from ..hf.side_files import copy_side_files
from . import _output as output
from ._common import EXIT_OK, UsageError, add_model_dir, add_trust_remote_code, model_dir

MODEL_FILE, ORIGINAL_FILE, CONFIG_FILE = "model.onnx", "original.onnx", "config.json"
# the layout of an export folder's normfold_report.json (kind "onnx_export"): raised when a key changes meaning,
# so that a reader can tell this report from a folded Hugging Face folder's (hf/folder_report.py's schema)
EXPORT_REPORT_SCHEMA = 1


def _run_export(args) -> int:
    source = model_dir(args)
    try:  # the command line's mistakes and a missing extra, before any work
        check_target(args.target, args.opset)
    except ValueError as err:
        raise UsageError(str(err)) from err
    require_onnx_extra()
    with output.steps(not args.json) as step:
        step("loading")
        model = load_model(source, trust_remote_code=args.trust_remote_code)
        if args.kv_cache:  # before the fold's work
            check_decoder(model)
        inputs = example_inputs_for(model)
        step("folding" + (" and fusing" if args.fuse else ""))
        folded, fold_report = convert(model, inputs, fold=fold_config_for_export(model),
                                      fuse=FuseConfig() if args.fuse else None)
        step(f"exporting to ONNX (target {args.target}{', with the KV cache' if args.kv_cache else ''}) "
             "and proving it in ONNX Runtime")
        with atomic_output_dir(args.output, overwrite=args.overwrite, protect=(source,)) as tmp:
            report = export_onnx(folded, inputs, tmp / MODEL_FILE, original=model, original_path=tmp / ORIGINAL_FILE,
                                 target=args.target, opset=args.opset, kv_cache=args.kv_cache)
            model.config.to_json_file(tmp / CONFIG_FILE)
            skipped = copy_side_files(source, tmp)
            summary = _summary(source, report.to_dict(), args.fuse, args.kv_cache, fold_report, skipped)
            (tmp / REPORT_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    if args.json:
        print(json.dumps(summary, indent=2))
        return EXIT_OK
    onnx = summary["onnx"]
    output.console().print(
        f"{fold_report.num_foldable}/{fold_report.num_norms} norms folded; ONNX opset {onnx['opset']} "
        f"({args.target}): error {onnx['error']:.2e} <= tolerance {onnx['tolerance']:.2e} ({onnx['rule']})")
    output.console().print(f"norm nodes ONNX Runtime runs: {_nonzero(onnx['node_counts'])} "
                           f"(original: {_nonzero(onnx['original_node_counts'])})")
    output.console().print(f"wrote [bold]{args.output}[/bold]")
    output.warn_skipped_files(summary)
    return EXIT_OK


def _summary(source, onnx: dict, fuse: bool, kv_cache: bool, fold_report, skipped: list) -> dict:
    """normfold_report.json: what was exported, how, and the proof (paths relative to the folder)."""
    for key in ("path", "original_path"):
        onnx[key] = Path(onnx[key]).name
    return {"schema_version": EXPORT_REPORT_SCHEMA, "kind": "onnx_export", "model": str(source), "fuse": fuse, "kv_cache": kv_cache,
            "num_norms": fold_report.num_norms,
            "num_folded": fold_report.num_foldable, "onnx": onnx, "skipped_files": skipped}


def _nonzero(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {t}" for t, n in counts.items() if n) or "none"


def add_commands(subparsers) -> None:
    """Add ``export`` to the ``normfold`` command's subparsers."""
    p = subparsers.add_parser("export", help="fold (--fuse) and export to ONNX with the runtime's RMS kernels, proved "
                                             "in ONNX Runtime (needs normfold[onnx])")
    add_model_dir(p)
    p.add_argument("-o", "--output", metavar="OUT_DIR", required=True,
                   help="new folder to write: model.onnx, original.onnx, config.json, normfold_report.json")
    p.add_argument("--fuse", action="store_true", help="also fuse residual adds into the norms (Skip* kernels)")
    p.add_argument("--target", choices=TARGETS, default="onnxruntime",
                   help="onnxruntime: its SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (default); "
                        "onnx: the standard RMSNormalization (opset >= 23)")
    p.add_argument("--opset", type=int, metavar="N",
                   help=f"ONNX opset (default {DEFAULT_OPSET['onnxruntime']} for onnxruntime, "
                        f"{DEFAULT_OPSET['onnx']} for onnx)")
    p.add_argument("--kv-cache", action="store_true",
                   help="decoders: the KV cache as graph inputs past_key_values.{i}.key/value and outputs "
                        f"present.{{i}}.key/value (optimum's names), for generation in ONNX Runtime; model types "
                        f"{', '.join(KV_CACHE_MODEL_TYPES)}")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it is empty or an earlier normfold output, once the new one is proved")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_trust_remote_code(p)
    p.set_defaults(run=_run_export)
