"""benchmarks/hf_zoo.py --tests PATH (issue 33 item 5): transformers' own ModelTesters, read from a checkout
without its test_modeling_common, give each type its config and valid inputs; a tester that cannot be loaded
is a "no tester" row, not a crash; a FoldError gets its reason class; and every norm the engine leaves
unfolded is judged by the fuzzer's brute-force oracle (the missed-fold column)."""
from __future__ import annotations

import csv
import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]

# a tester file the way transformers' suite writes one: helpers from test_modeling_common (absent here),
# decorators from testing_utils, a module-level constant, the tester, and the test case it feeds
BERT_TESTS = '''
import unittest

from transformers import BertConfig, is_torch_available
from transformers.testing_utils import require_torch, slow, torch_device

from ...test_configuration_common import ConfigTester
from ...test_modeling_common import ModelTesterMixin, floats_tensor, ids_tensor, random_attention_mask

if is_torch_available():
    import torch

    from transformers import BertForMaskedLM, BertModel

VOCAB = 50


@require_torch
class BertModelTester:
    def __init__(self, parent, batch_size=3, seq_length=6, vocab_size=VOCAB, hidden_size=16, type_vocab_size=2):
        self.parent = parent
        self.batch_size = batch_size
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.type_vocab_size = type_vocab_size

    def get_config(self):
        return BertConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, num_hidden_layers=1,
                          num_attention_heads=2, intermediate_size=32, type_vocab_size=self.type_vocab_size,
                          max_position_embeddings=16)

    def prepare_config_and_inputs(self):
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        input_mask = random_attention_mask([self.batch_size, self.seq_length])
        token_type_ids = ids_tensor([self.batch_size, self.seq_length], self.type_vocab_size)
        labels = ids_tensor([self.batch_size], 2)
        return self.get_config(), input_ids, token_type_ids, input_mask, labels

    def prepare_config_and_inputs_for_common(self):
        config, input_ids, token_type_ids, input_mask, labels = self.prepare_config_and_inputs()
        self.parent.assertEqual(input_ids.device.type, torch_device)
        return config, {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": input_mask,
                        "labels": labels, "return_loss": True}


@require_torch
class BertModelTest(ModelTesterMixin, unittest.TestCase):
    def setUp(self):
        self.model_tester = BertModelTester(self)
        self.config_tester = ConfigTester(self, config_class=BertConfig, hidden_size=37)
'''

# a base tester in another file of the suite (as causal_lm_tester.py is), imported relatively
CAUSAL_LM_TESTER = '''
from .test_modeling_common import ids_tensor


class CausalLMModelTester:
    config_class = None

    def __init__(self, parent, batch_size=2, seq_length=5, vocab_size=40):
        self.parent, self.batch_size, self.seq_length, self.vocab_size = parent, batch_size, seq_length, vocab_size

    def prepare_config_and_inputs_for_common(self):
        config = self.config_class(vocab_size=self.vocab_size, n_embd=16, n_layer=1, n_head=2, n_positions=16)
        return config, {"input_ids": ids_tensor([self.batch_size, self.seq_length], self.vocab_size)}
'''
GPT2_TESTS = '''
from transformers import GPT2Config

from ...causal_lm_tester import CausalLMModelTester


class GPT2ModelTester(CausalLMModelTester):
    config_class = GPT2Config
'''

# a tester that needs a helper of the suite normfold does not provide
OPT_TESTS = '''
from transformers import OPTConfig

from ...test_modeling_common import ids_tensor, _prepare_4d_causal_mask


class OPTModelTester:
    def __init__(self, parent):
        self.parent = parent

    def prepare_config_and_inputs_for_common(self):
        ids = ids_tensor([2, 5], 50)
        return OPTConfig(), {"input_ids": ids, "attention_mask": _prepare_4d_causal_mask(ids)}
'''


