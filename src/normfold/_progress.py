"""Progress for long work: bars for loops, a one-line notice for a single wait.

A leaf module (every layer may import it). Output goes to stderr so that ``--json`` output on stdout
stays machine-readable. Shown when stderr is a terminal; ``NORMFOLD_PROGRESS=1`` forces it on
(e.g. in CI logs), ``NORMFOLD_PROGRESS=0`` off. Bars use tqdm when it is installed (it comes with the
``hf`` extra); without it a loop runs silently.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def enabled(*, unless_off: bool = False) -> bool:
    """Whether progress is shown: ``NORMFOLD_PROGRESS`` if set, else whether stderr is a terminal
    (``unless_off``: shown unless ``NORMFOLD_PROGRESS`` turns it off, terminal or not)."""
    setting = os.environ.get("NORMFOLD_PROGRESS", "").strip().lower()
    if setting in {"0", "false", "no", "off"}:
        return False
    if setting in {"1", "true", "yes", "on"} or unless_off:
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


def progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """``items`` unchanged, with a progress bar on stderr while they are consumed (when :func:`enabled`)."""
    if not enabled():
        yield from items
        return
    try:
        from tqdm.auto import tqdm
    except ImportError:
        yield from items
        return
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True) as bar:
        yield from bar


@contextlib.contextmanager
def notice(message: str, *, always: bool = False) -> Iterator[None]:
    """One line on stderr for a single long wait: ``message ...`` then ``done in 12.3 s`` (when :func:`enabled`;
    ``always``: a wait long enough to look like a hang, announced in logs and pipes too, unless turned off)."""
    if not enabled(unless_off=always):
        yield
        return
    start = time.perf_counter()
    print(f"normfold: {message} ...", file=sys.stderr, flush=True)
    try:
        yield
    except BaseException:
        print(f"normfold: {message}: failed after {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        raise
    print(f"normfold: {message}: done in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
