"""normfold.lab.check: each warning fires on its mistake and stays silent on the correct setup."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from normfold.lab.check import check, post_ln_norms
from normfold.ops.reference import layer_norm_ref


class _Encoder(nn.Module):
    """Two residual blocks; ``pre=False``: LN(h + F(h)) (Post-LN), ``pre=True``: h + F(LN(h)) + final LN."""

    def __init__(self, pre: bool):
        super().__init__()
        self.pre = pre
        self.emb = nn.Embedding(10, 8)
        self.ln0, self.ln1, self.ln2 = nn.LayerNorm(8), nn.LayerNorm(8), nn.LayerNorm(8)
        self.f1, self.f2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)

    def forward(self, ids):
        h = self.emb(ids)  # (B, T, C)
        if self.pre:
            h = h + torch.tanh(self.f1(self.ln1(h)))
            h = h + torch.tanh(self.f2(self.ln2(h)))
            return self.ln0(h)
        h = self.ln0(h)
        h = self.ln1(h + self.drop(torch.tanh(self.f1(h))))
        return self.ln2(h + torch.tanh(self.f2(h)))


def _codes(findings):
    return sorted(f.code for f in findings if f.severity == "warning")


_IDS = (torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(0)),)


def test_post_ln_is_detected_structurally_and_pre_ln_is_not():
    assert post_ln_norms(_Encoder(pre=False), _IDS) == ["ln1", "ln2"]
    assert post_ln_norms(_Encoder(pre=True), _IDS) == []


@pytest.mark.parametrize("config", [{"warmup_steps": 0}, {"warmup_steps": 0, "warmup_ratio": 0.0}])
def test_post_ln_without_warmup_warns(config):
    assert _codes(check(_Encoder(pre=False), _IDS, training_config=config)) == ["post-ln-no-warmup"]


@pytest.mark.parametrize("pre, config", [
    (False, {"warmup_steps": 500}),
    (False, {"warmup_steps": 0, "warmup_ratio": 0.06}),
    (False, {}),                       # warmup unknown: no claim
    (True, {"warmup_steps": 0}),       # Pre-LN trains without warmup
])
def test_no_warmup_warning_when_warmup_is_set_unknown_or_pre_ln(pre, config):
    assert "post-ln-no-warmup" not in _codes(check(_Encoder(pre=pre), _IDS, training_config=config))


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 2))


def test_batchnorm_in_train_mode_at_inference_warns_and_eval_mode_does_not():
    x = (torch.randn(2, 3, 6, 6),)
    model = _cnn()
    assert _codes(check(model.train(), x)) == ["batchnorm-train-mode"]
    assert _codes(check(model.eval(), x)) == []
    assert _codes(check(model.train(), x, inference=False)) == []


@pytest.mark.parametrize("key", ["per_device_train_batch_size", "batch_size", "train_batch_size"])
def test_batchnorm_with_training_batch_size_one_warns(key):
    model = _cnn().eval()
    findings = check(model, (torch.randn(2, 3, 6, 6),), training_config={key: 1, "gradient_accumulation_steps": 8})
    assert _codes(findings) == ["batchnorm-batch-size-1"]
    assert "does not help" in findings[0].message


def test_batch_size_one_without_batchnorm_or_with_large_batch_is_fine():
    assert _codes(check(_Encoder(pre=True), _IDS, training_config={"batch_size": 1})) == []
    assert _codes(check(_cnn().eval(), (torch.randn(2, 3, 6, 6),), training_config={"batch_size": 32})) == []


def test_bias_before_batchnorm_is_redundant():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)).eval()
    findings = check(model, (torch.randn(2, 3, 6, 6),))
    assert [(f.code, f.severity, f.path) for f in findings] == [("bias-before-norm", "warning", "0")]


def test_bias_before_layernorm_is_only_partly_redundant_and_before_rmsnorm_not_at_all():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.RMSNorm(8)).eval()
    findings = check(model, (torch.randn(2, 4),))
    assert [(f.code, f.severity, f.path) for f in findings] == [("bias-before-norm", "info", "0")]
    # the claim behind the message: LN removes the bias's mean only
    torch.manual_seed(0)
    x, b = torch.randn(5, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    assert torch.allclose(layer_norm_ref(x + b.mean()), layer_norm_ref(x), atol=1e-12)
    assert not torch.allclose(layer_norm_ref(x + b), layer_norm_ref(x), atol=1e-3)


def test_no_bias_no_finding():
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)).eval()
    assert check(model, (torch.randn(2, 4),)) == []  # the second LN reads a GELU, not the biased Linear


def test_structure_checks_say_when_skipped():
    findings = check(_Encoder(pre=False), training_config={"warmup_steps": 0})
    assert [f.code for f in findings] == ["structure-skipped"]


def test_refuses_bad_arguments():
    with pytest.raises(TypeError, match="nn.Module"):
        check("model")
    with pytest.raises(TypeError, match="mapping"):
        check(_cnn(), training_config=[("batch_size", 1)])
