""":class:`CheckpointError`, the user error every part of ``normfold.hf`` raises for a folder it cannot
read or write, and how an underlying exception is worded in one."""
from __future__ import annotations

import re

_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colours some libraries put in their messages


class CheckpointError(ValueError):
    """A folder cannot be read as a model, or the output folder cannot be written: a user error."""


def _first_line(err: BaseException) -> str:
    """The first line of an exception's message, without terminal colour codes (its type name when it
    has none)."""
    text = _TERMINAL_CODES.sub("", str(err)).strip() or type(err).__name__
    return text.splitlines()[0]
