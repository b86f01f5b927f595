"""benchmarks/cli_zoo.py, the sweep of `normfold fold` over a tiny folder of every transformers type: its
verdicts call every malformed exit a bug (a sweep that could not see one would prove nothing), a folder
folds on the route it names, and a type past the memory limit is stopped as a skipped row, not the sweep."""
from __future__ import annotations

import pytest
from scripts import load_benchmark

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("cli_zoo")]


@pytest.fixture(scope="module")
def cli_zoo():
    return load_benchmark("cli_zoo")


REFUSAL = "normfold: error: fold cannot handle this model: no example inputs"


@pytest.mark.parametrize(("code", "stderr", "leave_output", "verdict"), [
    (1, REFUSAL + "\n", False, "refused"),
    (2, "Traceback (most recent call last):\n  ...\nValueError: boom\n", False, "BUG: traceback"),
    (None, "ValueError: escaped main\n", False, "BUG: traceback"),
    (1, REFUSAL + "\nnormfold: error: and again\n", False, "BUG: 2 normfold: lines"),
    (1, "something went wrong\n", False, "BUG: 0 normfold: lines"),
    (1, REFUSAL + "\n", True, "BUG: output left after a refusal"),
    (0, "", False, "BUG: exit 0 without a report"),
])
def test_every_malformed_exit_is_a_bug_and_a_one_line_refusal_is_not(cli_zoo, tmp_path, code, stderr, leave_output,
                                                                      verdict):
    out = tmp_path / "folded"
    if leave_output:
        out.mkdir()
    assert cli_zoo.judge(code, "", stderr, out)["verdict"] == verdict


def test_a_tiny_folder_folds_and_names_its_input_route(cli_zoo, tmp_path):
    row = cli_zoo.cli_row("vit", tmp_path, cli_zoo._helpers())
    assert row["verdict"] == "folded" and row["exit"] == 0
    assert row["processor"].startswith("ViTImageProcessor") and row["route"] == "processor"
    assert not list(tmp_path.iterdir())  # the folder and its fold are removed after the row


def test_a_type_past_the_memory_limit_is_a_skipped_row_and_the_sweep_goes_on_without_its_leftovers(cli_zoo, tmp_path):
    """A killed child cannot clean up: what it left in the sweep's folder (BLT's tiny folder was 5.6 GB, and
    the disk filled) is removed before the next child starts."""
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "model.safetensors").write_bytes(b"left by a killed child")
    rows = list(cli_zoo._rows_in_children(["bert", "gpt2"], tmp_path, max_rss_gb=0.05))  # any child holds > 50 MB
    assert [r["model_type"] for r in rows] == ["bert", "gpt2"]
    assert all(r["verdict"] == "skipped" and "resident memory passed 0.05 GB" in r["line"] for r in rows)
    assert not (tmp_path / "bert").exists()


def test_merged_tables_keep_one_row_per_type_the_later_file_winning(cli_zoo, tmp_path):
    first, rerun = tmp_path / "a.csv", tmp_path / "b.csv"
    rows = [{**dict.fromkeys(cli_zoo.COLUMNS, ""), "model_type": t, "verdict": v} for t, v in
            [("vit", "folded"), ("bert", "refused")]]
    cli_zoo._write(rows, first.with_suffix(""), "first")
    cli_zoo._write([{**rows[1], "verdict": "folded"}], rerun.with_suffix(""), "rerun")
    merged = cli_zoo.read_rows([str(first), str(rerun)])
    assert [(r["model_type"], r["verdict"]) for r in merged] == [("bert", "folded"), ("vit", "folded")]


@pytest.mark.parametrize(("argv", "said"), [(["--seconds-per-type", "0"], "--seconds-per-type must be > 0, got 0"),
                                             (["--shard", "3/2"], "--shard takes K/N with 1 <= K <= N, got '3/2'")])
