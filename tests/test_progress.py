"""``normfold._progress``: bars and notices on stderr only when asked for, never on stdout."""
from __future__ import annotations

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
