"""Publishing claims its target: whatever appears at the output while a run writes, and a concurrent
run's output, is never deleted or replaced; the run that loses fails with CheckpointError, never quietly."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import threading

import pytest

import normfold.hf.output_dir as output_folder
from normfold.hf import CheckpointError
from normfold.hf.output_dir import REPORT_JSON, atomic_output_dir

TRIALS = 24  # per concurrent setting; the appearing-folder test runs every combination (28 per claim mechanism)


@pytest.fixture(params=["renameat2", "mkdir claim"])
def claim(request, monkeypatch):
    """Both ways of claiming a name: Linux renameat2 and the fallback where it is unsupported."""
    if request.param == "mkdir claim":
        monkeypatch.setattr(output_folder, "_renameat2", lambda src, dst, flags: False)
    return request.param


def _what_is_at(path):
    """What a user finds at ``path``: its kind and content (a folder's files with their bytes)."""
    if path.is_symlink():
        return "link", os.readlink(path)
    if path.is_file():
        return "file", path.read_bytes()
    if path.is_dir():
        return "folder", {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return None


def _normfold_output(folder, run):
    """What a run of normfold writes into ``folder`` (made if missing)."""
    folder.mkdir(exist_ok=True)
    (folder / REPORT_JSON).write_text(json.dumps({"run": run}))
    (folder / "model.safetensors").write_bytes(run.encode() * 100)


def _leftovers(out):
    """Temporary, old or lock files of ``out`` that a run left beside it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# (overwrite, what is at the output when the run starts, what a user or another program makes of it meanwhile)
_START = {False: ["absent"], True: ["absent", "empty folder", "normfold output"]}
_INTRUSIONS = {"absent": ["user folder", "empty folder", "file", "link"],
               "empty folder": ["user file inside", "user folder", "file", "link"],
               "normfold output": ["user folder", "file", "link"]}


def _intrude(out, kind, elsewhere):
    """Make ``out`` something normfold did not create (replacing what was there, or writing into it)."""
    if kind == "user file inside":
        (out / "notes.txt").write_text("mine")
        return
    if out.is_dir():
        shutil.rmtree(out)
    if kind == "user folder":
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
    elif kind == "empty folder":
        out.mkdir()
    elif kind == "file":
        out.write_text("a file")
    else:
        elsewhere.mkdir(exist_ok=True)
        (elsewhere / "data.txt").write_text("linked data")
        out.symlink_to(elsewhere)


def test_a_folder_that_appears_at_the_output_while_a_run_writes_is_never_replaced(tmp_path, monkeypatch, claim):
    real_check = output_folder.check_output_dir
    trials = [(overwrite, start, kind, moment) for overwrite in (False, True) for start in _START[overwrite]
              for kind in _INTRUSIONS[start] if not (overwrite and kind == "empty folder")
              for moment in ("while writing", "after the last check")]
    assert len(trials) >= 20
    for i, (overwrite, start, kind, moment) in enumerate(trials):
        where = f"trial {i}: overwrite={overwrite}, {start} at the start, then a {kind} {moment} ({claim})"
        out, elsewhere = tmp_path / f"out{i}", tmp_path / f"elsewhere{i}"
        if start == "empty folder":
            out.mkdir()
        elif start == "normfold output":
            _normfold_output(out, "old")
        checks = []

        def check_then_intrude(*args, **kwargs):  # the check when publishing passes, then the folder changes
            checks.append(args)
            result = real_check(*args, **kwargs)
            if moment == "after the last check" and len(checks) == 2:
                _intrude(out, kind, elsewhere)
            return result

        monkeypatch.setattr(output_folder, "check_output_dir", check_then_intrude)
        refused = None
        try:
            with atomic_output_dir(out, overwrite=overwrite) as tmp:
                _normfold_output(tmp, "new")
                if moment == "while writing":
                    _intrude(out, kind, elsewhere)
        except CheckpointError as err:
            refused = str(err)
        assert refused and "changed while this run was writing" in refused and str(out) in refused, \
            f"{where}: {refused or 'published, no error'}"
        assert len(checks) == 2, f"{where}: published without checking again"
        after = _what_is_at(out)
        assert after is not None and after[0] == {"file": "file", "link": "link"}.get(kind, "folder"), where
        if kind == "user file inside":
            assert after == ("folder", {"notes.txt": b"mine"}), where
        elif kind == "user folder":
            assert after == ("folder", {"thesis.tex": b"years of work"}), where
        elif kind == "empty folder":
            assert after == ("folder", {}), where
        elif kind == "file":
            assert after == ("file", b"a file"), where
        else:
            assert after == ("link", str(elsewhere)) and (elsewhere / "data.txt").read_text() == "linked data", where
        assert _leftovers(out) == [], f"{where}: left {_leftovers(out)}"


@pytest.mark.parametrize("overwrite", [False, True], ids=["no overwrite", "overwrite"])
@pytest.mark.parametrize("lock", ["flock", "no flock"])
def test_two_concurrent_runs_on_one_output_take_turns_or_the_later_fails_loudly(tmp_path, monkeypatch, claim,
                                                                                overwrite, lock):
    """Two runs have checked the output and written everything; they publish at once. Without
    ``overwrite`` exactly one publishes and the other raises; with it both may publish in turn (the
    later replaces the earlier's normfold output). Never a merge, never a quiet loss. Without flock
    (Windows), both even pass the check at publish time together: the atomic claim decides."""
    if lock == "no flock":
        monkeypatch.setattr(output_folder, "_HAS_FLOCK", False)
    real_check, local = output_folder.check_output_dir, threading.local()
    for trial in range(TRIALS):
        out = tmp_path / f"out{trial}"
        if overwrite and trial % 2:
            _normfold_output(out, "old")
        together = threading.Barrier(2, timeout=30)

        def check_together(*args, **kwargs):
            result = real_check(*args, **kwargs)
            local.checks = getattr(local, "checks", 0) + 1
            if local.checks == 2 and lock == "no flock":  # both runs past the last check before either claims
                together.wait()
            return result

        monkeypatch.setattr(output_folder, "check_output_dir", check_together)
        results, written = {}, {}

        def run(name):
            local.checks = 0
            try:
                with atomic_output_dir(out, overwrite=overwrite) as tmp:
                    _normfold_output(tmp, name)
                    written[name] = _what_is_at(tmp)
                    if lock == "flock":
                        together.wait()  # both runs written and about to publish
                results[name] = "published"
            except Exception as err:  # noqa: BLE001  judged below: only a CheckpointError is a loud, typed refusal
                results[name] = err

        threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        where = f"trial {trial} ({claim}, {lock}, overwrite={overwrite}): {results}"
        assert set(results) == {"a", "b"}, where
        published = [name for name, r in results.items() if r == "published"]
        failed = [r for r in results.values() if r != "published"]
        assert all(isinstance(err, CheckpointError) and str(out) in str(err) for err in failed), where
        if not overwrite:
            assert len(published) == 1 and len(failed) == 1, where
        assert published, where
        assert _what_is_at(out) in [written[name] for name in published], f"{where}: not one run's whole output"
        assert _leftovers(out) == [], f"{where}: left {_leftovers(out)}"


def test_fold_fails_in_one_line_when_a_folder_appears_at_its_output(capsys, tiny_dirs, tmp_path, monkeypatch):
    """The command, end to end: the fold finishes, a user's folder appeared at -o meanwhile: exit 2,
    the user's folder as it was, no temporary left."""
    import normfold.hf.folder as folder
    from normfold.cli import EXIT_USAGE, main

    out = tmp_path / "out"
    real_save = folder.save_folded

    def save_then_a_folder_appears(*args, **kwargs):
        real_save(*args, **kwargs)
        out.mkdir()
        (out / "notes.txt").write_text("mine")

    monkeypatch.setattr(folder, "save_folded", save_then_a_folder_appears)
    code = main(["fold", str(tiny_dirs["gpt2"]), "-o", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_USAGE and len(err) == 1 and "changed while this run was writing" in err[0], err
    assert _what_is_at(out) == ("folder", {"notes.txt": b"mine"}) and _leftovers(out) == []


def test_overwrite_puts_back_an_empty_output_that_a_program_wrote_into_at_the_last_moment(tmp_path, monkeypatch):
    """The check at publish time passed (an empty folder), then a file went into it before the swap:
    the swapped-out folder is checked again, put back and kept, not deleted."""
    out = tmp_path / "out"
    out.mkdir()
    real_exchange = output_folder._exchange
    swaps = itertools.count()

    def write_then_exchange(a, b):
        if next(swaps) == 0:
            (out / "notes.txt").write_text("mine")
        return real_exchange(a, b)

    monkeypatch.setattr(output_folder, "_exchange", write_then_exchange)
    with pytest.raises(CheckpointError, match="no longer empty or a normfold output"):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / REPORT_JSON).write_text("{}")
    assert _what_is_at(out) == ("folder", {"notes.txt": b"mine"}) and _leftovers(out) == []
