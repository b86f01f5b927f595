"""What every ``normfold`` subcommand shares: exit codes, the usage error, the model-folder argument."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..hf.load import default_model_path

EXIT_OK, EXIT_VERIFY_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(ValueError):
    """A bad command line that argparse cannot see (e.g. two options that do not go together)."""


def add_model_dir(parser, what: str = "Hugging Face folder") -> None:
    """The optional MODEL_DIR positional (default: the bundled model)."""
    parser.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help=f"{what} (default: the bundled model)")


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
    """The command's MODEL_DIR, or the bundled model when none was given."""
    return Path(args.model_dir) if args.model_dir else default_model_path()
