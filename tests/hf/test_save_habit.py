"""The Hugging Face habit (issue 30): ``folded, _ = normfold.fold(model, example)`` then
``folded.save_pretrained(d)`` writes normfold's folder. ``normfold.from_pretrained(d)`` rebuilds the
folded model bitwise; under the default plan for a ``PreTrainedModel`` (stock-compatible) stock
``from_pretrained(d)`` loads the same model, and under ``stock_compatible=False`` saving warns.

Fails on main (36efdc1): the folded model's ``save_pretrained`` was transformers' own, which wrote
no report (``normfold.from_pretrained``: "no normfold_report.json") and dropped GPT-2's created
``lm_head.bias`` silently (stock reload 6% off); no ``stock_compatible`` option existed.
"""
from __future__ import annotations

import copy
import gc
import json
import pickle
import warnings
import weakref

import pytest
import torch
from torch import nn

import normfold
from normfold.cli import EXIT_OK, main
from normfold.hf import CheckpointError, load_model
from normfold.hf.output_dir import REPORT_JSON

transformers = pytest.importorskip("transformers")


def _example(seed: int) -> dict:
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "use_cache": False}


def _out(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def _stock_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "stock transformers" in str(w.message)]


@pytest.fixture(scope="module")
def gpt2(tiny_dirs):
    """(source folder, original, fold under the default plan, fold under the whole plan)."""
    original = load_model(tiny_dirs["gpt2"])
    return tiny_dirs["gpt2"], original, normfold.fold(original, _example(0)), \
        normfold.fold(original, _example(0), stock_compatible=False)


# ------------------------------------------------------------------------------------ the round trips

def test_gpt2s_habit_folder_loads_exactly_in_stock_transformers_and_bitwise_in_normfold(gpt2, tmp_path):
    src, original, (folded, report), _ = gpt2
    assert getattr(folded.lm_head, "bias", None) is None  # the default plan creates nothing GPT-2 lacks:
    ln_f = folded.transformer.ln_f  # ln_f keeps its γ/β, inside its RMSNorm
    assert isinstance(ln_f, normfold.RMSNorm) and ln_f.weight is not None and ln_f.bias is not None
    assert "lm_head.bias" in next(e.reason for e in report.norms if e.path == "transformer.ln_f")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folded.save_pretrained(tmp_path / "d")
    assert not _stock_warnings(caught)
    saved = json.loads((tmp_path / "d" / REPORT_JSON).read_text())
    assert saved["stock_compatible"] is True and saved["recipe"]["command"] == "save_pretrained"
    fresh = _example(1)
    assert torch.equal(_out(normfold.from_pretrained(tmp_path / "d"), fresh), _out(folded, fresh))
    stock, info = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "d", attn_implementation="eager",
                                                              output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert _rel(_out(original, fresh), _out(stock.eval(), fresh)) < 1e-5
    assert main(["verify", str(src), str(tmp_path / "d")]) == EXIT_OK


def test_gpt2s_whole_plan_habit_folder_is_normfolds_layout_rebuilt_bitwise_and_saving_warns(gpt2, tmp_path):
    src, original, _, (folded, _) = gpt2
    assert folded.lm_head.bias is not None  # ln_f's γ/β moved into a bias stock GPT-2 does not have
    with pytest.warns(UserWarning, match=r"stock transformers would drop lm_head.bias"):
        folded.save_pretrained(tmp_path / "d")
    saved = json.loads((tmp_path / "d" / REPORT_JSON).read_text())
    assert saved["stock_compatible"] is False and saved["extra_parameters"] == [{"name": "lm_head.bias", "shape": [96]}]
    fresh = _example(1)
    reloaded = normfold.from_pretrained(tmp_path / "d")
    assert torch.equal(reloaded.lm_head.bias, folded.lm_head.bias)
    assert torch.equal(_out(reloaded, fresh), _out(folded, fresh))
    assert _rel(_out(original, fresh), _out(reloaded, fresh)) < 1e-5
    assert main(["verify", str(src), str(tmp_path / "d")]) == EXIT_OK


