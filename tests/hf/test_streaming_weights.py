"""``verify_by_blocks`` (``normfold verify`` on sharded folders) compares every stored tensor with
the streaming fold re-derived from the original, one group of tensors at a time.

Running a piece cannot see a change smaller than the piece's own error in the stored dtype: in the
tiny bf16 post-LN BERT a 1.5x last MLP weight moves its block's output by 3.7e-3 and a zeroed
attention output by 6.1e-3, under that block's tolerance of 1.2e-2 (both passed before). The
re-derived tensors are bit-identical to a correct fold's, so any such change is caught and named.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_VERIFY_FAILED, main
from normfold.hf import load_model
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.streaming import Checkpoint, fold_checkpoint, verify_by_blocks

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
        assert len(list(src.glob("*.safetensors"))) > 2  # sharded: verify takes the streaming path
        fold_checkpoint(src, root / f"{family}-folded")
        folds[family] = src, root / f"{family}-folded"
    return folds


def _edited_copy(folded, to, key: str, edit):
    """A copy of ``folded`` at ``to`` whose shard holding ``key`` has its tensors replaced by ``edit(state)``."""
    shutil.copytree(folded, to)
    shard = to / Checkpoint(to).file_of[key]
    state = safetensors_torch.load_file(shard)
    safetensors_torch.save_file(edit(state), shard, metadata={"format": "pt"})
    return to


def _scaled(key: str, factor: float):
    return lambda state: {**state, key: (state[key].double() * factor).to(state[key].dtype)}


def _with_report(folded, to, **changes):
    """A copy of ``folded`` at ``to`` whose report has ``changes`` (None: the key removed)."""
    shutil.copytree(folded, to)
    report = json.loads((to / REPORT_JSON).read_text())
    report.update(changes)
    (to / REPORT_JSON).write_text(json.dumps({k: v for k, v in report.items() if v is not None}))
    return to


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_a_correct_streamed_fold_has_every_stored_tensor_equal_to_the_rederived_fold(bf16_folds, family):
    src, out = bf16_folds[family]
    ver = verify_by_blocks(src, out)
    weights = ver["weights"]
    assert ver["ok"] and weights["ok"] is True and weights["skipped"] is None and weights["why"] is None
    assert weights["num_tensors"] == len(Checkpoint(out).meta) > 0  # every stored tensor compared
    assert weights["worst"] is None  # bit-identical: the same code on the same numbers


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
    weights = verify_by_blocks(src, bad)["weights"]
    assert weights["ok"] is False and weights["worst"]["name"] == names[family]


def test_a_sharded_fold_verifies_with_exit_0_and_prints_the_weight_check(bf16_folds, capsys):
    src, out = bf16_folds["bert"]
    capsys.readouterr()
    assert main(["verify", "--json", str(src), str(out)]) == EXIT_OK
    weights = json.loads(capsys.readouterr().out)["verification"]["weights"]
    assert weights["ok"] is True and weights["num_tensors"] == len(Checkpoint(out).meta)


def test_a_stored_tensor_the_fold_does_not_write_fails_the_key_set(bf16_folds, tmp_path):
    src, out = bf16_folds["bert"]
    key = "encoder.layer.1.output.dense.weight"
    bad = _edited_copy(out, tmp_path / "bad", key, lambda state: {**state, "extra.weight": state[key].clone()})
    ver = verify_by_blocks(src, bad)
    assert not ver["ok"] and ver["weights"]["ok"] is False
    assert ver["weights"]["why"] == "the folder holds extra.weight, which the fold does not write"


@pytest.mark.parametrize("changes, reason", [
    ({"fold_affine": None}, f"{REPORT_JSON} lacks fold_affine"),
    ({"saved_dtype": "float64"}, f"{REPORT_JSON} records saved_dtype 'float64'"),
    ({"fold_affine": False}, "the plan this normfold derives from the original differs from the one the report"),
])
def test_a_report_without_what_the_rederivation_needs_skips_the_weight_check_with_the_reason(
        bf16_folds, tmp_path, changes, reason):
    src, out = bf16_folds["gpt2"]
    ver = verify_by_blocks(src, _with_report(out, tmp_path / "folded", **changes))
    assert ver["weights"]["ok"] is None and ver["weights"]["skipped"].startswith(reason)
    assert ver["weights"]["num_tensors"] == 0
    assert ver["ok"]  # skipped is neither passed nor failed: the outputs decide, as for unsharded folders


def test_a_fold_that_cannot_be_rederived_fails_the_weight_check_rather_than_passing_it(bf16_folds, monkeypatch):
    import normfold.hf.streaming.verification as verification

    src, out = bf16_folds["gpt2"]

    def broken(*args, **kwargs):
        raise RuntimeError("export failed")

    monkeypatch.setattr(verification, "plan_for_checkpoint", broken)
    ver = verify_by_blocks(src, out)
    assert not ver["ok"] and ver["weights"]["ok"] is False and ver["weights"]["num_tensors"] == 0
    assert ver["why"] == "stored weights: could not re-derive the fold from the original and compare: export failed"


def test_fold_time_verification_skips_the_weight_check_and_says_where_it_runs(bf16_folds):
    _, out = bf16_folds["gpt2"]
    weights = json.loads((out / REPORT_JSON).read_text())["verification"]["weights"]
    assert weights["ok"] is None and "normfold verify ORIG OUT" in weights["skipped"]


def test_a_mixed_dtype_original_folded_without_dtype_keeps_each_tensors_dtype_in_the_rederivation(tiny_dirs, tmp_path):
    src = tmp_path / "mixed"
    load_model(tiny_dirs["gpt2"]).to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    key = "transformer.h.1.mlp.c_fc.weight"  # rewritten by the fold (γ folded in), kept in float32
    shard = src / Checkpoint(src).file_of[key]
    state = safetensors_torch.load_file(shard)
    safetensors_torch.save_file({**state, key: state[key].float()}, shard, metadata={"format": "pt"})
    fold_checkpoint(src, tmp_path / "folded")
    assert Checkpoint(tmp_path / "folded").meta[key][0] == "F32"
    weights = verify_by_blocks(src, tmp_path / "folded")["weights"]
    assert weights["ok"] is True and weights["num_tensors"] == len(Checkpoint(tmp_path / "folded").meta)
