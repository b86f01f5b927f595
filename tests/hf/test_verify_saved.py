"""``normfold verify`` / ``verify_folders`` on folders saved in fp32, fp16, bf16: the tolerance is
measured from the original's own error in the stored dtype, so correct folds pass and a scaled
head, a scaled MLP weight or a zeroed attention output fail (fixed bf16 bounds let all three pass)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_VERIFY_FAILED, main
from normfold.fold.verify import OWN_ERROR_MULTIPLE
from normfold.hf import default_model_path, fold_folder, load_model, verify_folders

safetensors_torch = pytest.importorskip("safetensors.torch")

CORRUPTIONS = {  # what a broken fold or a damaged file might do to a folded GPT-2: tensor, factor
    "lm_head x1.1": ("lm_head.weight", 1.1),
    "last MLP weight x1.5": ("transformer.h.{last}.mlp.c_proj.weight", 1.5),
    "last attention output zeroed": ("transformer.h.{last}.attn.c_proj.weight", 0.0),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tiny_dirs):
    """(model, dtype) -> (original saved in dtype, its fold by ``fold_folder``), made on first use."""
    root, cache = tmp_path_factory.mktemp("saved"), {}
    sources = {"tiny gpt2": tiny_dirs["gpt2"], "bundled": default_model_path()}

    def get(model: str, dtype: str):
        if (model, dtype) not in cache:
            src, out = root / f"{model}-{dtype}".replace(" ", "-"), root / f"{model}-{dtype}-folded".replace(" ", "-")
            load_model(sources[model]).to(getattr(torch, dtype)).save_pretrained(src)
            fold_folder(src, out)
            cache[model, dtype] = src, out
        return cache[model, dtype]

    return get


def _corrupt(folded, to, corruption: str):
    """A copy of the folded folder at ``to`` with one tensor scaled as ``CORRUPTIONS`` says."""
    name, factor = CORRUPTIONS[corruption]
    shutil.copytree(folded, to)
    state = safetensors_torch.load_file(to / "model.safetensors")
    last = max(int(k.split(".")[2]) for k in state if k.startswith("transformer.h."))
    key = name.format(last=last)
    state[key] = (state[key].double() * factor).to(state[key].dtype)
    safetensors_torch.save_file(state, to / "model.safetensors", metadata={"format": "pt"})
    return to


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
def test_a_corrupted_bfloat16_fold_fails(saved, tmp_path, model, corruption):
    src, out = saved(model, "bfloat16")
    result = verify_folders(src, _corrupt(out, tmp_path / "bad", corruption))
    assert not result["ok"] and result["max_rel_error"] > 2 * result["tolerance"]


def test_the_command_exits_1_on_a_corrupted_bfloat16_fold_and_prints_the_rule(saved, tmp_path, capsys):
    src, out = saved("bundled", "bfloat16")
    assert main(["verify", str(src), str(out), "--json"]) == EXIT_OK
    verification = json.loads(capsys.readouterr().out)["verification"]
    assert verification["ok"] and "bfloat16" in verification["tolerance_rule"]
    bad = _corrupt(out, tmp_path / "bad", "lm_head x1.1")
    assert main(["verify", str(src), str(bad)]) == EXIT_VERIFY_FAILED
    assert "FAILED" in capsys.readouterr().out
