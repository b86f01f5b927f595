"""BatchNorm merging is a step of the FoldPlan: serialised with it, replayed by apply_plan alone."""
import copy
import json

import pytest
import torch
from torch import nn

import normfold
from normfold.engine.math import identity_batchnorm_variance
from normfold.engine.pipeline import plan_fold
from normfold.engine.plan import BatchNormFoldStep, FoldPlan, PlanConstraints
from normfold.engine.transform import apply_plan


class LinearBatchNormLayerNorm(nn.Module):
    """Linear (no bias) → BatchNorm1d → LayerNorm → Linear: the LN folds once the BN is merged into fc."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, 6)
        return self.head(self.ln(self.bn(self.fc(x))))


def _model():
    torch.manual_seed(0)
    model = LinearBatchNormLayerNorm()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def test_the_plan_json_holds_the_batchnorm_merge_and_round_trips():
    report = normfold.analyze(_model(), (torch.randn(4, 6),))
    (step,) = report.plan.batchnorm
    assert step == BatchNormFoldStep("bn", "fc", "fc.weight", "fc.bias", True, "bn.running_mean", "bn.running_var",
                                     "bn.weight", "bn.bias", 1e-5)
    data = json.loads(report.plan.to_json())
    assert data["batchnorm"][0]["producer_path"] == "fc"
    assert FoldPlan.from_dict(data) == report.plan


def test_applying_the_round_tripped_plan_alone_reproduces_the_fold():
    model, x = _model(), torch.randn(4, 6)
    folded, report = normfold.fold(model, (x,))
    replayed = apply_plan(copy.deepcopy(model), FoldPlan.from_dict(json.loads(report.plan.to_json())))
    assert isinstance(replayed.bn, nn.Identity) and isinstance(replayed.ln, normfold.RMSNorm)
    assert replayed.fc.bias is not None  # created: the merged BatchNorm's shift lives there
    for (name, a), (_, b) in zip(folded.state_dict().items(), replayed.state_dict().items()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(replayed(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_kept_module_merge_leaves_an_exact_identity_batchnorm():
    model, x = _model(), torch.randn(4, 6)
    (step,) = normfold.analyze(model, (x,)).plan.batchnorm
    kept = apply_plan(copy.deepcopy(model), FoldPlan(batchnorm=[
        BatchNormFoldStep(**{**step.__dict__, "keep_module": True})]))
    assert isinstance(kept.bn, nn.BatchNorm1d)
    assert torch.equal(kept.bn.running_var + kept.bn.eps, torch.ones(8))
    y = torch.randn(5, 8)
    assert torch.equal(kept.bn(y), y)  # the identity is exact in float32, not merely close
    torch.testing.assert_close(kept(x), model(x), rtol=1e-5, atol=1e-5)


def test_loadable_keys_refuse_a_bias_the_loader_does_not_know_with_the_reason():
    model, x = _model(), torch.randn(4, 6)
    keys = {name for name, _ in model.named_parameters()}  # no fc.bias
    report = plan_fold(model, (x,), PlanConstraints(loadable_keys=keys))
    (entry,) = report.batchnorms
    assert not entry.folded and entry.reason == "the stock architecture has no fc.bias to absorb its shift"
    assert report.plan.batchnorm == [] and report.num_foldable == 0


@pytest.mark.parametrize("dtype, exact", [(torch.float32, True), (torch.float64, True), (torch.bfloat16, False),
                                          (torch.float16, False)])
def test_identity_variance_exists_only_where_var_plus_eps_rounds_to_one(dtype, exact):
    var = identity_batchnorm_variance(1e-5, dtype)
    assert (var is not None) == exact
    if exact:
        x = torch.randn(64, 4, dtype=dtype)
        stats = dict(running_mean=torch.zeros(4, dtype=dtype), running_var=torch.full((4,), var, dtype=dtype))
        assert torch.equal(nn.functional.batch_norm(x, **stats, training=False, eps=1e-5), x)


@pytest.mark.parametrize("kwargs, error", [({"fold_affine": 1}, "fold_affine must be a bool"),
                                           ({"loadable_keys": {1}}, "loadable_keys"),
                                           ({"keep_modules_in": torch.int64}, "keep_modules_in")])
def test_plan_constraints_are_checked_on_construction(kwargs, error):
    with pytest.raises(TypeError, match=error):
        PlanConstraints(**kwargs)
