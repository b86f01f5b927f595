"""The ``normfold`` command.

    normfold analyze [MODEL_DIR]                      per-norm table (default: the bundled model)
    normfold fold [MODEL_DIR] -o OUT_DIR [--json]     fold, verify in float64, write OUT_DIR
        [--approximate --calibration FILE [--min-cosine 0.999]]   also replace the other norms, within a cosine bar
    normfold verify ORIG_DIR FOLDED_DIR               compare a folded folder with its original
    normfold demo                                     fold the bundled model into a temp folder

Exit codes: 0 ok, 1 verification failed, 2 usage or input error (one line on stderr).

Subcommands are registered by modules listed in ``COMMAND_MODULES``: each defines
``add_commands(subparsers)``, which adds its parsers and sets ``run=`` (a function
``args -> exit code``) with ``set_defaults``. Modules must import heavy dependencies inside ``run``.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_USAGE = 0, 1, 2

# Modules that add subcommands (each defines ``add_commands(subparsers)``; see the module docstring).
COMMAND_MODULES: list[str] = ["normfold.cli", "normfold.train.cli", "normfold.lab.commands", "normfold.bench.cli"]


class UsageError(ValueError):
    """A bad command line that argparse cannot see (e.g. a missing -o)."""


# ------------------------------------------------------------------------------------------ output

def _console(stderr: bool = False):
    from ._deps import require

    rich_console = require("rich.console")
    file = sys.stderr if stderr else sys.stdout
    # bound to sys.stdout at call time, so captured output sees it; wide when piped so paths stay whole
    width = None if file.isatty() else 160
    return rich_console.Console(file=file, width=width, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _progress(enabled: bool = True) -> Iterator:
    """A rich spinner on stderr; yields ``step(description)`` that starts the next step."""
    if not enabled:
        yield lambda _description: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=_console(stderr=True), transient=True) as progress:
        task = progress.add_task("starting", total=None)
        yield lambda description: progress.update(task, description=description)


def _print_norm_table(report: dict) -> None:
    from rich.table import Table

    from .hf.report import norm_rows

    rows = norm_rows(report)
    model = report.get("model", {})
    table = Table(title=f"{model.get('architecture', 'model')}: {sum(r['folded'] for r in rows)} of {len(rows)} "
                        "LayerNorms foldable", title_justify="left")
    table.add_column("norm", style="bold", no_wrap=True)
    table.add_column("input zero-mean?")
    table.add_column("γ/β")
    table.add_column("why (for a kept norm: the op that breaks zero mean)")
    approximate = set(report.get("approximate_norms", ()))  # --approximate: replaced, but not exactly
    for r in rows:
        result = ("[green]yes: RMSNorm[/green]" if r["folded"] else
                  "[magenta]no: RMSNorm, approximate[/magenta]" if r["path"] in approximate else
                  "[yellow]no: LayerNorm kept[/yellow]")
        table.add_row(r["path"], result, "folded into next layer" if r["affine_folded"] else "kept", r["reason"])
    _console().print(table)


_FIGURES = {  # verification figure -> how the table names it (a figure the result lacks is not shown)
    "max_rel_error": "max relative error, float64",
    "max_abs_error": "max absolute error, float64",
    "model_dtype_max_rel_error": "max relative error, model dtype",
    "max_input_mean_ratio": "RMSNorm inputs: max |mean| / rms",
    "tolerance": "tolerance (relative, float64)",
    "tolerance_rule": "tolerance rule",
    "stored_dtype_own_error": "original's own error in the stored dtype",
    "num_runs": "inputs compared",
    "saved_dtype_check": "weights rounded to the saved dtype",
    "weights": "stored weights vs the fold re-derived from the original",
}


def _figure_text(key: str, value) -> str:
    """A verification figure for people: numbers to two digits (``1.2e-03``); JSON keeps them whole."""
    if value is None:
        return "n/a"
    if key == "weights":
        return _weights_text(value)
    if key == "saved_dtype_check":
        return _saved_dtype_check_text(value)
    return f"{value:.1e}" if isinstance(value, float) else str(value)


def _weights_text(weights: dict) -> str:
    """The tensor-by-tensor check in one line: skipped (why), bit-identical, or the worst tensor."""
    if weights.get("skipped"):
        return f"skipped: {weights['skipped']}"
    if weights.get("why"):
        return f"FAILED: {weights['why']}"
    worst = weights.get("worst")
    if worst is None:
        return f"{weights['num_tensors']} tensors, all bit-identical"
    return (f"{weights['num_tensors']} tensors within {weights['bound']}; {weights['num_differing_tensors']} not "
            f"bit-identical, worst {worst['name']} ({worst['max_ulps']:.2g} ulp, max abs {worst['max_abs_error']:.1e})")


def _saved_dtype_check_text(check: dict) -> str:
    if check.get("skipped"):
        return f"skipped: {check['skipped']}"
    return (f"{'passed' if check['ok'] else 'FAILED'}: max relative error {check['max_rel_error']:.1e}, "
            f"tolerance {check['tolerance']:.1e}")


def _print_verification(ver: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    where = ""
    if "blocks" in ver:  # a streamed fold: checked piece by piece
        blocks = ", ".join(b["block"] for b in ver["blocks"]) or "none"
        where = f" (blocks {blocks}; {ver['shell']['block'] if 'shell' in ver else 'no shell'}; each alone)"
    table = Table(title=f"verification{where}: {'[green]passed[/green]' if ver['ok'] else '[red]FAILED[/red]'}",
                  title_justify="left")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, label in _FIGURES.items():
        if key in ver:  # numbers line up on the right; sentences (the tolerance rule) read from the left
            text = _figure_text(key, ver[key])
            table.add_row(label, Text(text, justify="right" if _is_number(text) else "left"))
    _console().print(table)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _json_report(report: dict) -> dict:
    """What ``--json`` prints: the counts, the per-norm entries and the verification figures."""
    keys = ("num_norms", "num_foldable", "norms", "verification", "model", "out_dir", "fold_affine", "saved_dtype",
            "streaming", "num_approximate", "calibration_min_cosine", "approximate", "skipped_files", "traced_calls",
            "exactness_scope")
    return {k: report[k] for k in keys if k in report}


def _model_dir(args) -> Path:
    from .hf.load import default_model_path

    return Path(args.model_dir) if args.model_dir else default_model_path()


# ---------------------------------------------------------------------------------------- commands

def _run_analyze(args) -> int:
    from .hf.folder import analyze_folder

    with _progress(not args.json) as step:
        report = analyze_folder(_model_dir(args), trust_remote_code=args.trust_remote_code, step=step)
    if args.json:
        print(json.dumps(_json_report(report), indent=2, default=str))
    else:
        _print_norm_table(report)
    return EXIT_OK


def _run_fold(args) -> int:
    from .hf.folder import fold_folder
    from .hf.streaming import fold_checkpoint, is_sharded

    if not args.output:
        raise UsageError("fold needs an output folder: -o OUT_DIR")
    model_dir = _model_dir(args)
    approximate = _approximate_options(args, model_dir)
    # sharded checkpoints are streamed: never loaded whole, checked block by block
    fold_fn = fold_checkpoint if args.stream or is_sharded(model_dir) else fold_folder
    with _progress(not args.json) as step:
        report = fold_fn(model_dir, args.output, fold_affine=not args.no_fold_affine, dtype=args.dtype,
                         overwrite=args.overwrite, trust_remote_code=args.trust_remote_code, step=step, **approximate)
    if not report["verification"]["ok"]:
        if not args.json:
            _print_verification(report["verification"])
        print(f"normfold: verification failed for the blocks written to {report['out_dir']}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    if args.json:
        print(json.dumps(_json_report(report), indent=2, default=str))
    else:
        _print_norm_table(report)
        _print_verification(report["verification"])
        _console().print(f"wrote [bold]{report['out_dir']}[/bold]")
    _warn_if_approximate(report)
    _warn_skipped_files(report)
    return EXIT_OK


def _approximate_options(args, model_dir: Path) -> dict:
    """fold_folder's keywords for ``--approximate``; UsageError for a bad combination, before any loading."""
    if not args.approximate:
        if args.calibration is not None or args.min_cosine is not None:
            raise UsageError("--calibration and --min-cosine only apply with --approximate")
        return {}
    from .hf.streaming import is_sharded

    if args.calibration is None:
        raise UsageError("--approximate needs --calibration FILE (one sentence per line)")
    min_cosine = 0.999 if args.min_cosine is None else args.min_cosine
    if not 0.0 < min_cosine <= 1.0:
        raise UsageError(f"--min-cosine must be in (0, 1], got {min_cosine}")
    if args.stream or is_sharded(model_dir):
        raise UsageError("--approximate needs the whole model in memory: not available with --stream or sharded folders")
    return {"calibration_file": args.calibration, "min_cosine": min_cosine}


