"""fold()'s pipeline around the exact LayerNorm fold: BatchNorm merging first, approximate folding last."""
import copy
from dataclasses import replace

import pytest
import torch
from torch import nn

import normfold
from normfold.engine import FoldReport

from tiny_models import tiny_gpt2


class LinearBatchNormLayerNorm(nn.Module):
    """Linear → BatchNorm1d → LayerNorm → Linear: the LN folds only once the BN is merged into fc."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, 6)
        return self.head(self.ln(self.bn(self.fc(x))))


def _bn_model(train_stats=True):
    torch.manual_seed(0)
    model = LinearBatchNormLayerNorm()
    with torch.no_grad():  # non-trivial running statistics and affine, as after training
        model.bn.running_mean.normal_()
        model.bn.running_var.uniform_(0.5, 2.0)
        model.bn.weight.normal_()
        model.bn.bias.normal_()
        model.ln.weight.normal_()
        model.ln.bias.normal_()
    return model.eval()


def test_batchnorm_merges_into_its_linear_and_then_the_layernorm_folds():
    model = _bn_model()
    before = copy.deepcopy(model.state_dict())
    folded, report = normfold.fold(model, (torch.randn(4, 6),))
    assert [(e.path, e.folded, e.producer) for e in report.batchnorms] == [("bn", True, "fc")]
    assert report.num_batchnorms_folded == 1 and report.num_foldable == 1
    assert isinstance(folded.bn, nn.Identity) and isinstance(folded.ln, normfold.RMSNorm)
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # original untouched
    x = torch.randn(5, 6)
    torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)
    assert report.to_dict()["batchnorms"][0]["folded"] is True


def test_without_batchnorm_folding_the_batchnorm_blocks_the_layernorm():
    folded, report = normfold.fold(_bn_model(), (torch.randn(4, 6),), fold_batchnorm=False)
    assert report.batchnorms == [] and report.num_foldable == 0
    assert isinstance(folded.bn, nn.BatchNorm1d) and isinstance(folded.ln, nn.LayerNorm)
    assert "batch_norm" in report.norms[0].reason


def test_a_batchnorm_in_train_mode_is_kept_and_reported():
    model = _bn_model().train()
    _, report = normfold.fold(model, (torch.randn(4, 6),), verify=False)
    (entry,) = report.batchnorms
    assert not entry.folded and "train mode" in entry.reason
    assert "BatchNorm bn: kept" in str(report)


def test_analyze_reports_batchnorms_without_touching_the_model():
    model = _bn_model()
    before = copy.deepcopy(model.state_dict())
    report = normfold.analyze(model, (torch.randn(4, 6),))
    assert isinstance(report, FoldReport) and report.num_batchnorms_folded == 1 and report.num_foldable == 1
    assert isinstance(model.bn, nn.BatchNorm1d)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class PostLN(nn.Module):
    """ln0 folds exactly (its input is a private Linear's output); ln1 reads ln0's output (Post-LN)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.ln0 = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)
        self.ln1 = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):  # (B, T, 8)
        h = self.ln0(self.inp(x))
        h = self.ln1(h + self.fc(torch.relu(h)))
        return self.head(h)


def test_approximate_fold_replaces_the_post_ln_norm_under_the_cosine_bar():
    torch.manual_seed(0)
    model = PostLN().eval()
    calibration = [(torch.randn(4, 5, 8),) for _ in range(4)]
    folded, report = normfold.fold(model, (torch.randn(2, 5, 8),), approximate=True, calibration=calibration,
                                   min_cosine=0.99)
    statuses = {e.path: e.status for e in report.approximate.entries}
    assert statuses["ln0"] == "exact" and statuses["ln1"] in {"approximate", "kept"}
    assert report.num_approximate == (statuses["ln1"] == "approximate")
    left = [n for n, m in folded.named_modules() if isinstance(m, nn.LayerNorm)]
    assert len(left) == report.approximate.num_kept
    assert report.approximate.calibration.min_cosine >= 0.99
    assert report.to_dict()["num_approximate"] == report.num_approximate


def test_exact_fold_reports_no_approximate_norms():
    _, report = normfold.fold(PostLN().eval(), (torch.randn(2, 5, 8),))
    assert report.num_approximate == 0 and report.approximate is None


@pytest.mark.parametrize("kwargs, message", [
    ({"approximate": True}, "calibration"),
    ({"approximate": True, "calibration": [(torch.randn(2, 5, 8),)], "min_cosine": 1.5}, "min_cosine"),
    ({"approximate": True, "calibration": [(torch.randn(2, 5, 8),)], "min_cosine": 0}, "min_cosine"),
])
def test_approximate_options_are_checked_before_any_work(kwargs, message, monkeypatch):
    from normfold.engine import graph

    monkeypatch.setattr(graph, "capture", lambda *a, **k: pytest.fail("captured before checking options"))
    with pytest.raises(ValueError, match=message):
        normfold.fold(PostLN().eval(), (torch.randn(2, 5, 8),), **kwargs)


