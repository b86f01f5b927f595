"""How messages word two things every layer names: an exception (its first line) and a dtype.

A leaf module: every layer may import it.
"""
from __future__ import annotations

import re

_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # colours some libraries put in their messages


def first_line(err: BaseException, limit: int | None = None) -> str:
    """The first line of an exception's message, without terminal colour codes (its type name when it
    has none), cut to ``limit`` characters when given (a message that prints a whole tensor)."""
    text = _TERMINAL_CODES.sub("", str(err)).strip() or type(err).__name__
    return text.splitlines()[0][:limit]


def dtype_name(dtype) -> str:
    """``float16`` for ``torch.float16`` (or for the string "torch.float16"): how messages and reports
    name a dtype."""
    return str(dtype).replace("torch.", "")


__all__ = ["dtype_name", "first_line"]
