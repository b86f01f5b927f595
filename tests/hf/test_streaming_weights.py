"""``normfold verify`` of a streamed (sharded) fold re-makes the folder from the original with the
streaming fold its recipe names and compares every stored tensor with the re-made one
(:mod:`normfold.hf.judge`), besides running every block (``verify_by_blocks``).

Running a piece cannot see a change smaller than the piece's own error in the stored dtype: in the
tiny bf16 post-LN BERT a 1.5x last MLP weight moves its block's output by 3.7e-3 and a zeroed
attention output by 6.1e-3, under that block's tolerance of 1.2e-2. The re-made tensors are
bit-identical to a correct fold's, so any such change is caught and named; and what the report
says about itself (its recipe, its figures) is sealed, and re-derived rather than believed.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_VERIFY_FAILED, main
from normfold.hf import load_model
from normfold.hf.judge import verify_folders
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.recipe import Recipe, file_sha256
from normfold.hf.report import seal_problems
from normfold.hf.streaming import Checkpoint, fold_checkpoint, verify_by_blocks
import sealing

safetensors_torch = pytest.importorskip("safetensors.torch")

CHANGED = {  # corruption -> (tensor per family, factor): the two a bf16 BERT block's own error hides
    "last MLP weight x1.5": ({"gpt2": "transformer.h.1.mlp.c_proj.weight",
                              "bert": "encoder.layer.1.output.dense.weight"}, 1.5),
    "last attention output zeroed": ({"gpt2": "transformer.h.1.attn.c_proj.weight",
                                      "bert": "encoder.layer.1.attention.output.dense.weight"}, 0.0),
}


@pytest.fixture(scope="module")
def bf16_folds(tiny_dirs, tmp_path_factory):
    """family -> (the tiny model in bf16, ~20 KB shards; its streamed fold), for GPT-2 (pre-LN) and BERT (post-LN)."""
    root, folds = tmp_path_factory.mktemp("streaming_weights"), {}
    for family in ("gpt2", "bert"):
        src = root / family
        load_model(tiny_dirs[family]).to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
        assert len(list(src.glob("*.safetensors"))) > 2  # sharded: the fold streams
        fold_checkpoint(src, root / f"{family}-folded")
        folds[family] = src, root / f"{family}-folded"
    return folds


def _edited_copy(folded, to, key: str, edit, *, reseal: bool = True):
    """A copy of ``folded`` at ``to`` whose shard holding ``key`` has its tensors replaced by ``edit(state)``."""
    shutil.copytree(folded, to)
    shard = to / Checkpoint(to).file_of[key]
    state = safetensors_torch.load_file(shard)
    safetensors_torch.save_file(edit(state), shard, metadata={"format": "pt"})
    if reseal:
        sealing.reseal(to)
    return to


def _scaled(key: str, factor: float):
    return lambda state: {**state, key: (state[key].double() * factor).to(state[key].dtype)}


def _with_report(folded, to, edit, *, reseal: bool = True):
    """A copy of ``folded`` at ``to`` whose report was changed in place by ``edit(report)``."""
    shutil.copytree(folded, to)
    report = json.loads((to / REPORT_JSON).read_text())
    edit(report)
    (to / REPORT_JSON).write_text(json.dumps(report))
    if reseal:
        sealing.reseal(to)
    return to


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_correct_streamed_fold_has_every_stored_tensor_equal_to_the_remade_fold(bf16_folds, family):
    src, out = bf16_folds[family]
    result = verify_folders(src, out)
    assert result["ok"] and result["problems"] == [] and result["kind"] == "streamed exact fold"
    weights = result["files"]["weights"]
    assert weights["ok"] is True and weights["why"] is None
    assert weights["num_tensors"] == len(Checkpoint(out).meta) > 0  # every stored tensor compared
    assert weights["worst"] is None  # bit-identical: the same code on the same numbers
    assert result["outputs"]["ok"] and result["outputs"]["num_runs"] >= 1  # and loaded and run, piece by piece


@pytest.mark.parametrize("corruption", list(CHANGED))
@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_normfold_verify_fails_a_changed_tensor_of_a_sharded_bf16_fold_and_names_it(bf16_folds, tmp_path, capsys,
                                                                                    family, corruption):
    src, out = bf16_folds[family]
    names, factor = CHANGED[corruption]
    bad = _edited_copy(out, tmp_path / "bad", names[family], _scaled(names[family], factor))
    capsys.readouterr()
    assert main(["verify", str(src), str(bad)]) == EXIT_VERIFY_FAILED
    failure = [line for line in capsys.readouterr().err.splitlines() if "verification failed" in line]
    assert len(failure) == 1 and f"stored weights: {names[family]} differs from the fold re-derived" in failure[0]
    weights = verify_folders(src, bad)["files"]["weights"]
    assert weights["ok"] is False and weights["worst"]["name"] == names[family]


def test_the_block_checks_alone_cannot_see_a_scaled_mlp_weight_of_a_bf16_bert(bf16_folds, tmp_path):
    """Why every stored tensor is compared: this change is smaller than bf16's own error in the block."""
    src, out = bf16_folds["bert"]
    key = CHANGED["last MLP weight x1.5"][0]["bert"]
    bad = _edited_copy(out, tmp_path / "bad", key, _scaled(key, 1.5))
    assert verify_by_blocks(src, bad)["ok"]
    result = verify_folders(src, bad)
    assert result["outputs"]["ok"] and not result["ok"] and result["why"].startswith(f"stored weights: {key}")


