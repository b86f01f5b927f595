"""Casts that round in the float64 proof: a cast to a float dtype narrower than the model's (``.float()``
inside a float64 model, as lfm2_vl's Siglip2 position resize does) is judged by the analysis, which
refuses a norm whose zero-mean input passes through one, with that reason, instead of a fold the
float64 proof then rejects (FoldVerificationError, 1e-7 > 1e-9)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import normfold


class CastResize(nn.Module):
    """A Linear, then ``weights @ h.float()`` (the resize of a position table in float32), back to the
    input's dtype and into a LayerNorm. ``cast``: the dtype the product runs in (None: the input's)."""

    def __init__(self, cast: torch.dtype | None = torch.float32, c: int = 16):
        super().__init__()
        self.cast = cast
        self.proj = nn.Linear(c, c)
        self.register_buffer("weights", torch.rand(6, 4))
        self.norm = nn.LayerNorm(c)

    def forward(self, x):
        cast = x.dtype if self.cast is None else self.cast
        h = self.weights.to(cast) @ self.proj(x).to(cast)
        return self.norm(h.to(x.dtype))


class CastBeside(nn.Module):
    """One Linear read by a LayerNorm directly and, through a cast to float32, by a second LayerNorm:
    centering it for the first would shift the second's input through the rounding cast."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.proj = nn.Linear(c, c)
        self.a, self.b = nn.LayerNorm(c), nn.LayerNorm(c)

    def forward(self, x):
        h = self.proj(x)
        return self.a(h), self.b(h.float().to(x.dtype))


def _inputs(dtype=torch.float64):
    return (torch.randn(4, 16, dtype=dtype),)


def test_a_norm_behind_a_cast_that_rounds_is_refused_by_the_analysis_with_that_reason():
    torch.manual_seed(0)
    model = CastResize().double()
    folded, report = normfold.fold(model, _inputs())  # no FoldVerificationError: nothing inexact is claimed
    (entry,) = report.norms
    assert not entry.foldable
    assert "aten.to rounds float64 to float32, narrower than the model's float64" in entry.reason, entry.reason
    assert report.verification.ok and not report.plan.center


def test_a_norm_behind_a_cast_that_does_not_round_still_folds():
    torch.manual_seed(0)
    model = CastResize(cast=torch.float64).double()
    folded, report = normfold.fold(model, _inputs())
    assert report.norms[0].foldable and report.verification.max_rel_error < 1e-12


def test_a_float32_model_whose_cast_is_to_its_inputs_dtype_folds():
    torch.manual_seed(0)
    model = CastResize(cast=None)  # .to(x.dtype): float32 in the trace, float64 in the proof's copy
    folded, report = normfold.fold(model, _inputs(torch.float32))
    assert report.norms[0].foldable and report.verification.ok


def test_a_centering_shift_through_a_rounding_cast_is_not_taken_as_absorbed():
    torch.manual_seed(0)
    model = CastBeside().double()
    folded, report = normfold.fold(model, _inputs())
    by_path = {e.path: e for e in report.norms}
    assert not by_path["b"].foldable and "rounds float64 to float32" in by_path["b"].reason
    assert not by_path["a"].foldable and "its centering shift reaches aten.to" in by_path["a"].reason, by_path["a"].reason
    assert "rounds float64 to float32" in by_path["a"].reason
    assert report.verification.ok


@pytest.mark.parametrize("narrow", [torch.float16, torch.bfloat16])
def test_a_cast_narrower_than_a_float32_model_rounds_too(narrow):
    torch.manual_seed(0)
    report = normfold.analyze(CastResize(cast=narrow), _inputs(torch.float32))
    assert f"rounds float32 to {str(narrow).removeprefix('torch.')}" in report.norms[0].reason, report.norms[0].reason


def test_siglip2s_position_resize_in_float32_inside_a_float64_model_is_judged_by_the_analysis():
    transformers = pytest.importorskip("transformers")
    config = transformers.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_channels=3, patch_size=4, num_patches=16)
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(config).double().eval()
    inputs = {"pixel_values": torch.randn(2, 12, 3 * 4 * 4, dtype=torch.float64),
              "pixel_attention_mask": torch.ones(2, 12, dtype=torch.long), "spatial_shapes": torch.tensor([[3, 4], [3, 4]])}
    report = normfold.analyze(model, inputs)
    residual = [e for e in report.norms if e.path.startswith("encoder.") or e.path == "post_layernorm"]
    assert len(residual) == 5 and not any(e.foldable for e in residual)
    assert all("rounds float64 to float32" in e.reason and "at embeddings" in e.reason for e in residual), residual


def test_a_float32_model_whose_fixed_cast_hides_in_its_own_trace_is_replanned_in_float64():
    """Fails on main 3abda10 (FoldVerificationError, 7.5e-08 > 1e-9): in a float32 model ``.float()`` is a
    no-op of the trace, so the analysis folds b; the float64 proof fails, and the plan read from a float64
    copy's trace, where the cast rounds, keeps b with that reason while a still folds."""
    torch.manual_seed(0)
    model = CastBeside()
    folded, report = normfold.fold(model, _inputs(torch.float32))
    by_path = {e.path: e for e in report.norms}
    assert not by_path["b"].foldable and "rounds float64 to float32" in by_path["b"].reason
    assert "seen in a float64 trace" in by_path["b"].reason, by_path["b"].reason
    assert report.verification.ok and report.verification.max_rel_error < 1e-12
    assert report.traced_calls == [{"x": "tensor (4, 16) float32"}]  # the user's call, not the float64 copy's


def test_siglip2_in_float32_folds_what_its_float64_trace_allows_instead_of_failing_the_proof():
    """Fails on main 3abda10 (FoldVerificationError 1.1e-07 > 1e-9, the zoo's siglip2 rows): the position
    resize's ``.float()`` is invisible in the float32 trace."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Siglip2VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_channels=3, patch_size=4, num_patches=16)
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(config).eval()
    inputs = {"pixel_values": torch.randn(2, 12, 3 * 4 * 4),
              "pixel_attention_mask": torch.ones(2, 12, dtype=torch.long), "spatial_shapes": torch.tensor([[3, 4], [3, 4]])}
    folded, report = normfold.fold(model, inputs)
    residual = [e for e in report.norms if e.path.startswith("encoder.") or e.path == "post_layernorm"]
    assert len(residual) == 5 and not any(e.foldable for e in residual)
    assert report.verification.ok
