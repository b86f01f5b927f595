"""The scope of exactness: the report records the traced call(s), and ``fold``/``analyze`` take a
list of example calls and fold only what is exact for every one of them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import normfold

from tiny_models import tiny_gpt2

C = 8


class Branchy(nn.Module):
    """fc → LayerNorm → head; ``shift=True`` adds a constant before the norm (not zero-mean), and
    ``skip_norm=True`` bypasses the norm: a fold made for the plain call is wrong for both."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, 3)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.normal_()

    def forward(self, x, shift: bool = False, skip_norm: bool = False):
        h = self.fc(x)
        if shift:
            h = h + 1.0
        return self.head(h if skip_norm else self.ln(h))


def _x(seed: int = 0):
    return torch.randn(4, C, generator=torch.Generator().manual_seed(seed))


def _rel(a, b):
    return ((a - b).abs().max() / a.abs().max()).item()


def test_the_report_records_the_traced_call_and_that_other_paths_are_not_covered():
    model = Branchy()
    folded, report = normfold.fold(model, {"x": _x(), "shift": False})
    assert report.traced_calls == [{"x": "tensor (4, 8) float32", "shift": "False"}]
    data = report.to_dict()
    assert data["traced_calls"] == report.traced_calls
    assert "exact for the traced call and for calls that take the same path" in data["exactness_scope"]
    assert "traced call 0: x=tensor (4, 8) float32, shift=False" in str(report)
    assert report.num_foldable == 1  # the plain call centers fc and swaps the norm: wrong for another branch
    assert _rel(model(_x(1), shift=True), folded(_x(1), shift=True)) > 1e-3


def test_a_norm_unfoldable_in_the_second_call_is_kept_with_a_reason_naming_that_call():
    model = Branchy()
    folded, report = normfold.fold(model, [(_x(),), {"x": _x(), "shift": True}])
    (entry,) = report.norms
    assert not entry.foldable and entry.reason.startswith("kept: not foldable in example call 1: blocked")
    assert isinstance(folded.ln, nn.LayerNorm) and not report.plan.center
    assert report.verification.ok and report.verification.num_runs == 6  # both calls, 2 random inputs each
    for kwargs in ({}, {"shift": True}):
        assert _rel(model(_x(2), **kwargs), folded(_x(2), **kwargs)) < 1e-5
    assert len(report.traced_calls) == 2 and "each of the 2 traced calls" in report.exactness_scope


def test_a_norm_that_a_call_does_not_run_keeps_its_affine_and_stays_a_layernorm():
    model = Branchy()
    folded, report = normfold.fold(model, [(_x(),), (_x(), False, True)])
    (entry,) = report.norms
    assert not entry.foldable and not entry.affine_folded and "example call 1 does not run it" in entry.reason
    assert "affine kept" in entry.reason and not report.plan
    assert torch.equal(folded.head.weight, model.head.weight)
    for args in ((_x(3),), (_x(3), False, True)):
        assert _rel(model(*args), folded(*args)) < 1e-6


def test_analyze_takes_a_list_and_other_list_contents_are_refused():
    report = normfold.analyze(Branchy(), [(_x(),), (_x(),)])
    assert report.num_foldable == 1 and len(report.traced_calls) == 2
    with pytest.raises(TypeError, match="example call 1: each call in the list must be a tuple"):
        normfold.analyze(Branchy(), [(_x(),), _x()])
    with pytest.raises(ValueError, match="at least one call"):
        normfold.fold(Branchy(), [])
    with pytest.raises(TypeError, match="or a list of such calls"):
        normfold.fold(Branchy(), _x())


def test_gpt2_folded_for_input_ids_and_inputs_embeds_is_exact_for_both():
    model = tiny_gpt2(vocab_size=64, n_positions=16, n_embd=16).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    by_ids = {"input_ids": ids, "use_cache": False}
    by_embeds = {"inputs_embeds": model.transformer.wte(ids).detach(), "use_cache": False}

    folded_one, _ = normfold.fold(model, by_ids)
    with torch.no_grad():  # folded for input_ids only: a call with inputs_embeds takes another path
        assert _rel(model(**by_embeds).logits, folded_one(**by_embeds).logits) > 1e-3

    folded, report = normfold.fold(model, [by_ids, by_embeds])
    assert report.verification.ok and report.verification.num_runs == 6
    assert [sorted(call) for call in report.traced_calls] == [["input_ids", "use_cache"], ["inputs_embeds", "use_cache"]]
    assert all("not foldable in example call 1" in e.reason for e in report.norms if e.kind == "LayerNorm")
    with torch.no_grad():
        for call in (by_ids, by_embeds):
            assert _rel(model(**call).logits, folded(**call).logits) < 1e-5
