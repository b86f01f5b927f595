"""Output folders: published only complete and verified, never where writing them could lose data."""
from __future__ import annotations

import json
import os
import shutil
import stat

import pytest

import normfold.hf.output_dir as output_folder
from normfold.cli import EXIT_OK, EXIT_USAGE, main
from normfold.hf import CheckpointError
from normfold.hf.output_dir import REPORT_JSON, atomic_output_dir

pytest.importorskip("transformers")
pytest.importorskip("rich")


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str) -> bool:
    lines = err.strip().splitlines()
    return len(lines) == 1 and lines[0].startswith("normfold: error:")


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def nested_model(tiny_dirs, tmp_path):
    """work/models/m: a model two levels below the folder a careless -o might name."""
    model = tmp_path / "work" / "models" / "m"
    shutil.copytree(tiny_dirs["gpt2"], model)
    (tmp_path / "work" / "notes.txt").write_text("beside the model")
    return model


@pytest.mark.parametrize("output", ["work", "work/models", ".", "work/models/m", "work/models/m/sub"])
def test_output_that_is_the_input_its_ancestor_or_inside_it_is_refused(capsys, nested_model, tmp_path, monkeypatch,
                                                                       output):
    monkeypatch.chdir(tmp_path)
    before = _snapshot(tmp_path / "work")
    code, _, err = _run(capsys, "fold", nested_model, "-o", output, "--overwrite")
    assert code == EXIT_USAGE and _one_line_error(err) and "input model folder" in err
    assert _snapshot(tmp_path / "work") == before


def test_overwrite_refuses_a_folder_that_is_not_a_normfold_output(capsys, tiny_dirs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out, "--overwrite")
    assert code == EXIT_USAGE and _one_line_error(err) and REPORT_JSON in err
    assert (out / "thesis.tex").read_text() == "years of work"


@pytest.mark.parametrize("previous", ["empty", "normfold output"])
def test_overwrite_replaces_an_empty_folder_or_a_previous_normfold_output(capsys, tiny_dirs, tmp_path, previous):
    out = tmp_path / "out"
    if previous == "empty":
        out.mkdir()
    else:
        assert _run(capsys, "fold", tiny_dirs["opt"], "-o", out)[0] == EXIT_OK
    assert _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out, "--overwrite")[0] == EXIT_OK
    assert json.loads((out / REPORT_JSON).read_text())["model"]["architecture"] == "GPT2LMHeadModel"
    assert [p.name for p in tmp_path.iterdir() if output_folder.TEMP_MARK in p.name] == []


def test_an_output_path_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(CheckpointError, match="symbolic link"):
        with atomic_output_dir(tmp_path / "link", overwrite=True):
            pass


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_the_output_folder_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "f").write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_a_rerun_removes_the_temporary_folders_a_killed_run_left(tmp_path):
    stale = tmp_path / f".out{output_folder.TEMP_MARK}dead1234"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    other = tmp_path / f".other{output_folder.TEMP_MARK}dead5678"  # another output's: not ours to touch
    other.mkdir()
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "f").write_text("x")
    assert not stale.exists() and other.exists() and (tmp_path / "out" / "f").is_file()


def test_a_temporary_folder_in_use_by_a_running_fold_is_not_removed(tmp_path):
    busy = tmp_path / f".out{output_folder.TEMP_MARK}busy1234"
    busy.mkdir()
    lock = output_folder._try_lock(busy)  # what a live run holds; a second open + flock conflicts with it
    assert lock is not None
    try:
        assert output_folder.remove_stale_temporaries(tmp_path / "out") == [] and busy.exists()
    finally:
        os.close(lock)
    assert output_folder.remove_stale_temporaries(tmp_path / "out") == [busy] and not busy.exists()


def test_the_temporary_folder_is_locked_while_in_use_and_gone_after(tmp_path):
    with atomic_output_dir(tmp_path / "out") as tmp:
        assert output_folder._try_lock(tmp) is None  # a concurrent run's cleanup cannot take it
        assert output_folder.remove_stale_temporaries(tmp_path / "out") == [] and tmp.exists()
    assert not tmp.exists() and [p.name for p in tmp_path.iterdir()] == ["out"]


# -------------------------------------------------------------------------------------- kill test

# A process that imports normfold and folds once to warm up, then forks one child per request
# that runs the CLI's main(argv): a trial costs a warm fold (0.8 s measured on an idle machine),
# not an interpreter start with its imports and first export (6-7 s, in which nothing is written
# for most of the time). It forks from one thread (torch set to one intra-op thread, the fold's
# prefetch thread joined), so the children start clean.
_FORK_SERVER = r"""
import json, os, sys, time
import torch
torch.set_num_threads(1)
from normfold.cli import main

def run(argv):
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        code = main(argv)
    except BaseException:
        code = 99
    os._exit(code)

import contextlib, io
t0 = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    code = main(json.loads(sys.argv[1]))  # in this process: every lazy import and cache is warm in the children
print(json.dumps({"warmup_status": code, "seconds": time.perf_counter() - t0}), flush=True)
for line in sys.stdin:
    argv = json.loads(line)
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        run(argv)
    print(json.dumps({"pid": pid}), flush=True)
    sys.stdin.readline()  # reaped only when the test is done with the pid: never reused before its kill
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status), "seconds": time.perf_counter() - t0}), flush=True)
"""


