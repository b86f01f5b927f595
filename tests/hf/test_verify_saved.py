"""``normfold verify`` / ``verify_folders`` on folders saved in fp32, fp16, bf16.

Outputs: the tolerance is measured from the original's own error in the stored dtype, so correct
folds pass and, in GPT-2s, a scaled head, a scaled MLP weight or a zeroed attention output fail
(fixed bf16 bounds let all three pass). Weights: every stored tensor is compared with the folder
re-made from the original, which also catches the changes output comparison cannot see (in a
bf16 post-LN BERT, a 1.5x MLP weight and a zeroed attention output stay within bf16's own error).
The report, the weight files that load and the files beside them are judged against the re-made
folder too: nothing the folder says about itself is believed (issue 29)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main
from normfold.engine import FoldVerificationError
from normfold.engine.verify import OWN_ERROR_MULTIPLE
from normfold.hf import CheckpointError, default_model_path, fold_folder, load_model, verify_folders
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.report import write_sealed_report

import sealing

safetensors_torch = pytest.importorskip("safetensors.torch")

CORRUPTIONS = {  # what a broken fold or a damaged file might do to a folded model: tensor per family, factor
    "head x1.1": ({"gpt2": "lm_head.weight", "bert": "pooler.dense.weight"}, 1.1),
    "last MLP weight x1.5": ({"gpt2": "transformer.h.{last}.mlp.c_proj.weight",
                              "bert": "encoder.layer.{last}.output.dense.weight"}, 1.5),
    "last attention output zeroed": ({"gpt2": "transformer.h.{last}.attn.c_proj.weight",
                                      "bert": "encoder.layer.{last}.attention.output.dense.weight"}, 0.0),
}


def _family(model: str) -> str:
    return "bert" if "bert" in model else "gpt2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_dirs):
    """(model, dtype) -> (original saved in dtype, its fold by ``fold_folder``), made on first use."""
    root, cache = tmp_path_factory.mktemp("saved"), {}
    sources = {"tiny gpt2": tiny_dirs["gpt2"], "tiny bert": tiny_dirs["bert"], "bundled": default_model_path()}

    def get(model: str, dtype: str):
        if (model, dtype) not in cache:
            src, out = root / f"{model}-{dtype}".replace(" ", "-"), root / f"{model}-{dtype}-folded".replace(" ", "-")
            load_model(sources[model]).to(getattr(torch, dtype)).save_pretrained(src)
            fold_folder(src, out)
            cache[model, dtype] = src, out
        return cache[model, dtype]

    return get


def _corrupt(folded, to, corruption: str, family: str = "gpt2", *, reseal: bool = True):
    """A copy of the folded folder at ``to`` with one tensor scaled as ``CORRUPTIONS`` says; returns
    (the copy, the tensor's name). ``reseal``: the report's seal recomputed over the changed weights,
    as someone who means it would, so that the checks behind the seal are the ones tested."""
    names, factor = CORRUPTIONS[corruption]
    shutil.copytree(folded, to)
    state = safetensors_torch.load_file(to / "model.safetensors")
    layers = [int(k.split(".")[2]) for k in state if k.startswith(("transformer.h.", "encoder.layer."))]
    key = names[family].format(last=max(layers))
    state[key] = (state[key].double() * factor).to(state[key].dtype)
    safetensors_torch.save_file(state, to / "model.safetensors", metadata={"format": "pt"})
    if reseal:
        sealing.reseal(to)
    return to, key


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_correct_fold_passes_a_tolerance_measured_in_its_stored_dtype(saved, dtype):
    src, out = saved("tiny gpt2", dtype)
    result = verify_folders(src, out)
    outputs = result["outputs"]
    own = outputs["stored_dtype_own_error"]
    assert result["ok"] and result["why"] is None and result["problems"] == [] and own > 0
    assert outputs["tolerance"] == pytest.approx(OWN_ERROR_MULTIPLE * own + torch.finfo(getattr(torch, dtype)).eps / 2)
    assert dtype in outputs["tolerance_rule"]
    assert outputs["max_rel_error"] < outputs["tolerance"] / 2  # margin: measured 0.13-0.5x the own error
    assert outputs["stock_load"]["ok"]  # GPT-2's stock-compatible fold: what stock transformers loads is checked too


@pytest.mark.parametrize("model", ["tiny gpt2", "bundled"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_bfloat16_gpt2_fails_the_output_check(saved, tmp_path, model, corruption):
    src, out = saved(model, "bfloat16")
    result = verify_folders(src, _corrupt(out, tmp_path / "bad", corruption)[0])
    outputs = result["outputs"]
    assert not result["ok"] and outputs["max_rel_error"] > 2 * outputs["tolerance"]


def test_the_command_exits_1_on_a_corrupted_bfloat16_fold_and_prints_the_rule(saved, tmp_path, capsys):
    src, out = saved("bundled", "bfloat16")
    assert main(["verify", str(src), str(out), "--json"]) == EXIT_OK
    verification = json.loads(capsys.readouterr().out)["verification"]
    assert verification["ok"] and "bfloat16" in verification["outputs"]["tolerance_rule"]
    bad, _ = _corrupt(out, tmp_path / "bad", "head x1.1")
    assert main(["verify", str(src), str(bad)]) == EXIT_VERIFY_FAILED
    assert "FAILED" in capsys.readouterr().out


# ----------------------------------------------------------------- the weights, tensor by tensor

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny gpt2", "tiny bert"])
def test_a_correct_fold_has_every_stored_tensor_bit_identical_to_the_remade_fold(saved, model, dtype):
    src, out = saved(model, dtype)
    result = verify_folders(src, out)
    weights = result["files"]["weights"]
    stored = safetensors_torch.load_file(out / "model.safetensors")
    assert result["ok"] and weights["ok"] is True and weights["why"] is None
    assert weights["num_tensors"] == len(stored) and weights["num_differing_tensors"] == 0 and weights["worst"] is None


@pytest.mark.parametrize("model", ["tiny gpt2", "tiny bert"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_bfloat16_fold_fails_the_weight_check_naming_the_tensor(saved, tmp_path, model, corruption):
    # tiny bert: the output check alone passes the MLP and attention corruptions (within bf16's own error)
    src, out = saved(model, "bfloat16")
    bad, key = _corrupt(out, tmp_path / "bad", corruption, _family(model))
    result = verify_folders(src, bad)
    weights = result["files"]["weights"]
    assert not result["ok"] and weights["ok"] is False
    assert weights["worst"]["name"] == key and weights["worst"]["max_ulps"] > 10
    assert key in weights["why"] and key in result["why"]


def test_a_corrupted_fold_whose_seal_was_not_recomputed_fails_the_seal_first(saved, tmp_path):
    src, out = saved("tiny gpt2", "bfloat16")
    bad, key = _corrupt(out, tmp_path / "bad", "head x1.1", reseal=False)
    result = verify_folders(src, bad)
    assert not result["ok"] and "model.safetensors was changed after normfold wrote it" in result["why"]
    assert any(key in p for p in result["problems"])  # the tensor is still named, further down
    assert "does not load" in result["outputs"]["why"]  # normfold.from_pretrained refuses a broken seal


def test_the_output_check_alone_cannot_see_a_scaled_mlp_weight_in_a_bfloat16_bert(saved, tmp_path):
    """Why the weight check exists: this corruption is smaller than bf16's own error in the model."""
    src, out = saved("tiny bert", "bfloat16")
    bad, _ = _corrupt(out, tmp_path / "bad", "last MLP weight x1.5", "bert")
    result = verify_folders(src, bad)
    assert result["outputs"]["ok"] and result["outputs"]["max_rel_error"] <= result["outputs"]["tolerance"]
    assert not result["ok"] and "stored weights" in result["why"]


def test_the_command_exits_1_on_a_corrupted_bert_with_one_line_naming_the_tensor(saved, tmp_path, capsys):
    src, out = saved("tiny bert", "bfloat16")
    bad, key = _corrupt(out, tmp_path / "bad", "last attention output zeroed", "bert")
    assert main(["verify", str(src), str(bad)]) == EXIT_VERIFY_FAILED
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("normfold:")]
    assert len(lines) == 1 and key in lines[0] and "ulp" in lines[0]
    assert "FAILED" in captured.out and key in captured.out


