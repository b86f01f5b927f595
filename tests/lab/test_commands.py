"""`normfold inspect` and `normfold check` on a tiny Hugging Face folder."""
from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("tiny_bert")
    BertModel(config).save_pretrained(path, safe_serialization=True)
    return path


def _run(argv):
    from normfold.lab.commands import add_commands

    parser = argparse.ArgumentParser(prog="normfold")
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.run(args)


def test_inspect_prints_json_for_every_norm_and_draws_the_plot(bert_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "inspect.png"
    assert _run(["inspect", str(bert_dir), "--json", "--plot", str(png), "--seq", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["norms"]) == 5  # embeddings + 2 per layer
    assert report["norms"][0]["path"] == "embeddings.LayerNorm"
    assert png.stat().st_size > 0


def test_check_finds_post_ln_without_warmup_and_strict_sets_the_exit_code(bert_dir, tmp_path, capsys):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"warmup_steps": 0, "per_device_train_batch_size": 8}))
    assert _run(["check", str(bert_dir), "--train-config", str(config), "--json", "--seq", "8"]) == 0
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert [f["code"] for f in findings] == ["post-ln-no-warmup"]
    assert _run(["check", str(bert_dir), "--train-config", str(config), "--strict", "--seq", "8"]) == 1


def test_check_without_training_config_is_quiet_on_bert(bert_dir, capsys):
    assert _run(["check", str(bert_dir), "--strict", "--seq", "8"]) == 0
    assert "0 warning(s)" in capsys.readouterr().out


def test_check_refuses_an_unreadable_training_config(bert_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        _run(["check", str(bert_dir), "--train-config", str(bad)])
    with pytest.raises(ValueError, match="readable JSON"):
        _run(["check", str(bert_dir), "--train-config", str(tmp_path / "missing.json")])
