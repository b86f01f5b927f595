"""Norm variants are decided by what their traced ops compute, not by their class (issue 16 item 4):
a LayerNorm subclass scaling by (γ + 1) (Nemotron's LayerNorm1P) becomes an RMSNorm with offset 1,
a channels-first LayerNorm (ConvNeXt's: permute → layer_norm → permute) becomes an RMSNorm between
the same permutes (issue 33), a parameter-free module calling ``F.layer_norm`` (OLMo's) is replaced by a weightless
RMSNorm, or kept naming the float32 casts around its norm; a LayerNorm whose output is cast back to its
input's dtype (ESMC's) becomes an RMSNorm, which returns that dtype, and one cast through another dtype is kept.
Each folded model is compared with the original in float64, with and without the fold's own verification."""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from normfold.engine import FoldPlan, fold
from normfold.engine.pipeline import apply_fold
from normfold.nn import PermutedRMSNorm, RMSNorm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the zoo's randomiser, as tests/fuse does
from engine.conftest import _randomize_constant_parameters  # noqa: E402

DIM = 16


class LayerNorm1P(nn.LayerNorm):
    """Nemotron's: LN(x)·(γ + 1) + β (γ stored as the offset from 1)."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """ConvNeXt's channels_first: normalizes dim 1 of (B, C, T) by permuting it last and back."""

    def forward(self, x):
        return super().forward(x.permute(0, 2, 1)).permute(0, 2, 1)


class WeightlessLayerNorm(nn.Module):
    """A parameter-free module calling the functional norm (OLMo's, without its float32 cast)."""

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), None, None, 1e-5)


class Float32LayerNorm(nn.Module):
    """OLMo's OlmoLayerNorm: the norm computed in float32 whatever the input dtype."""

    def forward(self, x):
        return F.layer_norm(x.to(torch.float32), (x.shape[-1],), None, None, 1e-5).to(x.dtype)


class DtypeRestoringLayerNorm(nn.LayerNorm):
    """ESMC's EsmcLayerNorm: torch's LayerNorm with its output cast back to its input's dtype (under
    autocast torch's would hand back float32)."""

    def forward(self, x):
        return super().forward(x).to(x.dtype)


class Float32OutLayerNorm(nn.LayerNorm):
    """Its output cast to float32 whatever the input's dtype: in a float64 model a cast that rounds."""

    def forward(self, x):
        return super().forward(x).to(torch.float32).to(x.dtype)


class PreNormStack(nn.Module):
    """embedding → 2 pre-norm residual MLP blocks → final norm → head, every norm made by ``make_norm``."""

    def __init__(self, make_norm):
        super().__init__()
        self.embed = nn.Embedding(50, DIM)
        self.norms = nn.ModuleList(make_norm() for _ in range(3))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                  for _ in range(2))
        self.head = nn.Linear(DIM, 7)

    def forward(self, ids):
        h = self.embed(ids)
        for norm, mlp in zip(self.norms, self.mlps):
            h = h + mlp(norm(h))
        return self.head(self.norms[-1](h))


def _randomised(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return model.eval()


IDS = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))


def _errors(model: nn.Module, folded: nn.Module, plan: FoldPlan, inputs: dict) -> tuple[float, float]:
    """(the plan applied in float64 against the original in float64, the folded model against the
    original in their own dtype), max relative errors on ``inputs``."""
    exact = apply_fold(copy.deepcopy(model).double(), plan)
    as64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        pairs = [(copy.deepcopy(model).double()(**as64), exact(**as64)), (model(**inputs), folded(**inputs))]
    return tuple(float((_logits(b) - _logits(a)).abs().max() / _logits(a).abs().max()) for a, b in pairs)


def _logits(output):
    return output if torch.is_tensor(output) else output[0]


OTHER_IDS = {"ids": torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(2))}  # not the example


