"""The compiled-kernel cache (``normfold.ops._cpu``) imports a shared library only if it is provably
the one this user built: private folders and file, and the SHA-256 recorded after the build.

Each case runs ``_cpu.load()`` in a subprocess with its own ``NORMFOLD_CACHE_DIR``, seeded with a
copy of this session's build folder (so at most a relink runs, never a compile), and a planted
library whose constructor writes a marker file: the marker must never appear.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from torch.utils.cpp_extension import LIB_EXT

from normfold.ops import _cpu

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or not _cpu.kernel_available(),
                                reason="needs a C compiler and the fused C++ CPU kernel")

_PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
  const char* path = getenv("NF_PLANTED_MARKER");
  FILE* f = path ? fopen(path, "w") : NULL;
  if (f) { fputs("the planted library ran", f); fclose(f); }
}
"""

# The child loads the kernel as a fresh process would; NF_NO_BUILD replaces the build step with a
# failure (a recorded library must then load without it), NF_OTHER_UID poses as another account.
_CHILD = r"""
import json, os
from torch.utils import cpp_extension
if os.environ.get("NF_NO_BUILD"):
    def no_build(**kwargs):
        raise RuntimeError("build attempted (test stub)")
    cpp_extension.load = no_build
if os.environ.get("NF_OTHER_UID"):
    uid = os.getuid() + 1
    os.getuid = lambda: uid
from normfold.ops import _cpu
module = _cpu.load()
print(json.dumps({"loaded": module is not None and hasattr(module, "norm_fwd_eager"), "error": _cpu.build_error()}))
"""


SESSION_BUILD_DIR = _cpu.build_dir()  # where this test session's kernel was built


@pytest.fixture
def build_dir(tmp_path, monkeypatch) -> Path:
    """Where the child will look for the kernel: a cache root of its own under tmp_path."""
    monkeypatch.setenv("NORMFOLD_CACHE_DIR", str(tmp_path / "cache"))
    return _cpu.build_dir()  # same source, torch, ABI and flags as the session's: only the root differs


def _seed_from_session_build(build_dir):
    """Copy this session's build folder (objects, ninja files, library, record) to ``build_dir``."""
    shutil.copytree(SESSION_BUILD_DIR, build_dir, ignore=shutil.ignore_patterns("lock", "normfold.lock"))
    build_dir.chmod(0o700)
    build_dir.parent.chmod(0o700)


def _library(build_dir):
    return build_dir / f"{build_dir.name}{LIB_EXT}"


def _plant(build_dir, tmp_path):
    """Replace the library with one whose constructor writes a marker; returns its bytes."""
    source = tmp_path / "planted.c"
    source.write_text(_PLANTED_C)
    library = _library(build_dir)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60)
    return library.read_bytes()


def _write_record(build_dir, library_bytes):
    record = build_dir / "normfold_build.json"
    record.write_text(json.dumps({"sha256": hashlib.sha256(library_bytes).hexdigest()}))
    record.chmod(0o600)


def _load_in_child(tmp_path, **flags):
    env = dict(os.environ, NF_PLANTED_MARKER=str(tmp_path / "marker"))
    env.update({name: "1" for name, on in flags.items() if on})
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("record", ["no record", "record of the genuine library"])
def test_planted_library_is_never_imported_but_rebuilt(build_dir, tmp_path, record):
    """An up-to-date-looking build folder whose library was swapped: the swap is deleted, the
    library relinked from the folder's objects and recorded anew; the planted code never runs."""
    _seed_from_session_build(build_dir)
    if record == "no record":
        (build_dir / "normfold_build.json").unlink(missing_ok=True)
    else:
        _write_record(build_dir, _library(SESSION_BUILD_DIR).read_bytes())
    planted = _plant(build_dir, tmp_path)
    result = _load_in_child(tmp_path)
    assert not (tmp_path / "marker").exists(), "the planted library was imported"
    assert result == {"loaded": True, "error": None}
    rebuilt = _library(build_dir).read_bytes()
    assert rebuilt != planted
    record_file = build_dir / "normfold_build.json"
    assert json.loads(record_file.read_text())["sha256"] == hashlib.sha256(rebuilt).hexdigest()
    assert stat.S_IMODE(record_file.stat().st_mode) == 0o600


