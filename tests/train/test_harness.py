"""The experiment GPT, its data, config resolution, trainer and checkpoints."""
from __future__ import annotations

import json

import pytest
import torch

from normfold.train import GPT, GPTConfig, NORMS, PLACEMENTS, TrainConfig, resolve_config, train
from normfold.train.checkpoint import gpt2_incompatibility, save_checkpoint, to_gpt2
from normfold.train.cli import main
from normfold.train.data import TokenSplits, decode, encode
from normfold.train.model import HandrolledLayerNorm, HandrolledRMSNorm
from normfold.train.trainer import lr_at

TINY = dict(n_layer=2, n_head=2, n_embd=16, block_size=16)


def _tiny_train_config(tmp_path, **overrides) -> TrainConfig:
    values = dict(TINY, batch_size=2, max_steps=3, eval_interval=2, eval_iters=1, log_interval=1,
                  warmup_steps=1, out_dir=str(tmp_path / "run"), progress=False, save_checkpoint=False)
    values.update(overrides)
    return resolve_config(**values)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_every_norm_and_placement_gives_a_finite_loss_and_gradients(norm, placement, qk_norm):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, norm=norm, placement=placement, qk_norm=qk_norm))
    idx = torch.randint(256, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 256)
    assert torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_handrolled_norms_match_torch_in_float64():
    x = torch.randn(4, 7, 33, dtype=torch.float64) * 3 + 1
    ln, mine = torch.nn.LayerNorm(33, eps=1e-5).double(), HandrolledLayerNorm(33, 1e-5).double()
    rms, mine_rms = torch.nn.RMSNorm(33, eps=1e-5).double(), HandrolledRMSNorm(33, 1e-5).double()
    with torch.no_grad():
        for a, b in ((ln, mine), (rms, mine_rms)):
            w = torch.randn(33, dtype=torch.float64)
            a.weight.copy_(w), b.weight.copy_(w)
        ln.bias.copy_(torch.randn(33)), mine.bias.copy_(ln.bias)
    torch.testing.assert_close(mine(x), ln(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine_rms(x), rms(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bad, match", [
    (dict(norm="batchnorm"), "norm must be one of"),
    (dict(placement="middle"), "placement must be one of"),
    (dict(n_embd=30, n_head=4), "divisible"),
    (dict(dropout=1.0), "dropout"),
    (dict(n_layer=0), "n_layer"),
])
def test_gpt_config_refuses_invalid_values(bad, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**bad)


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(GPTConfig(**TINY))
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_tied_table_is_counted_once():
    tied, untied = GPT(GPTConfig(**TINY)), GPT(GPTConfig(**TINY, tie_embeddings=False))
    assert untied.num_parameters() - tied.num_parameters() == 256 * 16


def test_config_precedence_file_then_keywords_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('lr = 0.5\nmin_lr = 0.0\nmax_steps = 7\n[model]\nnorm = "rmsnorm"\nn_layer = 3\n')
    config = resolve_config(path, ["--n_layer=5", "--qk_norm=true", "--data=a.txt,b.txt"], max_steps=9)
    assert (config.lr, config.max_steps, config.data) == (0.5, 9, ["a.txt", "b.txt"])
    assert (config.model.norm, config.model.n_layer, config.model.qk_norm) == ("rmsnorm", 5, True)
    json_path = tmp_path / "c.json"
    json_path.write_text(json.dumps({"norm": "none", "seed": 3}))
    config = resolve_config(json_path)
    assert (config.model.norm, config.seed) == ("none", 3)


@pytest.mark.parametrize("overrides, match", [
    (["--n_layers=3"], "unknown config key 'n_layers'"),
    (["--lr"], "--key=value"),
    (["--max_steps=ten"], "expects an int"),
    (["--qk_norm=maybe"], "true/false"),
    (["--precision=fp8"], "precision must be one of"),
    (["--lr=0.001", "--min_lr=0.01"], "min_lr <= lr"),
])
def test_resolve_config_refuses_bad_overrides(overrides, match):
    with pytest.raises(ValueError, match=match):
        resolve_config(None, overrides)


def test_lr_schedule_warms_up_linearly_then_decays_to_min_lr():
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert lr_at(0, config) == pytest.approx(0.1)
    assert lr_at(9, config) == pytest.approx(1.0)
    assert lr_at(60, config) == pytest.approx(0.55)  # half-way through the cosine
    assert lr_at(110, config) == pytest.approx(0.1)
    lrs = [lr_at(s, config) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_byte_tokens_round_trip_and_split_is_deterministic():
    text = "héllo wörld, " * 50
    tokens = encode(text)
    assert decode(tokens) == text and int(tokens.max()) < 256
    splits = TokenSplits(tokens, block_size=8, val_fraction=0.2)
    assert len(splits.val) == int(len(tokens) * 0.2)
    torch.testing.assert_close(torch.cat([splits.train, splits.val]), tokens)
    a = splits.batch("train", 3, torch.Generator().manual_seed(1))
    b = splits.batch("train", 3, torch.Generator().manual_seed(1))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a[0][:, 1:], a[1][:, :-1])  # targets are inputs shifted by one


def test_too_little_text_is_refused():
    with pytest.raises(ValueError, match="fewer than block_size"):
        TokenSplits(encode("tiny"), block_size=8)


def test_train_writes_log_config_summary_and_loss_falls(tmp_path):
    config = _tiny_train_config(tmp_path, max_steps=12, lr=1e-2, min_lr=1e-3, warmup_steps=2)
    summary = train(config)
    out = tmp_path / "run"
    rows = (out / "log.csv").read_text().splitlines()
    assert rows[0].startswith("step,tokens,lr,train_loss,val_loss")
    assert len(rows) == 1 + 12
    assert json.loads((out / "config.json").read_text())["model"]["n_embd"] == 16
    assert json.loads((out / "summary.json").read_text())["steps"] == 12
    assert "whole documents" in json.loads((out / "summary.json").read_text())["validation_split"]  # what was held out
    assert len(summary["train_losses"]) == 12 and not summary["diverged"]
    assert summary["train_losses"][-1] < summary["train_losses"][0] - 0.5
    assert summary["tokens_per_s"] > 0


def test_divergence_stops_the_run_and_is_reported(tmp_path):
    config = _tiny_train_config(tmp_path, max_steps=5, lr=1e30, min_lr=0.0, warmup_steps=0, grad_clip=0.0,
                                norm="none", placement="post")
    summary = train(config)
    assert summary["diverged"] and summary["steps"] < 5


def test_gpt2_checkpoint_loads_in_transformers_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    with torch.no_grad():  # move every parameter off its init value, norms included
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert save_checkpoint(model, tmp_path / "ckpt") == "gpt2"
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt").eval()
    idx = torch.randint(256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model.eval()(idx)[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change, reason", [
    (dict(norm="rmsnorm"), "norm="), (dict(placement="post"), "placement="),
    (dict(qk_norm=True), "qk_norm"), (dict(tie_embeddings=False), "tie_embeddings"),
])
def test_non_gpt2_architectures_are_saved_as_torch_files(tmp_path, change, reason):
    model = GPT(GPTConfig(**TINY, **change))
    assert reason in gpt2_incompatibility(model.config)
    with pytest.raises(ValueError, match="no GPT-2 equivalent"):
        to_gpt2(model)
    assert save_checkpoint(model, tmp_path) == "torch"
    state = torch.load(tmp_path / "model.pt")
    fresh = GPT(GPTConfig(**TINY, **change))
    fresh.load_state_dict(state)
    idx = torch.randint(256, (1, 16))
    torch.testing.assert_close(fresh.eval()(idx)[0], model.eval()(idx)[0])


def test_cli_main_trains_from_overrides(tmp_path, capsys):
    out = tmp_path / "cli"
    status = main(["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2", "--max_steps=2",
                   "--eval_interval=1", "--eval_iters=1", "--progress=false", "--save_checkpoint=false",
                   f"--out_dir={out}"])
    assert status == 0
    assert "layernorm/pre: 2 steps" in capsys.readouterr().out
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize("argv", [["--no_such_key=1"], ["--n_layer=three"], ["--norm=batchnorm"]])
def test_cli_rejects_unknown_keys_and_bad_values_with_usage_error(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_cli_plugs_into_the_normfold_command_and_resolves_space_separated_values(capsys):
    import argparse

    from normfold.train.cli import add_commands

    parser = argparse.ArgumentParser(prog="normfold")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--norm", "rmsnorm", "--n_layer=3", "--print-config"])
    assert args.run(args) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["model"]["norm"], printed["model"]["n_layer"], printed["lr"]) == ("rmsnorm", 3, 1e-3)


def test_bf16_autocast_trains_on_cpu(tmp_path):
    summary = train(_tiny_train_config(tmp_path, precision="bf16", max_steps=2))
    assert all(torch.isfinite(torch.tensor(summary["train_losses"])))


def test_python_m_normfold_train_spells_options_with_dashes_and_accepts_underscores(capsys):
    from normfold.train.cli import main

    for spelling in ("--max-steps=7", "--max_steps=7"):
        assert main([spelling, "--print-config"]) == 0
        assert '"max_steps": 7' in capsys.readouterr().out
    main_help = None
    try:
        main(["--help"])
    except SystemExit as exit_:
        main_help = exit_.code
    out = capsys.readouterr().out
    assert main_help == 0 and "--max-steps" in out and "--max_steps" not in out
