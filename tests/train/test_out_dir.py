"""``normfold train --out_dir``: never writes over files a training run did not make."""
from __future__ import annotations

import json

import pytest

from normfold.cli import EXIT_OK, EXIT_USAGE, main

TINY_RUN = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2", "--max_steps=1",
            "--eval_interval=1", "--eval_iters=1", "--progress=false", "--save_checkpoint=false"]


def _train(capsys, out, *extra):
    code = main(["train", *TINY_RUN, f"--out_dir={out}", *extra])
    return code, capsys.readouterr().err


@pytest.fixture
def model_folder(tmp_path):
    """A folder someone else made: a Hugging Face config that training would overwrite."""
    folder = tmp_path / "my_model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    return folder


def test_a_non_empty_folder_that_holds_no_training_run_is_refused_and_left_alone(capsys, model_folder):
    code, err = _train(capsys, model_folder)
    lines = err.strip().splitlines()
    assert code == EXIT_USAGE and len(lines) == 1 and "--overwrite" in lines[0] and "Traceback" not in err
    assert json.loads((model_folder / "config.json").read_text()) == {"model_type": "gpt2", "n_layer": 12}
    assert sorted(p.name for p in model_folder.iterdir()) == ["config.json"]


def test_overwrite_writes_into_such_a_folder(capsys, model_folder):
    assert _train(capsys, model_folder, "--overwrite")[0] == EXIT_OK
    assert "max_steps" in json.loads((model_folder / "config.json").read_text())


def test_a_previous_run_and_an_empty_folder_are_written_without_the_flag(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    assert _train(capsys, out)[0] == EXIT_OK  # empty
    assert _train(capsys, out)[0] == EXIT_OK  # a previous run of normfold train
    assert (out / "summary.json").is_file()


def test_python_m_normfold_train_refuses_it_as_a_usage_error(model_folder):
    from normfold.train.cli import main as train_main

    with pytest.raises(SystemExit) as exc:
        train_main([*TINY_RUN, f"--out_dir={model_folder}"])
    assert exc.value.code == 2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_an_interrupted_run_says_what_it_left_not_that_nothing_was_written(capsys, monkeypatch, tmp_path, checkpointing):
    import normfold.train.cli as train_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "train", interrupted)
    extra = ["--checkpoint_interval=1"] if checkpointing else []
    code, err = _train(capsys, tmp_path / "run", *extra)
    assert code == 130 and "nothing was written" not in err and str(tmp_path / "run") in err
    assert ("--resume=" + str(tmp_path / "run") in err) == checkpointing


@pytest.mark.parametrize("theirs", ["summary.json", "log.csv"])
def test_a_folder_with_a_summary_or_log_but_no_run_marker_is_not_taken_for_a_run(capsys, model_folder, theirs):
    """A log.csv or summary.json may be anyone's: only the marker every run writes first makes a folder a run."""
    (model_folder / theirs).write_text("my own results")
    before = {p.name: p.read_bytes() for p in model_folder.iterdir()}
    code, err = _train(capsys, model_folder)
    assert code == EXIT_USAGE and ".normfold-run" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in model_folder.iterdir()} == before


def test_a_run_marks_its_folder_first_and_a_marked_folder_is_written_again(capsys, tmp_path):
    out = tmp_path / "run"
    assert _train(capsys, out)[0] == EXIT_OK
    marker = json.loads((out / ".normfold-run").read_text())
    assert marker["kind"] == "normfold train run"
    (out / "summary.json").unlink()
    (out / "log.csv").unlink()  # still a run: the marker says so, not these
    assert _train(capsys, out)[0] == EXIT_OK and json.loads((out / ".normfold-run").read_text()) == marker


def test_resume_of_a_moved_run_writes_only_into_the_folder_it_was_given(capsys, tmp_path, interrupt_at_step):
    old, moved = tmp_path / "old", tmp_path / "moved"
    interrupt_at_step(2)
    assert _train(capsys, old, "--max_steps=3", "--checkpoint_interval=1")[0] == 130
    interrupt_at_step(None)
    old.rename(moved)
    assert _train(capsys, old)[0] == EXIT_OK  # another run now lives at the old path (its config.json says out_dir=old)
    theirs = {p.name: p.read_bytes() for p in old.iterdir()}
    assert json.loads((moved / "config.json").read_text())["out_dir"] == str(old)
    code = main(["train", f"--resume={moved}"])
    assert code == EXIT_OK, capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in old.iterdir()} == theirs
    summary = json.loads((moved / "summary.json").read_text())
    assert summary["resumed_from"] == 1 and summary["steps"] == 3
    assert json.loads((moved / "config.json").read_text())["out_dir"] == str(moved)


def test_a_run_refused_for_its_data_size_writes_nothing(capsys, tmp_path):
    data = tmp_path / "short.txt"
    data.write_text("too short")
    out = tmp_path / "run"
    code, err = _train(capsys, out, f"--data={data}")
    assert code == EXIT_USAGE and "--data: the train split has" in err and "fewer than block_size + 2" in err
    assert len(err.strip().splitlines()) == 1 and "not a known refusal" not in err
    assert not out.exists()
