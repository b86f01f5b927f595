"""The fused C++ CPU kernel (``ops/csrc/norm_cpu.cpp``): built once on first use, then cached.

Built with ``torch.utils.cpp_extension.load`` into ``$NORMFOLD_CACHE_DIR`` (default
``~/.cache/normfold/cpp``), in a folder keyed by the source hash, the torch version and the
CPU's vector capability, so an edit, a torch upgrade or another machine gets its own build.
cpp_extension holds a file lock in that folder while it builds, so concurrent processes (pytest
workers) wait for one build instead of racing. Without a compiler the build fails and callers
fall back to the reference (``normfold.ops._library`` warns once).

Trigger the build ahead of time with ``python -m normfold.ops.build``.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "norm_cpu.cpp"

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


def build_dir() -> Path:
    """Where this source / torch / CPU combination is built."""
    sources = b"".join(path.read_bytes() for path in sorted(_SOURCE.parent.iterdir()) if path.suffix in (".cpp", ".h"))
    key = hashlib.sha256(sources + torch.__version__.encode() + " ".join(_cflags()).encode())
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


def _build_and_import(verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # cpp_extension waits for as long as its lock file exists; one left by a killed build would
    # block every later process, so a lock older than any real build is removed.
    lock = directory / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
    except FileNotFoundError:
        pass
    return cpp_extension.load(name=directory.name, sources=[str(_SOURCE)], extra_cflags=_cflags(),
                              extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=verbose)


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
