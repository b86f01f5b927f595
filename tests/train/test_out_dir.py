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
