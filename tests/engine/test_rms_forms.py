"""RMSNorms written out as elementwise ops (issue 32 item 1) are recognised from what their traced ops
compute, whatever their class: LlamaRMSNorm and its copies (Mistral, Qwen2, Phi-3: a float32 cast
around the statistics, γ after the cast back), Gemma's (1 + w) and OLMo2's (γ before the cast back)
become normfold RMSNorms saying which form they were; the fold is then proved against the original's
math without its casts in float64 (here on fresh inputs of another shape against that math written
by the test) and against the original itself in the model's dtype. A look-alike computing anything
else is kept, with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from normfold.engine import fold
from normfold.engine.pipeline import apply_fold
from normfold.nn import RMSNorm
from tiny_models import lm_call, lm_logits, olmo_layer_norm_math, rms_norm_math, tiny_olmo, tiny_rms_lm

FORMS = {"llama": "times γ after the cast back", "mistral": "times γ after the cast back",
         "qwen2": "times γ after the cast back", "phi3": "times γ after the cast back",
         "gemma": "times (1 + γ) in float32", "olmo2": "times γ in float32"}


@pytest.mark.parametrize("family", sorted(FORMS))
def test_rmsnorm_classes_become_normfold_rmsnorms_saying_their_form(family):
    model = tiny_rms_lm(family)
    classes = {path: type(m).__name__ for path, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    folded, report = fold(model, lm_call(2, 7, 0))
    entries = {e.path: e for e in report.norms}
    for path, name in classes.items():
        new = folded.get_submodule(path)
        assert isinstance(new, RMSNorm), (path, type(new))
        assert f"{name} recognised as an RMSNorm from its traced ops" in entries[path].reason
        assert FORMS[family] in entries[path].reason
        assert new.offset == (1.0 if family == "gemma" else 0.0)
    assert report.verification.ok and report.verification.model_dtype_check is not None
    # fresh inputs of another shape: the plan applied in float64 against the RMSNorm math without casts
    call = lm_call(3, 5, 1)
    expected = lm_logits(rms_norm_math(model), call)
    got = lm_logits(apply_fold(copy.deepcopy(model).double(), report.plan), call)
    assert (got - expected).abs().max().item() <= 1e-12 * expected.abs().max().item()
    # the original as it is (float32 casts inside), in float32: within rounding, not exact
    assert torch.allclose(lm_logits(folded.float(), call).double(), lm_logits(model, call).double(), atol=1e-5)


class _Base(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.eps = 1e-6


class MeanNotSquaredRMSNorm(_Base):
    def forward(self, x):
        return x * torch.rsqrt(x.mean(-1, keepdim=True).abs() + self.eps) * self.weight


class EpsOutsideRMSNorm(_Base):
    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.weight


class ShiftedRMSNorm(_Base):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + 0.5


class BufferedRMSNorm(_Base):
    """Computes an RMSNorm but holds a buffer besides γ, which a swap to normfold's RMSNorm would drop."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale_history", torch.ones(3))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Model(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16), norm, nn.Linear(16, 4)

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


@pytest.mark.parametrize("norm, why", [
    (MeanNotSquaredRMSNorm(), "takes the mean of aten.linear, not of a square"),
    (EpsOutsideRMSNorm(), "adds eps outside the square root"),
    (ShiftedRMSNorm(), "computes aten.add on x·rsqrt(mean(x², -1) + eps)"),
    (BufferedRMSNorm(), "holds scale_history besides γ, which normfold's RMSNorm would drop"),
])
def test_look_alikes_that_compute_something_else_are_kept_with_the_reason(norm, why):
    model = _Model(norm).eval()
    folded, report = fold(model, (torch.randn(2, 8),))
    assert type(folded.norm) is type(norm)
    (entry,) = [e for e in report.norms if e.path == "norm"]
    assert entry.reason.startswith(f"kept: {type(norm).__name__} ") and why in entry.reason, entry.reason
    assert not entry.foldable


def test_a_written_out_rmsnorm_outside_transformers_is_recognised_and_folds_its_gamma():
    class PlainRMSNorm(_Base):
        def forward(self, x):
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    model = _Model(PlainRMSNorm()).eval()
    x = torch.randn(2, 8)
    folded, report = fold(model, (x,))
    assert isinstance(folded.norm, RMSNorm) and folded.norm.weight is None  # γ moved into `down`
    assert "x·rsqrt(mean(x², -1) + 1e-06), times γ" in report.norms[0].reason
    fresh = torch.randn(5, 8, dtype=torch.float64)
    folded64 = apply_fold(copy.deepcopy(model).double(), report.plan)
    assert torch.allclose(folded64(fresh), copy.deepcopy(model).double()(fresh), rtol=0, atol=1e-13)


