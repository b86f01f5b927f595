"""The output folder: checked before work starts, written as a temporary sibling (locked, verified
there) and swapped in atomically, so nothing is published before it is proved."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .load import CheckpointError, _first_line

REPORT_JSON = "normfold_report.json"  # every folder normfold writes holds one: what marks a folder as replaceable

TEMP_MARK = ".normfold-tmp-"  # temporary siblings are named .<out name>.normfold-tmp-XXXXXXXX
_HAS_FLOCK = importlib.util.find_spec("fcntl") is not None  # POSIX; not on Windows


def check_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                     protect: tuple[str | os.PathLike, ...] = ()) -> Path:
    """``out_dir`` as an absolute path, or CheckpointError when writing it could lose data.

    Refused: the output is a protected folder (the input model), inside one or an ancestor of one
    (replacing ``work`` would delete ``work/models/m``); a symbolic link; an existing file; an
    existing folder without ``overwrite``; with ``overwrite``, a folder that is neither empty nor
    a previous normfold output (one holding ``normfold_report.json``).
    """
    out = Path(os.path.abspath(out_dir))
    real = out.resolve()
    for p in protect:
        p = Path(p).resolve()
        if real == p or p in real.parents:
            raise CheckpointError(f"refusing to write into the input model folder {p}: pick another -o")
        if real in p.parents:
            raise CheckpointError(f"refusing to write {out}: it contains the input model folder {p}, "
                                  "which replacing it would delete; pick another -o")
    if out.is_symlink():
        raise CheckpointError(f"output path is a symbolic link: {out} (pass the folder it points to)")
    if not out.exists():
        return out
    if not out.is_dir():
        raise CheckpointError(f"output path exists and is not a folder: {out}")
    if not overwrite:
        raise CheckpointError(f"output folder exists: {out} (pass --overwrite to replace it)")
    if any(out.iterdir()) and not (out / REPORT_JSON).is_file():
        raise CheckpointError(f"refusing to replace {out}: it is not empty and holds no {REPORT_JSON}, so it is not "
                              "a normfold output (--overwrite only replaces those)")
    return out


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                      protect: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out_dir``; publish it as ``out_dir`` when the block
    finishes without an exception, so that ``out_dir`` only ever holds a complete output.

    Checks :func:`check_output_dir` first. The old output is replaced by one atomic exchange
    (Linux ``renameat2(RENAME_EXCHANGE)``), so a kill at any moment leaves ``out_dir`` either old
    or new, and the old one is deleted only after the exchange. On an exception the temporary
    folder is removed and ``out_dir`` is untouched. The temporary folder is locked (``flock``)
    while in use; folders a killed run left (``.<name>.normfold-tmp-*`` that nobody holds) are
    removed by the next run. The output folder gets the umask's permissions, like ``mkdir``.
    """
    out = check_output_dir(out_dir, overwrite=overwrite, protect=protect)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        tmp, lock = _locked_temporary(out)
    except OSError as err:  # e.g. a read-only parent: a user error, said before any work
        raise CheckpointError(f"cannot write a folder next to {out}: {_first_line(err)}") from err
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            os.close(lock)


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Remove the temporary siblings of ``out`` that no running normfold holds; returns them.
    Without ``flock`` (Windows) nothing tells a live run's folder from a dead one's: none is removed."""
    removed = []
    for p in out.parent.iterdir():
        if not p.name.startswith(f".{out.name}{TEMP_MARK}") or p.is_symlink() or not p.is_dir():
            continue
        lock = _try_lock(p)
        if lock is None:  # in use by another run (or just vanished)
            continue
        try:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
        finally:
            os.close(lock)
    return removed


def _locked_temporary(out: Path) -> tuple[Path, int | None]:
    """A new temporary sibling of ``out`` and the descriptor holding its lock (None without ``flock``).

    A concurrent run's cleanup may take the lock of (and remove) a folder between its creation
    and our lock: then it is not ours any more, and we make another.
    """
    while True:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}{TEMP_MARK}", dir=out.parent))
        if not _HAS_FLOCK:
            return tmp, None
        lock = _try_lock(tmp)
        if lock is not None:
            return tmp, lock


def _try_lock(folder: Path) -> int | None:
    """An open descriptor of ``folder`` holding an exclusive ``flock``, or None when another
    process holds it or the folder is gone. The lock dies with the process that holds it."""
    if not _HAS_FLOCK:
        return None
    import fcntl

    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.fstat(fd), os.stat(folder)):  # still the folder at that name
            return fd
    except OSError:  # BlockingIOError: held elsewhere; FileNotFoundError: removed meanwhile
        pass
    os.close(fd)
    return None


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` is exchanged with it atomically
    and deleted afterwards (it then sits at ``tmp``'s name, where a later run would clean it)."""
    if not out.exists():
        try:
            os.rename(tmp, out)
        except OSError as err:  # a non-empty folder appeared at out meanwhile: never merge into it
            raise CheckpointError(f"output folder {out} appeared while writing: {_first_line(err)}") from err
        return
    if not _exchange(tmp, out):  # no atomic exchange here: two renames, out missing in between
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.normfold-old-", dir=out.parent))  # not cleaned by others
        os.rename(out, old / out.name)
        os.rename(tmp, out)
        tmp = old
    shutil.rmtree(tmp, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where unsupported."""
    import ctypes
    import errno

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
