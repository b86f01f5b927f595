"""The fused C++ CPU kernel (``ops/csrc/norm_cpu.cpp``): built once on first use, then cached.

Built with ``torch.utils.cpp_extension.load`` into ``$NORMFOLD_CACHE_DIR`` (default
``~/.cache/normfold/cpp``), in a folder keyed by the source hash, the torch version, the Python
ABI and the CPU's vector capability, so an edit, a torch or Python upgrade or another machine gets
its own build. A file lock in that folder is held while a process checks, builds or imports it,
so concurrent processes (pytest workers) wait for one build instead of racing. Without a compiler the build
fails and callers fall back to the reference (``normfold.ops._library`` warns once).

Importing a shared library runs its code, so a cached one is imported only if it is provably the
one this user built: the cache folders (created 0700) and the library must belong to the current
user and be writable by nobody else, and the library's SHA-256 must match the record written
right after its build. An unrecorded or mismatching library is deleted and rebuilt; a folder that
fails the ownership check is refused (the reference runs, ``build_error()`` says why).

Trigger the build ahead of time with ``python -m normfold.ops.build``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import stat
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

from ..._progress import notice

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_SOURCES = (_CSRC / "norm_cpu.cpp", _CSRC / "center_cpu.cpp")  # norm_cpu.cpp holds the Python bindings

# Compiler flags per torch CPU capability: ATen's Vectorized picks its implementation from the
# CPU_CAPABILITY_* macro, and the -m flags let the compiler emit those instructions.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}
# -ffp-contract=off: no implicit fused multiply-adds, so an expression like g − mean(g) is exactly 0
# when it should be (LayerNorm over one element), in the scalar tails as in the vector body.
_BASE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
_STALE_LOCK_S = 900  # a build takes ~1 min on 2 busy cores

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch or an unknown platform: build the portable version
        return "DEFAULT"


def _cflags() -> list[str]:
    return _BASE_FLAGS + _CAPABILITY_FLAGS.get(_capability(), ["-DCPU_CAPABILITY=DEFAULT"])


def _abi_tag() -> str:
    """The Python ABI the extension is compiled against: a library built for another one must not load."""
    return f"{sys.implementation.cache_tag} {sysconfig.get_config_var('SOABI')}"


def build_dir() -> Path:
    """Where this source / torch / Python ABI / CPU combination is built."""
    sources = b"".join(path.read_bytes() for path in sorted(_CSRC.iterdir()) if path.suffix in (".cpp", ".h"))
    key = hashlib.sha256(sources + torch.__version__.encode() + " ".join(_cflags()).encode() + _abi_tag().encode())
    root = Path(os.environ.get("NORMFOLD_CACHE_DIR") or Path.home() / ".cache" / "normfold") / "cpp"  # "" = unset
    return root / f"norm_cpu_{key.hexdigest()[:16]}"


def load(verbose: bool = False) -> ModuleType | None:
    """Build (first time) and import the extension; None, with ``build_error()`` set, if that fails."""
    global _module, _error
    if _module is not None:  # the common case, without taking the lock
        return _module
    with _lock:
        if _module is not None or _error is not None:
            return _module
        for attempt in range(2):  # a second try covers a concurrent builder that died mid-build
            try:
                _module = _build_and_import(verbose)
                _error = None
                break
            except Exception as exc:  # no compiler, no ninja, read-only home, ...: fall back, never fail
                _error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        return _module


class UnsafeCacheError(RuntimeError):
    """A kernel cache folder or file that another account could have written: never imported from."""


def _build_and_import(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    directory = build_dir()
    _make_private_dirs(directory)
    for folder in (directory.parent, directory):
        _check_private(folder)
    library = directory / f"{directory.name}{cpp_extension.LIB_EXT}"
    record = directory / "normfold_build.json"
    with _exclusive(directory / "normfold.lock"):  # no other process deletes or builds meanwhile
        recorded = _recorded_sha256(record)
        if recorded is not None and recorded == _sha256_if_private(library):
            return _import_library(directory.name, library)
        # Unrecorded, tampered with or half-built: never imported, built afresh.
        library.unlink(missing_ok=True)
        record.unlink(missing_ok=True)
        # cpp_extension waits for as long as its lock file exists; one left by a killed build would
        # block every later process, so a lock older than any real build is removed.
        lock = directory / "lock"
        try:
            if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
                lock.unlink()
        except FileNotFoundError:
            pass
        # announced even in a log or a pipe: a silent first run of one to two minutes looks like a hang
        with notice(f"building the C++ CPU kernel once, in {directory} (1-2 minutes; later runs load it)",
                    always=True):
            module = cpp_extension.load(name=directory.name, sources=[str(path) for path in _SOURCES],
                                        extra_cflags=_cflags(), extra_ldflags=["-fopenmp"],
                                        build_directory=str(directory), verbose=verbose)
        _write_record(record, library)
        return module


def _make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents with mode 0700 (existing ones are left as they are)."""
    missing = [folder for folder in (directory, *directory.parents) if not folder.exists()]
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)