# --------------------------------------------------------------------------- OLMo's float32-cast LayerNorm

def test_olmo_float32_cast_layer_norms_fold_into_rmsnorms_exact_without_the_casts():
    model = tiny_olmo()
    paths = [path for path, m in model.named_modules() if type(m).__name__ == "OlmoLayerNorm"]
    assert len(paths) == 2 * 2 + 1
    folded, report = fold(model, lm_call(2, 7, 0))
    entries = {e.path: e for e in report.norms}
    for path in paths:
        assert isinstance(folded.get_submodule(path), RMSNorm) and entries[path].foldable, entries[path].reason
        assert "OlmoLayerNorm computes a layer norm of its input cast to float32, cast back" in entries[path].reason
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    assert report.verification.model_dtype_check is not None
    # fresh inputs of another shape: the plan applied in float64 against the LayerNorm math without casts
    call = lm_call(3, 5, 1)
    expected = lm_logits(olmo_layer_norm_math(model), call)
    got = lm_logits(apply_fold(copy.deepcopy(model).double(), report.plan), call)
    assert (got - expected).abs().max().item() <= 1e-12 * expected.abs().max().item()
    # the original as it is, in float32: within rounding
    assert torch.allclose(lm_logits(folded, call), lm_logits(model, call), atol=1e-5)


def test_olmo_in_bfloat16_folds_and_passes_the_model_dtype_check_against_the_original():
    model = tiny_olmo().to(torch.bfloat16)
    folded, report = fold(model, lm_call(2, 7, 0))
    assert all(isinstance(folded.get_submodule(e.path), RMSNorm) for e in report.norms)
    assert report.verification.ok and report.verification.model_dtype_check is not None
    assert next(folded.parameters()).dtype == torch.bfloat16


class _CastBackToHalf(nn.Module):
    """A layer norm of x in float32 whose output is cast to float16, not back to x's dtype."""

    def forward(self, x):
        return nn.functional.layer_norm(x.to(torch.float32), (16,), None, None, 1e-5).to(torch.float16)


class _CastLayerNormWithAffine(nn.LayerNorm):
    """γ/β inside the casts: not the parameter-free form read as a cast LayerNorm."""

    def forward(self, x):
        return nn.functional.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps).to(x.dtype)


class _HalfOut(_Model):
    def forward(self, x):
        return self.down(self.norm(self.up(x)).float())


@pytest.mark.parametrize("model, why", [
    (_HalfOut(_CastBackToHalf()), "computes aten.to → aten.layer_norm → aten.to, not a layer norm of its input alone"),
    (_Model(_CastLayerNormWithAffine(16)), "with γ/β inside the casts: only a parameter-free layer norm between casts"),
])
def test_cast_layer_norms_that_are_not_olmos_form_are_kept_with_the_reason(model, why):
    model = model.eval()
    folded, report = fold(model, (torch.randn(2, 8),))
    assert type(folded.norm) is type(model.norm)
    (entry,) = [e for e in report.norms if e.path == "norm"]
    assert entry.reason.startswith(f"kept: {type(model.norm).__name__} ") and why in entry.reason, entry.reason


class _PlainRMSNorm(_Base):
    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _SelectedRows(nn.Module):
    """An RMSNorm over the rows a mask selects: their number is data-dependent (an unbacked size in the
    trace, as in Idefics2's image rows), the width is fixed."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm = nn.Linear(8, 16), _PlainRMSNorm()

    def forward(self, x):
        h = self.up(x)
        return self.norm(h[h[:, 0] > 0])


def test_a_norm_over_a_data_dependent_number_of_rows_is_recognised_by_its_fixed_width():
    """Fails on main 16464e7: reading the norm's shape asked for the unbacked row count and planning
    ended in "GuardOnDataDependentSymNode" (Idefics2 and VITS in the zoo)."""
    torch.manual_seed(0)
    model = _SelectedRows().eval()
    x = torch.randn(6, 8)
    folded, report = fold(model, (x,))
    assert isinstance(folded.norm, RMSNorm) and report.verification.ok
    assert "recognised as an RMSNorm" in next(e.reason for e in report.norms if e.path == "norm")
