"""``normfold rotate DIR -o OUT``: rotate a folder's residual stream (``normfold.rotate``, proved in
float64) and write the result atomically, composed here: hf loads and saves, ``rotate`` rotates
(hf never imports rotate)."""
from __future__ import annotations

import json
from functools import partial

from ..hf.rotate_folder import rotate_folder
from ..hf.streaming import is_sharded
from ..rotate import rotate
from . import _output as output
from ._common import EXIT_OK, UsageError, add_model_dir, add_trust_remote_code, model_dir

FOLDER_METHODS = ("hadamard", "random")  # "pca" needs calibration inputs and slicing: API only for now

_JSON_KEYS = ("rotation", "verification", "model", "out_dir", "saved_dtype", "stock_compatible", "stock_warning",
              "skipped_files")


def _run_rotate(args) -> int:
    source = model_dir(args)
    _check_supported(args, sharded=is_sharded(source))
    rotate_step = partial(rotate, method=args.method, seed=args.seed)
    with output.steps(not args.json) as step:
        report = rotate_folder(source, args.output, rotate_step, overwrite=args.overwrite,
                               trust_remote_code=args.trust_remote_code, step=step)
    if args.json:
        print(json.dumps({k: report[k] for k in _JSON_KEYS if k in report}, indent=2, default=str))
    else:
        rotation = report["rotation"]
        output.console().print(f"rotated ({rotation['method']}, seed {rotation['seed']}): "
                               f"{len(rotation['streams'])} residual stream(s)")
        output.print_verification(report["verification"])
        output.console().print(f"wrote [bold]{report['out_dir']}[/bold]")
    output.warn(report["stock_warning"])
    output.warn_skipped_files(report)
    return EXIT_OK


def _check_supported(args, *, sharded: bool) -> None:
    """UsageError, before any loading, for what ``normfold.rotate`` does but folders do not yet."""
    if args.method not in FOLDER_METHODS:
        raise UsageError(f"--method {args.method} (it needs calibration inputs) is not supported for folders yet: "
                         f"use {' or '.join(FOLDER_METHODS)}, or normfold.rotate in Python")
    if args.slice is not None:
        raise UsageError("--slice is not supported for folders yet: slicing is approximate and needs --method pca; "
                         "use normfold.rotate(..., method='pca', slice_fraction=...) in Python")
    if args.stream or sharded:
        raise UsageError("--stream (and sharded checkpoints) is not supported for folders yet: rotate loads the whole "
                         "model in memory")


def add_commands(subparsers) -> None:
    """Add ``rotate`` to the ``normfold`` command's subparsers."""
    p = subparsers.add_parser("rotate", help="fold, rotate the residual stream (QuaRot-style), prove in float64 "
                                             "and write the result (load it with normfold.from_pretrained)")
    add_model_dir(p)
    p.add_argument("-o", "--output", metavar="OUT_DIR", required=True,
                   help="new folder to write (must not exist; not the input, inside it or above it)")
    p.add_argument("--method", choices=["hadamard", "random", "pca"], default="hadamard",
                   help="the orthogonal basis: a seeded randomised Hadamard (default) or a seeded Haar-random "
                        "matrix; pca is not supported for folders yet")
    p.add_argument("--seed", type=int, default=0, help="seed of the random signs / matrix (default 0)")
    p.add_argument("--slice", type=float, metavar="FRACTION",
                   help="not supported for folders yet (slicing is approximate; use normfold.rotate in Python)")
    p.add_argument("--stream", action="store_true",
                   help="not supported for folders yet (sharded checkpoints are refused: rotate loads the model)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it is empty or an earlier normfold output, once the new one is proved")
    p.add_argument("--json", action="store_true", help="print only the JSON report on stdout (numbers in full)")
    add_trust_remote_code(p)
    p.set_defaults(run=_run_rotate)
