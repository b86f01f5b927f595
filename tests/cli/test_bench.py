"""normfold.cli.bench: the ``normfold bench`` command on a saved folder."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from normfold.cli import EXIT_OK, EXIT_USAGE, main

pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny folders of tests/hf
from hf.conftest import tiny_dirs  # noqa: E402,F401

_QUICK = ["--quick", "--rounds", "2", "--seq", "1", "--no-profile", "--no-plot"]


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_writes_the_tables_where_out_says(capsys, tiny_dirs, tmp_path):  # noqa: F811
    code, out, _ = _run(capsys, "bench", tiny_dirs["gpt2"], *_QUICK, "--out", tmp_path / "out")
    assert code == EXIT_OK and "batch" in out
    assert (tmp_path / "out.csv").exists() and (tmp_path / "out.md").exists()


def test_bench_without_out_writes_a_new_folder_under_the_current_one(capsys, monkeypatch, tiny_dirs, tmp_path):  # noqa: F811
    monkeypatch.chdir(tmp_path)
    first, second = (_run(capsys, "bench", tiny_dirs["gpt2"], *_QUICK) for _ in range(2))
    assert first[0] == second[0] == EXIT_OK
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert len(folders) == 2 and all(name.startswith("normfold-bench-") for name in folders)  # never the same one
    for name in folders:
        assert {p.name for p in (tmp_path / name).iterdir()} == {"bench.csv", "bench.md"}


@pytest.mark.parametrize("option", [["--batch", "0"], ["--seq", "1", "-3"], ["--rounds", "0"], ["--rounds", "two"]])
def test_bench_counts_must_be_positive_ints(capsys, tiny_dirs, option):  # noqa: F811
    code, _, err = _run(capsys, "bench", tiny_dirs["gpt2"], "--quick", *option)
    assert code == EXIT_USAGE and "expected a positive int" in err and "Traceback" not in err


def test_bench_out_with_a_dot_writes_exactly_the_names_it_was_given(capsys, tiny_dirs, tmp_path):  # noqa: F811
    """notes.v2 gives notes.v2.csv / .md, never notes.csv / notes.md (the user's files beside it stay)."""
    (tmp_path / "notes.csv").write_text("my table")
    (tmp_path / "notes.md").write_text("my notes")
    code, out, _ = _run(capsys, "bench", tiny_dirs["gpt2"], *_QUICK, "--out", tmp_path / "notes.v2")
    assert code == EXIT_OK and f"wrote {tmp_path / 'notes.v2.csv'}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.csv", "notes.md", "notes.v2.csv", "notes.v2.md"]
    assert (tmp_path / "notes.csv").read_text() == "my table" and (tmp_path / "notes.md").read_text() == "my notes"


def test_bench_refuses_to_overwrite_its_files_before_timing_unless_told(capsys, monkeypatch, tiny_dirs, tmp_path):  # noqa: F811
    import normfold.cli.bench as bench_cli

    (tmp_path / "notes.v2.md").write_text("my notes")
    real = bench_cli.bench_model
    monkeypatch.setattr(bench_cli, "bench_model", lambda *a, **k: pytest.fail("timed before the refusal"))
    code, _, err = _run(capsys, "bench", tiny_dirs["gpt2"], *_QUICK, "--out", tmp_path / "notes.v2")
    lines = err.strip().splitlines()
    assert code == EXIT_USAGE and len(lines) == 1 and str(tmp_path / "notes.v2.md") in lines[0]
    assert "--overwrite" in lines[0] and (tmp_path / "notes.v2.md").read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.v2.md"]
    monkeypatch.setattr(bench_cli, "bench_model", real)
    assert _run(capsys, "bench", tiny_dirs["gpt2"], *_QUICK, "--out", tmp_path / "notes.v2", "--overwrite")[0] == EXIT_OK
    assert (tmp_path / "notes.v2.md").read_text() != "my notes" and (tmp_path / "notes.v2.csv").is_file()


def test_bench_says_how_long_it_takes_before_and_after_on_stderr(capsys, monkeypatch, tiny_dirs, tmp_path):  # noqa: F811
    """--quick's help and the notice give its measured time (was: "a few seconds" for a 53 s run, then silence)."""
    monkeypatch.delenv("NORMFOLD_PROGRESS", raising=False)
    code, out, err = _run(capsys, "bench", tiny_dirs["gpt2"], *_QUICK, "--out", tmp_path / "out")
    lines = err.splitlines()
    assert code == EXIT_OK and "normfold:" not in out
    assert lines[0] == "normfold: timing gpt2: --quick, 10 s to a minute on 2 CPU cores for a small model ..."
    assert lines[1].startswith("normfold: timing gpt2: ") and " done in " in lines[1] and len(lines) == 2
    assert main(["bench", "--help"]) == EXIT_OK
    assert "a few seconds" not in capsys.readouterr().out