# a tester whose defaults are a constant of the checkout's own testing_utils (as CausalLMModelTester reads
# _TEXT_MODEL_TESTER_DEFAULTS there), absent from the installed transformers' copy
TESTING_UTILS = '''
import os

_TINY_GPT2_DEFAULTS = {"n_embd": 16, "n_layer": 1, "n_head": 2}
_NOT_A_LITERAL = os.getcwd()
'''
GPT_NEO_TESTS = '''
from transformers import GPT2Config
from transformers.testing_utils import _TINY_GPT2_DEFAULTS, require_torch

from ...test_modeling_common import ModelTesterMixin, global_rng, ids_tensor


@require_torch
class GPTNeoModelTester(ModelTesterMixin):  # a tester may subclass the suite's mixin (PvtV2ModelTester does)
    def __init__(self, parent):
        self.parent = parent

    def prepare_config_and_inputs_for_common(self):
        length = global_rng.randint(5, 5)  # the suite's module-level random.Random
        return GPT2Config(**_TINY_GPT2_DEFAULTS), {"input_ids": ids_tensor([2, length], 50)}
'''


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_zoo():
    return _load("_hf_zoo_testers", REPO / "benchmarks" / "hf_zoo.py")


@pytest.fixture(scope="module")
def zoo(hf_zoo):
    return hf_zoo._zoo_helpers()


@pytest.fixture()
def checkout(tmp_path):
    """A mini transformers checkout: bert, gpt2 (with its base tester) and opt (whose tester fails)."""
    for name, text in {"models/bert/test_modeling_bert.py": BERT_TESTS, "models/gpt2/test_modeling_gpt2.py": GPT2_TESTS,
                       "models/opt/test_modeling_opt.py": OPT_TESTS, "causal_lm_tester.py": CAUSAL_LM_TESTER}.items():
        path = tmp_path / "tests" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_a_tester_is_loaded_without_the_suite_and_gives_valid_inputs_without_labels(hf_zoo, checkout):
    testers = hf_zoo._testers_module()
    config, inputs, tester = testers.tester_inputs("bert", checkout, seed=0)
    assert tester == "BertModelTester" and config.model_type == "bert" and config.hidden_size == 16
    assert set(inputs) == {"input_ids", "token_type_ids", "attention_mask"}  # labels and return_loss left out
    assert inputs["input_ids"].shape == (3, 6) and 0 <= int(inputs["input_ids"].min()) <= int(inputs["input_ids"].max()) < 50
    mask = inputs["attention_mask"]
    assert set(mask.unique().tolist()) <= {0, 1} and bool((mask[:, -1] == 1).all())  # no row masked out
    other = testers.tester_inputs("bert", checkout, seed=1)[1]
    assert not torch.equal(other["input_ids"], inputs["input_ids"])  # another seed, other values


def test_the_bare_model_and_the_main_head_prove_on_the_testers_inputs(hf_zoo, zoo, checkout):
    rows = hf_zoo.tester_rows("bert", checkout, zoo, hf_zoo._testers_module())
    assert [r["model_class"] for r in rows] == ["BertModel", "BertLMHeadModel"]  # the causal-LM mapping lists it first
    for row in rows:
        assert row["status"] == "proved", row
        assert row["capture"] == "whole" and row["compared_in"] == "float64" and int(row["norms"]) > 0
        assert row["detail"].startswith("BertModelTester")
        assert row["missed"] == 0 or row["missed_folds"]  # every missed fold is listed


def test_a_base_tester_of_another_file_of_the_suite_is_loaded_from_the_checkout(hf_zoo, zoo, checkout):
    rows = hf_zoo.tester_rows("gpt2", checkout, zoo, hf_zoo._testers_module())
    assert [(r["model_class"], r["status"]) for r in rows] == [("GPT2Model", "proved"), ("GPT2LMHeadModel", "proved")]
    assert all(int(r["folded"]) == int(r["norms"]) and r["missed"] == 0 for r in rows)  # pre-LN: every norm folds


def test_a_tester_that_fails_or_is_missing_is_a_no_tester_row_with_the_reason(hf_zoo, zoo, checkout):
    testers = hf_zoo._testers_module()
    [failing] = hf_zoo.tester_rows("opt", checkout, zoo, testers)
    assert failing["status"] == "no tester" and "_prepare_4d_causal_mask" in failing["detail"]
    [missing] = hf_zoo.tester_rows("vit", checkout, zoo, testers)
    assert missing["status"] == "no tester" and "no file tests/models/vit/test_modeling_vit.py" in missing["detail"]


