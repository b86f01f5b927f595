"""``normfold._progress``: bars and notices on stderr only when asked for, never on stdout."""
from __future__ import annotations

from pathlib import Path

import pytest

from normfold import _progress


@pytest.mark.parametrize("setting, shown", [("1", True), ("on", True), ("0", False), ("off", False)])
def test_environment_variable_switches_progress(monkeypatch, setting, shown):
    monkeypatch.setenv("NORMFOLD_PROGRESS", setting)
    assert _progress.enabled() is shown


def test_without_setting_progress_follows_whether_stderr_is_a_terminal(monkeypatch):
    monkeypatch.delenv("NORMFOLD_PROGRESS", raising=False)
    assert _progress.enabled() is False  # pytest captures stderr: not a terminal


def test_progress_yields_every_item_in_order_and_draws_on_stderr_only(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("NORMFOLD_PROGRESS", "1")
    assert list(_progress.progress(range(5), desc="folding")) == [0, 1, 2, 3, 4]
    out, err = capsys.readouterr()
    assert out == "" and "folding" in err


def test_progress_off_prints_nothing(monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    assert list(_progress.progress(iter("ab"), desc="x")) == ["a", "b"]
    with _progress.notice("compiling"):
        pass
    assert capsys.readouterr() == ("", "")


def test_notice_says_what_waits_and_how_long_it_took(monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "1")
    with _progress.notice("building the C++ kernel"):
        pass
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and lines[0] == "normfold: building the C++ kernel ..."
    assert lines[1].startswith("normfold: building the C++ kernel: done in ") and lines[1].endswith(" s")


def test_notice_reports_a_failure_and_lets_the_error_through(monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "1")
    with pytest.raises(KeyError), _progress.notice("loading"):
        raise KeyError("x")
    assert "loading: failed after" in capsys.readouterr().err


def test_a_wait_announced_always_is_shown_without_a_terminal_unless_turned_off(monkeypatch, capsys):
    """The first C++ build (1-2 minutes) speaks in logs and pipes too (was: silent unless on a terminal)."""
    monkeypatch.delenv("NORMFOLD_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    with _progress.notice("building the C++ kernel", always=True):
        pass
    with _progress.notice("a short wait"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "normfold: building the C++ kernel ..." and "building the C++ kernel: done in" in lines[1]
    assert len(lines) == 2  # an ordinary notice stays quiet without a terminal
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    with _progress.notice("building the C++ kernel", always=True):
        pass
    assert capsys.readouterr().err == ""


def test_the_first_cpu_kernel_build_is_announced_without_a_terminal(monkeypatch, tmp_path, capsys):
    """A build into an empty cache (the compiler replaced by a stand-in that writes the library) prints
    where it builds and about how long it takes, and when it is done, to a stderr that is no terminal."""
    from torch.utils import cpp_extension

    from normfold.ops import _cpu

    monkeypatch.delenv("NORMFOLD_PROGRESS", raising=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.setenv("NORMFOLD_CACHE_DIR", str(tmp_path / "cache"))
    built = object()

    def compile_stand_in(name, build_directory, **_):
        Path(build_directory, f"{name}{cpp_extension.LIB_EXT}").write_bytes(b"library")
        return built

    monkeypatch.setattr(cpp_extension, "load", compile_stand_in)
    assert _cpu._build_and_import(verbose=False) is built
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"normfold: building the C++ CPU kernel once, in {_cpu.build_dir()} (1-2 minutes; later runs load it) ..."
    assert lines[1].startswith("normfold: building the C++ CPU kernel once") and " done in " in lines[1]