def test_a_changed_shard_whose_seal_was_not_recomputed_fails_the_seal_and_still_names_the_tensor(bf16_folds, tmp_path):
    src, out = bf16_folds["gpt2"]
    key = CHANGED["last MLP weight x1.5"][0]["gpt2"]
    bad = _edited_copy(out, tmp_path / "bad", key, _scaled(key, 1.5), reseal=False)
    shard = Checkpoint(bad).file_of[key]
    result = verify_folders(src, bad)
    assert not result["ok"] and result["why"] == (f"{shard} was changed after normfold wrote it (its SHA-256 is not "
                                                  "the one the report records)")
    assert any(p.startswith(f"stored weights: {key}") for p in result["problems"][1:])  # still compared, further down


def test_a_sharded_fold_verifies_with_exit_0_and_prints_the_weight_check(bf16_folds, capsys):
    src, out = bf16_folds["bert"]
    capsys.readouterr()
    assert main(["verify", "--json", str(src), str(out)]) == EXIT_OK
    verification = json.loads(capsys.readouterr().out)["verification"]
    weights = verification["files"]["weights"]
    assert verification["ok"] is True and weights["ok"] is True and weights["num_tensors"] == len(Checkpoint(out).meta)
    assert main(["verify", str(src), str(out)]) == EXIT_OK
    assert f"weights: {len(Checkpoint(out).meta)} tensors, all bit-identical" in capsys.readouterr().out


def test_a_stored_tensor_the_fold_does_not_write_fails(bf16_folds, tmp_path):
    src, out = bf16_folds["bert"]
    key = "encoder.layer.1.output.dense.weight"

    def extra(state):
        return {**state, "extra.weight": state[key].clone()}

    # a shard holding a tensor its index does not list: which tensors load depends on the reader
    bad = _edited_copy(out, tmp_path / "unlisted", key, extra)
    result = verify_folders(src, bad)
    assert not result["ok"] and result["files"]["weights"] is None
    assert any("model.safetensors.index.json disagrees with its shards on 1 tensor(s), e.g. extra.weight" in p
               for p in result["problems"])
    # listed in the index too: transformers loads it, and the key sets differ
    bad = _edited_copy(out, tmp_path / "listed", key, extra, reseal=False)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = Checkpoint(out).file_of[key]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    sealing.reseal(bad)
    result = verify_folders(src, bad)
    assert not result["ok"] and result["files"]["weights"]["ok"] is False
    assert result["files"]["weights"]["why"] == "the folder holds extra.weight, which the fold does not write"
    assert "stored weights: the folder holds extra.weight, which the fold does not write" in result["problems"]


def _drop(key):
    return lambda report: report.pop(key)


def _set(*path, value):
    def edit(report):
        *parents, last = path
        for part in parents:
            report = report[part]
        report[last] = value
    return edit


