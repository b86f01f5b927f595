"""``normfold rotate DIR -o OUT``: rotate a folder's residual stream (``normfold.rotate``, proved in
float64) and write the result atomically: hf loads and saves, ``rotate`` rotates (hf never imports
rotate: :mod:`normfold.folders` composes them). ``--method pca --calibration FILE [--slice F]`` takes the basis from the
calibration text and may slice it (SliceGPT): the whole rotation is proved first, the sliced model is
measured (cosine, loss) and ``normfold verify`` measures it again, never calling it exact.
``--method learned --calibration FILE [--steps N] [--lr X] [--calibration-count N]`` learns the bases
for the W4-quantized model (``normfold.rotate``'s ``LearnConfig``) and stores them in the folder, so
that ``normfold verify`` re-makes it from them without learning again."""
from __future__ import annotations

import json
from pathlib import Path

from ..folders import learned_rotation_step, rotation_step, streaming_rotation_step
from ..hf.load import load_config
from ..hf.rotate_folder import rotate_checkpoint, rotate_folder
from ..hf.recipe import SEED_RANGE
from ..hf.report import read_folder_report
from ..hf.streaming import is_sharded
from ..rotate import LearnConfig, OptionNames, check_rotate_options, kept_directions
from . import _output as output
from ._common import EXIT_OK, UsageError, add_model_dir, add_trust_remote_code, model_dir

_JSON_KEYS = ("rotation", "verification", "calibration", "model", "out_dir", "saved_dtype", "stock_compatible",
              "stock_warning", "skipped_files")


def _run_rotate(args) -> int:
    source = model_dir(args)
    streaming = args.stream or is_sharded(source)  # sharded checkpoints are streamed: never loaded whole
    learning = _check_supported(args, source, streaming=streaming)
    with output.steps(not args.json) as step:
        if learning is not None:
            report = rotate_folder(source, args.output, learned_rotation_step(args.seed, learning),
                                   calibration_file=args.calibration, calibration_count=args.calibration_count,
                                   overwrite=args.overwrite, trust_remote_code=args.trust_remote_code, step=step)
        elif streaming:
            report = rotate_checkpoint(source, args.output, streaming_rotation_step(args.method, args.seed),
                                       overwrite=args.overwrite, trust_remote_code=args.trust_remote_code, step=step)
        else:
            report = rotate_folder(source, args.output, rotation_step(args.method, args.seed, args.slice or 0.0),
                                   calibration_file=args.calibration, overwrite=args.overwrite,
                                   trust_remote_code=args.trust_remote_code, step=step)
    if args.json:
        print(json.dumps({k: report[k] for k in _JSON_KEYS if k in report}, indent=2, default=str))
    else:
        rotation = report["rotation"]
        output.console().print(f"rotated ({rotation['method']}, seed {rotation['seed']}): "
                               f"{len(rotation['streams'])} residual stream(s)")
        if rotation.get("slicing") is not None:
            output.console().print("the whole rotation, before slicing, proved in float64:")
        if rotation.get("learning") is not None:
            output.console().print(_learning_line(rotation["learning"]))
        output.print_verification(report["verification"], "rotation")
        if rotation.get("slicing") is not None:
            output.console().print(_slicing_line(rotation["slicing"], rotation["streams"]))
        output.console().print(f"wrote [bold]{report['out_dir']}[/bold]")
    written = read_folder_report(Path(report["out_dir"]))
    output.warn(written.stock_warning)
    output.warn_skipped_files(written)
    return EXIT_OK


def _learning_line(learning: dict) -> str:
    return (f"learned for {learning['scheme']} ({learning['steps']} steps, lr {learning['lr']:g}) on "
            f"{learning['calibration_calls']} calibration batch(es): loss {learning['start_loss']:.4g} -> "
            f"{learning['end_loss']:.4g}; returned the {learning['returned']} bases ({learning['returned_why']})")


def _slicing_line(slicing: dict, streams: list[dict]) -> str:
    widths = ", ".join(f"{s['stream']['width']} -> {s['kept']}" for s in streams)
    losses = "".join(f"; {name} {a:.4f} -> {b:.4f}" for name, (a, b) in slicing["losses"].items())
    return (f"sliced {slicing['fraction']:.0%} (width {widths}): approximate, not exact: on "
            f"{slicing['calibration_calls']} calibration batch(es) min cosine {slicing['min_cosine']:.6f}, mean "
            f"{slicing['mean_cosine']:.6f}{losses}")


_OPTIONS = OptionNames("--slice", lambda method: f"--method {method}", "--calibration FILE",
                       "--calibration FILE (UTF-8 text, one example per line, tokenized with the folder's tokenizer): "
                       "the principal directions are those of its residual stream")