def test_the_table_runs_each_type_in_a_child_process_and_counts_the_no_tester_rows(hf_zoo, checkout, tmp_path):
    out = tmp_path / "zoo"
    assert hf_zoo.main(["--tests", str(checkout), "--types", "opt", "vit", "--out", str(out)]) == 0
    with open(out.with_suffix(".csv"), newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["model_type"], r["status"]) for r in rows] == [("opt", "no tester"), ("vit", "no tester")]
    table = out.with_suffix(".md").read_text()
    assert "2 no tester" in table and f"--tests {checkout}" in table


def test_the_tests_option_needs_a_checkout_with_tests_models(hf_zoo, tmp_path, capsys):
    with pytest.raises(SystemExit):
        hf_zoo.main(["--tests", str(tmp_path), "--types", "bert"])
    assert "--tests needs a transformers checkout" in capsys.readouterr().err


def test_a_brute_force_budget_that_is_not_positive_is_refused(hf_zoo, capsys):
    with pytest.raises(SystemExit):
        hf_zoo.main(["--types", "bert", "--brute-force-seconds", "0"])
    assert "--brute-force-seconds must be > 0, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(("message", "eager", "expected"), [
    (("LlavaModel (llava): verifying (running both models) failed: ValueError: Image features and image tokens "
      "do not match"), "ValueError: Image features and image tokens do not match", "missing input"),
    (("LEDModel (led): planning (capture and analysis): torch.export could not capture LEDModel: "
      "GuardOnDataDependentSymNode: Could not guard on data-dependent expression"), None, "export limit"),
    (("VitsModel (vits): planning (capture and analysis) failed: GuardOnDataDependentSymNode: Could not extract "
      "specialized integer from data-dependent expression u0"), None, "export limit"),
    ("folded model differs from the original: float64 max relative error 8.829e-01 > 1e-09", None,
     "normfold refusal"),
    ("GPT2Model (gpt2): the plan overflows float16 at h.0.attn.c_attn.weight", None, "normfold refusal"),
])
def test_a_fold_error_is_classed_by_whether_the_original_runs_and_whose_error_it_is(hf_zoo, message, eager, expected):
    assert hf_zoo.error_class(message, eager).split(" (")[0] == expected


class _FlippedNorm(nn.Module):
    """Linear -> flip along the sequence -> LayerNorm -> Linear: the engine has no rule for flip (it
    refuses the norm), yet centering ``proj`` makes the norm's input zero-mean and changes no output."""

    def __init__(self, through_proj: bool = True):
        super().__init__()
        self.through_proj = through_proj
        self.proj, self.norm, self.head = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.norm(torch.flip(self.proj(x) if self.through_proj else x, dims=[1])))


def test_the_brute_force_counts_a_norm_the_engine_refuses_but_centering_folds(hf_zoo):
    row = dict.fromkeys(hf_zoo.COLUMNS, "")
    calls = [{"x": torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(s))} for s in (0, 1)]
    hf_zoo.fold_and_prove(row, _FlippedNorm().eval(), *calls)
    assert row["status"] == "proved" and row["folded"] == 0 and row["missed"] == 1
    assert row["missed_folds"].startswith("norm: centering ['proj.bias', 'proj.weight'] (whole) folds it")
    assert "aten.flip" in row["missed_folds"]  # with the engine's reason


def test_the_brute_force_confirms_a_norm_no_centering_can_fold(hf_zoo):
    row = dict.fromkeys(hf_zoo.COLUMNS, "")
    calls = [{"x": torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(s))} for s in (0, 1)]
    hf_zoo.fold_and_prove(row, _FlippedNorm(through_proj=False).eval(), *calls)  # the input feeds the norm itself
    assert row["status"] == "proved" and row["folded"] == 0 and row["missed"] == 0 and row["missed_folds"] == ""