@pytest.mark.parametrize("unsafe", ["build folder group-writable", "cache folder world-writable",
                                    "owned by another user"])
def test_cache_another_account_could_write_is_refused(build_dir, tmp_path, unsafe):
    """Whoever can write the folder can write a matching record too: nothing in it is imported
    or rebuilt, the reference runs, and build_error() says which path and why."""
    _seed_from_session_build(build_dir)
    _write_record(build_dir, _plant(build_dir, tmp_path))  # the record matches the planted bytes
    if unsafe == "build folder group-writable":
        build_dir.chmod(0o770)
    elif unsafe == "cache folder world-writable":
        build_dir.parent.chmod(0o777)
    result = _load_in_child(tmp_path, NF_OTHER_UID=unsafe == "owned by another user")
    assert not (tmp_path / "marker").exists(), "the planted library was imported"
    assert result["loaded"] is False
    if unsafe == "owned by another user":
        assert f"refusing the kernel cache at {build_dir.parent}: expected it owned by uid" in result["error"]
    else:
        folder = build_dir if unsafe.startswith("build") else build_dir.parent
        assert f"refusing the kernel cache at {folder}: expected a real file or folder writable only by its owner" \
            in result["error"]


def test_group_writable_library_is_rebuilt_not_imported(build_dir, tmp_path):
    """A library others could have rewritten since its record was made is relinked, not trusted."""
    _seed_from_session_build(build_dir)
    planted = _plant(build_dir, tmp_path)
    _write_record(build_dir, planted)
    _library(build_dir).chmod(0o775)
    assert _load_in_child(tmp_path) == {"loaded": True, "error": None}
    assert not (tmp_path / "marker").exists(), "the planted library was imported"
    assert _library(build_dir).read_bytes() != planted
    assert not _library(build_dir).stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def test_recorded_library_is_imported_without_building(build_dir, tmp_path):
    """A private folder whose library matches its record loads with the build step disabled."""
    _seed_from_session_build(build_dir)
    assert (build_dir / "normfold_build.json").exists(), "the session's build left no record"
    assert _load_in_child(tmp_path, NF_NO_BUILD=True) == {"loaded": True, "error": None}


def test_new_cache_folders_are_private(build_dir, tmp_path):
    """Folders the cache creates are 0700 whatever the umask allows (here 022: 0755 before)."""
    old_umask = os.umask(0o022)
    try:
        result = _load_in_child(tmp_path, NF_NO_BUILD=True)
    finally:
        os.umask(old_umask)
    assert "build attempted (test stub)" in result["error"]
    for folder in (build_dir.parent.parent, build_dir.parent, build_dir):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


def test_cache_key_changes_with_the_python_abi(monkeypatch):
    """A library built for one Python ABI must not be found by another interpreter."""
    base = _cpu.build_dir()
    monkeypatch.setattr(sys.implementation, "cache_tag", "cpython-999")
    other_tag = _cpu.build_dir()
    monkeypatch.undo()
    real_get = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var",
                        lambda name: "cpython-311d-x86_64-linux-gnu" if name == "SOABI" else real_get(name))
    other_soabi = _cpu.build_dir()
    assert len({base, other_tag, other_soabi}) == 3
    assert base.parent == other_tag.parent == other_soabi.parent


@pytest.mark.parametrize("error, remedy", [
    ("UnsafeCacheError: refusing the kernel cache at /x: expected it owned by uid 0, got uid 1",
     "Fix the cache folder's ownership or permissions"),
    ("RuntimeError: Error building extension 'norm_cpu': ninja not found", "Install a C++ compiler and ninja"),
])
def test_fallback_warning_names_the_remedy_for_its_cause(monkeypatch, error, remedy):
    """A refused cache is not fixed by installing a compiler: the one-time warning says what is."""
    from normfold.ops import _library

    monkeypatch.setattr(_cpu, "kernel_available", lambda: False)
    monkeypatch.setattr(_cpu, "build_error", lambda: error)
    monkeypatch.setattr(_library, "_warned", set())
    with pytest.warns(RuntimeWarning) as caught:
        assert _library._cpu_backend() is None
    message = str(caught[0].message)
    assert error in message and remedy in message
