"""The compatibility table over the transformers zoo (benchmarks/hf_zoo.py, issue 16 item 6) on a fast
subset: every row is a proof (float64, or a reported float32 fallback) on inputs of another batch size
and length than the example, or a FoldError with its reason, never another exception; refused norms
each have a reason; parameters are randomised first. And the models issue 16 item 5 names: what
crashed before is now folded, or refused as a FoldError naming the model, the norm and the step."""
from __future__ import annotations

import csv

import pytest
import torch
from scripts import load_benchmark

from normfold.engine import fold
from normfold.hf.inputs import example_inputs_for

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hf_zoo_table")]  # one worker builds the table once

# post-LN (bert), pre-LN (gpt2), tensors made in the default dtype (xglm), cannot run in float64: nan (canine),
# bboxes (layoutlm); the whole
# zoo: python benchmarks/hf_zoo.py (benchmarks/results/hf_zoo.md)
FAST_SUBSET = ["bert", "gpt2", "xglm", "canine", "layoutlm"]


@pytest.fixture(scope="module")
def hf_zoo():
    return load_benchmark("hf_zoo")


@pytest.fixture(scope="module")
def zoo(hf_zoo):
    return hf_zoo._zoo_helpers()


@pytest.fixture(scope="module")
def rows(hf_zoo, zoo, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_zoo") / "table"
    assert hf_zoo.main(["--types", *FAST_SUBSET, "--out", str(out)]) == 0  # 1: a wrong claim or an exception
    with open(out.with_suffix(".csv")) as handle:
        table = {row["model_type"]: row for row in csv.DictReader(handle)}
    return table, out.with_suffix(".md").read_text()


@pytest.mark.parametrize("model_type", FAST_SUBSET)
def test_every_row_is_a_proof_on_other_inputs_or_a_fold_error(rows, model_type):
    row = rows[0][model_type]
    assert row["status"] in ("proved", "FoldError"), row
    if row["status"] == "FoldError":
        assert row["detail"], "a FoldError row says why"
        return
    assert float(row["other_inputs_error"]) <= float(row["tolerance"])
    assert row["compared_in"] == "float64" or "cannot run in float64" in row["detail"]  # a fallback says so
    refused = int(row["norms"]) - int(row["folded"])
    assert sum(int(part.split("x ", 1)[0]) for part in row["refused"].split("; ") if part) == refused


def test_models_that_cannot_run_in_float64_are_proved_in_float32_and_say_so(rows):
    row = rows[0]["canine"]  # before: "a check that compared nothing"
    assert row["status"] == "proved" and row["compared_in"] == "float32", row
    assert 0 < float(row["tolerance"]) < 1e-4  # measured at float32's scale (canine: 1.0e-05), not float64's 1e-9
    for model_type in ("gpt2", "xglm"):  # xglm: a RuntimeError in float64, then a float32 fallback, before 61708a4
        assert rows[0][model_type]["compared_in"] == "float64" and float(rows[0][model_type]["tolerance"]) == 1e-9


def test_the_norms_a_float32_model_leaves_unfolded_are_judged_by_the_oracle_in_float32(rows):
    """Were "not judged: the model does not run in float64" (398 norms of the table): the oracle judges
    them in float32 at its float32 tolerances, and the row says so."""
    for model_type in ("canine",):
        row = rows[0][model_type]
        assert int(row["norms"]) > int(row["folded"]) and row["not_judged"] == "0", row
        assert row["missed_folds"].startswith("judged in float32") and row["missed"] != "", row


def test_the_markdown_table_names_its_command_machine_and_commit(rows):
    markdown = rows[1]
    assert "command: `python benchmarks/hf_zoo.py --types bert" in markdown
    assert "machine: " in markdown and "commit " in markdown
    assert "wrong claims 0; exceptions other than FoldError 0" in markdown
    assert all(f"| {t} |" in markdown for t in FAST_SUBSET)


def test_constant_parameters_are_randomised_before_folding(hf_zoo, zoo):
    config = zoo._config("bert")
    plain = zoo._bare_model_class(config)(config)
    assert (plain.embeddings.LayerNorm.weight == 1).all()  # what a fresh model has: it would hide a wrong γ fold
    model = hf_zoo.tiny_model("bert", zoo)
    for name, p in model.named_parameters():
        assert p.numel() == 1 or not (p == p.flatten()[0]).all(), f"{name} is still constant"


def test_deberta_v2_with_a_layer_norm_of_its_relative_embeddings_folds_it_by_centering_the_table(hf_zoo, zoo):
    """Was a FoldError ("norm encoder.LayerNorm: planning the centering step"), before that an IndexError."""
    model = hf_zoo.tiny_model("deberta-v2", zoo, relative_attention=True, norm_rel_ebd="layer_norm")
    _, report = fold(model, example_inputs_for(model))
    (entry,) = [e for e in report.norms if e.path == "encoder.LayerNorm"]
    assert entry.foldable and entry.producers == ("encoder.rel_embeddings.weight",), entry.reason
    assert report.verification.ok


def test_layoutlm_with_ordered_boxes_is_verified_on_boxes_that_stay_ordered(hf_zoo, zoo):
    model = hf_zoo.tiny_model("layoutlm", zoo)
    example = example_inputs_for(model)
    corner = torch.randint(0, 500, (*example["input_ids"].shape, 2), generator=torch.Generator().manual_seed(0))
    example["bbox"] = torch.cat([corner, corner + 1 + corner % 7], -1)  # x0 <= x1, y0 <= y1: a valid box
    _, report = fold(model, example)  # before: IndexError (independent random integers unordered the boxes)
    assert report.verification.ok and report.verification.num_runs == 3


def test_a_rerun_against_an_earlier_table_shows_folded_before_and_tries_only_the_types_it_reached(hf_zoo, tmp_path):
    before = tmp_path / "before.csv"
    with open(before, "w", newline="") as handle:  # an earlier table: the counts of issue 16's first zoo run
        writer = csv.DictWriter(handle, hf_zoo.COLUMNS)
        writer.writeheader()
        writer.writerow({**dict.fromkeys(hf_zoo.COLUMNS, ""), "model_type": "dinov2", "status": "proved",
                         "norms": 5, "folded": 0})  # every norm blocked at a layer scale
        writer.writerow({**dict.fromkeys(hf_zoo.COLUMNS, ""), "model_type": "gpt2", "status": "proved",
                         "norms": 5, "folded": 6})  # a made-up higher count: the summary must show it fell
        writer.writerow({**dict.fromkeys(hf_zoo.COLUMNS, ""), "model_type": "t5", "status": "no LayerNorm"})
        writer.writerow({**dict.fromkeys(hf_zoo.COLUMNS, ""), "model_type": "nemotron", "status": "skipped"})
    out = tmp_path / "after"
    assert hf_zoo.main(["--before", str(before), "--reached-only", "--types", "nemotron", "--out", str(out)]) == 0
    with open(out.with_suffix(".csv")) as handle:
        rows = {row["model_type"]: row for row in csv.DictReader(handle)}
    assert list(rows) == ["dinov2", "gpt2", "nemotron"]  # t5 had no LayerNorm: not tried; nemotron asked for
    assert (rows["dinov2"]["folded_before"], rows["dinov2"]["folded"]) == ("0", "5")  # layer scales merged
    assert (rows["nemotron"]["folded_before"], rows["nemotron"]["folded"]) == ("skipped", "5")  # LayerNorm1P
    markdown = out.with_suffix(".md").read_text()
    assert ("rose in 2 types (dinov2: 0 → 5, nemotron: skipped → 5); fell in 1 type (gpt2: 6 → 5); "
            "not measured (skipped) in 0 types (none)") in markdown
    assert "| folded | folded_before |" in markdown
    skipped_now = {"model_type": "cvt", "status": "skipped", "folded": "", "folded_before": "3"}
    assert hf_zoo.folded_changes([skipped_now]) == ([], [], ["cvt: 3 → skipped"])  # a time box is not a fall


def test_reached_only_needs_an_earlier_table(hf_zoo, capsys):
    with pytest.raises(SystemExit):
        hf_zoo.main(["--reached-only"])
    assert "--reached-only needs --before CSV" in capsys.readouterr().err


def test_a_recorded_transformers_bug_is_its_own_class_only_with_the_error_it_records(hf_zoo):
    """llama4 and tvp fail inside transformers for every call the zoo makes (file and cause recorded in
    TRANSFORMERS_BUGS); another eager error of theirs, or that error of another type, stays "missing input"."""
    message = "Llama4ForConditionalGeneration (llama4): the example inputs are not valid"
    bug = "AttributeError: 'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'"
    assert hf_zoo.error_class(message, bug, "llama4").startswith("transformers bug (modeling_llama4.py: ")
    assert hf_zoo.error_class(message, "IndexError: index out of range in self", "llama4").startswith("missing input")
    assert hf_zoo.error_class(message, bug, "llava").startswith("missing input")
    assert hf_zoo.error_class(message, None, "llama4") == "normfold refusal"


def test_a_model_whose_eager_attention_computes_no_finite_number_is_measured_with_sdpa(hf_zoo, zoo):
    """Nemotron's streaming ASR encoder reads the float additive mask eager attention gets as a boolean one
    (every score -inf, every output NaN): its row was "compared nothing"; with sdpa it is a proof, and the row
    says which attention it measured. A model with finite eager outputs keeps eager."""
    eager = hf_zoo.tiny_model("nemotron_asr_streaming_encoder", zoo)
    assert hf_zoo.computes_nothing_finite(eager, example_inputs_for(eager))
    bert = hf_zoo.tiny_model("bert", zoo)
    assert not hf_zoo.computes_nothing_finite(bert, example_inputs_for(bert))
    row = hf_zoo.fold_row("nemotron_asr_streaming_encoder", zoo)
    assert row["status"] == "proved" and row["compared_in"] == "float64", row
    assert row["detail"].startswith(hf_zoo.EAGER_NAN_NOTE) and int(row["folded"]) > 0


def test_a_model_whose_example_call_runs_none_of_its_layer_norms_says_so_not_no_layer_norm(hf_zoo):
    """CSM's example call is its text alone (its audio layouts rejected): the fold sees no LayerNorm, though its
    codec holds 32. Was "no LayerNorm" on 5be980f's text-only inputs, a row that hid a tower not measured."""
    class TextWithUnusedTower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.tower_norm = torch.nn.Embedding(8, 4), torch.nn.LayerNorm(4)

        def forward(self, input_ids):
            return self.embed(input_ids)

    row = hf_zoo._unreached_layer_norms(TextWithUnusedTower(), {"input_ids": torch.zeros(1, 2, dtype=torch.long)})
    assert row["status"] == "LayerNorm not reached" and "(input_ids) runs none of its 1 LayerNorm" in row["detail"]
    assert hf_zoo._unreached_layer_norms(torch.nn.Embedding(8, 4), {}) == {"status": "no LayerNorm"}


def test_a_proof_failed_where_the_original_itself_jumps_is_its_own_class(hf_zoo):
    """DEIMv2 and PP-DocLayout select queries by a top-k over tied scores: the float64 proof fails where the
    original's own output jumps under one rounding of its weights; that is no normfold refusal."""
    message = ("folded model differs from the original: float64 max relative error 6.410e+00 > 1.0e-09 at "
               "out['init_reference_points'][1, 272, 1] on input 1: original 0.0397034, folded 2.05364 (the original's "
               "own output there moves by 6.388e+00 when every weight moves by one unit in the last place: it jumps "
               "at this input, a top-k, sort or argmax over tied values, so it proves nothing of a transform)")
    assert hf_zoo.error_class(message, None, "pp_doclayout_v4") == "the original jumps"
    assert hf_zoo.error_class(message.split(" (the original")[0], None, "pp_doclayout_v4") == "normfold refusal"