def _check_supported(args, source: Path, *, streaming: bool) -> LearnConfig | None:
    """UsageError, before any loading, for bad combinations and what folders do not support yet;
    the learning's config for ``--method learned``."""
    if not SEED_RANGE[0] <= args.seed <= SEED_RANGE[1]:
        raise UsageError(f"--seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (what torch's generators take), "
                         f"got {args.seed}")
    try:  # the rotation's own rules (normfold.rotate.RotateConfig), spelled as this command's options
        check_rotate_options(args.method, args.seed, 0.0 if args.slice is None else args.slice,
                             args.calibration is not None, _OPTIONS)
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    if streaming and args.method in ("pca", "learned"):
        raise UsageError(f"--method {args.method} needs the whole model in memory (the stream's covariance, or "
                         "learning on the calibration text): not available with --stream or sharded folders (use "
                         "--method hadamard or random)")
    if args.slice:
        _check_heads_keep_directions(source, args.slice, args.trust_remote_code)
    return _learning(args)


def _learning(args) -> LearnConfig | None:
    """``--steps``, ``--lr`` and ``--calibration-count`` as the learning's config (``LearnConfig``'s rules,
    spelled as this command's options); UsageError for them without ``--method learned``."""
    given = [name for name, value in (("--steps", args.steps), ("--lr", args.lr),
                                      ("--calibration-count", args.calibration_count)) if value is not None]
    if args.method != "learned":
        if given:
            raise UsageError(f"{', '.join(given)} apply only to --method learned, got --method {args.method}")
        return None
    if args.calibration_count is not None and args.calibration_count < 1:
        raise UsageError(f"--calibration-count must be at least 1, got {args.calibration_count}")
    options = {k: v for k, v in (("steps", args.steps), ("lr", args.lr)) if v is not None}
    try:
        return LearnConfig(**options)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--{exc}") from exc


def _check_heads_keep_directions(source: Path, fraction: float, trust_remote_code: bool) -> None:
    """UsageError when slicing ``fraction`` of the stream leaves fewer directions than the model has
    attention heads (each head must still read at least one), read from the config alone."""
    config = load_config(source, trust_remote_code=trust_remote_code).get_text_config()
    width, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if not isinstance(width, int) or not isinstance(heads, int):
        return  # no such config fields: normfold.rotate still refuses a fraction that keeps nothing
    kept = kept_directions(width, fraction)
    if kept < heads:
        raise UsageError(f"--slice {fraction} keeps {kept} of the {width} directions of the residual stream, fewer "
                         f"than the model's {heads} attention heads (at least one each): use a fraction of at most "
                         f"{1 - heads / width:.4f}")


def add_commands(subparsers) -> None:
    """Add ``rotate`` to the ``normfold`` command's subparsers."""
    p = subparsers.add_parser("rotate", help="fold, rotate the residual stream (QuaRot-style), prove in float64 "
                                             "and write the result (load it with normfold.from_pretrained)")
    add_model_dir(p, required=True)
    p.add_argument("-o", "--output", metavar="OUT_DIR", required=True,
                   help="new folder to write (must not exist; not the input, inside it or above it)")
    p.add_argument("--method", choices=["hadamard", "random", "pca", "learned"], default="hadamard",
                   help="the orthogonal basis: a seeded randomised Hadamard (default), a seeded Haar-random "
                        "matrix, the principal directions of the stream on --calibration, or the Hadamard basis "
                        "learned on --calibration for the W4-quantized model (stored in the folder)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random signs / matrix (default 0)")
    p.add_argument("--calibration", metavar="FILE",
                   help="with --method pca or learned: UTF-8 text, one example per line, tokenized with the folder's "
                        "tokenizer")
    p.add_argument("--steps", type=int, metavar="N", help="with --method learned: Adam steps (default 100)")
    p.add_argument("--lr", type=float, metavar="X", help="with --method learned: Adam's learning rate (default 1e-3)")
    p.add_argument("--calibration-count", type=int, metavar="N",
                   help="with --method learned: learn on the first N lines of --calibration only (default: all)")
    p.add_argument("--slice", type=float, metavar="FRACTION",
                   help="with --method pca: drop this share of the stream's directions, the least used (SliceGPT); "
                        "approximate: the whole rotation is proved first, the sliced model measured on the calibration")
    p.add_argument("--stream", action="store_true",
                   help="rewrite the safetensors shard by shard without loading the model (automatic for sharded "
                        "folders; hadamard or random): every block proved in float64 against the original's with "
                        "Q applied to its stream")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it is empty or an earlier normfold output, once the new one is proved")
    p.add_argument("--json", action="store_true", help="print only the JSON report on stdout (numbers in full)")
    add_trust_remote_code(p)
    p.set_defaults(run=_run_rotate)