def _edit_report(folded, to, edit, *, reseal: bool = True):
    """A copy of the folded folder at ``to`` whose normfold_report.json went through ``edit(dict)``
    (sealed again: the report is then consistent with itself, and only re-making can tell)."""
    shutil.copytree(folded, to)
    path = to / REPORT_JSON
    report = json.loads(path.read_text())
    edit(report)
    path.write_text(json.dumps(report))
    if reseal:
        sealing.reseal(to)
    return to


def _resave(folder, edit):
    """Load the folder's weights, ``edit(state)``, save them back (not resealed)."""
    state = safetensors_torch.load_file(folder / "model.safetensors")
    edit(state)
    safetensors_torch.save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_tensor_the_fold_does_not_write_fails_the_weight_check(saved, tmp_path):
    src, out = saved("tiny gpt2", "bfloat16")
    shutil.copytree(out, tmp_path / "extra")
    _resave(tmp_path / "extra", lambda state: state.update({"smuggled.weight": torch.zeros(3, dtype=torch.bfloat16)}))
    sealing.reseal(tmp_path / "extra")  # stock loading ignores the tensor: only the comparison sees it
    result = verify_folders(src, tmp_path / "extra")
    assert not result["ok"] and "smuggled.weight" in result["files"]["weights"]["why"]


