"""``normfold verify`` / ``verify_folders`` on folders saved in fp32, fp16, bf16.

Outputs: the tolerance is measured from the original's own error in the stored dtype, so correct
folds pass and, in GPT-2s, a scaled head, a scaled MLP weight or a zeroed attention output fail
(fixed bf16 bounds let all three pass). Weights: every stored tensor is compared with the fold
re-derived from the original, which also catches the changes output comparison cannot see (in a
bf16 post-LN BERT, a 1.5x MLP weight and a zeroed attention output stay within bf16's own error)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main
from normfold.fold import FoldVerificationError
from normfold.fold.verify import OWN_ERROR_MULTIPLE
from normfold.hf import default_model_path, fold_folder, load_model, verify_folders

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


def _corrupt(folded, to, corruption: str, family: str = "gpt2"):
    """A copy of the folded folder at ``to`` with one tensor scaled as ``CORRUPTIONS`` says; returns
    (the copy, the tensor's name)."""
    names, factor = CORRUPTIONS[corruption]
    shutil.copytree(folded, to)
    state = safetensors_torch.load_file(to / "model.safetensors")
    layers = [int(k.split(".")[2]) for k in state if k.startswith(("transformer.h.", "encoder.layer."))]
    key = names[family].format(last=max(layers))
    state[key] = (state[key].double() * factor).to(state[key].dtype)
    safetensors_torch.save_file(state, to / "model.safetensors", metadata={"format": "pt"})
    return to, key


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_correct_fold_passes_a_tolerance_measured_in_its_stored_dtype(saved, dtype):
    src, out = saved("tiny gpt2", dtype)
    result = verify_folders(src, out)
    own = result["stored_dtype_own_error"]
    assert result["ok"] and result["why"] is None and own > 0
    assert result["tolerance"] == pytest.approx(OWN_ERROR_MULTIPLE * own + torch.finfo(getattr(torch, dtype)).eps / 2)
    assert dtype in result["tolerance_rule"]
    assert result["max_rel_error"] < result["tolerance"] / 2  # margin: measured 0.13-0.5x the own error


@pytest.mark.parametrize("model", ["tiny gpt2", "bundled"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_bfloat16_gpt2_fails_the_output_check(saved, tmp_path, model, corruption):
    src, out = saved(model, "bfloat16")
    result = verify_folders(src, _corrupt(out, tmp_path / "bad", corruption)[0])
    assert not result["ok"] and result["max_rel_error"] > 2 * result["tolerance"]


def test_the_command_exits_1_on_a_corrupted_bfloat16_fold_and_prints_the_rule(saved, tmp_path, capsys):
    src, out = saved("bundled", "bfloat16")
    assert main(["verify", str(src), str(out), "--json"]) == EXIT_OK
    verification = json.loads(capsys.readouterr().out)["verification"]
    assert verification["ok"] and "bfloat16" in verification["tolerance_rule"]
    bad, _ = _corrupt(out, tmp_path / "bad", "head x1.1")
    assert main(["verify", str(src), str(bad)]) == EXIT_VERIFY_FAILED
    assert "FAILED" in capsys.readouterr().out


# ----------------------------------------------------------------- the weights, tensor by tensor

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny gpt2", "tiny bert"])
def test_a_correct_fold_has_every_stored_tensor_bit_identical_to_the_rederived_fold(saved, model, dtype):
    src, out = saved(model, dtype)
    result = verify_folders(src, out)
    weights = result["weights"]
    stored = safetensors_torch.load_file(out / "model.safetensors")
    assert result["ok"] and weights["ok"] is True and weights["why"] is None and weights["skipped"] is None
    assert weights["num_tensors"] == len(stored) and weights["num_differing_tensors"] == 0 and weights["worst"] is None


@pytest.mark.parametrize("model", ["tiny gpt2", "tiny bert"])
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_corrupted_bfloat16_fold_fails_the_weight_check_naming_the_tensor(saved, tmp_path, model, corruption):
    # tiny bert: the output check alone passes the MLP and attention corruptions (within bf16's own error)
    src, out = saved(model, "bfloat16")
    bad, key = _corrupt(out, tmp_path / "bad", corruption, _family(model))
    result = verify_folders(src, bad)
    weights = result["weights"]
    assert not result["ok"] and weights["ok"] is False
    assert weights["worst"]["name"] == key and weights["worst"]["max_ulps"] > 10
    assert key in weights["why"] and key in result["why"]


def test_the_output_check_alone_cannot_see_a_scaled_mlp_weight_in_a_bfloat16_bert(saved, tmp_path):
    """Why the weight check exists: this corruption is smaller than bf16's own error in the model."""
    src, out = saved("tiny bert", "bfloat16")
    bad, _ = _corrupt(out, tmp_path / "bad", "last MLP weight x1.5", "bert")
    result = verify_folders(src, bad)
    assert result["max_rel_error"] <= result["tolerance"] and result["why"] is not None
    assert not result["ok"]


def test_the_command_exits_1_on_a_corrupted_bert_with_one_line_naming_the_tensor(saved, tmp_path, capsys):
    src, out = saved("tiny bert", "bfloat16")
    bad, key = _corrupt(out, tmp_path / "bad", "last attention output zeroed", "bert")
    assert main(["verify", str(src), str(bad)]) == EXIT_VERIFY_FAILED
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.startswith("normfold:")]
    assert len(lines) == 1 and key in lines[0] and "ulp" in lines[0]
    assert "stored weights vs the fold re-derived from the original" in captured.out and "FAILED" in captured.out


def _edit_report(folded, to, edit):
    """A copy of the folded folder at ``to`` whose normfold_report.json went through ``edit(dict)``."""
    shutil.copytree(folded, to)
    path = to / "normfold_report.json"
    report = json.loads(path.read_text())
    edit(report)
    path.write_text(json.dumps(report))
    return to


def test_a_tensor_the_fold_does_not_write_fails_the_weight_check(saved, tmp_path):
    src, out = saved("tiny gpt2", "bfloat16")
    shutil.copytree(out, tmp_path / "extra")
    state = safetensors_torch.load_file(tmp_path / "extra" / "model.safetensors")
    state["smuggled.weight"] = torch.zeros(3, dtype=torch.bfloat16)  # stock loading ignores it
    safetensors_torch.save_file(state, tmp_path / "extra" / "model.safetensors", metadata={"format": "pt"})
    result = verify_folders(src, tmp_path / "extra")
    assert not result["ok"] and "smuggled.weight" in result["weights"]["why"]


def test_a_tensor_stored_in_another_dtype_fails_the_weight_check(saved, tmp_path):
    src, out = saved("tiny gpt2", "bfloat16")
    shutil.copytree(out, tmp_path / "mixed")
    state = safetensors_torch.load_file(tmp_path / "mixed" / "model.safetensors")
    state["lm_head.weight"] = state["lm_head.weight"].float()  # same values, other dtype
    safetensors_torch.save_file(state, tmp_path / "mixed" / "model.safetensors", metadata={"format": "pt"})
    result = verify_folders(src, tmp_path / "mixed")
    assert result["weights"]["ok"] is False and "lm_head.weight is stored as float32" in result["weights"]["why"]


@pytest.mark.parametrize("edit, reason", [
    (lambda r: r.update(num_approximate=2), "--approximate"),
    (lambda r: [r.pop(k) for k in ("plan", "fold_affine")], "lacks fold_affine, plan (written by an older normfold"),
    (lambda r: r["plan"]["center"].pop(), "plan this normfold derives"),
], ids=["approximate", "older report", "other plan"])
def test_a_weight_check_that_cannot_run_is_skipped_with_its_reason_not_failed(saved, tmp_path, capsys, edit, reason):
    src, out = saved("tiny gpt2", "bfloat16")
    folder = _edit_report(out, tmp_path / "edited", edit)
    result = verify_folders(src, folder)
    assert result["ok"] and result["weights"]["ok"] is None and reason in result["weights"]["skipped"]
    if reason == "--approximate":  # the command checks an approximate folder's cosine bar, which this one lacks
        assert main(["verify", str(src), str(folder)]) == EXIT_USAGE
        assert "calibration sentences" in capsys.readouterr().err
        return
    assert main(["verify", str(src), str(folder)]) == EXIT_OK
    assert "skipped:" in capsys.readouterr().out


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
    own = ver["stored_dtype_own_error"]
    assert own != float(f"{own:.1e}")  # JSON: every digit
    assert main(["verify", str(src), str(out)]) == EXIT_OK
    table = capsys.readouterr().out
    assert "tolerance rule" in table and "bfloat16 unit roundoff" in table
    assert "original's own error in the stored dtype" in table and f"{own:.4g}" in table and repr(own) not in table
    assert f"{ver['weights']['num_tensors']} tensors, all bit-identical" in table


def test_fold_json_and_markdown_say_what_was_traced_and_what_the_fold_is_exact_for(tiny_dirs, tmp_path, capsys):
    assert main(["fold", str(tiny_dirs["gpt2"]), "-o", str(tmp_path / "out"), "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["traced_calls"][0]["input_ids"].startswith("tensor (") and report["exactness_scope"]
    assert report["verification"]["saved_dtype_check"]["ok"] is True
    markdown = (tmp_path / "out" / "normfold_report.md").read_text()
    assert "## What the fold is exact for" in markdown and "traced call 0: `input_ids` = tensor (" in markdown
    assert report["exactness_scope"][1:] in markdown
    assert "### Weights rounded to the saved dtype, against the original" in markdown
    # numbers for people: two digits, never a dict or a float repr
    own = report["verification"]["saved_dtype_check"]["stored_dtype_own_error"]
    assert f"| stored_dtype_own_error | {own:.1e} |" in markdown and "{" not in markdown
