"""The Hugging Face folder commands: ``analyze``, ``fold``, ``demo`` (``verify``: :mod:`normfold.cli.verify`)."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from ..engine.cosine_bar import DEFAULT_MIN_COSINE, is_cosine_bar
from ..folders import approximate_config
from ..hf.folder import analyze_folder, fold_folder
from ..hf.folder_report import FolderReport, FoldSection
from ..hf.load import default_model_path
from ..hf.report import norm_rows, read_folder_report, report_rows
from ..hf.streaming import fold_checkpoint, is_sharded
from . import _output as output
from ._common import EXIT_OK, EXIT_VERIFY_FAILED, UsageError, add_model_dir, add_trust_remote_code, model_dir

_JSON_KEYS = ("num_norms", "num_foldable", "norms", "verification", "model", "out_dir", "fold_affine", "saved_dtype",
              "streaming", "num_approximate", "calibration_min_cosine", "approximate", "skipped_files",
              "traced_calls", "exactness_scope", "example_inputs")


def _json_report(report: dict) -> dict:
    """What ``--json`` prints: the counts, the per-norm entries and the verification figures."""
    return {k: report[k] for k in _JSON_KEYS if k in report}


def _run_analyze(args) -> int:
    with output.steps(not args.json) as step:
        report = analyze_folder(model_dir(args), fold_affine=not args.no_fold_affine, keep=tuple(args.keep),
                                calls=tuple(args.call), trust_remote_code=args.trust_remote_code, step=step)
    if args.json:
        print(json.dumps(_json_report(report), indent=2, default=str))
    else:
        fold = FoldSection.from_json(report, "the analysis")
        output.print_norm_table(norm_rows(fold), report["model"]["architecture"], fold.capture_line,
                                report.get("example_inputs"))
    return EXIT_OK


def _run_fold(args) -> int:
    source = model_dir(args)
    approximate = _approximate_options(args, source)
    streamed = args.stream or is_sharded(source)  # sharded checkpoints: never loaded whole, checked block by block
    if args.keep and (streamed or approximate):
        raise UsageError("--keep applies to exact in-memory folds only: not with --approximate (which would replace "
                         "the kept norms), --stream or sharded folders")
    if args.call and streamed:
        raise UsageError("--call applies to in-memory folds only: not with --stream or sharded folders")
    fold_fn, chosen = ((fold_checkpoint, {}) if streamed
                       else (fold_folder, {"keep": tuple(args.keep), "calls": tuple(args.call)}))
    with output.steps(not args.json) as step:
        report = fold_fn(source, args.output, fold_affine=not args.no_fold_affine, dtype=args.dtype,
                         overwrite=args.overwrite, trust_remote_code=args.trust_remote_code, step=step, **approximate,
                         **chosen)
    if not report["verification"]["ok"]:
        if not args.json:
            output.print_verification(report["verification"])
        print(f"normfold: verification failed for the blocks written to {report['out_dir']}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    written = read_folder_report(Path(report["out_dir"]))
    if args.json:
        print(json.dumps(_json_report(report), indent=2, default=str))
    else:
        _print_folded(written)
        output.console().print(f"wrote [bold]{report['out_dir']}[/bold]")
    output.warn_if_approximate(written)
    output.warn_skipped_files(written)
    return EXIT_OK


def _print_folded(report: FolderReport) -> None:
    """The norm table and the verification of a folder written."""
    output.print_norm_table(report_rows(report), report.model.architecture, report.fold.capture_line,
                            report.sections.get("example_inputs"))
    output.print_verification(report.verification)


def _approximate_options(args, source: Path) -> dict:
    """fold_folder's keywords for ``--approximate``; UsageError for a bad combination, before any loading."""
    if not args.approximate:
        if args.calibration is not None or args.min_cosine is not None:
            raise UsageError("--calibration and --min-cosine only apply with --approximate")
        return {}
    if args.calibration is None:
        raise UsageError("--approximate needs --calibration FILE (one sentence per line)")
    min_cosine = DEFAULT_MIN_COSINE if args.min_cosine is None else args.min_cosine
    if not is_cosine_bar(min_cosine):
        raise UsageError(f"--min-cosine must be in (0, 1], got {min_cosine}")
    if args.stream or is_sharded(source):
        raise UsageError("--approximate needs the whole model in memory: not available with --stream or sharded folders")
    return {"calibration_file": args.calibration, "approximate": approximate_config(min_cosine)}