def _check_private(path: Path) -> os.stat_result:
    """Raise UnsafeCacheError unless ``path`` (not followed if a link) is owned by this user and
    writable by no one else; returns its stat."""
    info = path.lstat()
    if info.st_uid != os.getuid():
        raise UnsafeCacheError(f"refusing the kernel cache at {path}: expected it owned by uid {os.getuid()}, "
                               f"got uid {info.st_uid}")
    if stat.S_ISLNK(info.st_mode) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(f"refusing the kernel cache at {path}: expected a real file or folder writable "
                               f"only by its owner, got mode {stat.filemode(info.st_mode)} "
                               f"(`chmod go-w {path}` if you trust it)")
    return info


def _sha256_if_private(library: Path) -> str | None:
    """The library's SHA-256, or None when it is missing or not private (then it is rebuilt)."""
    try:
        _check_private(library)
        return hashlib.sha256(library.read_bytes()).hexdigest()
    except (FileNotFoundError, UnsafeCacheError):
        return None


def _recorded_sha256(record: Path) -> str | None:
    """The SHA-256 written after the last successful build, or None when absent, unreadable or not private."""
    try:
        _check_private(record)
        value = json.loads(record.read_text())["sha256"]
    except (FileNotFoundError, UnsafeCacheError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, str) and len(value) == 64 else None


def _write_record(record: Path, library: Path) -> None:
    """Record the just-built library's SHA-256 (written whole or not at all, mode 0600)."""
    # the linker honours the umask (0775 under umask 002); nobody else can write in this 0700 folder
    library.chmod(stat.S_IMODE(library.stat().st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    digest = _sha256_if_private(library)
    assert digest is not None, f"cpp_extension built {library} not private to this user"
    fd, tmp = tempfile.mkstemp(dir=record.parent, prefix=".normfold_build.")  # mkstemp: mode 0600
    with os.fdopen(fd, "w") as f:
        json.dump({"library": library.name, "sha256": digest, "torch": torch.__version__, "abi": _abi_tag()}, f)
    os.replace(tmp, record)


def _import_library(name: str, library: Path) -> ModuleType:
    """Import a recorded library as cpp_extension would, without running its build step."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive advisory lock on ``lock_path``; the OS drops it if the process dies."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): cpp_extension's own build lock still serializes builds
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def kernel_available() -> bool:
    """True when the fused CPU kernel is built (building it now if needed)."""
    return load() is not None


def set_stream_sum_bytes(nbytes: int) -> int:
    """Stream residual sums of at least ``nbytes`` (see norm_cpu.cpp); returns the previous threshold."""
    module = load()
    if module is None:
        raise RuntimeError(f"the fused CPU kernel is not available: {_error}")
    return module.set_stream_sum_bytes(nbytes)


def build_error() -> str | None:
    """Why the kernel could not be built, or None."""
    return _error


def norm_fwd(x: Tensor, weight: Tensor | None, bias: Tensor | None, residual: Tensor | None, eps: float,
             offset: float, is_rms: bool, out: Tensor | None = None,
             residual_out: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Backend contract forward (see ``normfold.ops._library``)."""
    return _module.norm_fwd(x, weight, bias, residual, eps, offset, is_rms, out, residual_out)


def norm_bwd(dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, mean: Tensor | None, rstd: Tensor,
             offset: float, is_rms: bool, has_bias: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Backend contract backward (see ``normfold.ops._library``)."""
    return _module.norm_bwd(dy, ds, s, weight, mean, rstd, offset, is_rms, has_bias)
