"""The ``normfold`` command.

    normfold analyze [MODEL_DIR]                      per-norm table (default: the bundled model)
    normfold fold MODEL_DIR -o OUT_DIR [--json]       fold, verify in float64, write OUT_DIR
        [--keep PATTERN] [--call KIND]                 leave norms as they are; fold for several kinds of call
        [--approximate --calibration FILE [--min-cosine 0.999]]   also replace the other norms, within a cosine bar
    normfold verify ORIG_DIR FOLDED_DIR               re-make the folder from its original, compare, load, prove
        [--calibration FILE] [--min-cosine 0.999]     (approximate folders and PCA rotations: the file they were made from)
    normfold rotate MODEL_DIR -o OUT_DIR              fold, rotate the residual stream, prove in float64, write OUT_DIR

MODEL_DIR (and ORIG_DIR, FOLDED_DIR) may be a Hugging Face model id (``--revision REV``); ``fold`` and
``rotate`` take the bundled toy model only with ``--bundled`` (instead of MODEL_DIR).
    normfold demo                                     fold the bundled model into a temp folder
    normfold inspect | check | train | bench          the lab, training and benchmarks

Exit codes: 0 ok, 1 verification failed (or ``check --strict`` found warnings), 2 usage or input
error, always one line on stderr (``NORMFOLD_TRACEBACK=1`` re-raises an unexpected error instead).

Subcommands are registered by the modules in ``COMMAND_MODULES``: each defines
``add_commands(subparsers)``, which adds its parsers and sets ``run=`` (``args -> exit code``) with
``set_defaults``. Options are spelled with dashes; :func:`build_parser` accepts the underscore
spelling of every one as a hidden alias (``--out_dir`` for ``--out-dir``).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

import torch

from .. import __version__
from .._options import dash_options
from .._text import first_line
from ..engine import FoldError, FoldVerificationError
from ..hf.load import CheckpointError
from ..hf.output_dir import disk_full_error
from ..train import cli as train_cli
from ..train.cli import TrainConfigError
from . import bench, folder, lab, onnx_export, rotate, verify
from ._common import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, UsageError

__all__ = ["main", "build_parser", "COMMAND_MODULES", "UsageError", "EXIT_OK", "EXIT_USAGE", "EXIT_VERIFY_FAILED"]

# Modules that add subcommands (each defines ``add_commands(subparsers)``; see the module docstring).
COMMAND_MODULES = (folder, verify, rotate, train_cli, lab, bench, onnx_export)

TRACEBACK_ENV = "NORMFOLD_TRACEBACK"  # set to re-raise an unexpected error with its traceback (for bug reports)

# the refusals a user can cause and fix: their message is the whole story (FoldVerificationError is a FoldError
# but is caught first: exit 1)
_USER_ERRORS = (UsageError, CheckpointError, FoldError, TrainConfigError, ImportError)

# torch.export logs a whole traceback (logging.ERROR) from these before raising the error the command reports
_CAPTURE_LOGGERS = ("torch._subclasses.fake_tensor", "torch.export", "torch._dynamo", "torch.fx.experimental.symbolic_shapes")


# -------------------------------------------------------------------------------------------- parser

def _version_line() -> str:
    """normfold's version and the torch it runs on (what a bug report needs first)."""
    return f"normfold {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an option it does not know is its error, named under the subcommand
    (``normfold fold: error: unrecognized arguments: --wrongflag``), before any other complaint
    (a missing ``-o`` would otherwise hide the misspelled option that was meant to give it)."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        unknown = self.unknown_options(getattr(self, "_given", []))
        if unknown and not message.startswith("unrecognized arguments"):
            message = f"unrecognized arguments: {' '.join(unknown)}"
        super().error(message)

    def unknown_options(self, given: list[str]) -> list[str]:
        """The words of ``given`` that look like options this parser does not take (its unique
        prefixes, ``--opt=value`` and ``-oVALUE`` forms are known; nothing after ``--`` is an option)."""
        given = given[:given.index("--")] if "--" in given else given
        known = self._option_string_actions
        unknown = []
        for word in given:
            if not word.startswith("-") or word == "-" or self._negative_number_matcher.match(word):
                continue
            name = word.split("=", 1)[0] if word.startswith("--") else word[:2]
            if not any(option.startswith(name) for option in known):
                unknown.append(word)
        return unknown


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="normfold", description="LayerNorm's behaviour at RMSNorm's cost.")
    parser.add_argument("--version", action="version", version=_version_line())
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser,
                                       help="'normfold COMMAND --help' for its options")
    for module in COMMAND_MODULES:
        module.add_commands(subparsers)
    for sub in subparsers.choices.values():
        dash_options(sub)
    return parser


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{command name: its parser}`` of the ``normfold`` parser."""
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(subparsers.choices)


# --------------------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # what the subcommand does not take: its own error, under its own name
            command = subcommand_parsers(parser).get(args.command, parser)
            command.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exit_:  # argparse: --help (0) or a usage error (2, message already printed)
        return int(exit_.code or 0)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    _quiet_transformers()
    try:
        with _quiet_torch_capture_logs():
            return args.run(args)
    except FoldVerificationError as err:
        print(f"normfold: verification failed: {err}", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    except _USER_ERRORS as err:
        print(f"normfold: error: {first_line(err)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        on_interrupt = getattr(args, "on_interrupt", None)  # a command that writes as it goes says what it left
        print(f"normfold: {on_interrupt(args) if on_interrupt else 'interrupted; nothing was written'}", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001  the last boundary before the user: one line, never a traceback
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"normfold: error: {_unexpected(err, args.command)}", file=sys.stderr)
        return EXIT_USAGE


def _unexpected(err: Exception, command: str) -> str:
    """The line for an error no command refused on purpose: a full disk as such (whatever library
    raised it), another error of the machine as the system said it, anything else as what it is."""
    full = disk_full_error(err)
    if full is not None:
        path = getattr(full, "filename", None)
        return f"no space left on device{f' while writing {path}' if path else ''}: free space or write elsewhere"
    if isinstance(err, OSError):  # the machine, not the model (a vanished file): what the system said
        return f"{first_line(err)} ({TRACEBACK_ENV}=1 shows the traceback)"
    return (f"{command} cannot handle this model: {type(err).__name__}: {first_line(err)} "
            f"(not a known refusal; {TRACEBACK_ENV}=1 shows the traceback)")


def _quiet_transformers() -> None:
    """No per-file progress bars or info logs from transformers: the command shows its own."""
    try:
        from transformers.utils import logging as transformers_logging  # optional dependency: only when installed
    except ImportError:
        return
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()


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