class PreLN(nn.Module):
    """Two Pre-LN norms; the residual add ``h = h + y`` feeds ln2 directly."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.fc = nn.Linear(16, 16)
        self.ln1 = nn.LayerNorm(16)
        self.ln2 = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):  # (B, T, 8)
        h = self.emb(x)
        y = self.fc(self.ln1(h))
        h = h + y
        return self.head(self.ln2(h))


def test_fuse_runs_the_residual_add_with_the_norm_it_feeds():
    torch.manual_seed(0)
    model = PreLN().eval()
    folded, report = normfold.fold(model, (torch.randn(2, 5, 8),), fuse=True)
    assert report.num_foldable == 2
    assert [p.norm for p in report.fuse.fused] == ["ln2"] and "ln1" in report.fuse.skipped
    assert report.fuse.verification.ok
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)
    assert report.to_dict()["fuse"]["fused"][0]["norm"] == "ln2"


def test_fuse_is_off_by_default():
    _, report = normfold.fold(PreLN().eval(), (torch.randn(2, 5, 8),))
    assert report.fuse is None


class OptionalBatchNorm(LinearBatchNormLayerNorm):
    """The BatchNorm runs only when ``use_bn``: merging it into fc would be wrong for the other call."""

    def forward(self, x, use_bn: bool = True):  # (B, 6)
        h = self.fc(x)
        return self.head(self.ln(self.bn(h) if use_bn else h))


def test_a_batchnorm_one_example_call_does_not_run_is_kept_naming_that_call():
    model = OptionalBatchNorm()
    model.load_state_dict(_bn_model().state_dict())
    x = torch.randn(4, 6)
    folded, report = normfold.fold(model.eval(), [(x,), (x, False)])
    (entry,) = report.batchnorms
    assert not entry.folded and entry.reason == "not foldable in example call 1: that call does not run it"
    assert isinstance(folded.bn, nn.BatchNorm1d) and report.verification.ok
    for args in ((x,), (x, False)):
        torch.testing.assert_close(folded(*args), model(*args), rtol=1e-5, atol=1e-5)


def _tiny_gpt2():
    return tiny_gpt2(n_head=4, vocab_size=99, n_positions=64).eval()


def test_the_folder_path_proves_on_a_short_example_that_still_mixes_tokens():
    """The example inputs the folder fold proves on are short (each token costs float64 forwards) but
    keep >= 2 positions, so attention mixes tokens, and >= 1 row."""
    from normfold.hf.inputs import example_inputs_for

    ids = example_inputs_for(_tiny_gpt2())["input_ids"]
    assert ids.shape[0] >= 1 and 2 <= ids.shape[1] <= 4


def test_a_corrupted_fold_of_gpt2_fails_its_proof_on_the_short_example(monkeypatch):
    """The cheap proof is still a proof: one centering step left out of the transform (of the returned
    fold and of the float64 one alike) is caught on the folder path's short example inputs."""
    from normfold.engine import FoldVerificationError, transform
    from normfold.hf.inputs import example_inputs_for

    model = _tiny_gpt2()
    inputs = example_inputs_for(model)
    _, report = normfold.fold(model, inputs)
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    real = transform.apply_plan

    def one_centering_left_out(m, plan):
        return real(m, replace(plan, center=[s for s in plan.center if s.fqn != "transformer.h.0.attn.c_proj.weight"]))

    monkeypatch.setattr(transform, "apply_plan", one_centering_left_out)
    with pytest.raises(FoldVerificationError, match="relative error"):
        normfold.fold(model, inputs)


class ReadsItsNormsWeight(nn.Module):
    """Linear → LayerNorm → Linear whose forward casts its input to the norm's weight dtype (FunASR's
    encoder reads ``layers[0].input_layernorm.weight.dtype``): a norm left weightless breaks the forward."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):  # (B, T, 8)
        x = x.to(self.norm.weight.dtype)
        return self.head(self.norm(self.proj(x)))


def test_a_model_whose_code_reads_a_norms_weight_folds_with_its_affine_kept_and_says_why():
    torch.manual_seed(0)
    model = ReadsItsNormsWeight().eval()
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    x = torch.randn(2, 5, 8)
    folded, report = normfold.fold(model, (x,))
    (entry,) = report.norms
    assert entry.foldable and not entry.affine_folded
    assert entry.affine_kept.startswith("the fold with γ/β moved out did not run") and "'NoneType'" in entry.affine_kept
    assert folded.norm.weight is not None and report.verification.max_rel_error <= 1e-9
    with torch.no_grad():
        torch.testing.assert_close(folded(x), model(x), rtol=1e-5, atol=1e-5)
