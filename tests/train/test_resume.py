"""A run interrupted and resumed from its ``train_state.pt`` gives the uninterrupted run's curves bitwise (float32,
CPU, one thread), gradient accumulation and dropout included; a state that would not continue the run is refused
before any work, naming what differs."""
from __future__ import annotations

import csv
import json

import pytest
import torch

from normfold.cli import main
from normfold.train import resolve_config, train
from normfold.train import trainer
from normfold.train.resume import STATE_FILE, ResumeError

# dropout draws from torch's generator every step: a resume that lost the RNG state would change the curve
RUN = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, batch_size=2, max_steps=7, eval_interval=3, eval_iters=1,
           log_interval=1, warmup_steps=2, norm="cbwc_rmsnorm", dropout=0.1, precision="fp32", device="cpu",
           progress=False, save_checkpoint=False, save_rank_weights=True)


def _config(out, **values):
    return resolve_config(**{**RUN, "out_dir": str(out), **values})


def _log_without_timing(out) -> list[list[str]]:
    with open(out / "log.csv") as f:
        rows = list(csv.DictReader(f))
    return [[row[k] for k in ("step", "tokens", "lr", "train_loss", "val_loss", "grad_norm")] for row in rows]


@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_an_interrupted_run_resumed_gives_the_uninterrupted_curves_bitwise(tmp_path, interrupt_at_step,
                                                                         grad_accum_steps):
    whole = train(_config(tmp_path / "whole", grad_accum_steps=grad_accum_steps))
    out = tmp_path / "interrupted"
    interrupt_at_step(6)  # the state of step 4 is the last one saved
    with pytest.raises(KeyboardInterrupt):
        train(_config(out, grad_accum_steps=grad_accum_steps, checkpoint_interval=2))
    interrupt_at_step(None)
    assert torch.load(out / STATE_FILE, weights_only=True)["step"] == 4
    resumed = train(_config(out, grad_accum_steps=grad_accum_steps, checkpoint_interval=2, resume=str(out)))
    assert resumed["resumed_from"] == 4 and resumed["steps"] == 7
    for key in ("train_losses", "grad_norms", "val_losses"):
        assert resumed[key] == whole[key], key  # bitwise: == on the floats
    final, expected = torch.load(out / "weights_rank0.pt"), torch.load(tmp_path / "whole" / "weights_rank0.pt")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)
    assert _log_without_timing(out) == _log_without_timing(tmp_path / "whole")  # the rows of steps 5-6 rewritten once
    assert whole["train_losses"][4] != whole["train_losses"][3]  # the compared steps differ from each other


def test_the_state_holds_model_optimizer_step_rng_and_data_position_when_asked(tmp_path):
    train(_config(tmp_path / "default", max_steps=2))
    assert not (tmp_path / "default" / STATE_FILE).exists()  # checkpoint_interval=0: no state
    out = tmp_path / "run"
    train(_config(out, max_steps=2, checkpoint_interval=2))
    state = torch.load(out / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and state["world_size"] == 1 and len(state["corpus_sha256"]) == 64
    # CBWC's centered tensors, trained by projection (plain names), and the tied table's free W
    assert {"transformer.h.0.mlp.c_proj.weight", "transformer.wte.parametrizations.weight.original"} <= state["model"].keys()
    adam = state["optimizer"]["state"]["transformer.h.0.mlp.c_proj.weight"]
    assert adam["step"].item() == 2 and adam["exp_avg"].abs().sum() > 0
    assert state["rng"][0].keys() >= {"torch", "python", "batches"}
    assert state["config"]["model"]["dropout"] == 0.1 and len(state["history"]["train_losses"]) == 2


def test_resume_refuses_a_changed_config_naming_each_field_before_any_work(tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(_config(out, max_steps=2, checkpoint_interval=2))
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    monkeypatch.setattr(trainer, "build_model", lambda *a, **k: pytest.fail("work started before the refusal"))
    with pytest.raises(ResumeError) as refusal:
        train(_config(out, max_steps=2, checkpoint_interval=2, resume=str(out), lr=2e-3, n_layer=1))
    message = str(refusal.value)
    assert "lr: run 0.001, now 0.002" in message and "n_layer: run 2, now 1" in message
    assert "max_steps" not in message and "out_dir" in message  # unchanged fields are not named; the allowed listed
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_resume_refuses_another_corpus(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("normfold folds LayerNorms into RMSNorms. " * 40)
    out = tmp_path / "run"
    train(_config(out, data=[str(data)], max_steps=1, checkpoint_interval=1))
    data.write_text("a different text entirely, with other bytes. " * 40)
    with pytest.raises(ResumeError, match="corpus SHA-256: run [0-9a-f]{12}…, now [0-9a-f]{12}…"):
        train(_config(out, data=[str(data)], max_steps=1, checkpoint_interval=1, resume=str(out)))


@pytest.mark.parametrize("content, match", [(None, f"no {STATE_FILE} there"), (b"not a torch file", "is unreadable"),
                                            ({"step": 1}, "has format None, expected 1")])
def test_resume_refuses_a_folder_without_a_readable_state(tmp_path, content, match):
    folder = tmp_path / "old"
    folder.mkdir()
    if isinstance(content, bytes):
        (folder / STATE_FILE).write_bytes(content)
    elif content is not None:
        torch.save(content, folder / STATE_FILE)
    with pytest.raises(ResumeError, match=match):
        train(_config(tmp_path / "new", resume=str(folder)))
    assert not (tmp_path / "new").exists()


def test_normfold_train_resume_continues_with_the_runs_own_config(tmp_path, interrupt_at_step, capsys):
    out = tmp_path / "run"
    argv = ["train", *(f"--{k}={v}" for k, v in RUN.items()), "--max-steps=4", "--checkpoint-interval=2",
            f"--out-dir={out}"]
    interrupt_at_step(3)
    assert main(argv) == 130  # interrupted
    interrupt_at_step(None)
    assert not (out / "summary.json").exists()
    assert main(["train", f"--resume={out}"]) == 0  # every other option from out/config.json
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 2 and summary["steps"] == 4 and summary["norm"] == "cbwc_rmsnorm"
    capsys.readouterr()
    assert main(["train", f"--resume={out}", "--lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"normfold: error: --resume {out}: the run would not continue as it started")
    assert "lr: run 0.001, now 0.01" in err


def test_checkpoint_interval_must_not_be_negative():
    with pytest.raises(ValueError, match=r"checkpoint_interval must be >= 0 \(0: no resumable state\), got -1"):
        resolve_config(checkpoint_interval=-1)