def test_the_centering_recipes_name_each_parameters_output_dim(hf_zoo):
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 6), nn.Conv1d(6, 6, 3, groups=2), nn.LayerNorm(6))
    recipes = hf_zoo.centering_recipes(model)
    assert recipes == {"0.weight": (1, None), "1.weight": (0, None), "1.bias": (0, None), "2.weight": (0, 3),
                       "2.bias": (0, 3)}  # the norm's own γ/β are no linear map


def test_the_checkouts_own_testing_utils_constants_and_the_suites_mixins_and_rng_reach_its_testers(hf_zoo, checkout):
    testers = hf_zoo._testers_module()
    (checkout / "src" / "transformers").mkdir(parents=True)
    (checkout / "src" / "transformers" / "testing_utils.py").write_text(textwrap.dedent(TESTING_UTILS))
    path = checkout / "tests" / "models" / "gpt_neo" / "test_modeling_gpt_neo.py"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(GPT_NEO_TESTS))
    namespace = testers.load_namespace(path, checkout)
    assert namespace["_TINY_GPT2_DEFAULTS"] == {"n_embd": 16, "n_layer": 1, "n_head": 2}  # the literal, read from source
    assert namespace["require_torch"] is testers._pass_through  # a decorator still passes through
    assert "_NOT_A_LITERAL" not in testers.testing_utils_constants(checkout)  # nothing of that file is run
    tester = namespace["GPTNeoModelTester"](testers._Parent())
    config, inputs = tester.prepare_config_and_inputs_for_common()
    assert (config.n_embd, config.n_layer) == (16, 1) and inputs["input_ids"].shape == (2, 5)


def test_shards_split_the_type_list_and_merge_back_in_its_order(hf_zoo, checkout, tmp_path):
    stems = [tmp_path / f"shard{i}" for i in range(2)]
    for i, stem in enumerate(stems):
        assert hf_zoo.main(["--tests", str(checkout), "--types", "opt", "vit", "gpt_neo", "--shard", f"{i}/2",
                            "--out", str(stem)]) == 0
    shard_types = [[r["model_type"] for r in csv.DictReader(open(s.with_suffix(".csv"), newline=""))] for s in stems]
    assert shard_types == [["opt", "gpt_neo"], ["vit"]]  # every second type, from the first and the second
    merged = tmp_path / "merged"
    assert hf_zoo.main(["--merge", *(str(s.with_suffix(".csv")) for s in reversed(stems)), "--types", "opt", "vit",
                        "gpt_neo", "--out", str(merged)]) == 0
    with open(merged.with_suffix(".csv"), newline="") as handle:
        assert [r["model_type"] for r in csv.DictReader(handle)] == ["opt", "vit", "gpt_neo"]  # the list's order
    table = merged.with_suffix(".md").read_text()
    assert "model types: 3; proved in at least one row: 0" in table
    assert table.count("--shard") == 2  # each shard's command recorded


@pytest.mark.parametrize("shard", ["2/2", "1", "a/b", "-1/2"])
def test_a_shard_outside_the_list_is_refused(hf_zoo, shard, capsys):
    with pytest.raises(SystemExit):
        hf_zoo.main(["--types", "bert", "--shard", shard])
    assert "--shard" in capsys.readouterr().err