class _ForkServer:
    def __init__(self, warmup_argv: list[str]) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, json.dumps(warmup_argv)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.warmup = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def run(self, argv: list[str], kill_after: float | None = None) -> dict:
        """Run the CLI in a fresh child; SIGKILL it after ``kill_after`` seconds. Returns its exit status
        (-9 when the kill landed) and the seconds it ran."""
        import signal
        import time

        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        pid = self._read()["pid"]
        if kill_after is not None:
            time.sleep(kill_after)
            os.kill(pid, signal.SIGKILL)  # a child that already exited is a zombie until reaped: no error
        self.proc.stdin.write("reap\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _state(out):
    """What a user finds at ``out``: absent, or (saved dtype, verification ok, file bytes)."""
    if not out.exists():
        return None
    report = json.loads((out / REPORT_JSON).read_text())
    return report["saved_dtype"], report["verification"]["ok"], _snapshot(out)


@pytest.mark.slow
def test_a_fold_killed_at_random_points_leaves_the_old_or_a_verified_new_output(tiny_dirs, tmp_path):
    import random

    from normfold.hf import load_model

    src = tmp_path / "sharded"
    load_model(tiny_dirs["gpt2"]).save_pretrained(src, max_shard_size="30KB", safe_serialization=True)
    assert len(list(src.glob("*.safetensors"))) > 2
    out = tmp_path / "out"

    def argv(dtype):
        return ["fold", str(src), "-o", str(out), "--overwrite", "--json", "--dtype", dtype]

    server = _ForkServer(argv("float32"))
    try:
        assert server.warmup["warmup_status"] == EXIT_OK
        warm = [server.run(argv("float16")) for _ in range(3)]  # the kills are spread over a warm run's duration
        assert all(run["status"] == EXIT_OK for run in warm)
        duration, trials, killed = min(run["seconds"] for run in warm), 24, 0
        rng = random.Random(14)
        for i in range(trials):
            if i % 4 == 3:
                shutil.rmtree(out)  # every fourth trial starts with no output at all
            before = _state(out)
            new_dtype = "float32" if before is None or before[0] == "float16" else "float16"
            delay = duration * (i + rng.random()) / trials  # one kill in each slice of the run
            result = server.run(argv(new_dtype), kill_after=delay)
            killed += result["status"] == -9
            after = _state(out)
            where = f"trial {i}, killed after {delay:.2f} s of {duration:.2f} s (status {result['status']})"
            if after is None:
                assert before is None, f"{where}: the old output was deleted without a replacement"
            elif after != before:
                assert after[:2] == (new_dtype, True), f"{where}: neither the old output nor a verified new one"
            rerun = server.run(argv(new_dtype))
            assert rerun["status"] == EXIT_OK, where
            assert _state(out)[:2] == (new_dtype, True), where
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == [], f"{where}: leftovers"
        assert killed >= 2 * trials // 3, f"only {killed} of {trials} trials were killed mid-run"
    finally:
        server.close()


def test_without_an_atomic_exchange_the_old_output_is_still_replaced_and_nothing_is_left(tmp_path, monkeypatch):
    monkeypatch.setattr(output_folder, "_exchange", lambda a, b: False)  # a system without renameat2(RENAME_EXCHANGE)
    out = tmp_path / "out"
    out.mkdir()
    (out / REPORT_JSON).write_text("{}")
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == ["new"] and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_output_next_to_which_nothing_can_be_written_is_a_checkpoint_error(tmp_path, monkeypatch):
    def read_only_parent(**kwargs):
        raise PermissionError(13, "Permission denied", kwargs.get("dir"))

    monkeypatch.setattr(output_folder.tempfile, "mkdtemp", read_only_parent)  # root ignores chmod: simulate the refusal
    with pytest.raises(CheckpointError, match="cannot write a folder next to .*Permission denied"):
        with atomic_output_dir(tmp_path / "out"):
            pass


def test_without_flock_the_output_is_still_published_and_no_other_temporary_is_touched(tmp_path, monkeypatch):
    monkeypatch.setattr(output_folder, "_HAS_FLOCK", False)  # Windows: a live run's folder looks like a dead one's
    other = tmp_path / f".out{output_folder.TEMP_MARK}maybe_alive"
    other.mkdir()
    with atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "f").write_text("x")
    assert (tmp_path / "out" / "f").is_file() and other.exists()