def test_a_tensor_stored_in_another_dtype_fails_the_weight_check(saved, tmp_path):
    src, out = saved("tiny gpt2", "bfloat16")
    shutil.copytree(out, tmp_path / "mixed")
    _resave(tmp_path / "mixed", lambda state: state.update({"lm_head.weight": state["lm_head.weight"].float()}))
    sealing.reseal(tmp_path / "mixed")  # same values, other dtype
    result = verify_folders(src, tmp_path / "mixed")
    weights = result["files"]["weights"]
    assert weights["ok"] is False and "lm_head.weight is stored as float32" in weights["why"]


@pytest.mark.parametrize("edit, reason", [
    (lambda r: r.update(num_approximate=2), "at num_approximate"),
    (lambda r: r.pop("plan"), "at plan (missing)"),
    (lambda r: r["plan"]["center"].pop(), "at plan.center"),
    (lambda r: r.update(rotation={"method": "hadamard", "seed": 0}), "at rotation (not in the re-made report)"),
    (lambda r: r["swapped"][0].update(weight=True), "at swapped.0.weight"),
], ids=["approximate count", "plan deleted", "plan altered", "rotation added", "swapped flag"])
def test_a_report_claiming_what_the_remade_fold_does_not_fails_never_skips(saved, tmp_path, capsys, edit, reason):
    """Fails on main (0a5ea51): there these edits turned the weight check into "skipped", counted as passed."""
    src, out = saved("tiny gpt2", "bfloat16")
    folder = _edit_report(out, tmp_path / "edited", edit)
    result = verify_folders(src, folder)
    assert not result["ok"] and any(reason in p for p in result["problems"]), result["problems"]
    assert main(["verify", str(src), str(folder)]) == EXIT_VERIFY_FAILED
    capsys.readouterr()


def test_an_edited_report_that_was_not_resealed_fails_the_seal(saved, tmp_path):
    src, out = saved("tiny gpt2", "float32")
    folder = _edit_report(out, tmp_path / "edited", lambda r: r.pop("plan"), reseal=False)
    result = verify_folders(src, folder)
    assert not result["ok"] and "normfold_report.json was changed after normfold wrote it" in result["why"]


@pytest.mark.parametrize("recipe, reason", [
    (None, "records no recipe"),
    ({"command": "fold"}, "recipe lacks"),
    ("fold", "must be a JSON object"),
])
def test_a_report_without_a_usable_recipe_fails_with_the_reason(saved, tmp_path, recipe, reason):
    src, out = saved("tiny gpt2", "float32")
    folder = _edit_report(out, tmp_path / "edited", lambda r: r.update(recipe=recipe))
    result = verify_folders(src, folder)
    assert not result["ok"] and reason in result["why"] and result["files"] is None


def test_a_recipe_choosing_another_fold_remakes_that_fold_and_fails_the_comparison(saved, tmp_path):
    """The recipe only chooses among correct folds: here γ/β left in the norms, which the folder did not do."""
    src, out = saved("tiny gpt2", "float32")
    folder = _edit_report(out, tmp_path / "edited", lambda r: r["recipe"].update(fold_affine=False))
    result = verify_folders(src, folder)
    assert not result["ok"] and result["files"]["weights"]["ok"] is False


# ------------------------------------------------------- the files that load, and the files beside them

