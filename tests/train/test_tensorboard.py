"""TensorBoard logging: optional (``--tensorboard``, the ``tensorboard`` extra), next to the CSV that stays the
default; without the package the option is refused with the install hint before any work."""
from __future__ import annotations

import csv

import pytest

from normfold.cli import main
from normfold.train import resolve_config, train

RUN = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, max_steps=4, eval_interval=2, eval_iters=1,
           log_interval=1, warmup_steps=1, device="cpu", progress=False, save_checkpoint=False)


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_logs_the_csvs_curves_next_to_it_when_asked(tmp_path):
    pytest.importorskip("tensorboard")
    train(resolve_config(**RUN, out_dir=str(tmp_path / "default")))
    assert (tmp_path / "default" / "log.csv").is_file() and not (tmp_path / "default" / "tensorboard").exists()
    out = tmp_path / "run"
    summary = train(resolve_config(**RUN, tensorboard=True, out_dir=str(out)))
    scalars = _scalars(out / "tensorboard")
    assert set(scalars) == {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss"}
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx(summary["train_losses"], rel=1e-6)
    assert [value for _, value in scalars["train/grad_norm"]] == pytest.approx(summary["grad_norms"], rel=1e-6)
    assert [step for step, _ in scalars["val/loss"]] == [step for step, _ in summary["val_losses"]] == [2, 4]
    assert [value for _, value in scalars["val/loss"]] == pytest.approx([v for _, v in summary["val_losses"]], rel=1e-6)
    with open(out / "log.csv") as f:
        logged = [float(row["train_loss"]) for row in csv.DictReader(f)]
    assert logged == pytest.approx(summary["train_losses"], abs=1e-6)


def test_without_tensorboard_the_option_is_refused_with_the_install_hint_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "tensorboard", None)  # as if not installed
    out = tmp_path / "run"
    with pytest.raises(ImportError, match=r"pip install 'normfold\[tensorboard\]'"):
        train(resolve_config(**RUN, tensorboard=True, out_dir=str(out)))
    assert not out.exists()
    argv = ["train", "--tensorboard", *(f"--{k}={v}" for k, v in RUN.items()), f"--out-dir={out}"]
    assert main(argv) == 2 and not out.exists()
    assert capsys.readouterr().err.strip() == ("normfold: error: tensorboard is needed for this normfold feature: "
                                               "pip install 'normfold[tensorboard]'")


def test_a_resumed_run_replaces_the_events_logged_after_its_state(tmp_path, interrupt_at_step):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    interrupt_at_step(4)
    with pytest.raises(KeyboardInterrupt):  # steps 1-3 logged, the state saved at step 2
        train(resolve_config(**RUN, tensorboard=True, checkpoint_interval=2, out_dir=str(out)))
    interrupt_at_step(None)
    summary = train(resolve_config(**RUN, tensorboard=True, checkpoint_interval=2, out_dir=str(out), resume=str(out)))
    losses = _scalars(out / "tensorboard")["train/loss"]
    assert [step for step, _ in losses] == [1, 2, 3, 4]  # step 3 once: the interrupted run's was purged
    assert [value for _, value in losses] == pytest.approx(summary["train_losses"], rel=1e-6)