def _run_demo(args) -> int:
    source = default_model_path()
    with tempfile.TemporaryDirectory(prefix="normfold-demo-") as tmp:
        out = Path(args.output) if args.output else Path(tmp) / "folded"
        output.console().print(f"folding the bundled model {source}\n")
        with output.steps() as step:
            report = fold_folder(source, out, overwrite=args.overwrite, step=step)
        _print_folded(read_folder_report(out))
        files = ", ".join(sorted(p.name for p in out.iterdir()))
        where = (f"into {report['out_dir']}" if args.output
                 else "into a temporary folder, removed now; `normfold demo -o DIR` keeps them")
        output.console().print(f"wrote {files}\n({where})")
    return EXIT_OK


def _add_no_fold_affine(parser) -> None:
    parser.add_argument("--no-fold-affine", action="store_true",
                        help="keep γ/β on the RMSNorms instead of folding them into the next linear layers")


def _add_keep(parser) -> None:
    parser.add_argument("--keep", action="append", default=[], metavar="PATTERN",
                        help="leave the norms whose module path matches PATTERN (fnmatch, e.g. 'transformer.h.0.*') "
                             "as they are; repeatable")


def _add_call(parser) -> None:
    parser.add_argument("--call", action="append", default=[], metavar="KIND",
                        help="a kind of example call to fold for: input_ids (the default), inputs_embeds (embeddings "
                             "instead of ids), or the model's other main input (pixel_values, ...); repeat it to fold "
                             "only what is exact for every kind")


def _add_json(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON report on stdout (numbers in full)")


def _add_plan_options(p, run) -> None:
    """The options ``analyze`` and ``fold`` share after their own: ``--keep``, ``--call``, ``--json``,
    ``--trust-remote-code``; ``run`` runs the command."""
    _add_keep(p)
    _add_call(p)
    _add_json(p)
    add_trust_remote_code(p)
    p.set_defaults(run=run)


def add_commands(subparsers) -> None:
    """Add ``analyze``, ``fold`` and ``demo`` to the ``normfold`` command's subparsers."""
    p = subparsers.add_parser("analyze", help="per-norm table: which LayerNorms can become RMSNorms")
    add_model_dir(p)
    _add_no_fold_affine(p)
    _add_plan_options(p, _run_analyze)

    p = subparsers.add_parser("fold", help="fold, verify and write an equivalent RMSNorm model")
    add_model_dir(p, required=True)
    p.add_argument("-o", "--output", metavar="OUT_DIR", required=True,
                   help="new folder to write (must not exist; not the input, inside it or above it)")
    _add_no_fold_affine(p)
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the saved weights (default: the checkpoint's)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it is empty or an earlier normfold output, once the new one is verified")
    p.add_argument("--stream", action="store_true",
                   help="rewrite the safetensors shard by shard without loading the model "
                        "(automatic for sharded folders); verifies every block, the embeddings and the head "
                        "one at a time")
    p.add_argument("--approximate", action="store_true",
                   help="also replace the norms the exact fold cannot touch, within --min-cosine on the calibration "
                        "sentences (not exact: load the result with normfold.from_pretrained)")
    p.add_argument("--calibration", metavar="FILE",
                   help="UTF-8 text, one calibration sentence per line (tokenized with the folder's tokenizer)")
    p.add_argument("--min-cosine", type=float, metavar="X",
                   help=f"lowest cosine similarity allowed between original and result outputs (default "
                        f"{DEFAULT_MIN_COSINE}); sentence encoders are compared on mean-pooled embeddings")
    _add_plan_options(p, _run_fold)

    p = subparsers.add_parser("demo", help="fold the bundled trained model and show the report")
    p.add_argument("-o", "--output", metavar="OUT_DIR",
                   help="keep the folded folder here (default: a temporary folder, removed at the end)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it is empty or an earlier normfold output")
    p.set_defaults(run=_run_demo)