def test_merging_tables_without_rows_is_refused(hf_zoo, tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("model_type,status\n")
    with pytest.raises(ValueError, match="expected rows"):
        hf_zoo.merge_tables([empty], tmp_path / "out", ["bert"])


def test_the_main_head_is_the_first_whose_forward_takes_every_tester_input(hf_zoo, zoo):
    from transformers import WhisperConfig

    inputs = {"input_features": torch.zeros(1, 80, 60), "decoder_input_ids": torch.zeros(1, 1, dtype=torch.long)}
    names = [cls.__name__ for cls in hf_zoo.model_classes(WhisperConfig(), zoo, inputs)]
    assert names == ["WhisperModel", "WhisperForConditionalGeneration"]  # WhisperForCausalLM reads no audio
    assert [cls.__name__ for cls in hf_zoo.model_classes(WhisperConfig(), zoo)][1] == "WhisperForCausalLM"


def test_a_sub_configs_model_is_found_by_its_config_class_name(hf_zoo, zoo):
    from transformers import Aimv2TextConfig

    inputs = {"input_ids": torch.zeros(1, 3, dtype=torch.long)}
    assert [cls.__name__ for cls in hf_zoo.model_classes(Aimv2TextConfig(), zoo, inputs)] == ["Aimv2TextModel"]


HIFIGAN_TESTS = '''
from transformers import SpeechT5HifiGanConfig

from ...test_modeling_common import floats_tensor


class SpeechT5HifiGanTester:
    def __init__(self, parent):
        self.parent = parent

    def prepare_config_and_inputs_for_common(self):
        return SpeechT5HifiGanConfig(), {"spectrogram": floats_tensor([7, 80])}
'''


def test_a_tester_whose_config_no_model_class_takes_is_a_skipped_row(hf_zoo, zoo, checkout):
    path = checkout / "tests" / "models" / "speecht5" / "test_modeling_speecht5.py"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(HIFIGAN_TESTS))
    [row] = hf_zoo.tester_rows("speecht5_hifigan", checkout, zoo, hf_zoo._testers_module())
    assert row["status"] == "skipped" and "no model class takes SpeechT5HifiGanConfig" in row["detail"]


def test_a_rerun_merged_last_replaces_the_rows_of_its_types(hf_zoo, tmp_path):
    tables = {"first": [("bert", "BertModel", "FoldError"), ("bert", "BertLMHeadModel", "FoldError"),
                        ("gpt2", "GPT2Model", "proved")],
              "rerun": [("bert", "BertModel", "proved")]}
    for name, rows in tables.items():
        with open(tmp_path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, hf_zoo.COLUMNS)
            writer.writeheader()
            writer.writerows({**dict.fromkeys(hf_zoo.COLUMNS, ""), "model_type": t, "model_class": c, "status": s}
                             for t, c, s in rows)
    rows = hf_zoo.merge_tables([tmp_path / "first.csv", tmp_path / "rerun.csv"], tmp_path / "out", ["gpt2", "bert"])
    assert [(r["model_type"], r["model_class"], r["status"]) for r in rows] == [("gpt2", "GPT2Model", "proved"),
                                                                              ("bert", "BertModel", "proved")]


def test_a_merge_of_merges_names_every_run_its_rows_came_from(hf_zoo, tmp_path):
    """The provenance line keeps each input's whole recorded command, nested shards included (it kept only the
    first backticked command of each input, so a merge of a merged table lost its shards)."""
    for name, model_type in (("s0", "bert"), ("s1", "gpt2"), ("rerun", "xglm")):
        row = {**dict.fromkeys(hf_zoo.COLUMNS, ""), "model_type": model_type, "model_class": "M", "status": "proved"}
        with open(tmp_path / f"{name}.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, hf_zoo.COLUMNS)
            writer.writeheader()
            writer.writerow(row)
        hf_zoo.write_markdown([row], tmp_path / f"{name}.md", f"python benchmarks/hf_zoo.py --types {model_type}")
    hf_zoo.merge_tables([tmp_path / "s0.csv", tmp_path / "s1.csv"], tmp_path / "first", ["bert", "gpt2", "xglm"])
    hf_zoo.merge_tables([tmp_path / "first.csv", tmp_path / "rerun.csv"], tmp_path / "final", ["bert", "gpt2", "xglm"])
    provenance = (tmp_path / "final.md").read_text()
    for command in ("--types bert", "--types gpt2", "--types xglm", f"--merge {tmp_path / 's0.csv'}"):
        assert command in provenance
    line = provenance.splitlines()[2]
    assert line.count("`") % 2 == 0 and line.count("from: ") == 2  # each command its own code span, nesting said


# a tester whose inputs are for one head only (multiple choice: ids of shape (B, choices, T)), as the test file's
# test case says in its all_model_classes (TimesFM's and PI0's testers feed their prediction heads only)
MULTIPLE_CHOICE_TESTS = '''
import unittest

from transformers import BertConfig, is_torch_available

from ...test_modeling_common import ModelTesterMixin, ids_tensor

if is_torch_available():
    from transformers import BertForMultipleChoice


class BertChoiceModelTester:
    def __init__(self, parent):
        self.parent = parent

    def prepare_config_and_inputs_for_common(self):
        config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16)
        return config, {"input_ids": ids_tensor([2, 3, 5], 50)}


class BertChoiceModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (BertForMultipleChoice,) if is_torch_available() else ()
'''


def test_a_class_the_test_file_does_not_run_its_inputs_on_is_skipped_not_a_fold_error(hf_zoo, zoo, tmp_path):
    """Inputs made for another class are no FoldError of normfold's: TimesFmModel, PI0Model and
    PerceiverForMaskedLM were "FoldError: missing input" rows, given inputs their test files run on other classes."""
    path = tmp_path / "tests" / "models" / "bert" / "test_modeling_bert.py"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(MULTIPLE_CHOICE_TESTS))
    testers = hf_zoo._testers_module()
    assert testers.tested_classes("bert", tmp_path) == {"BertForMultipleChoice"}
    rows = hf_zoo.tester_rows("bert", tmp_path, zoo, testers)
    assert rows and all(r["status"] == "skipped" for r in rows), rows
    assert all("its inputs are for BertForMultipleChoice (the test file's all_model_classes)" in r["detail"]
               and r["model_class"] + " rejects them: " in r["detail"] for r in rows)


