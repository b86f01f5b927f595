"""normfold.convert: validated step configs, and the exact fold composed with fusion and the approximate fold."""
import dataclasses
import inspect
import sys

import pytest
import torch
from torch import nn

import normfold
from normfold import ApproximateConfig, FoldConfig, FuseConfig, convert


class PreLN(nn.Module):
    """emb → ln1 → fc with a residual add → ln2 → head: both norms fold, the add ``h = h + ...`` feeds ln2."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.ln1, self.ln2 = nn.LayerNorm(16), nn.LayerNorm(16)

    def forward(self, x):  # (B, T, 8)
        h = self.emb(x)
        h = h + self.fc(self.ln1(h))
        return self.head(self.ln2(h))


class PostLN(PreLN):
    """ln1 folds; ln2 reads ln1's output plus a residual branch (not zero-mean): only the approximate
    fold replaces it."""

    def forward(self, x):
        h = self.ln1(self.emb(x))
        return self.head(self.ln2(h + self.fc(torch.relu(h))))


def _model(post_ln: bool):
    torch.manual_seed(0)
    return (PostLN() if post_ln else PreLN()).eval()


def _calibration():
    torch.manual_seed(1)
    return [(torch.randn(4, 5, 8),) for _ in range(3)]


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ------------------------------------------------------------------------------------ the configs

def test_default_configs_are_valid_and_frozen():
    config = FoldConfig()
    assert (config.fold_affine, config.precompute, config.fold_batchnorm, config.verify) == (True, True, True, True)
    assert FuseConfig().norm_paths is None and ApproximateConfig([(torch.randn(2, 8),)]).min_cosine == 0.999
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.verify = False


@pytest.mark.parametrize("field", ["fold_affine", "precompute", "fold_batchnorm", "verify"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_fold_config_refuses_a_flag_that_is_not_a_bool(field, value):
    with pytest.raises(TypeError, match=rf"FoldConfig\.{field} must be a bool, got {type(value).__name__}"):
        FoldConfig(**{field: value})


def test_fuse_config_keeps_norm_paths_as_a_tuple():
    assert FuseConfig(norm_paths=["a.ln", "b.ln"]).norm_paths == ("a.ln", "b.ln")


@pytest.mark.parametrize("norm_paths, error, match", [
    ("ln2", TypeError, "sequence of module paths"),      # one string is not a list of paths
    (["ln2", 3], TypeError, r"got \[3\]"),
    ([], ValueError, "at least one norm"),
    (7, TypeError, "got int 7"),
])
def test_fuse_config_refuses_bad_norm_paths(norm_paths, error, match):
    with pytest.raises(error, match=match):
        FuseConfig(norm_paths=norm_paths)


@pytest.mark.parametrize("field", ["layer_norms", "verify"])
def test_fuse_config_refuses_a_flag_that_is_not_a_bool(field):
    with pytest.raises(TypeError, match=rf"FuseConfig\.{field} must be a bool, got int"):
        FuseConfig(**{field: 0})


@pytest.mark.parametrize("min_cosine", [0.0, -0.5, 1.5, True, "0.99", None])
def test_approximate_config_refuses_min_cosine_outside_zero_one(min_cosine):
    with pytest.raises(ValueError, match=r"min_cosine must be a number in \(0, 1\], got"):
        ApproximateConfig(_calibration(), min_cosine=min_cosine)


@pytest.mark.parametrize("calibration, error, match", [
    (None, ValueError, "calibration must be a batch or a list of batches"),
    ([], ValueError, "at least one batch"),
    (3, TypeError, "got int"),
    ([1, 2], TypeError, "must hold tensors, tuples or dicts"),
])
def test_approximate_config_refuses_bad_calibration(calibration, error, match):
    with pytest.raises(error, match=match):
        ApproximateConfig(calibration)


def test_approximate_config_refuses_an_output_fn_that_is_not_callable():
    with pytest.raises(TypeError, match="output_fn must be None or a callable"):
        ApproximateConfig(_calibration(), output_fn="mean")
    assert ApproximateConfig(_calibration(), min_cosine=1, output_fn=normfold.lab.mean_pooled).min_cosine == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"fold": None}, r"fold= must be FoldConfig\(\.\.\.\), got NoneType"),
    ({"fuse": True}, r"fuse= must be None or FuseConfig\(\.\.\.\), got bool"),
    ({"approximate": {"calibration": []}}, r"approximate= must be None or ApproximateConfig\(\.\.\.\), got dict"),
])
def test_convert_refuses_a_step_that_is_not_its_config(kwargs, match):
    with pytest.raises(TypeError, match=match):
        convert(_model(post_ln=False), (torch.randn(2, 5, 8),), **kwargs)


# ---------------------------------------------------------------------------- the composition

def test_convert_alone_is_the_exact_fold():
    model, x = _model(post_ln=False), (torch.randn(2, 5, 8),)
    folded, report = convert(model, x)
    expected, expected_report = sys.modules["normfold.engine"].fold(model, x)
    assert _same_weights(folded, expected) and report.to_dict() == expected_report.to_dict()
    assert report.fuse is None and report.approximate is None and report.verification.ok


def test_convert_with_fuse_equals_the_fuse_keyword():
    model, x = _model(post_ln=False), (torch.randn(2, 5, 8),)
    fused, report = convert(model, x, fuse=FuseConfig())
    by_keyword, keyword_report = normfold.fold(model, x, fuse=True)
    assert [p.norm for p in report.fuse.fused] == ["ln2"] and report.fuse.verification.ok
    assert report.to_dict() == keyword_report.to_dict()
    probe = torch.randn(3, 5, 8)
    assert torch.equal(fused(probe), by_keyword(probe))


def test_fuse_config_norm_paths_limit_what_is_fused():
    _, report = convert(_model(post_ln=False), (torch.randn(2, 5, 8),), fuse=FuseConfig(norm_paths=["ln1"]))
    assert report.fuse.fused == [] and "ln1" in report.fuse.skipped and "ln2" not in report.fuse.skipped


def test_convert_with_approximate_equals_the_approximate_keyword():
    model, x = _model(post_ln=True), (torch.randn(2, 5, 8),)
    torch.manual_seed(2)
    approx, report = convert(model, x, approximate=ApproximateConfig(_calibration(), min_cosine=0.99))
    torch.manual_seed(2)
    by_keyword, keyword_report = normfold.fold(model, x, approximate=True, calibration=_calibration(),
                                               min_cosine=0.99)
    assert {e.path: e.status for e in report.approximate.entries}["ln1"] == "exact"
    assert report.to_dict() == keyword_report.to_dict()
    assert _same_weights(approx, by_keyword)


def test_convert_leaves_the_model_untouched():
    model = _model(post_ln=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert(model, (torch.randn(2, 5, 8),), fuse=FuseConfig(), approximate=ApproximateConfig(_calibration(), 0.9))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_fold_keywords_are_checked_like_the_configs():
    x = (torch.randn(2, 5, 8),)
    with pytest.raises(ValueError, match="approximate=True needs calibration"):
        normfold.fold(_model(post_ln=True), x, approximate=True)
    with pytest.raises(ValueError, match="min_cosine must be a number in"):
        normfold.fold(_model(post_ln=True), x, approximate=True, calibration=_calibration(), min_cosine=2)
    with pytest.raises(TypeError, match="fold.fuse must be a bool, got str"):
        normfold.fold(_model(post_ln=False), x, fuse="yes")


def test_the_engine_fold_is_exact_only():
    """normfold.fold (the function) composes; the engine's fold takes only the exact fold's options."""
    engine_fold = sys.modules["normfold.engine"].fold
    assert set(inspect.signature(engine_fold).parameters) == {
        "model", "example_inputs", "fold_affine", "precompute", "fold_batchnorm", "verify", "keep"}
    assert normfold.fold is not engine_fold and normfold.fold.__module__ == "normfold.convert"
