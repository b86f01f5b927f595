"""Rotating the RMSNorm families (issue 32 item 2): their RMSNorm classes recognised by the fold, γ moved
into the readers (a tied head untied for it, and said), the residual stream rotated (embeddings,
attention and MLP input and output projections, Phi-3's fused qkv_proj / gate_up_proj, the head),
exact in float64 on fresh inputs of another shape against the norms' math written by the test; Q
orthogonal and not the identity; Gemma's (1 + w) moves into the readers as (1 + w). An (offset + γ)
that stays in its norm, and OLMo2's norms, are refused with the reason. OLMo's float32-cast LayerNorms
fold into weightless RMSNorms, so OLMo rotates too."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import normfold
from normfold import FoldError
from normfold.rotate.apply import apply_rotation
from normfold.engine.pipeline import apply_fold
from normfold.nn import RMSNorm
from tiny_models import lm_call, lm_logits, olmo_layer_norm_math, rms_norm_math, tiny_olmo, tiny_rms_lm

FAMILIES = [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("mistral", {}), ("qwen2", {}), ("phi3", {}),
            ("gemma", {})]  # Gemma: (1 + w) norms, a tied head


@pytest.mark.parametrize("family, overrides", FAMILIES, ids=["llama", "llama-tied", "mistral", "qwen2", "phi3", "gemma"])
def test_rms_family_rotates_exactly_in_float64_on_inputs_of_another_shape(family, overrides):
    model = tiny_rms_lm(family, **overrides)
    rotated, report = normfold.rotate(model, lm_call(2, 7, 0))
    assert report.verification.ok and report.exact and len(report.streams) == 1
    (stream,) = report.streams
    q = stream.basis
    assert (q.T @ q - torch.eye(32, dtype=torch.float64)).abs().max() <= 1e-12
    assert stream.identity_distance > 0.1
    assert len(stream.stream.norms) == 2 * 2 + 1 and all(getattr(rotated.get_submodule(p), "weight", None) is None
                                                          for p in stream.stream.norms)
    roles = {t.fqn: t.role for t in stream.stream.tensors}
    readers = ("qkv_proj", "gate_up_proj") if family == "phi3" else ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    for name in (*readers, "lm_head"):
        assert any(name in fqn and role == "reader" for fqn, role in roles.items()), name
    for name in ("embed_tokens", "o_proj", "down_proj"):
        assert any(name in fqn and role == "writer" for fqn, role in roles.items()), name
    if model.config.tie_word_embeddings:  # untied only because γ of model.norm folds into the head
        assert report.fold.untied == ["lm_head.weight (copy of model.embed_tokens.weight, to take model.norm's γ)"]
        assert rotated.lm_head.weight is not rotated.model.embed_tokens.weight
    else:
        assert report.fold.untied == []
    # fresh inputs of another shape: the fold and rotation in float64 against the RMSNorm math without casts
    call = lm_call(3, 5, 1)
    exact = apply_rotation(apply_fold(copy.deepcopy(model).double(), report.fold.plan), [s.stream for s in report.streams],
                           [s.basis for s in report.streams])
    expected = lm_logits(rms_norm_math(model), call)
    assert (lm_logits(exact, call) - expected).abs().max().item() <= 1e-12 * expected.abs().max().item()
    # and the rotated model as returned, in float32, against the original as it is
    assert torch.allclose(lm_logits(rotated, call), lm_logits(model, call), atol=1e-5)


class _OffsetNormReadByARelu(nn.Module):
    """An RMSNorm scaling by (1 + γ) whose output a ReLU reads: its γ cannot move, so it stays."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.norm, self.head = nn.Embedding(10, 8), RMSNorm(8, offset=1.0), nn.Linear(8, 3)
        with torch.no_grad():
            self.norm.weight.uniform_(-0.5, 0.5)

    def forward(self, ids):
        return self.head(torch.relu(self.norm(self.embed(ids))))


def test_an_offset_gamma_that_stays_in_its_norm_is_refused_naming_the_norm():
    with pytest.raises(FoldError, match=r"norm scales by \(1 \+ γ\) \(Gemma's RMSNorm\), which stays in the norm"):
        normfold.rotate(_OffsetNormReadByARelu().eval(), (torch.tensor([[1, 2, 3]]),))


def test_olmo2_is_refused_with_the_reason():
    with pytest.raises(FoldError, match="not closed under rotation"):
        normfold.rotate(tiny_rms_lm("olmo2"), lm_call(2, 7, 0))


def test_olmo_rotates_exactly_in_float64_against_its_layer_norms_without_the_casts():
    model = tiny_olmo()
    rotated, report = normfold.rotate(model, lm_call(2, 7, 0))
    assert report.verification.ok and report.exact and len(report.streams) == 1
    (stream,) = report.streams
    assert len(stream.stream.norms) == 2 * 2 + 1 and stream.identity_distance > 0.1
    call = lm_call(3, 5, 1)
    exact = apply_rotation(apply_fold(copy.deepcopy(model).double(), report.fold.plan), [stream.stream], [stream.basis])
    expected = lm_logits(olmo_layer_norm_math(model), call)
    assert (lm_logits(exact, call) - expected).abs().max().item() <= 1e-12 * expected.abs().max().item()
    assert torch.allclose(lm_logits(rotated, call), lm_logits(model, call), atol=1e-5)
