"""``normfold verify ORIG FOLDED``: judge a folder against its original (:func:`normfold.verify_folder`,
which composes the steps hf cannot compose itself). Exit 0 means: this folder, as transformers and normfold load it, is what normfold makes
from ORIG; approximate results also keep the cosine bar given here (``--min-cosine``, default 0.999)
on the calibration text given here (``--calibration``, the file the folder was made from)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..engine.cosine_bar import DEFAULT_MIN_COSINE, is_cosine_bar
from ..folders import verify_folder
from . import _output as output
from ._common import EXIT_OK, EXIT_VERIFY_FAILED, UsageError, add_trust_remote_code


def _run_verify(args) -> int:
    if args.min_cosine is not None and not is_cosine_bar(args.min_cosine):
        raise UsageError(f"--min-cosine must be in (0, 1], got {args.min_cosine}")
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise UsageError(f"--calibration: file not found: {args.calibration}")
    with output.steps(not args.json) as step:
        ver = verify_folder(args.orig_dir, args.folded_dir, revision=args.revision, calibration_file=args.calibration,
                            min_cosine=args.min_cosine, trust_remote_code=args.trust_remote_code, step=step)
    if args.json:
        print(json.dumps({"verification": ver}, indent=2, default=str))
    else:
        _print(ver)
    if not ver["ok"]:
        more = f" (and {len(ver['problems']) - 1} more problem(s) above)" if len(ver["problems"]) > 1 else ""
        print(f"normfold: verification failed: {ver['why']}{more}", file=sys.stderr)
    return EXIT_OK if ver["ok"] else EXIT_VERIFY_FAILED


def _print(ver: dict) -> None:
    """What was checked, one line each, then the outputs' verdict."""
    console = output.console()
    verdict = "[green]passed[/green]" if ver["ok"] else "[red]FAILED[/red]"
    console.print(f"verification: {verdict}" + (f" ({ver['kind']})" if ver.get("kind") else ""))
    files, outputs = ver.get("files"), ver.get("outputs")
    if files is not None:
        weights = files.get("weights")
        console.print(f"  files: {files['num_files']} compared with the folder re-made from the original"
                      + ("" if weights is None else f"; weights: {output.weights_text(weights)}"))
    if outputs is not None:
        if "promised_min_cosine" in outputs:
            console.print("  outputs: " + output.approximate_rule_line(outputs))
        else:
            output.print_verification(outputs, "rotation" if (ver.get("recipe") or {}).get("rotation") else "fold",
                                      title="  outputs of the folder as loaded, against the original")
            stock = outputs.get("stock_load")
            if stock is not None:
                console.print(f"  loaded by stock transformers: {'passed' if stock['ok'] else 'FAILED'}, max relative "
                              f"error {output.number(stock['max_rel_error'])} (tolerance {output.number(stock['tolerance'])})")
    for problem in ver["problems"]:
        console.print(f"  [red]problem[/red]: {problem}")


def add_commands(subparsers) -> None:
    """Add ``verify`` to the ``normfold`` command's subparsers."""
    p = subparsers.add_parser("verify", help="check a folder normfold wrote against its original: re-made from the "
                                             "original and compared file by file, loaded and compared in float64 "
                                             "(approximate results: against --min-cosine)")
    p.add_argument("orig_dir", metavar="ORIG_DIR", help="the original Hugging Face folder, or its hub model id")
    p.add_argument("folded_dir", metavar="FOLDED_DIR",
                   help="the folder 'normfold fold' (or rotate) wrote from it, or its hub model id")
    p.add_argument("--revision", metavar="REV", help="with a hub model id as ORIG_DIR: its branch, tag or commit")
    p.add_argument("--calibration", metavar="FILE",
                   help="the calibration text the folder was made from (folders made with --approximate or "
                        "--method pca: they are re-made from it, and measured on it)")
    p.add_argument("--min-cosine", type=float, metavar="X",
                   help=f"the lowest output cosine an approximate folder may have (default {DEFAULT_MIN_COSINE}); "
                        "a folder's own recorded bar is never used")
    p.add_argument("--json", action="store_true", help="print only the JSON result on stdout (numbers in full)")
    add_trust_remote_code(p)
    p.set_defaults(run=_run_verify)