def _warn_skipped_files(report: dict) -> None:
    """One line on stderr per file of the input folder that was not carried over (a link, a pipe, ...)."""
    from rich.markup import escape

    for skip in report.get("skipped_files", ()):
        _console(stderr=True).print(f"[bold yellow]warning:[/bold yellow] not copied from the input folder: "
                                    f"{escape(skip['path'])} ({skip['reason']})")


def _warn_if_approximate(report: dict) -> None:
    """The approximate-fold warning, on stderr (so --json stdout stays JSON)."""
    from .hf.folder import approximate_warning

    warning = approximate_warning(report)
    if warning:
        _console(stderr=True).print(f"[bold yellow]warning:[/bold yellow] {warning}")


def _run_verify(args) -> int:
    from .hf.folder import verify_folders
    from .hf.streaming import is_sharded, verify_by_blocks

    # sharded checkpoints are checked block by block, never loaded whole
    verify_fn = verify_by_blocks if is_sharded(args.orig_dir) or is_sharded(args.folded_dir) else verify_folders
    with _progress(not args.json) as step:
        ver = verify_fn(args.orig_dir, args.folded_dir, trust_remote_code=args.trust_remote_code, step=step)
    if args.json:
        print(json.dumps({"verification": ver}, indent=2, default=str))
    else:
        _print_verification(ver)
    if not ver["ok"] and ver.get("why"):
        print(f"normfold: verification failed, {ver['why']}", file=sys.stderr)
    return EXIT_OK if ver["ok"] else EXIT_VERIFY_FAILED