def test_a_stale_single_file_beside_an_index_is_two_weight_sources(saved, tmp_path):
    """Fails on main (0a5ea51): verify checked the shards while transformers loads the single file."""
    src, out = saved("tiny gpt2", "float32")
    folder = tmp_path / "stale"
    shutil.copytree(out, folder)
    shutil.copy(folder / "model.safetensors", folder / "model-00001-of-00001.safetensors")
    names = safetensors_torch.load_file(folder / "model.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}))
    _resave(folder, lambda state: state["transformer.wte.weight"][90:].neg_())  # rows the check tokens never reach
    result = verify_folders(src, folder)
    assert not result["ok"]
    assert any("two weight sources: transformers loads model.safetensors" in p and "model.safetensors.index.json" in p
               for p in result["problems"]), result["problems"]


def test_weights_named_by_transformers_weights_are_the_ones_compared(saved, tmp_path):
    """Fails on main (0a5ea51): transformers (and normfold.from_pretrained) load the file config.json
    names, verify compared model.safetensors."""
    src, out = saved("tiny gpt2", "float32")
    folder = tmp_path / "alt"
    shutil.copytree(out, folder)
    state = safetensors_torch.load_file(folder / "model.safetensors")
    state["transformer.wpe.weight"][8:] = 0.0  # positions the check inputs never reach
    safetensors_torch.save_file(state, folder / "alt.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "transformers_weights": "alt.safetensors"}))
    result = verify_folders(src, folder)
    problems = " | ".join(result["problems"])
    assert not result["ok"] and "transformers loads alt.safetensors" in problems
    assert "transformer.wpe.weight" in problems and "config.json" in problems


def test_a_side_file_changed_after_the_fold_fails_naming_it(saved, tmp_path):
    src, out = saved("tiny gpt2", "float32")
    folder = tmp_path / "side"
    shutil.copytree(out, folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 9.0}))
    (folder / "notes.txt").write_text("added by someone")
    result = verify_folders(src, folder)
    problems = " | ".join(result["problems"])
    assert not result["ok"] and "generation_config.json: differs from the JSON the fold writes" in problems
    assert "the folder holds notes.txt, which the fold does not write" in problems


def test_whitespace_in_a_json_file_changes_nothing_that_loads_and_passes(saved, tmp_path):
    src, out = saved("tiny gpt2", "float32")
    folder = tmp_path / "spaced"
    shutil.copytree(out, folder)
    (folder / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text()), indent=7))
    assert verify_folders(src, folder)["ok"]


# ------------------------------------------------------------------ before publishing: the rounded weights

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fold_folder_verifies_the_weights_rounded_to_the_saved_dtype_and_reports_it(saved, dtype):
    _, out = saved("tiny gpt2", dtype)
    check = json.loads((out / "normfold_report.json").read_text())["verification"]["saved_dtype_check"]
    assert check["ok"] and dtype in check["tolerance_rule"] and check["stored_dtype_own_error"] > 0
    assert 0 < check["max_rel_error"] <= check["tolerance"]