def test_settings_that_cannot_run_are_refused_before_any_type(cli_zoo, argv, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_zoo.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize(("line", "kind"), [
    ("normfold: error: cannot build example inputs for BarkConfig: its forward takes none of ...",
     "cannot build example inputs"),
    ("normfold: error: could not load the weights in /tmp/x/t5gemma: You set ...", "could not load the weights"),
    ("normfold: verification failed: folded model differs from the original: ...", "verification failed"),
    ("normfold: error: nothing to fold: BitModel has no LayerNorm ...", "nothing to fold"),
    ("normfold: error: EncodecModel (encodec): planning (capture and analysis): torch.export could not ...",
     "planning"),  # was counted as a kind "EncodecModel"
])
def test_refusals_are_counted_by_kind_not_by_the_model_they_name(cli_zoo, line, kind):
    assert cli_zoo._refusal_kind(line) == kind


def test_a_head_entry_folds_a_folder_of_that_head_class(cli_zoo, tmp_path):
    """``TYPE:CLASS`` rows (``--heads``): the folder holds the head, as a fine-tuned checkpoint's does, and the
    entries list every head class a task mapping names for the type."""
    helpers = cli_zoo._helpers()
    entries = cli_zoo.head_entries(["bert"], helpers[0].transformers)
    assert {"bert:BertForMultipleChoice", "bert:BertForTokenClassification", "bert:BertForMaskedLM"} <= set(entries)
    row = cli_zoo.cli_row("bert:BertForMultipleChoice", tmp_path, helpers)
    assert row["verdict"] == "folded", row
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("entry", ["mpnet:MPNetForMultipleChoice", "data2vec-audio:Data2VecAudioForSequenceClassification"])
def test_a_classifier_of_few_logits_is_judged_in_float32_by_the_larger_measure_of_its_own_error(cli_zoo, tmp_path,
                                                                                                entry):
    """Its float64 proof passes, but over 2 x 2 logits the original's float32 error against float64 is the largest
    of 4 samples: the fold's float32 logits were 4.9 and 5.2 x it, past the bar of 4 x, and the folder was refused
    (6922b33). The bar now takes the larger of that and the logits' change under one rounding of every weight."""
    row = cli_zoo.cli_row(entry, tmp_path, cli_zoo._helpers())
    assert row["verdict"] == "folded", row


VIT_TESTS = '''
from transformers import ViTConfig

from ...test_modeling_common import floats_tensor


class ViTModelTester:
    def __init__(self, parent):
        self.parent = parent

    def prepare_config_and_inputs_for_common(self):
        config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=32)
        return config, {"pixel_values": floats_tensor([2, 3, 8, 8])}
'''


def test_with_tests_a_folder_is_built_from_the_types_own_tester_config(cli_zoo, tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    (checkout / "tests" / "models" / "vit").mkdir(parents=True)
    (checkout / "tests" / "models" / "vit" / "test_modeling_vit.py").write_text(VIT_TESTS)
    monkeypatch.setattr(cli_zoo, "TESTS", checkout)
    built = {}
    helpers = cli_zoo._helpers()
    real = cli_zoo._tester_model

    def spy(model_type, head, helpers_):
        config, model = real(model_type, head, helpers_)
        built[model_type] = (config.hidden_size, type(model).__name__)
        return config, model

    monkeypatch.setattr(cli_zoo, "_tester_model", spy)
    row = cli_zoo.cli_row("vit", tmp_path, helpers)
    assert row["verdict"] == "folded" and row["exit"] == 0, row
    assert built["vit"][0] == 16  # the tester's width, not the shrunk default config's
    missing = cli_zoo.cli_row("bert", tmp_path, helpers)
    assert missing["verdict"] == "skipped" and "no tiny model from its tester (TesterError" in missing["line"]


def test_tests_must_be_a_checkout(cli_zoo, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_zoo.main(["--tests", str(tmp_path), "--types", "vit"])
    assert exit_.value.code == 2 and "--tests must be a transformers checkout with tests/models/" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "kind"), [
    ("no tiny model from its shrunk default config (ValueError: ...)", "no tiny folder from its shrunk default config"),
    ("no tiny model from its tester (TesterError: no file tests/models/x/test_modeling_x.py)",
     "no tiny folder from its tester"),  # was counted as "from the shrunk default config" too
])
def test_skips_are_counted_by_where_the_tiny_model_failed(cli_zoo, line, kind):
    assert cli_zoo._skip_kind(line) == kind