def _run_demo(args) -> int:
    from .hf.folder import fold_folder
    from .hf.load import default_model_path

    source = default_model_path()
    with tempfile.TemporaryDirectory(prefix="normfold-demo-") as tmp:
        out = Path(tmp) / "folded"
        _console().print(f"folding the bundled model {source}\n")
        with _progress() as step:
            report = fold_folder(source, out, step=step)
        _print_norm_table(report)
        _print_verification(report["verification"])
        files = ", ".join(sorted(p.name for p in out.iterdir()))
        _console().print(f"wrote {files}\n(into a temporary folder; `normfold fold -o DIR` keeps one)")
    return EXIT_OK


def add_commands(subparsers) -> None:
    """The Hugging Face folder commands."""
    def common(p):
        p.add_argument("--json", action="store_true", help="print only the JSON report on stdout")
        p.add_argument("--trust-remote-code", action="store_true",
                       help="allow the folder's own modeling code to run (off by default)")

    p = subparsers.add_parser("analyze", help="per-norm table: which LayerNorms can become RMSNorms")
    p.add_argument("model_dir", nargs="?", help="Hugging Face folder (default: the bundled model)")
    common(p)
    p.set_defaults(run=_run_analyze)

    p = subparsers.add_parser("fold", help="fold, verify and write an equivalent RMSNorm model")
    p.add_argument("model_dir", nargs="?", help="Hugging Face folder (default: the bundled model)")
    p.add_argument("-o", "--output", metavar="OUT_DIR",
                   help="new folder to write (must not exist; not the input, inside it or above it)")
    p.add_argument("--no-fold-affine", action="store_true",
                   help="keep γ/β on the RMSNorms instead of folding them into the next linear layers")
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
                   help="lowest cosine similarity allowed between original and result outputs (default 0.999); "
                        "sentence encoders are compared on mean-pooled embeddings")
    common(p)
    p.set_defaults(run=_run_fold)

    p = subparsers.add_parser("verify", help="compare a folded folder with its original in float64")
    p.add_argument("orig_dir")
    p.add_argument("folded_dir")
    common(p)
    p.set_defaults(run=_run_verify)

    p = subparsers.add_parser("demo", help="fold the bundled trained model and show the report")
    p.set_defaults(run=_run_demo)


# -------------------------------------------------------------------------------------------- main

def _version_line() -> str:
    """normfold's version and the torch it runs on (what a bug report needs first)."""
    import torch

    from . import __version__

    return f"normfold {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normfold", description="LayerNorm's behaviour at RMSNorm's cost.")
    parser.add_argument("--version", action="version", version=_version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(subparsers)
    return parser


def _quiet_transformers() -> None:
    """No per-file progress bars or info logs from transformers: the command shows its own."""
    try:
        from transformers.utils import logging
    except ImportError:
        return
    logging.set_verbosity_error()
    logging.disable_progress_bar()


def _user_errors() -> tuple[type[BaseException], ...]:
    from .fold import FoldError, FoldVerificationError  # noqa: F401  (FoldError: unsupported model)
    from .hf.load import CheckpointError

    return (UsageError, CheckpointError, FoldError, ImportError)


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, message already printed)
        return int(exit_.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    from .fold import FoldVerificationError

    _quiet_transformers()
    try:
        with _quiet_torch_capture_logs():
            return args.run(args)
    except FoldVerificationError as err:
        print(f"normfold: verification failed: {err}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    except _user_errors() as err:
        print(f"normfold: error: {_first_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("normfold: interrupted; nothing was written", file=sys.stderr)
        return 130
    except OSError:  # the machine, not the model (a full disk, a vanished file): the system's own report
        raise
    except Exception as err:  # noqa: BLE001  the last boundary before the user: one line, never a traceback
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"normfold: error: {args.command} cannot handle this model: {type(err).__name__}: {_first_line(err)} "
              f"(not a known refusal; {TRACEBACK_ENV}=1 shows the traceback)", file=sys.stderr)
        return EXIT_USAGE


TRACEBACK_ENV = "NORMFOLD_TRACEBACK"  # set to re-raise an unexpected error with its traceback (for bug reports)
# torch.export logs a whole traceback (logging.ERROR) from these before raising the error the command reports
_CAPTURE_LOGGERS = ("torch._subclasses.fake_tensor", "torch.export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


@contextlib.contextmanager
def _quiet_torch_capture_logs():
    """Silence the tracebacks torch logs while capturing a model it then fails on: the command says
    why in one line. Levels are restored afterwards (``main`` also runs inside tests)."""
    loggers = [logging.getLogger(name) for name in _CAPTURE_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


if __name__ == "__main__":
    raise SystemExit(main())