@pytest.mark.parametrize("verify", [True, False])
def test_a_layer_norm_scaling_by_gamma_plus_one_becomes_an_rms_norm_with_offset_one(verify):
    model = _randomised(PreNormStack(lambda: LayerNorm1P(DIM)))
    folded, report = fold(model, {"ids": IDS}, verify=verify)  # before: swapped as γ, 55% off without verify
    assert [n.foldable for n in report.norms] == [True, True, True]
    assert {s.offset for s in report.plan.swap} == {1.0}
    assert all(isinstance(m, RMSNorm) and m.offset == 1.0 for m in folded.norms)
    exact, own = _errors(model, folded, report.plan, OTHER_IDS)
    assert exact < 1e-12 and own < 1e-5


def test_a_channels_first_layer_norm_folds_between_its_permutes():
    class ConvStack(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(4, DIM, 1)
            self.norm = ChannelsFirstLayerNorm(DIM)
            self.out = nn.Conv1d(DIM, 3, 1)

        def forward(self, x):
            return self.out(self.norm(self.conv(x)))

    model = _randomised(ConvStack())
    folded, report = fold(model, {"x": torch.randn(2, 4, 5)})  # before: a raw ValueError (γ of 16 on a last dim of 5)
    entry = report.norms[0]
    assert entry.foldable and [s.permute for s in report.plan.swap] == [(0, 2, 1)]
    assert isinstance(folded.norm, PermutedRMSNorm)


def test_a_parameter_free_module_calling_the_functional_norm_becomes_a_weightless_rms_norm():
    model = _randomised(PreNormStack(WeightlessLayerNorm))
    folded, report = fold(model, {"ids": IDS})  # before: "functional layer_norm: no nn.LayerNorm module to replace"
    assert [n.path for n in report.norms] == ["norms.0", "norms.1", "norms.2"]
    assert all(n.foldable for n in report.norms)
    assert all(isinstance(m, RMSNorm) and m.weight is None for m in folded.norms)
    exact, own = _errors(model, folded, report.plan, OTHER_IDS)
    assert exact < 1e-12 and own < 1e-5

    class Inline(nn.Module):  # not a norm module: the call inside a module that computes more stays functional
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

        def forward(self, x):
            return self.b(F.layer_norm(self.a(x), (DIM,)))

    _, report = fold(_randomised(Inline()), {"x": torch.randn(2, DIM)})
    assert report.norms[0].path == "<root>:layer_norm" and "functional layer_norm" in report.norms[0].reason


def test_a_norm_module_computing_in_float32_folds_naming_the_casts():
    # was kept ("computes aten.to → aten.layer_norm → aten.to"); OLMo's form folds since the issue 32 follow-up
    model = _randomised(PreNormStack(Float32LayerNorm))
    folded, report = fold(model, {"ids": IDS})
    for entry in report.norms:
        assert entry.foldable
        assert "Float32LayerNorm computes a layer norm of its input cast to float32, cast back" in entry.reason, entry.reason
    assert all(isinstance(m, RMSNorm) and m.weight is None for m in folded.norms)
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9  # against its math without the casts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_layer_norm_casting_its_output_back_to_its_input_dtype_folds(dtype):
    # was kept: "DtypeRestoringLayerNorm computes aten.layer_norm → aten.to, not a layer norm of its input
    # alone" (ESMC's EsmcLayerNorm, 9 norms of the zoo's esmc)
    model = _randomised(PreNormStack(lambda: DtypeRestoringLayerNorm(DIM))).to(dtype)
    folded, report = fold(model, {"ids": IDS})
    for entry in report.norms:
        assert entry.foldable, entry.reason
        assert "casts its layer norm's output back to its input's dtype, as normfold's RMSNorm returns it" \
            in entry.reason, entry.reason
    assert all(type(m) is RMSNorm for m in folded.norms)
    assert report.verification.ok
    exact, own = _errors(model, folded, report.plan, OTHER_IDS)
    assert exact < 1e-12 and own < {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 0.1}[dtype]
    h = torch.randn(3, DIM, dtype=dtype)
    for old, new in zip(model.norms, folded.norms):  # the swapped module returns the input's dtype, as the cast did
        assert new(h).dtype == old(h).dtype == dtype


@pytest.mark.parametrize("dtype, why", [
    # float64: the cast to float32 rounds, which normfold's RMSNorm (returning float64) would not do
    (torch.float64, "casting its layer norm's output to float32, not back to its input's float64"),
    # float32: the trace shows both casts as float32 → float32; read as a cast back, the fixed one would
    # round in the float64 proof (FoldVerificationError 1.3e-07 > 1e-09 instead of a kept norm)
    (torch.float32, "casting its layer norm's output more than once: only one cast back to its input's dtype"),
])
def test_a_layer_norm_casting_its_output_through_a_fixed_dtype_is_kept_with_the_reason(dtype, why):
    model = _randomised(PreNormStack(lambda: Float32OutLayerNorm(DIM))).to(dtype)
    folded, report = fold(model, {"ids": IDS})  # no FoldVerificationError: nothing inexact is claimed
    for entry in report.norms:
        assert not entry.foldable
        assert entry.reason.startswith("kept: Float32OutLayerNorm computes aten.layer_norm → aten.to → aten.to, ") \
            and why in entry.reason, entry.reason
    assert all(type(m) is Float32OutLayerNorm for m in folded.norms)
    assert report.verification.ok and not report.plan.center


def test_a_plan_with_an_offset_and_a_layer_scale_survives_the_json_round_trip():
    model = _randomised(PreNormStack(lambda: LayerNorm1P(DIM)))
    _, report = fold(model, {"ids": IDS})
    again = FoldPlan.from_dict(json.loads(report.plan.to_json()))
    assert again == report.plan and again.swap[0].offset == 1.0
    old = report.plan.to_dict()
    for step in old["swap"]:
        del step["offset"]  # a plan written before offsets existed
    del old["layer_scale"]
    assert [s.offset for s in FoldPlan.from_dict(old).swap] == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------ Hugging Face models


def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


@pytest.mark.parametrize("verify", [True, False])
def test_a_tiny_random_nemotron_folds_exactly(verify):
    t = _transformers()
    config = t.NemotronConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = t.NemotronForCausalLM(config).eval()
    _randomize_constant_parameters(model)  # γ = 0 stored (1 + γ = 1) and β = 0 would hide a wrong offset
    example = {"input_ids": torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0)), "use_cache": False}
    folded, report = fold(model, example, verify=verify)  # before: verify=False gave a model 55% off
    assert sum(n.foldable for n in report.norms) == 5 == len(report.norms)
    other = {"input_ids": torch.randint(0, 64, (3, 7), generator=torch.Generator().manual_seed(1)), "use_cache": False}
    exact, own = _errors(model, folded, report.plan, other)
    assert exact < 1e-12 and own < 1e-5


