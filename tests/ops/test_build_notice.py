"""The first-use C++ kernel build says so on stderr, in one line with its elapsed time; a cached
kernel loads silently. (The compiler is replaced by a stub: no real build runs here.)"""
from __future__ import annotations

import types
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from normfold.ops import _cpu


@pytest.fixture
def stub_build(tmp_path, monkeypatch):
    """A cache in ``tmp_path`` and a 'compiler' that writes a file where the library goes."""
    monkeypatch.setenv("NORMFOLD_CACHE_DIR", str(tmp_path))
    built = []

    def fake_load(*, name, build_directory, **kwargs):
        library = Path(build_directory) / f"{name}{cpp_extension.LIB_EXT}"
        library.write_bytes(b"not really a library")
        library.chmod(0o700)
        built.append(name)
        return types.ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(_cpu, "_import_library", lambda name, library: types.ModuleType(name))
    return built


def test_first_build_prints_one_notice_with_elapsed_time_on_stderr(stub_build, monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "1")
    _cpu._build_and_import(verbose=False)
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert stub_build and out == ""
    assert lines[0].startswith("normfold: building the C++ CPU kernel once, in ") and lines[0].endswith(" ...")
    assert "(1-2 minutes; later runs load it)" in lines[0]  # where, and about how long
    assert "done in " in lines[1] and lines[1].endswith(" s") and len(lines) == 2


def test_a_cached_kernel_loads_without_a_notice(stub_build, monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "1")
    _cpu._build_and_import(verbose=False)
    capsys.readouterr()
    _cpu._build_and_import(verbose=False)  # recorded: imported, not built
    assert len(stub_build) == 1 and capsys.readouterr() == ("", "")


def test_no_notice_when_progress_is_off(stub_build, monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    _cpu._build_and_import(verbose=False)
    assert stub_build and capsys.readouterr() == ("", "")