def test_fold_folder_refuses_to_write_weights_that_fail_once_rounded(tiny_dirs, tmp_path, monkeypatch):
    """A transform whose float64 proof passed but whose saved model differs (here: a head scaled
    after the proof, as a bug between proof and save would) is refused and nothing is written."""
    from normfold.hf import folder as folder_module

    proved = folder_module.fold_for_stock

    def fold_then_break(model, inputs, **kwargs):
        folded, report = proved(model, inputs, **kwargs)
        with torch.no_grad():
            folded.lm_head.weight.mul_(1.1)
        return folded, report

    monkeypatch.setattr(folder_module, "fold_for_stock", fold_then_break)
    with pytest.raises(FoldVerificationError, match="rounded to float32"):
        fold_folder(tiny_dirs["gpt2"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- what is shown to people

def test_the_verify_table_shows_the_rule_and_own_error_rounded_and_json_keeps_full_precision(saved, capsys):
    src, out = saved("tiny gpt2", "bfloat16")
    assert main(["verify", str(src), str(out), "--json"]) == EXIT_OK
    ver = json.loads(capsys.readouterr().out)["verification"]
    own = ver["outputs"]["stored_dtype_own_error"]
    assert own != float(f"{own:.1e}")  # JSON: every digit
    assert main(["verify", str(src), str(out)]) == EXIT_OK
    table = capsys.readouterr().out
    assert "tolerance rule" in table and "bfloat16 unit roundoff" in table
    assert "original's own error in the stored dtype" in table and f"{own:.4g}" in table and repr(own) not in table
    assert f"{ver['files']['weights']['num_tensors']} tensors, all bit-identical" in table


def test_fold_json_and_markdown_say_what_was_traced_and_what_the_fold_is_exact_for(tiny_dirs, tmp_path, capsys):
    assert main(["fold", str(tiny_dirs["gpt2"]), "-o", str(tmp_path / "out"), "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["traced_calls"][0]["input_ids"].startswith("tensor (") and report["exactness_scope"]
    assert report["verification"]["saved_dtype_check"]["ok"] is True
    markdown = (tmp_path / "out" / "normfold_report.md").read_text()
    assert "## What the fold is exact for" in markdown and "traced call 0: `input_ids` = tensor (" in markdown
    assert report["exactness_scope"][1:] in markdown
    assert "### Weights rounded to the saved dtype, against the original" in markdown
    # numbers for people: in words, four digits, never a field name, a dict, None or a float repr
    own = report["verification"]["saved_dtype_check"]["stored_dtype_own_error"]
    assert f"the original's own error in the stored dtype: {own:.4g}" in markdown and "{" not in markdown
    assert repr(own) not in markdown and "stored_dtype_own_error" not in markdown and "None" not in markdown


def test_a_sentence_transformers_pooling_switched_after_the_fold_fails(tiny_dirs, tmp_path):
    """Fails on main (0a5ea51): side files were never compared, so a folder whose pooling was switched
    from mean to CLS passed, while SentenceTransformer(folder) embeddings moved far off."""
    src = tmp_path / "st"
    shutil.copytree(tiny_dirs["bert"], src)
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (src / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}
    (src / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    fold_folder(src, tmp_path / "out")
    assert verify_folders(src, tmp_path / "out")["ok"]
    switched = {**pooling, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}
    (tmp_path / "out" / "1_Pooling" / "config.json").write_text(json.dumps(switched))
    result = verify_folders(src, tmp_path / "out")
    assert not result["ok"] and "1_Pooling/config.json: differs from the JSON the fold writes at pooling_mode" in result["why"]


def test_options_an_exact_fold_has_no_use_for_are_refused_not_ignored(saved, tmp_path, capsys):
    src, out = saved("tiny gpt2", "float32")
    (tmp_path / "calibration.txt").write_text("a sentence\n")
    with pytest.raises(CheckpointError, match="--calibration applies only to folders made from a calibration text"):
        verify_folders(src, out, calibration_file=tmp_path / "calibration.txt")
    with pytest.raises(CheckpointError, match="--min-cosine applies only to approximate results"):
        verify_folders(src, out, min_cosine=0.99)
    assert main(["verify", str(src), str(out), "--min-cosine", "0.99"]) == EXIT_USAGE
    assert "not to this one (exact fold)" in capsys.readouterr().err


def test_a_folder_checked_against_another_model_fails_before_anything_is_remade(saved, tiny_dirs, monkeypatch):
    """Fails on main (0a5ea51): verify of a folded GPT-2 against a BERT folder ran for seconds, then crashed."""
    from normfold.hf import judge

    _, out = saved("tiny gpt2", "float32")

    def never(*args, **kwargs):
        raise AssertionError("re-made although the folder names another model")

    monkeypatch.setattr(judge, "fold_folder", never)
    result = verify_folders(tiny_dirs["bert"], out)
    assert not result["ok"] and result["files"] is None
    assert result["why"] == (f"the folder was folded from a GPT2LMHeadModel (gpt2), but {tiny_dirs['bert']} holds a "
                             "BertModel (bert): it is not the folder's original")


def test_a_rendering_dropped_from_the_seal_and_then_changed_fails(saved, tmp_path):
    """Which files the seal covers comes from the re-made report, never from the folder: a markdown report
    edited after its name was taken out of the seal (and the report resealed) is caught."""
    src, out = saved("tiny gpt2", "float32")
    folder = tmp_path / "unsealed-md"
    shutil.copytree(out, folder)
    (folder / "normfold_report.md").write_text("# all 9 norms folded, proved exact\n")
    report = json.loads((folder / REPORT_JSON).read_text())
    write_sealed_report(report, folder, ("normfold_zero_mean_graph.png",))  # sealed again, without the markdown
    result = verify_folders(src, folder)
    assert not result["ok"]
    assert any("seals model.safetensors, normfold_zero_mean_graph.png; the re-made folder seals model.safetensors, "
               "normfold_report.md, normfold_zero_mean_graph.png" in p for p in result["problems"]), result["problems"]