# a tester that makes inputs per model class (as Perceiver's does: floats for its bare model, ids for its masked LM)
PER_CLASS_TESTS = '''
import unittest

from transformers import BertConfig, is_torch_available

from ...test_modeling_common import ModelTesterMixin, ids_tensor

if is_torch_available():
    from transformers import BertLMHeadModel, BertModel


class BertPerClassModelTester:
    def __init__(self, parent):
        self.parent = parent

    def get_config(self):
        return BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=16)

    def prepare_config_and_inputs_for_common(self):
        return self.get_config(), {"input_ids": ids_tensor([2, 3, 5], 50)}  # right for none of the classes below

    def prepare_config_and_inputs_for_model_class(self, model_class):
        return self.get_config(), {"input_ids": ids_tensor([2, 5], 50), "model_class": model_class.__name__}


class BertPerClassModelTest(ModelTesterMixin, unittest.TestCase):
    all_model_classes = (BertModel, BertLMHeadModel) if is_torch_available() else ()
'''


def test_a_tester_that_makes_inputs_per_class_gives_each_class_its_own(hf_zoo, zoo, tmp_path):
    """PerceiverForMaskedLM was a "FoldError: missing input" row: it got the float inputs the tester makes for
    the bare model; a tester's per-class inputs are taken for each class."""
    path = tmp_path / "tests" / "models" / "bert" / "test_modeling_bert.py"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(PER_CLASS_TESTS))
    testers = hf_zoo._testers_module()
    _, inputs, _ = testers.tester_inputs("bert", tmp_path, seed=0, model_class=zoo.transformers.BertLMHeadModel)
    assert inputs["model_class"] == "BertLMHeadModel" and inputs["input_ids"].shape == (2, 5)
    rows = hf_zoo.tester_rows("bert", tmp_path, zoo, testers)
    assert [(r["model_class"], r["status"]) for r in rows] == [("BertModel", "proved"), ("BertLMHeadModel", "proved")]


def test_a_class_without_a_layer_norm_is_a_no_layer_norm_row_whatever_inputs_it_was_given(hf_zoo, zoo, tmp_path):
    """The all_model_classes check runs the model only where there is a LayerNorm to fold: TimesFM 2.5's bare
    model (RMSNorm only) stays "no LayerNorm", not "skipped"."""
    text = MULTIPLE_CHOICE_TESTS.replace("BertConfig(", "LlamaConfig(").replace("from transformers import BertConfig",
                                                                                "from transformers import LlamaConfig")
    text = text.replace("intermediate_size=32, max_position_embeddings=16", "intermediate_size=32")
    path = tmp_path / "tests" / "models" / "llama" / "test_modeling_llama.py"
    path.parent.mkdir(parents=True)
    path.write_text(textwrap.dedent(text))
    rows = hf_zoo.tester_rows("llama", tmp_path, zoo, hf_zoo._testers_module())
    assert rows and all(r["status"] == "no LayerNorm" for r in rows), rows
