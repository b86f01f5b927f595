"""What every ``normfold`` subcommand shares: exit codes, the usage error, the model-folder argument."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..hf.load import default_model_path, resolve_model

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(ValueError):
    """A bad command line that argparse cannot see (e.g. two options that do not go together)."""


def add_model_dir(parser, what: str = "Hugging Face folder", *, required: bool = False) -> None:
    """The MODEL_DIR positional (a folder or a hub model id) and ``--revision``. ``required``: the
    bundled toy model only through ``--bundled`` (a command that writes must not fold it by accident);
    otherwise MODEL_DIR defaults to it."""
    default = "or --bundled for the bundled toy model" if required else "default: the bundled model"
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR",
                        help=f"{what}, or a Hugging Face model id such as openai-community/gpt2 ({default})")
    parser.add_argument("--revision", metavar="REV",
                        help="with a hub model id: the branch, tag or commit to use (default: main)")
    if required:
        parser.add_argument("--bundled", action="store_true",
                            help="use the bundled toy model (a small trained byte-level GPT-2) instead of MODEL_DIR")


def add_trust_remote_code(parser) -> None:
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the folder's own modeling code to run (off by default)")


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts (batch sizes, lengths, rounds): an int >= 1, else argparse's usage error."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def model_dir(args) -> Path:
    """The command's MODEL_DIR, a hub id resolved to its snapshot (:func:`normfold.hf.load.resolve_model`),
    or the bundled model (without MODEL_DIR where it is the default, or with ``--bundled``)."""
    bundled = getattr(args, "bundled", None)  # None: the command defaults to the bundled model
    if bundled and args.model_dir:
        raise UsageError(f"give MODEL_DIR ({args.model_dir}) or --bundled, not both")
    if bundled is False and not args.model_dir:
        raise UsageError(f"{args.command} needs MODEL_DIR: a folder or a Hugging Face model id (e.g. "
                         "openai-community/gpt2), or --bundled for the bundled toy model")
    if not args.model_dir:
        if args.revision is not None:
            raise UsageError("--revision applies to a hub model id given as MODEL_DIR")
        return default_model_path()
    return resolve_model(args.model_dir, args.revision)
