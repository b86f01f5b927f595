"""``normfold analyze|fold --keep PATTERN`` (norms left as they are, recorded in the report and re-made
by ``verify``) and ``--call`` (several kinds of example call: the fold keeps what is exact for all)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import normfold
from normfold.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main
from normfold.hf.errors import CheckpointError
from normfold.hf.inputs import example_inputs_for
from normfold.hf.load import load_model
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.recipe import Recipe
import sealing

pytest.importorskip("transformers")
pytest.importorskip("rich")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny folders of tests/hf
from hf.conftest import tiny_dirs  # noqa: E402,F401


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _kept(report: dict) -> list[str]:
    return sorted(n["path"] for n in report["norms"] if n["reason"].startswith("kept by request"))


def test_fold_keep_leaves_the_named_norms_records_them_and_verify_re_makes_the_same(capsys, tiny_dirs, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    code, text, _ = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out, "--keep", "transformer.h.0.*",
                         "--keep", "transformer.ln_f", "--json")
    assert code == EXIT_OK
    report = json.loads(text)
    assert _kept(report) == ["transformer.h.0.ln_1", "transformer.h.0.ln_2", "transformer.ln_f"]
    assert {n["path"] for n in report["norms"] if n["foldable"]} == {"transformer.h.1.ln_1", "transformer.h.1.ln_2"}
    written = json.loads((out / REPORT_JSON).read_text())
    assert written["recipe"]["keep"] == ["transformer.h.0.*", "transformer.ln_f"]
    code, text, _ = _run(capsys, "verify", tiny_dirs["gpt2"], out)
    assert code == EXIT_OK and "passed" in text
    code, text, _ = _run(capsys, "analyze", tiny_dirs["gpt2"], "--keep", "transformer.h.0.*", "--keep",
                         "transformer.ln_f", "--json")
    assert code == EXIT_OK and json.loads(text)["norms"] == report["norms"]  # analyze plans as fold does


def test_verify_fails_a_folder_whose_recipe_drops_its_keep(capsys, tiny_dirs, tmp_path):  # noqa: F811
    """The recipe is re-made, not believed: without its keep the re-made folder folds every norm."""
    out = tmp_path / "out"
    assert _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out, "--keep", "transformer.h.0.*")[0] == EXIT_OK
    sealing.reseal(out, lambda report: report["recipe"].pop("keep"))
    code, _, err = _run(capsys, "verify", tiny_dirs["gpt2"], out)
    assert code == EXIT_VERIFY_FAILED and "verification failed" in err


@pytest.mark.parametrize("extra, says", [
    (["--keep", "nothing.here"], "keep pattern 'nothing.here' matches no norm of GPT2LMHeadModel; its norms: "
                                 "transformer.h.0.ln_1, "),
    (["--keep", "transformer.ln_f", "--stream"], "--keep applies to exact in-memory folds only"),
])
def test_fold_keep_refusals_are_one_line_and_write_nothing(capsys, tiny_dirs, tmp_path, extra, says):  # noqa: F811
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", tmp_path / "out", *extra)
    assert code == EXIT_USAGE and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


_FOLD_RECIPE = {"command": "fold", "streaming": False, "fold_affine": True, "dtype": None,
                "approximate_min_cosine": None, "rotation": None, "calibration": None, "stock_plan": True,
                "side_files": True}


def test_a_recipe_records_keep_only_when_there_is_one():
    assert "keep" not in Recipe.from_dict(_FOLD_RECIPE).to_dict()  # the reports of folds without keep are unchanged
    recipe = Recipe.from_dict({**_FOLD_RECIPE, "keep": ["h.0.*"]})
    assert recipe.keep == ("h.0.*",) and recipe.to_dict()["keep"] == ("h.0.*",)


@pytest.mark.parametrize("edit, says", [
    ({"keep": "h.0.*"}, "recipe.keep must be a list of non-empty strings, got str"),
    ({"keep": [""]}, "non-empty strings, got list"),
    ({"calls": ["inputs_embeds"], "command": "save_pretrained", "dtype": "float32"},
     "recipe.calls must be recorded only for in-memory folds"),
    ({"keep": ["h.0.*"], "streaming": True}, "recipe.keep must be recorded only for in-memory exact folds"),
])
def test_a_recipe_with_an_unusable_keep_is_refused(edit, says):
    with pytest.raises(CheckpointError, match=says):
        Recipe.from_dict({**_FOLD_RECIPE, **edit})


def _foldable(report: dict) -> set[str]:
    return {n["path"] for n in report["norms"] if n["foldable"]}


def test_fold_for_two_kinds_of_call_keeps_what_only_the_ids_make_zero_mean_and_verify_re_makes_it(capsys, tiny_dirs,  # noqa: F811
                                                                                                  tmp_path):
    """Embeddings passed in are the caller's, not a table the fold centers: the norms the token table
    makes zero-mean stay LayerNorms once inputs_embeds calls must stay exact too."""
    code, text, _ = _run(capsys, "analyze", tiny_dirs["gpt2"], "--json")
    ids_only = _foldable(json.loads(text))
    out = tmp_path / "out"
    code, text, _ = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out, "--call", "input_ids", "--call",
                         "inputs_embeds", "--json")
    assert code == EXIT_OK
    report = json.loads(text)
    both = _foldable(report)
    assert both < ids_only and "transformer.h.0.ln_1" in ids_only - both
    entry = next(n for n in report["norms"] if n["path"] == "transformer.h.0.ln_1")
    assert entry["reason"].startswith("kept: not foldable in example call 1")
    assert [sorted(call) for call in report["traced_calls"]] == [["attention_mask", "input_ids", "use_cache"],
                                                                 ["attention_mask", "inputs_embeds", "use_cache"]]
    assert json.loads((out / REPORT_JSON).read_text())["recipe"]["calls"] == ["input_ids", "inputs_embeds"]
    code, text, _ = _run(capsys, "verify", tiny_dirs["gpt2"], out)
    assert code == EXIT_OK and "passed" in text
    code, text, _ = _run(capsys, "analyze", tiny_dirs["gpt2"], "--call", "input_ids", "--call", "inputs_embeds",
                         "--json")
    assert _foldable(json.loads(text)) == both


@pytest.mark.parametrize("extra, says", [
    (["--call", "pixel_values"], "example call 'pixel_values': GPT2LMHeadModel takes input_ids, inputs_embeds"),
    (["--call", "inputs_embeds", "--stream"], "--call applies to in-memory folds only"),
])
def test_fold_call_refusals_are_one_line_and_write_nothing(capsys, tiny_dirs, tmp_path, extra, says):  # noqa: F811
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", tmp_path / "out", *extra)
    assert code == EXIT_USAGE and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_save_pretrained_fold_with_keep_is_re_made_with_its_keep(capsys, tiny_dirs, tmp_path):  # noqa: F811
    """normfold.fold(..., keep=) then the model's save_pretrained: verify re-makes the fold with the
    recorded keep and passes; the same folder with the keep dropped from its recipe fails."""
    model = load_model(tiny_dirs["gpt2"])
    folded, _ = normfold.fold(model, example_inputs_for(model), keep=["transformer.h.0.*"])
    folded.save_pretrained(tmp_path / "d")
    code, text, _ = _run(capsys, "verify", tiny_dirs["gpt2"], tmp_path / "d")
    assert code == EXIT_OK and "passed" in text
    sealing.reseal(tmp_path / "d", lambda report: report["recipe"].pop("keep"))
    assert _run(capsys, "verify", tiny_dirs["gpt2"], tmp_path / "d")[0] == EXIT_VERIFY_FAILED
