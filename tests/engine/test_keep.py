"""``keep=[patterns]``: norms the user names (fnmatch on module paths) stay as they are, say so in the
report, and a pattern that names no norm is refused before anything is folded."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import normfold
from normfold import FoldConfig
from normfold.engine import PlanConstraints
from normfold.engine import fold as engine_fold

from tiny_models import tiny_gpt2

C = 8


class TwoBlocks(nn.Module):
    """fc1 → ln1 → fc2 → ln2 → head: both norms read a Linear's output, so both fold."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.ln1, self.fc2, self.ln2, self.head = (nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, C),
                                                              nn.LayerNorm(C), nn.Linear(C, 3))
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.uniform_(0.5, 1.5)
                ln.bias.normal_()

    def forward(self, x):
        return self.head(self.ln2(self.fc2(self.ln1(self.fc1(x)))))


def _x():
    return (torch.randn(4, C, generator=torch.Generator().manual_seed(0)),)


def test_without_keep_both_norms_fold():  # the baseline the keep tests below change
    report = normfold.analyze(TwoBlocks(), _x())
    assert [e.foldable for e in report.norms] == [True, True]


def test_a_kept_norm_stays_untouched_and_is_reported_kept_by_request():
    model = TwoBlocks()
    folded, report = normfold.fold(model, _x(), keep=["ln1"])
    by_path = {e.path: e for e in report.norms}
    assert not by_path["ln1"].foldable and by_path["ln1"].reason.startswith("kept by request")
    assert not by_path["ln1"].affine_folded and by_path["ln2"].foldable
    assert type(folded.ln1) is nn.LayerNorm and torch.equal(folded.ln1.weight, model.ln1.weight)
    assert torch.equal(folded.ln1.bias, model.ln1.bias)
    assert torch.equal(folded.fc1.weight, model.fc1.weight)  # nothing centered for the kept norm
    assert isinstance(folded.ln2, normfold.RMSNorm)
    assert {s.fqn for s in report.plan.center} == {"fc2.weight", "fc2.bias"}
    assert report.verification.ok
    assert "kept by request" in report.to_dict()["norms"][0]["reason"]


def test_keep_patterns_are_fnmatch_on_module_paths_in_every_entry_point():
    assert [e.foldable for e in normfold.analyze(TwoBlocks(), _x(), keep=["ln*"]).norms] == [False, False]
    _, report = normfold.convert(TwoBlocks(), _x(), fold=FoldConfig(keep=("ln2",)))
    assert [e.foldable for e in report.norms] == [True, False]
    _, report = engine_fold(TwoBlocks(), _x(), keep=["ln?"])
    assert report.num_foldable == 0 and not report.plan


def test_a_pattern_matching_no_norm_is_a_value_error_naming_it_and_listing_norms():
    with pytest.raises(ValueError, match=r"keep pattern 'fc1' matches no norm of TwoBlocks; its norms: ln1, ln2"):
        normfold.fold(TwoBlocks(), _x(), keep=["ln1", "fc1"])
    with pytest.raises(ValueError, match="'LN1'"):  # module paths are case-sensitive
        normfold.analyze(TwoBlocks(), _x(), keep=["LN1"])


@pytest.mark.parametrize("keep, error, message", [
    ("ln1", TypeError, r"keep must be a list of module path patterns \(str\), got str 'ln1': write \['ln1'\]"),
    ({"ln1"}, TypeError, "got set"),
    ([1], TypeError, "got int 1"),
    ([""], ValueError, "non-empty"),
])
def test_keep_that_is_not_a_list_of_patterns_is_refused(keep, error, message):
    with pytest.raises(error, match=message):
        PlanConstraints(keep=keep)
    with pytest.raises(error):
        FoldConfig(keep=keep)


def test_keep_with_the_approximate_fold_is_refused_before_any_work():
    with pytest.raises(ValueError, match="does not go with the approximate fold"):
        normfold.fold(TwoBlocks(), _x(), keep=["ln1"], approximate=True, calibration=[_x()])


def test_keep_on_a_transformers_model_keeps_the_named_blocks_and_save_pretrained_records_it(tmp_path):
    model = tiny_gpt2(0, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                      attn_implementation="eager").eval()
    ids = {"input_ids": torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(0)), "use_cache": False}
    folded, report = normfold.fold(model, ids, keep=["transformer.h.0.*"])
    kept = sorted(e.path for e in report.norms if e.reason.startswith("kept by request"))
    assert kept == ["transformer.h.0.ln_1", "transformer.h.0.ln_2"]
    assert type(folded.transformer.h[0].ln_1) is nn.LayerNorm
    assert isinstance(folded.transformer.h[1].ln_1, normfold.RMSNorm)
    folded.save_pretrained(tmp_path / "out")
    recipe = json.loads((tmp_path / "out" / "normfold_report.json").read_text())["recipe"]
    assert recipe["keep"] == ["transformer.h.0.*"]
