"""Layer scale (issue 16 item 3): t = γ ⊙ Linear(h) (BEiT, DINOv2, data2vec-vision; γ ⊙ Conv(h) too)
merges into the producer before centering, W ← diag(γ)W, b ← γ⊙b, γ ← 1, so the norms behind it
fold; a γ or a producer output with another reader is refused with that reason."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from normfold.engine import fold
from normfold.engine.math import scale_output_channels
from normfold.engine.pipeline import apply_fold

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the zoo's randomiser, as tests/fuse does
from engine.conftest import _randomize_constant_parameters  # noqa: E402

DIM = 16


def test_scaling_output_channels_equals_scaling_the_output_of_a_linear_and_a_conv():
    torch.manual_seed(0)
    linear, conv = nn.Linear(5, DIM).double(), nn.Conv2d(3, DIM, 3).double()
    gamma = torch.randn(DIM, dtype=torch.float64)
    x, image = torch.randn(4, 5, dtype=torch.float64), torch.randn(2, 3, 6, 6, dtype=torch.float64)
    w, b = scale_output_channels(linear.weight, linear.bias, gamma)
    torch.testing.assert_close(x @ w.T + b, gamma * linear(x), rtol=1e-14, atol=1e-14)
    w, b = scale_output_channels(conv.weight, conv.bias, gamma.reshape(DIM, 1, 1))
    torch.testing.assert_close(nn.functional.conv2d(image, w, b), gamma.reshape(DIM, 1, 1) * conv(image),
                               rtol=1e-14, atol=1e-14)
    assert scale_output_channels(linear.weight, None, gamma)[1] is None
    with pytest.raises(ValueError, match=r"one value per output channel \(16\), got shape \(15,\)"):
        scale_output_channels(linear.weight, linear.bias, gamma[:15])


class LayerScaleBlocks(nn.Module):
    """embedding → 2 pre-norm blocks h + γ ⊙ fc2(gelu(fc1(norm(h)))) → final norm → head."""

    def __init__(self, share_gamma: bool = False, read_branch: bool = False):
        super().__init__()
        self.embed = nn.Embedding(50, DIM)
        self.norms = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(3))
        self.fc1 = nn.ModuleList(nn.Linear(DIM, 2 * DIM) for _ in range(2))
        self.fc2 = nn.ModuleList(nn.Linear(2 * DIM, DIM) for _ in range(2))
        self.gamma = nn.ParameterList(nn.Parameter(torch.randn(DIM)) for _ in range(2))
        self.head = nn.Linear(DIM, 7)
        self.share_gamma, self.read_branch = share_gamma, read_branch

    def forward(self, ids):
        h, extra = self.embed(ids), 0
        for i in range(2):
            branch = self.fc2[i](nn.functional.gelu(self.fc1[i](self.norms[i](h))))
            h = h + self.gamma[i] * branch
            if self.share_gamma:
                extra = extra + self.gamma[i].sum()
            if self.read_branch:
                extra = extra + branch.amax()
        return self.head(self.norms[-1](h)) + extra


IDS = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))


def _exact_error(model: nn.Module, plan, inputs: dict) -> float:
    """The plan applied in float64 against the original in float64, max relative error."""
    as64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    exact = apply_fold(copy.deepcopy(model).double(), plan)
    with torch.no_grad():
        ref, out = copy.deepcopy(model).double()(**as64), exact(**as64)
    ref, out = (t if torch.is_tensor(t) else t[0] for t in (ref, out))
    return float((out - ref).abs().max() / ref.abs().max())


def test_a_layer_scale_merges_into_its_linear_and_the_norms_behind_it_fold():
    torch.manual_seed(0)
    model = LayerScaleBlocks().eval()
    folded, report = fold(model, {"ids": IDS})  # before: 1 of 3 (blocked: aten.mul ... varies along the normalized dim)
    assert [n.foldable for n in report.norms] == [True, True, True]
    assert [(s.scale_fqn, s.weight_fqn, s.bias_fqn) for s in report.plan.layer_scale] == [
        ("gamma.0", "fc2.0.weight", "fc2.0.bias"), ("gamma.1", "fc2.1.weight", "fc2.1.bias")]
    assert all(bool((g == 1).all()) for g in folded.gamma)
    assert _exact_error(model, report.plan, {"ids": torch.randint(0, 50, (3, 9))}) < 1e-12


@pytest.mark.parametrize("variant, reason", [
    ({"share_gamma": True}, "layer scale gamma.0 cannot merge into aten.linear at fc2.0: γ is also read elsewhere"),
    ({"read_branch": True}, "layer scale gamma.0 cannot merge into aten.linear at fc2.0: the producer's output is "
                            "also read elsewhere"),
])
def test_a_layer_scale_with_another_reader_is_refused_with_the_reason(variant, reason):
    torch.manual_seed(0)
    model = LayerScaleBlocks(**variant).eval()
    _, report = fold(model, {"ids": IDS})
    assert not report.plan.layer_scale
    assert not report.norms[1].foldable and reason in report.norms[1].reason, report.norms[1].reason


# ------------------------------------------------------------------ Hugging Face models


def _vision_model(name: str) -> nn.Module:
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                 patch_size=8)
    if name == "dinov2":
        config, cls = t.Dinov2Config(**sizes, layerscale_value=0.1), t.Dinov2Model
    elif name == "beit":
        config, cls = t.BeitConfig(**sizes, num_labels=3, layer_scale_init_value=0.1), t.BeitForImageClassification
    else:
        config, cls = (t.Data2VecVisionConfig(**sizes, num_labels=3, layer_scale_init_value=0.1),
                       t.Data2VecVisionForImageClassification)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    _randomize_constant_parameters(model)  # HF's constant γ (and β, biases) would hide a wrong merge
    return model


@pytest.mark.parametrize("name, folded_norms", [("dinov2", 5), ("beit", 5), ("data2vec-vision", 5)])
def test_tiny_random_layer_scale_transformers_fold_every_norm_exactly(name, folded_norms):
    model = _vision_model(name)
    example = {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    _, report = fold(model, example)  # before: 0 folded (blocked at every layer scale)
    assert sum(n.foldable for n in report.norms) == folded_norms == len(report.norms)
    assert len(report.plan.layer_scale) == 4  # two per layer
    other = {"pixel_values": torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))}
    assert _exact_error(model, report.plan, other) < 1e-12