@pytest.mark.parametrize("edit, reason", [
    (_drop("recipe"), f"{REPORT_JSON}: it records no recipe"),
    (_set("recipe", "streaming", value="yes"), f"{REPORT_JSON}: recipe.streaming must be a bool, got str 'yes'"),
    (_set("recipe", "dtype", value="float64"), f"{REPORT_JSON}: recipe.dtype must be null or one of"),
    (_drop("fold_affine"), f"{REPORT_JSON} differs from the report of the re-made folder at fold_affine (missing)"),
    (_set("saved_dtype", value="float32"), (f"{REPORT_JSON} differs from the report of the re-made folder at "
                                            "saved_dtype ('float32', re-made 'bfloat16')")),
])
def test_a_report_that_cannot_be_remade_or_disagrees_with_the_remade_one_fails_naming_why(
        bf16_folds, tmp_path, edit, reason):
    """What was 'skipped' before (the weight check could not run) is now a failure with its reason."""
    src, out = bf16_folds["gpt2"]
    result = verify_folders(src, _with_report(out, tmp_path / "folded", edit))
    assert not result["ok"] and any(p.startswith(reason) for p in result["problems"]), result["problems"]
    assert seal_problems(json.loads((tmp_path / "folded" / REPORT_JSON).read_text()), tmp_path / "folded") == []


def test_a_recipe_that_names_another_fold_is_remade_as_that_fold_and_fails_the_comparison(bf16_folds, tmp_path):
    src, out = bf16_folds["gpt2"]
    bad = _with_report(out, tmp_path / "folded", _set("recipe", "fold_affine", value=False))
    result = verify_folders(src, bad)
    assert not result["ok"] and result["recipe"]["fold_affine"] is False  # the recipe chose what was re-made
    assert result["files"]["weights"]["ok"] is False  # γ/β not moved in the re-made one: other tensors
    assert any(p.startswith(f"{REPORT_JSON} differs from the report of the re-made folder") for p in result["problems"])


def test_an_edited_report_whose_seal_was_not_recomputed_fails_the_seal(bf16_folds, tmp_path):
    src, out = bf16_folds["gpt2"]
    bad = _with_report(out, tmp_path / "folded", _set("verification", "max_rel_error", value=0.0), reseal=False)
    result = verify_folders(src, bad)
    assert not result["ok"] and result["why"] == ("normfold_report.json was changed after normfold wrote it (its "
                                                  "digest does not match its content)")


def test_a_fold_that_cannot_be_remade_fails_rather_than_passing(bf16_folds, monkeypatch):
    from normfold.hf.streaming import publish

    src, out = bf16_folds["gpt2"]

    def broken(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setattr(publish, "plan_for_checkpoint", broken)
    result = verify_folders(src, out)
    assert not result["ok"] and result["files"] is None and result["outputs"] is None  # nothing compared
    assert result["why"] == ("could not re-make the folder from the original with its recipe (streamed exact fold): "
                             "export failed")


def test_the_fold_records_its_recipe_and_seals_every_file_it_wrote(bf16_folds):
    """What verify re-makes the folder with, and what makes every other byte of it count."""
    _, out = bf16_folds["gpt2"]
    report = json.loads((out / REPORT_JSON).read_text())
    assert Recipe.from_dict(report["recipe"]) == Recipe(command="fold", streaming=True, fold_affine=True, dtype=None)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert sorted(report["files"]) == sorted([*shards, "model.safetensors.index.json", "normfold_report.md",
                                              "normfold_zero_mean_graph.png"])
    assert all(report["files"][name] == file_sha256(out / name) for name in report["files"])
    assert seal_problems(report, out) == []
    assert "weights" not in report["verification"]  # the fold claims no tensor comparison: verify makes it


def test_a_mixed_dtype_original_folded_without_dtype_keeps_each_tensors_dtype_in_the_remade_fold(tiny_dirs, tmp_path):
    src = tmp_path / "mixed"
    load_model(tiny_dirs["gpt2"]).to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    key = "transformer.h.1.mlp.c_fc.weight"  # rewritten by the fold (γ folded in), kept in float32
    shard = src / Checkpoint(src).file_of[key]
    state = safetensors_torch.load_file(shard)
    safetensors_torch.save_file({**state, key: state[key].float()}, shard, metadata={"format": "pt"})
    fold_checkpoint(src, tmp_path / "folded")
    assert Checkpoint(tmp_path / "folded").meta[key][0] == "F32"
    result = verify_folders(src, tmp_path / "folded")
    weights = result["files"]["weights"]
    assert result["ok"], result["problems"]
    assert weights["ok"] is True and weights["num_tensors"] == len(Checkpoint(tmp_path / "folded").meta)
