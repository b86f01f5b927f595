"""The output folder: checked before work starts, written as a temporary sibling (locked, verified
there) and swapped in atomically, so nothing is published before it is proved."""
from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .._text import first_line
from .load import CheckpointError

REPORT_JSON = "normfold_report.json"  # every folder normfold writes holds one: what marks a folder as replaceable

TEMP_MARK = ".normfold-tmp-"  # temporary siblings are named .<out name>.normfold-tmp-XXXXXXXX
OLD_MARK = ".normfold-old-"  # where an old output waits for deletion without an atomic exchange (never cleaned by others)
LOCK_MARK = ".normfold-lock"  # .<out name>.normfold-lock: held by the run publishing to <out name>
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
    if not replaceable(out):
        raise CheckpointError(f"refusing to replace {out}: it is not empty and holds no {REPORT_JSON}, so it is not "
                              "a normfold output (--overwrite only replaces those)")
    return out


def replaceable(folder: Path) -> bool:
    """Whether ``--overwrite`` may replace ``folder``: a real folder, empty or a normfold output."""
    return (folder.is_dir() and not folder.is_symlink()
            and (not any(folder.iterdir()) or (folder / REPORT_JSON).is_file()))


# what the system says when a write finds the disk or the quota full
_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded")


def disk_full_error(err: BaseException) -> BaseException | None:
    """The error in ``err``'s chain (itself, its cause, its context...) that says the disk or the
    user's quota is full, or None: an OSError with ENOSPC / EDQUOT, or a library's error that only
    carries the system's text (safetensors' ``SafetensorError``: "... No space left on device ...")."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if (isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS) or any(t in str(err) for t in _DISK_FULL_TEXTS):
            return err
        err = err.__cause__ or err.__context__
    return None


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                      protect: tuple[str | os.PathLike, ...] = ()) -> Iterator[Path]:
    """Yield an empty temporary sibling of ``out_dir``; publish it as ``out_dir`` when the block
    finishes without an exception, so that ``out_dir`` only ever holds a complete output.

    Checks :func:`check_output_dir` first, and again when publishing, under a lock that runs
    publishing to the same ``out_dir`` take in turn (:func:`_publish`): the target is claimed
    atomically (``renameat2(RENAME_NOREPLACE)``), so a folder that appeared meanwhile is never
    replaced (CheckpointError naming it); with ``overwrite`` an old output is replaced by one
    atomic exchange (``RENAME_EXCHANGE``), so a kill at any moment leaves ``out_dir`` either old or
    new, and the old one is deleted only after the exchange and only if it still is empty or a
    normfold output. On an exception the temporary folder is removed and ``out_dir`` is untouched;
    a full disk becomes a CheckpointError saying so. The temporary folder is locked (``flock``)
    while in use; folders a killed run left (``.<name>.normfold-tmp-*`` that nobody holds) are
    removed by the next run. The output folder gets the umask's permissions, like ``mkdir``.
    """
    out = check_output_dir(out_dir, overwrite=overwrite, protect=protect)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(out)
        tmp, lock = _locked_temporary(out)
    except OSError as err:  # e.g. a read-only parent: a user error, said before any work
        raise CheckpointError(f"cannot write a folder next to {out}: {first_line(err)}") from err
    ours = os.lstat(tmp)
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        _publish(tmp, out, overwrite=overwrite)
    except BaseException as err:
        if _is(tmp, ours):  # not a folder a failed swap left at its name
            shutil.rmtree(tmp, ignore_errors=True)
        if disk_full_error(err) is not None:
            raise CheckpointError(f"no space left on device while writing {out}: free space or pick another -o "
                                  f"(nothing was published; {first_line(err)})") from err
        raise
    finally:
        if lock is not None:
            os.close(lock)


def _is(path: Path, stat: os.stat_result) -> bool:
    """Whether ``path`` still names the file ``stat`` was taken of (not another one put in its place)."""
    try:
        return os.path.samestat(os.lstat(path), stat)
    except FileNotFoundError:
        return False


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


def _try_lock(folder: Path, *, wait: bool = False) -> int | None:
    """An open descriptor of ``folder`` holding an exclusive ``flock``, or None when another
    process holds it (``wait``: wait until it lets go) or the folder is gone. The lock dies with
    the process that holds it."""
    if not _HAS_FLOCK:
        return None
    import fcntl

    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # gone, or not a folder
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        if os.path.samestat(os.fstat(fd), os.stat(folder)):  # still the folder at that name
            return fd
    except OSError:  # BlockingIOError: held elsewhere; FileNotFoundError: removed meanwhile
        pass
    os.close(fd)
    return None


def _publish(tmp: Path, out: Path, *, overwrite: bool) -> None:
    """Move the finished ``tmp`` to ``out``, after checking ``out`` again now: what the check at the
    start allowed may have changed while the run wrote. Runs publishing to one ``out`` take turns
    (:func:`_publish_lock`), and whatever else appears at ``out`` is never replaced: the claim is
    atomic (:func:`_claim`), and an old output is exchanged, then deleted only if it still is one
    (:func:`_replace`)."""
    with _publish_lock(out):
        try:
            check_output_dir(out, overwrite=overwrite)
        except CheckpointError as err:
            raise CheckpointError(_changed(out, first_line(err))) from None
        if overwrite and os.path.lexists(out):  # an empty folder or a normfold output, as just checked
            try:
                _replace(tmp, out)
            except FileNotFoundError as err:  # gone between the check and the swap: another program's doing
                raise CheckpointError(_changed(out, "it was moved or removed")) from err
        else:
            _claim(tmp, out)


_NOT_REPLACEABLE_NOW = "it is no longer empty or a normfold output"


def _changed(out: Path, why: str) -> str:
    """The message of a run whose output changed under it (another run, another program)."""
    return f"{out} changed while this run was writing ({why}); it was left as it is and nothing was published"


@contextlib.contextmanager
def _publish_lock(out: Path) -> Iterator[None]:
    """Held from the last check of ``out`` to its publication: an ``flock`` on ``.<name>.normfold-lock``
    beside it, waited for when another run holds it. The holder removes the file when done; a run
    that waited on a file removed meanwhile locks the new one instead. Without ``flock`` (Windows)
    there is no lock: the atomic claim alone keeps a concurrent run's output (the later run fails)."""
    if not _HAS_FLOCK:
        yield
        return
    import fcntl

    path = out.parent / f".{out.name}{LOCK_MARK}"
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # flock needs no write access
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                break
        except FileNotFoundError:  # its holder removed it while we waited
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _claim(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out`` only if nothing is there; CheckpointError naming ``out`` otherwise."""
    try:
        _rename_noreplace(tmp, out)
    except OSError as err:
        if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        raise CheckpointError(_changed(out, "something was created there")) from err


def _replace(tmp: Path, out: Path) -> None:
    """Publish ``tmp`` in place of ``out`` (an empty folder or a normfold output, checked under the
    publish lock) and delete the old folder, but only if it still is one once out of the way: a
    file that a program put into it between the check and the swap puts it back (CheckpointError).

    The old folder is locked first (:func:`_try_lock`), so that no other run's cleanup of stale
    temporaries takes it while it sits at ``tmp``'s name.
    """
    held = _try_lock(out, wait=True)
    try:
        if _exchange(tmp, out):  # one atomic step: a kill leaves the old or the new output at out
            if not replaceable(tmp):  # tmp now holds the old folder: swap it back
                try:
                    _exchange(tmp, out)
                except OSError as err:  # out vanished meanwhile: the folder stays where it is, and we say where
                    raise CheckpointError(_changed(out, f"{_NOT_REPLACEABLE_NOW}; it is now {tmp}")) from err
                raise CheckpointError(_changed(out, _NOT_REPLACEABLE_NOW))
            shutil.rmtree(tmp, ignore_errors=True)
            return
        # no atomic exchange here: the old folder is moved aside, then tmp claims out (out missing in between)
        aside = Path(tempfile.mkdtemp(prefix=f".{out.name}{OLD_MARK}", dir=out.parent))  # not cleaned by others
        old = aside / out.name
        try:
            os.rename(out, old)
        except OSError:
            aside.rmdir()
            raise
        try:
            if not replaceable(old):
                raise CheckpointError(_changed(out, _NOT_REPLACEABLE_NOW))
            _claim(tmp, out)
        except BaseException:
            _put_back(old, out)
            raise
        shutil.rmtree(aside, ignore_errors=True)
    finally:
        if held is not None:
            os.close(held)


def _put_back(old: Path, out: Path) -> None:
    """Return the folder moved aside to ``old`` to ``out``. If another output took ``out`` meanwhile
    (a concurrent run without ``flock``), one that ``--overwrite`` may replace is removed as it was
    going to be; any other stays at ``old``, and the error says where."""
    try:
        _rename_noreplace(old, out)
    except OSError as err:
        if not replaceable(old):
            raise CheckpointError(_changed(out, f"something was created there; the folder that was there is now "
                                                f"{old}")) from err
        shutil.rmtree(old.parent, ignore_errors=True)
        raise CheckpointError(_changed(out, "something was created there")) from err
    old.parent.rmdir()


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst`` only if nothing is at ``dst`` (else FileExistsError or ENOTEMPTY).

    Linux: one atomic ``renameat2(RENAME_NOREPLACE)``. Elsewhere a POSIX rename would silently
    replace an empty folder (or any file) at ``dst``, so ``dst`` is claimed first, atomically and
    failing on anything there (a dangling link included): a folder by ``mkdir``, then renamed onto
    the empty folder this run just made (only a program that removes that folder and makes its own
    empty one in the instant between loses that empty folder, never a file); a file or link by a
    hard link, then unlinked at ``src``. Windows' rename never replaces anything.
    """
    if _renameat2(src, dst, _RENAME_NOREPLACE):
        return
    if os.name == "nt":
        os.rename(src, dst)
        return
    if src.is_symlink() or not src.is_dir():
        os.link(src, dst, follow_symlinks=False)
        os.unlink(src)
        return
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # our claim, while it is empty; anything a program put into it stays
        raise


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False where unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # renameat2(2) flags, linux/fs.h


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """Linux ``renameat2(2)``: True when done, False where unsupported (another system, an old
    kernel or C library, a filesystem without the flag); OSError for any other failure."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError, TypeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
