"""The fold engine's public API: analyze / fold / verify, the plan, the pure math, bad input."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import normfold
from normfold.engine import FoldError, FoldPlan, FoldReport, FoldVerificationError, VerifyResult
from normfold.engine.math import center, fold_affine_into_consumer
from normfold.engine.transform import apply_plan

B, T, C, V = 2, 6, 8, 13  # batch, tokens, features, vocab


class TinyLM(nn.Module):
    """Pre-LN residual LM: tied embedding, one block, final norm, head without bias."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(C), nn.LayerNorm(C), nn.LayerNorm(C)
        self.attn_out = nn.Linear(C, C)
        self.fc, self.proj = nn.Linear(C, 2 * C), nn.Linear(2 * C, C)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(C, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):  # (B, T) -> (B, T, V)
        h = self.drop(self.emb(ids))                                   # (B, T, C)
        h = h + self.attn_out(self.ln1(h))
        h = h + self.proj(torch.nn.functional.gelu(self.fc(self.ln2(h))))
        return self.head(self.ln_f(h))


def _model(seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # γ ≠ 1, β ≠ 0: affine folding is exercised
    return model.eval()


def _ids(seed: int = 0):
    return (torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed)),)


def test_analyze_reports_every_norm_and_leaves_the_model_untouched():
    model = _model()
    before = copy.deepcopy(model.state_dict())
    report = normfold.analyze(model, _ids())
    assert isinstance(report, FoldReport)
    assert (report.num_norms, report.num_foldable, report.num_affine_folded) == (3, 3, 3)
    assert report.untied == ["head.weight (copy of emb.weight)"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.head.weight is model.emb.weight and report.verification is None


def test_report_is_json_ready_and_prints_an_aligned_table():
    report = normfold.analyze(_model(), _ids())
    data = json.loads(json.dumps(report.to_dict()))
    assert data["num_foldable"] == 3 and [n["path"] for n in data["norms"]] == ["ln1", "ln2", "ln_f"]
    text = str(report)
    assert text.splitlines()[0] == "3/3 norms foldable, 3 affine-folded"
    assert "ln_f" in text and "untied: head.weight" in text


def test_fold_returns_a_verified_copy_of_the_users_class_with_rmsnorms():
    model = _model()
    model.train()  # fold must analyse in eval mode and give the mode back
    before = copy.deepcopy(model.state_dict())
    folded, report = normfold.fold(model, _ids())
    assert model.training and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(folded) is TinyLM and folded is not model
    for path in ("ln1", "ln2", "ln_f"):
        norm = folded.get_submodule(path)
        assert isinstance(norm, normfold.RMSNorm) and norm.weight is None and norm.eps == 1e-5
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    assert report.verification.max_input_mean_ratio < 1e-12
    assert report.verification.model_dtype_max_rel_error < 1e-5  # float32 weights, rounded once
    assert "fc.bias" not in {s.fqn for s in report.plan.center}  # fc reads a norm; it is not a producer


def test_fold_without_affine_keeps_gamma_and_beta_in_the_rmsnorms():
    model = _model()
    folded, report = normfold.fold(model, _ids(), fold_affine=False)
    assert report.num_affine_folded == 0 and not report.plan.affine_fold
    assert torch.equal(folded.ln1.weight, model.ln1.weight) and torch.equal(folded.ln1.bias, model.ln1.bias)


def test_affine_folding_creates_a_bias_where_beta_needs_one():
    folded, report = normfold.fold(_model(), _ids())
    step = next(s for s in report.plan.affine_fold if s.norm_path == "ln_f")
    assert step.create_bias and step.bias_fqn == "head.bias" and folded.head.bias is not None


def test_folding_twice_changes_nothing():
    model = _model()
    once, _ = normfold.fold(model, _ids())
    twice, report = normfold.fold(once, _ids())
    assert report.num_foldable == 0 and not report.plan
    assert all(e.kind == "RMSNorm" for e in report.norms)
    assert once.state_dict().keys() == twice.state_dict().keys()
    assert all(torch.equal(v, twice.state_dict()[k]) for k, v in once.state_dict().items())


def test_plan_round_trips_through_json_and_applies_to_a_fresh_copy():
    model = _model()
    folded, report = normfold.fold(model, _ids())
    plan = FoldPlan.from_dict(json.loads(report.plan.to_json()))
    assert plan == report.plan
    again = apply_plan(copy.deepcopy(model), plan)
    assert all(torch.equal(v, folded.state_dict()[k]) for k, v in again.state_dict().items())


def test_plan_refuses_unknown_sections():
    with pytest.raises(ValueError, match="unknown plan sections"):
        FoldPlan.from_dict({"center": [], "rotate": []})


def test_verify_reports_a_difference_between_unrelated_models():
    result = normfold.verify(_model(0), _model(1), _ids())
    assert isinstance(result, VerifyResult) and not result.ok and result.max_rel_error > 1e-3
    assert {o["name"] for o in result.outputs} == {"out"}
    assert result.num_runs == 3 and all(o["argmax_agreement"] is not None for o in result.outputs)


def test_verify_on_identical_models_is_exact():
    model = _model()
    result = normfold.verify(model, copy.deepcopy(model), _ids(), num_random=1)
    assert result.ok and result.max_rel_error == 0.0 and result.max_input_mean_ratio is None


def test_fold_raises_and_returns_nothing_when_the_transform_is_wrong(monkeypatch):
    from normfold.engine import transform

    real = transform.apply_plan

    def broken(model, plan):
        real(model, plan)
        with torch.no_grad():
            model.proj.bias.add_(1.0)  # a shift that is not constant along the features
            model.proj.bias[0] += 1.0
        return model

    monkeypatch.setattr(transform, "apply_plan", broken)
    with pytest.raises(FoldVerificationError, match="relative error"):
        normfold.fold(_model(), _ids())


@pytest.mark.parametrize("bad", [[torch.zeros(2, 3)], torch.zeros(2, 3), "ids"])
def test_example_inputs_must_be_a_tuple_or_a_dict(bad):
    with pytest.raises(TypeError, match="tuple of positional arguments or a dict"):
        normfold.analyze(_model(), bad)
    with pytest.raises(TypeError):
        normfold.verify(_model(), _model(), bad)


def test_model_must_be_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        normfold.analyze(lambda x: x, (torch.zeros(1),))


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: export cannot capture it
            return x
        return -x


def test_a_model_export_cannot_capture_raises_fold_error_with_the_reason():
    with pytest.raises(FoldError, match="torch.export could not capture DataDependent") as info:
        normfold.analyze(DataDependent(), (torch.randn(3),))
    assert "submodule" in str(info.value) and info.value.__cause__ is not None


class AlreadyRMS(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.norm = normfold.RMSNorm(C, eps=1e-6)
        self.out = nn.Linear(C, C)

    def forward(self, x):
        return self.out(self.norm(self.fc(x)))


def test_an_existing_rmsnorm_is_left_alone_but_its_gamma_moves_into_the_next_linear():
    model = AlreadyRMS().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    folded, report = normfold.fold(model, (torch.randn(B, T, C),))
    (entry,) = report.norms
    assert (entry.kind, entry.foldable, entry.affine_folded) == ("RMSNorm", False, True)
    assert not report.plan.center and folded.norm.weight is None and report.verification.ok


# --------------------------------------------------------------------------- pure math

_shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None)
@given(shape=_shapes, data=st.data())
def test_center_removes_the_mean_along_dim_and_is_idempotent(shape, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    t = torch.randn(*shape, dtype=torch.float64)
    c = center(t, dim)
    assert c.mean(dim).abs().max() < 1e-12
    assert torch.allclose(center(c, dim), c, atol=1e-14)
    assert torch.allclose(t - c, (t - c).mean(dim, keepdim=True).expand_as(t), atol=1e-12)  # removed a constant


@settings(max_examples=30, deadline=None)
@given(groups=st.integers(1, 4), group=st.integers(1, 4), rows=st.integers(1, 4))
def test_center_per_group_centers_each_contiguous_group(groups, group, rows):
    t = torch.randn(groups * group, rows, dtype=torch.float64)
    c = center(t, 0, group)
    assert c.view(groups, group, rows).mean(1).abs().max() < 1e-12


def test_center_refuses_a_group_that_does_not_divide_the_dim():
    with pytest.raises(ValueError, match="positive divisor of the size 6"):
        center(torch.zeros(6, 2), 0, 4)
    with pytest.raises(ValueError, match="dim must be in"):
        center(torch.zeros(6, 2), 2)


@settings(max_examples=30, deadline=None)
@given(n_in=st.integers(1, 6), n_out=st.integers(1, 6), in_dim=st.sampled_from([0, 1]),
       has_bias=st.booleans(), has_beta=st.booleans())
def test_fold_affine_into_consumer_equals_applying_the_affine_first(n_in, n_out, in_dim, has_bias, has_beta):
    w_out_in = torch.randn(n_out, n_in, dtype=torch.float64)
    weight = w_out_in if in_dim == 1 else w_out_in.t().contiguous()
    bias = torch.randn(n_out, dtype=torch.float64) if has_bias else None
    gamma = torch.randn(n_in, dtype=torch.float64)
    beta = torch.randn(n_in, dtype=torch.float64) if has_beta else None
    x = torch.randn(5, n_in, dtype=torch.float64)
    expected = torch.nn.functional.linear(x * gamma + (beta if beta is not None else 0), w_out_in, bias)
    new_w, new_b = fold_affine_into_consumer(weight, bias, gamma, beta, in_dim)
    got = torch.nn.functional.linear(x, new_w if in_dim == 1 else new_w.t(), new_b)
    assert torch.allclose(got, expected, atol=1e-12)
    assert (new_b is None) == (bias is None and beta is None)


def test_fold_affine_into_consumer_checks_shapes():
    with pytest.raises(ValueError, match=r"gamma must have shape \(4,\)"):
        fold_affine_into_consumer(torch.zeros(3, 4), None, torch.ones(3), None, in_dim=1)
    with pytest.raises(ValueError, match="2-D"):
        fold_affine_into_consumer(torch.zeros(3), None, None, None, in_dim=0)


class TorchRMS(nn.Module):
    """torch.nn.RMSNorm has no ``bias`` attribute and may leave eps to the dtype."""

    def __init__(self, eps):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.norm = nn.RMSNorm(C, eps=eps)
        self.out = nn.Linear(C, C)

    def forward(self, x):
        return self.out(self.norm(self.fc(x)))


@pytest.mark.parametrize("eps", [1e-6, None])
def test_torch_rmsnorm_is_reported_and_affine_folded_only_with_an_explicit_eps(eps):
    model = TorchRMS(eps).eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    folded, report = normfold.fold(model, (torch.randn(B, T, C),))
    (entry,) = report.norms
    assert (entry.kind, entry.foldable, entry.affine_folded) == ("RMSNorm", False, eps is not None)
    assert report.verification.ok


class MultiDimNorm(nn.Module):
    """A LayerNorm over the last two dims (5, C): one mean and variance per (5, C) slab."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm((5, C)), nn.Linear(C, 3)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.normal_()

    def forward(self, x):  # (B, 5, C) -> (B, 5, 3)
        return self.head(self.ln(self.fc(x)))


def test_a_layernorm_over_several_dims_is_kept_whole_with_a_reason():
    model = MultiDimNorm()
    x = torch.randn(2, 5, C)
    folded, report = normfold.fold(model, (x,))
    (entry,) = report.norms
    assert not entry.foldable and not entry.affine_folded and not report.plan
    assert entry.reason.startswith(f"kept whole: normalizes over several dims together, (5, {C})")
    assert "affine kept: γ/β span 2 dims" in entry.reason
    assert isinstance(folded.ln, nn.LayerNorm) and folded.ln.normalized_shape == (5, C)
    assert report.verification.ok and torch.equal(folded(x), model(x))
