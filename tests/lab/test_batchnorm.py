"""BatchNorm folding: exact for eval-mode BatchNorm after Linear/Conv, refusals reported."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from normfold.lab.batchnorm import fold_batchnorm_into_producer, fold_batchnorms


def _trained(model: nn.Module, shape) -> nn.Module:
    """Give the BatchNorms non-trivial running statistics and affine parameters, then eval()."""
    torch.manual_seed(0)
    model.train()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.weight.uniform_(0.5, 2.0)
                m.bias.uniform_(-1.0, 1.0)
        for _ in range(5):
            model(torch.randn(*shape) * 3 + 1)
    return model.eval()


@pytest.mark.parametrize("producer, bn, shape", [
    (nn.Linear(6, 5), nn.BatchNorm1d(5), (8, 6)),
    (nn.Linear(6, 5, bias=False), nn.BatchNorm1d(5), (8, 6)),
    (nn.Conv1d(3, 5, 3), nn.BatchNorm1d(5), (8, 3, 7)),
    (nn.Conv2d(3, 5, 3, bias=False), nn.BatchNorm2d(5), (8, 3, 6, 6)),
    (nn.Conv3d(2, 5, 2, groups=1), nn.BatchNorm3d(5), (4, 2, 4, 4, 4)),
    (nn.Conv2d(4, 4, 3, groups=2), nn.BatchNorm2d(4, affine=False), (8, 4, 6, 6)),
])
def test_eval_batchnorm_folds_exactly_into_its_producer(producer, bn, shape):
    model = _trained(nn.Sequential(producer, bn, nn.ReLU()), shape)
    x = torch.randn(*shape)
    folded, entries = fold_batchnorms(model, (x,))
    assert [(e.path, e.folded, e.producer) for e in entries] == [("1", True, "0")]
    assert isinstance(folded[1], nn.Identity) and isinstance(model[1], nn.modules.batchnorm._BatchNorm)
    torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)


def test_fold_math_matches_batchnorm_in_float64():
    torch.manual_seed(0)
    w, b = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    mean, var = torch.randn(4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.1
    gamma, beta = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    x = torch.randn(10, 3, dtype=torch.float64)
    w2, b2 = fold_batchnorm_into_producer(w, b, mean, var, gamma, beta, 1e-5)
    expected = torch.nn.functional.batch_norm(x @ w.T + b, mean, var, gamma, beta, training=False, eps=1e-5)
    assert torch.allclose(x @ w2.T + b2, expected, atol=1e-12)


def test_train_mode_batchnorm_is_refused():
    model = _trained(nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5)), (8, 6)).train()
    folded, entries = fold_batchnorms(model, (torch.randn(8, 6),))
    assert not entries[0].folded and "train mode" in entries[0].reason
    assert isinstance(folded[1], nn.BatchNorm1d)


def test_batchnorm_without_running_stats_is_refused():
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5, track_running_stats=False)).eval()
    _, entries = fold_batchnorms(model, (torch.randn(8, 6),))
    assert not entries[0].folded and "running statistics" in entries[0].reason


def test_producer_output_used_elsewhere_is_refused():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.conv(x)
            return self.bn(y) + y

    model = _trained(Shared(), (4, 3, 6, 6))
    folded, entries = fold_batchnorms(model, (torch.randn(4, 3, 6, 6),))
    assert not entries[0].folded and "also used elsewhere" in entries[0].reason
    assert isinstance(folded.bn, nn.BatchNorm2d)


def test_batchnorm_not_after_a_producer_is_refused():
    model = _trained(nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.BatchNorm1d(5)), (8, 6))
    _, entries = fold_batchnorms(model, (torch.randn(8, 6),))
    assert not entries[0].folded and "not a Linear/Conv output" in entries[0].reason


def test_transposed_conv_is_refused():
    model = _trained(nn.Sequential(nn.ConvTranspose2d(3, 4, 3), nn.BatchNorm2d(4)), (2, 3, 5, 5))
    _, entries = fold_batchnorms(model, (torch.randn(2, 3, 5, 5),))
    assert not entries[0].folded


def test_a_wrong_batchnorm_fold_raises_the_one_proof_error_with_its_reason(monkeypatch):
    # before: a ValueError, unlike every other failed proof (issue 34: one prove-or-raise)
    from normfold.engine import FoldVerificationError
    from normfold.lab import batchnorm

    real = batchnorm.apply_plan

    def scaled(model, plan):
        real(model, plan)
        with torch.no_grad():
            model[0].weight.mul_(1.1)
        return model

    monkeypatch.setattr(batchnorm, "apply_plan", scaled)
    model = _trained(nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5)), (8, 6))
    with pytest.raises(FoldVerificationError, match="BatchNorm folding changed the outputs: float64 max relative error"):
        fold_batchnorms(model, (torch.randn(8, 6),))
