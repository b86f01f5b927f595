"""Approximate folding: the tensor math, the producer probe, the greedy choice and its guarantee."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from normfold.lab.approximate import (approximate_fold, center_linear_, compare_outputs, fit_rms_affine,
                                      mean_pooled, retrieval_agreement, _execution_order, _find_producer,
                                      token_outputs)
from normfold.nn import RMSNorm
from normfold.ops.reference import layer_norm_ref


class _Toy(nn.Module):
    """ln_a reads a linear only (exactly correctable); ln_b is Post-LN: ln_b(h + f(h)), h = ln_a(...)."""

    def __init__(self, share_f_output: bool = False, seed: int = 0):
        super().__init__()
        self.share_f_output = share_f_output
        with torch.random.fork_rng(), torch.no_grad():  # the same weights whatever ran before (test order)
            torch.manual_seed(seed)
            self.inp, self.f, self.head = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 4)
            self.ln_a, self.ln_b = nn.LayerNorm(16), nn.LayerNorm(16)
            # non-zero-mean norm inputs: what makes a plain RMSNorm wrong
            self.inp.bias.add_(3.0)
            self.ln_a.bias.add_(1.5)
            self.ln_a.weight.uniform_(0.5, 1.5)
            self.ln_b.weight.uniform_(0.5, 1.5)

    def forward(self, x):  # x: (B, 6)
        h = self.ln_a(self.inp(x))  # (B, 16)
        g = self.f(torch.tanh(h))
        out = self.head(self.ln_b(h + g))
        return out + g[:, :4] if self.share_f_output else out


def _batches(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 6, generator=gen) for _ in range(n)]


# ------------------------------------------------------------------------------------- tensor math

@settings(max_examples=25, deadline=None)
@given(st.integers(1, 12), st.integers(2, 12), st.integers(0, 2**16))
def test_centred_linear_output_is_zero_mean_for_any_input(n_in, n_out, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(n_in, n_out).double()
    center_linear_(lin)
    y = lin(torch.randn(7, n_in, dtype=torch.float64) * 10)
    assert y.mean(-1).abs().max() < 1e-12


def test_fit_recovers_layernorm_affine_on_zero_mean_rows():
    torch.manual_seed(0)
    x = torch.randn(200, 16, dtype=torch.float64)
    x = x - x.mean(-1, keepdim=True)  # zero-mean rows: LayerNorm == RMSNorm
    gamma, beta = torch.rand(16, dtype=torch.float64) + 0.5, torch.randn(16, dtype=torch.float64)
    fit_gamma, fit_beta = fit_rms_affine(x, layer_norm_ref(x, gamma, beta, eps=1e-12), eps=1e-12)
    assert torch.allclose(fit_gamma, gamma, atol=1e-9) and torch.allclose(fit_beta, beta, atol=1e-9)


def test_compare_outputs_and_retrieval_agreement():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    same = compare_outputs(a, a.clone())
    assert same.max_abs_error == 0 and same.min_cosine == pytest.approx(1.0)
    flipped = compare_outputs(a, -a)
    assert flipped.min_cosine == pytest.approx(-1.0) and flipped.max_abs_error == 2.0
    assert retrieval_agreement(a, a) == 1.0
    # row 1's nearest neighbour moves from row 0 to row 2; rows 0 and 2 keep theirs
    before = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    after = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    assert retrieval_agreement(before, after) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        compare_outputs(a, a[:2])
    with pytest.raises(ValueError):
        retrieval_agreement(a[:1], a[:1])


def test_mean_pooling_ignores_padding():
    class Echo(nn.Module):
        def forward(self, input_ids, attention_mask):
            return input_ids.unsqueeze(-1).float()  # (B, T, 1)

    batch = {"input_ids": torch.tensor([[2, 4, 100]]), "attention_mask": torch.tensor([[1, 1, 0]])}
    assert mean_pooled(Echo(), batch).item() == 3.0
    assert token_outputs(Echo(), batch).flatten().tolist() == [2.0, 4.0]


# ------------------------------------------------------------------------------------ producer probe

def test_probe_finds_the_linear_that_only_feeds_the_norm():
    model = _Toy().eval()
    batch = _batches(1)[0]
    order = _execution_order(model, batch, {"ln_a", "ln_b"})
    assert order == ["inp", "ln_a", "f", "ln_b", "head"]
    assert _find_producer(model, "ln_a", order, batch, token_outputs) == "inp"
    assert _find_producer(model, "ln_b", order, batch, token_outputs) == "f"


def test_probe_refuses_a_linear_whose_output_is_also_used_elsewhere():
    model = _Toy(share_f_output=True).eval()
    batch = _batches(1)[0]
    order = _execution_order(model, batch, {"ln_b"})
    assert _find_producer(model, "ln_b", order, batch, token_outputs) is None


# ---------------------------------------------------------------------------------------- the fold

def test_correction_makes_a_norm_reading_only_a_linear_exact():
    model = _Toy().eval()
    approx, report = approximate_fold(model, model, None, _batches(), min_cosine=0.5, candidates=["ln_a"])
    entry = {e.path: e for e in report.entries}
    assert entry["ln_a"].status == "approximate" and entry["ln_a"].producer == "inp"
    assert entry["ln_a"].cosine_alone > 1 - 1e-9          # centring + shift: the input is zero-mean
    assert entry["ln_a"].cosine_alone_naive < 0.999       # a plain RMSNorm is visibly off
    assert entry["ln_b"].status == "kept" and isinstance(approx.ln_b, nn.LayerNorm)
    x = torch.randn(50, 6)  # not calibration data: exact for any input
    torch.testing.assert_close(approx(x), model(x), atol=1e-4, rtol=1e-4)


def test_min_cosine_holds_on_calibration_and_statuses_follow_it():
    model = _Toy().eval()
    before = copy.deepcopy(model.state_dict())
    loose, loose_report = approximate_fold(model, model, None, _batches(), min_cosine=0.5)
    assert loose_report.num_approximate == 2 and loose_report.num_kept == 0
    assert isinstance(loose.ln_a, RMSNorm) and isinstance(loose.ln_b, RMSNorm)
    # ln_a's correction is exact up to fp32 rounding (1 − cos ≈ 1e-13…2e-12 over seeds); ln_b's ≤ 0.997
    strict, strict_report = approximate_fold(model, model, None, _batches(), min_cosine=1 - 1e-9)
    assert strict_report.num_approximate == 1 and strict_report.num_kept == 1  # only ln_a is exact
    for report in (loose_report, strict_report):
        assert report.calibration.min_cosine >= report.min_cosine
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # inputs untouched
    d = strict_report.to_dict()
    assert d["num_approximate"] == 1 and {e["status"] for e in d["entries"]} == {"approximate", "kept"}
    assert "ln_b" in strict_report.table()


def test_exactly_folded_norms_are_reported_as_exact():
    model = _Toy().eval()
    report = SimpleNamespace(norms=[SimpleNamespace(path="ln_a", foldable=True, reason="centred inp")])
    folded = copy.deepcopy(model)
    folded.ln_a = RMSNorm(16)  # stands in for the exact fold's swap
    _, approx_report = approximate_fold(model, folded, report, _batches(), min_cosine=0.0 + 1e-9)
    statuses = {e.path: e.status for e in approx_report.entries}
    assert statuses["ln_a"] == "exact" and approx_report.num_exact == 1


def test_refuses_a_folded_model_that_still_has_the_exactly_folded_norm():
    model = _Toy().eval()
    report = SimpleNamespace(norms=[SimpleNamespace(path="ln_a", foldable=True, reason="centred inp")])
    with pytest.raises(ValueError, match="exact fold's output"):
        approximate_fold(model, model, report, _batches(1))


@pytest.mark.parametrize("kwargs, error", [
    ({"min_cosine": 0.0}, ValueError),
    ({"min_cosine": 1.5}, ValueError),
    ({"min_cosine": True}, ValueError),  # a bool is not a bar (Python counts it as the int 1)
    ({"candidates": ["head"]}, ValueError),
])
def test_refuses_bad_arguments(kwargs, error):
    model = _Toy().eval()
    with pytest.raises(error):
        approximate_fold(model, model, None, _batches(1), **kwargs)


def test_refuses_empty_calibration():
    model = _Toy().eval()
    with pytest.raises(ValueError, match="at least one batch"):
        approximate_fold(model, model, None, [])


def test_progress_bars_on_stderr_name_each_phase_and_leave_stdout_alone(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("NORMFOLD_PROGRESS", "1")
    model = _Toy()
    approximate_fold(model, model, None, _batches(), min_cosine=0.5)
    out, err = capsys.readouterr()
    assert out == ""
    for phase in ("reference outputs", "each norm alone", "switching"):
        assert f"approximate fold: {phase}" in err


def test_no_progress_output_when_progress_is_off(monkeypatch, capsys):
    monkeypatch.setenv("NORMFOLD_PROGRESS", "0")
    model = _Toy()
    approximate_fold(model, model, None, _batches(), min_cosine=0.5)
    assert capsys.readouterr() == ("", "")
