"""`normfold inspect` and `normfold check` on tiny Hugging Face folders."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from normfold.cli import EXIT_OK, EXIT_USAGE, main

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny folders of tests/hf
from hf.conftest import tiny_dirs  # noqa: E402,F401
from tiny_models import tiny_gpt2


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)
    path = tmp_path_factory.mktemp("tiny_bert")
    transformers.BertModel(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def gpt2_with_tokenizer(tmp_path_factory):
    """A 2-layer GPT-2 (HF Conv1D projections) with a WordPiece tokenizer built offline."""
    root = tmp_path_factory.mktemp("gpt2_tok")
    words = "hello world the cat sat on mat one sentence , inline".split()
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(root / "vocab.txt"))
    folder = root / "gpt2"
    tiny_gpt2(None, vocab_size=len(tokenizer), n_positions=64, n_embd=16).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("normfold: error:") and "Traceback" not in err, err
    assert "not a known refusal" not in lines[0]  # a refusal the command knows, not the last-resort catch-all
    return lines[0]


def test_inspect_prints_json_for_every_norm_and_draws_the_plot(bert_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "inspect.png"
    code, out, _ = _run(capsys, "inspect", bert_dir, "--json", "--plot", png, "--seq", "8")
    assert code == EXIT_OK
    report = json.loads(out)
    assert len(report["norms"]) == 5  # embeddings + 2 per layer
    assert report["norms"][0]["path"] == "embeddings.LayerNorm"
    assert png.stat().st_size > 0


def test_inspect_text_feeds_real_text_and_counts_every_conv1d_output(gpt2_with_tokenizer, tmp_path, capsys):
    """GPT-2's projections are HF Conv1D (c_attn, c_proj, c_fc, mlp.c_proj: 4 a layer) and its head a Linear."""
    texts = tmp_path / "texts.txt"
    texts.write_text("hello world\n\nthe cat sat on the mat\n", encoding="utf-8")
    code, out, _ = _run(capsys, "inspect", gpt2_with_tokenizer, "--text", texts, "--json")
    assert code == EXIT_OK
    report = json.loads(out)
    assert report["num_linear_outputs"] == 2 * 4 + 1 and report["num_batches"] == 1
    # the rows are the real tokens of the two texts, not 2 x 32 random ids
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2_with_tokenizer, local_files_only=True)
    real_tokens = sum(len(tokenizer(t)["input_ids"]) for t in ("hello world", "the cat sat on the mat"))
    assert {n["num_rows"] for n in report["norms"]} == {real_tokens}

    code, out, _ = _run(capsys, "inspect", gpt2_with_tokenizer, "--text", "one sentence, inline")
    assert code == EXIT_OK and "9 linear-like outputs traced" in out


@pytest.mark.parametrize("value", ["texts.txt", "data/missing", "   "])
def test_inspect_text_refuses_a_missing_file_rather_than_inspecting_its_name(gpt2_with_tokenizer, capsys, value):
    code, _, err = _run(capsys, "inspect", gpt2_with_tokenizer, "--text", value)
    assert code == EXIT_USAGE and "--text names no file" in _one_error_line(err)


def test_inspect_text_needs_the_folder_tokenizer(bert_dir, capsys):
    code, _, err = _run(capsys, "inspect", bert_dir, "--text", "no tokenizer in this folder")
    assert code == EXIT_USAGE and "tokenizer" in _one_error_line(err)


def test_check_finds_post_ln_without_warmup_and_strict_sets_the_exit_code(bert_dir, tmp_path, capsys):
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"warmup_steps": 0, "per_device_train_batch_size": 8}))
    code, out, _ = _run(capsys, "check", bert_dir, "--train-config", config, "--json", "--seq", "8")
    assert code == EXIT_OK
    assert [f["code"] for f in json.loads(out)["findings"]] == ["post-ln-no-warmup"]
    assert _run(capsys, "check", bert_dir, "--train-config", config, "--strict", "--seq", "8")[0] == 1


def test_check_takes_the_training_config_inline(bert_dir, capsys):
    code, out, _ = _run(capsys, "check", bert_dir, "--train-config", '{"warmup_steps": 0}', "--json", "--seq", "8")
    assert code == EXIT_OK and [f["code"] for f in json.loads(out)["findings"]] == ["post-ln-no-warmup"]
    code, out, _ = _run(capsys, "check", bert_dir, "--train_config", '{"warmup_steps": 10}', "--json", "--seq", "8")
    assert code == EXIT_OK and json.loads(out)["findings"] == []


def test_check_without_training_config_is_quiet_on_bert(bert_dir, capsys):
    code, out, _ = _run(capsys, "check", bert_dir, "--strict", "--seq", "8")
    assert code == EXIT_OK and "0 warning(s)" in out


@pytest.mark.parametrize("value, says", [
    ("[1, 2]", "must be a JSON file or an inline JSON object"),  # neither a file nor an object
    ('{"warmup_steps": 0', "inline JSON does not parse"),
    ("missing.json", "must be a JSON file or an inline JSON object"),
])
def test_check_refuses_a_bad_training_config_in_one_line(bert_dir, capsys, value, says):
    code, _, err = _run(capsys, "check", bert_dir, "--train-config", value)
    assert code == EXIT_USAGE and says in _one_error_line(err)


def test_check_refuses_a_json_file_that_holds_no_object(bert_dir, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    code, _, err = _run(capsys, "check", bert_dir, "--train-config", bad)
    assert code == EXIT_USAGE and "must hold a JSON object, got list" in _one_error_line(err)


@pytest.mark.parametrize("option", [["--batch", "0"], ["--seq", "-1"]])
def test_inspect_and_check_counts_must_be_positive_ints(bert_dir, capsys, option):
    for command in ("inspect", "check"):
        code, _, err = _run(capsys, command, bert_dir, *option)
        assert code == EXIT_USAGE and "expected a positive int" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["inspect", "check"])
def test_a_seq_beyond_the_models_positions_is_refused_before_loading(capsys, monkeypatch, tiny_dirs, command):  # noqa: F811
    """The tiny GPT-2 takes 32 positions: --seq 100000 was cut to 32 without a word."""
    import normfold.cli.lab as lab

    monkeypatch.setattr(lab, "load_model", lambda *a, **k: pytest.fail("loaded before the refusal"))
    code, out, err = _run(capsys, command, tiny_dirs["gpt2"], "--seq", "100000")
    line = _one_error_line(err)
    assert code == EXIT_USAGE and out == ""
    assert "--seq 100000" in line and "32 positions" in line and "expected 1 to 32" in line


def test_a_seq_within_the_positions_is_used_as_given_and_the_default_fits_a_short_model(capsys, tmp_path):
    folder = tmp_path / "short"
    tiny_gpt2(None, vocab_size=64, n_positions=16, n_embd=16, n_layer=1).save_pretrained(folder, safe_serialization=True)
    for argv, tokens in ((["--seq", "16"], 16), ([], 16), (["--seq", "5"], 5)):  # the default 32 is cut to 16 positions
        code, out, err = _run(capsys, "inspect", folder, "--json", "--batch", "1", *argv)
        assert code == EXIT_OK, err
        assert {norm["num_rows"] for norm in json.loads(out)["norms"]} == {tokens}, argv
    assert _run(capsys, "inspect", folder, "--seq", "17")[0] == EXIT_USAGE