def test_a_tiny_random_olmo_folds_its_norms_naming_their_float32_casts():
    t = _transformers()
    config = t.OlmoConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = t.OlmoModel(config).eval()
    _randomize_constant_parameters(model)
    _, report = fold(model, {"input_ids": torch.randint(0, 64, (2, 5)), "use_cache": False})
    assert [n.path for n in report.norms] == ["layers.0.input_layernorm", "layers.0.post_attention_layernorm",
                                              "layers.1.input_layernorm", "layers.1.post_attention_layernorm", "norm"]
    assert all(n.foldable and "OlmoLayerNorm computes a layer norm of its input cast to float32, cast back" in n.reason
               for n in report.norms)  # was kept: "OlmoLayerNorm computes aten.to → aten.layer_norm → aten.to"


def test_two_layer_norms_sharing_one_gamma_are_each_judged_as_the_module_that_ran_them():
    class SharedGamma(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.fc, self.head = nn.Embedding(50, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 5)
            self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.ln2.weight = self.ln1.weight  # one γ under two names

        def forward(self, ids):
            h = self.embed(ids)
            h = h + self.fc(self.ln1(h))
            return self.head(self.ln2(h))

    model = _randomised(SharedGamma())
    folded, report = fold(model, {"ids": IDS})  # before: both calls filed under ln2, ln1 not reported
    assert [(n.path, n.foldable) for n in report.norms] == [("ln1", True), ("ln2", True)]
    assert isinstance(folded.ln1, RMSNorm) and isinstance(folded.ln2, RMSNorm)
    exact, own = _errors(model, folded, report.plan, OTHER_IDS)
    assert exact < 1e-12 and own < 1e-5