def test_berts_habit_folder_loads_exactly_in_stock_transformers_and_bitwise_in_normfold(tiny_dirs, tmp_path):
    """BERT: what folds (the embedding norm, which keeps its γ/β) fits the stock class under either plan."""
    original = load_model(tiny_dirs["bert"])
    folded, report = normfold.fold(original, {"input_ids": _example(0)["input_ids"]})
    assert report.num_foldable >= 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        folded.save_pretrained(tmp_path / "d")
    assert not _stock_warnings(caught)
    fresh = {"input_ids": _example(1)["input_ids"]}
    assert torch.equal(_out(normfold.from_pretrained(tmp_path / "d"), fresh), _out(folded, fresh))
    stock, info = transformers.BertModel.from_pretrained(tmp_path / "d", attn_implementation="eager",
                                                        output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert _rel(_out(original, fresh), _out(stock.eval(), fresh)) < 1e-5
    assert main(["verify", str(tiny_dirs["bert"]), str(tmp_path / "d")]) == EXIT_OK


# ------------------------------------------------------------------------------ transformers' keywords

@pytest.mark.parametrize("name, value", [
    ("state_dict", {f"w{i}": torch.zeros(1000) for i in range(100)}), ("push_to_hub", True), ("token", "hf_abc"),
    ("variant", "fp16"), ("max_shard_size", "1GB"), ("safe_serialization", False), ("save_function", torch.save),
])
def test_transformers_keywords_normfold_cannot_honour_are_refused_before_anything_is_written(gpt2, tmp_path,
                                                                                            name, value):
    folded = gpt2[2][0]
    with pytest.raises(ValueError, match=rf"cannot honour {name}=.*; it takes save_directory, source_dir=") as err:
        folded.save_pretrained(tmp_path / "d", **{name: value})
    assert len(str(err.value)) < 600  # one line, however large the value (this dict's repr: 434490 characters)
    assert not (tmp_path / "d").exists()


def test_an_unknown_keyword_is_a_type_error_and_a_non_bool_overwrite_too(gpt2, tmp_path):
    folded = gpt2[2][0]
    with pytest.raises(TypeError, match="unexpected keyword argument 'repo_id'"):
        folded.save_pretrained(tmp_path / "d", repo_id="me/model")
    with pytest.raises(TypeError, match="overwrite must be a bool"):
        folded.save_pretrained(tmp_path / "d", overwrite="yes")
    assert not (tmp_path / "d").exists()


def test_keywords_at_the_value_that_changes_nothing_are_accepted_and_other_ranks_write_nothing(gpt2, tmp_path):
    folded = gpt2[2][0]
    assert folded.save_pretrained(tmp_path / "rank1", is_main_process=False) is None
    assert not (tmp_path / "rank1").exists()
    assert folded.save_pretrained(tmp_path / "d", push_to_hub=False, state_dict=None, safe_serialization=True,
                                  variant=None, token=None) is None  # as transformers' save_pretrained returns
    assert json.loads((tmp_path / "d" / REPORT_JSON).read_text())["stock_compatible"] is True


# ---------------------------------------------------------------------------------- existing folders

def test_the_habit_replaces_an_empty_folder_or_its_own_output_and_refuses_any_other(gpt2, tmp_path):
    folded = gpt2[2][0]
    (tmp_path / "empty").mkdir()
    folded.save_pretrained(tmp_path / "empty")
    folded.save_pretrained(tmp_path / "empty")  # again: a normfold output is replaced, as transformers users expect
    assert (tmp_path / "empty" / REPORT_JSON).is_file()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"replaces a folder only when it is empty or a normfold output, and "
                                              r".*mine holds tokenizer.json: save into a new folder"):
        folded.save_pretrained(mine)
    assert [p.name for p in mine.iterdir()] == ["tokenizer.json"]


# ----------------------------------------------------------------------- which models get the saver

class _OwnSaver(nn.Module):
    """Not a transformers model, with a save_pretrained of its own."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.proj(x))

    def save_pretrained(self, path):
        return f"own save to {path}"


def test_a_model_that_is_not_a_transformers_model_keeps_its_class_behaviour_and_cannot_ask_for_the_stock_plan():
    folded, report = normfold.fold(_OwnSaver(), (torch.randn(2, 3, 8),))
    assert report.num_foldable == 1 and "save_pretrained" not in vars(folded)
    assert folded.save_pretrained("x") == "own save to x"
    with pytest.raises(TypeError, match="stock_compatible=True plans what a transformers PreTrainedModel's class "
                                        "loads, got a _OwnSaver"):
        normfold.fold(_OwnSaver(), (torch.randn(2, 3, 8),), stock_compatible=True)
    with pytest.raises(TypeError, match="FoldConfig.stock_compatible must be a bool"):
        normfold.FoldConfig(stock_compatible="yes")


def test_deleting_a_folded_model_frees_it_without_the_garbage_collector(gpt2):
    """The saver holds its model weakly: no reference cycle keeps a large model's memory after ``del``."""
    folded = copy.deepcopy(gpt2[2][0])
    alive = weakref.ref(folded)
    gc.disable()
    try:
        del folded
        assert alive() is None
    finally:
        gc.enable()


def test_a_deep_copy_and_an_unpickled_model_save_themselves(gpt2, tmp_path):
    folded = gpt2[2][0]
    duplicate = copy.deepcopy(folded)
    unpickled = pickle.loads(pickle.dumps(folded))
    for model in (duplicate, unpickled):
        assert model.save_pretrained.model is model and model.save_pretrained.report is not None
    with torch.no_grad():
        duplicate.lm_head.weight.mul_(2)  # tied to wte: the copy is now another model than ``folded``
    duplicate.save_pretrained(tmp_path / "d")
    fresh = _example(1)
    assert torch.equal(_out(normfold.from_pretrained(tmp_path / "d"), fresh), _out(duplicate, fresh))
    assert not torch.equal(_out(duplicate, fresh), _out(folded, fresh))
