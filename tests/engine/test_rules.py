"""Every rule of the zero-mean table, on handwritten modules, each with the case it must refuse.

Each positive case folds, keeps the outputs within the float64 bound on fresh inputs (``fold``
verifies; the test re-verifies on other seeds), feeds zero-mean rows to the new RMSNorms and
leaves the original untouched. Each negative case names what blocks it.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normfold
from normfold.engine.transform import apply_plan

B, T, C, H = 2, 5, 8, 2  # batch, tokens, features, heads
D = C // H               # head dim


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _randomize(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial values everywhere (LayerNorm γ=1, β=0 at init would hide affine bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return model.eval()


def fold_checked(model: nn.Module, inputs, foldable: dict[str, bool], **kwargs):
    """Fold, then check counts, exactness, zero-mean RMSNorm inputs and the untouched original."""
    model = _randomize(model)
    before = copy.deepcopy(model.state_dict())
    folded, report = normfold.fold(model, inputs, **kwargs)
    assert {e.path: e.foldable for e in report.norms} == foldable, str(report)
    assert report.num_foldable == sum(foldable.values())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), f"original model changed at {key}"
    exact = apply_plan(copy.deepcopy(model).double(), report.plan)
    result = normfold.verify(model, folded, inputs, num_random=3, seed=7, folded_exact=exact,
                             rms_norm_paths=[s.path for s in report.plan.swap if s.to == "RMSNorm"])
    assert result.max_rel_error <= 1e-9, str(result)
    if any(s.to == "RMSNorm" for s in report.plan.swap):
        assert result.max_input_mean_ratio is not None and result.max_input_mean_ratio < 1e-12
    for path, ok in foldable.items():
        if ":" not in path:
            expected = (normfold.RMSNorm, nn.Identity) if ok else (nn.LayerNorm, normfold.RMSNorm)
            assert isinstance(folded.get_submodule(path), expected)
    return folded, report


def reason_of(report, path: str) -> str:
    return next(e.reason for e in report.norms if e.path == path)


# --------------------------------------------------------------------------- linear maps


class LinearNorm(nn.Module):
    def __init__(self, act: nn.Module | None = None, bias: bool = True):
        super().__init__()
        self.proj = nn.Linear(C, C, bias=bias)
        self.act = act or nn.Identity()
        self.norm = nn.LayerNorm(C)

    def forward(self, x):  # (B, T, C)
        return self.norm(self.act(self.proj(x)))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_then_layernorm_folds_by_centering_the_weight_over_outputs(bias: bool):
    folded, report = fold_checked(LinearNorm(bias=bias), (_x(B, T, C),), {"norm": True})
    w = folded.proj.weight.double()
    assert w.mean(0).abs().max() < 1e-6  # columns of W sum to zero over outputs
    assert report.norms[0].producers == (("proj.bias", "proj.weight") if bias else ("proj.weight",))


def test_nonlinearity_between_linear_and_layernorm_blocks_and_is_named():
    _, report = fold_checked(LinearNorm(act=nn.GELU()), (_x(B, T, C),), {"norm": False})
    assert "aten.gelu at act" in report.norms[0].reason
    assert report.norms[0].blocking_path[-1] == "aten.gelu at act"


class ConvNorm(nn.Module):
    """Conv over channels, then a LayerNorm over channels (channels last)."""

    def __init__(self, groups: int):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1, groups=groups)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):  # (B, C, H, W)
        return self.norm(self.conv(x).permute(0, 2, 3, 1))  # (B, H, W, C)


def test_dense_conv_folds_over_its_output_channels():
    folded, _ = fold_checked(ConvNorm(groups=1), (_x(B, C, 4, 4),), {"norm": True})
    assert folded.conv.weight.double().mean(0).abs().max() < 1e-6


def test_grouped_conv_is_not_a_dense_map_over_channels():
    _, report = fold_checked(ConvNorm(groups=2), (_x(B, C, 4, 4),), {"norm": False})
    assert "groups=2" in report.norms[0].reason


class EmbeddingNorm(nn.Module):
    def __init__(self, vocab: int = 11):
        super().__init__()
        self.tok = nn.Embedding(vocab, C)
        self.pos = nn.Embedding(T, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, ids):  # (B, T)
        return self.norm(self.tok(ids) + self.pos(torch.arange(ids.shape[1])))


def test_embedding_tables_are_centered_along_their_rows():
    folded, report = fold_checked(EmbeddingNorm(), (torch.randint(0, 11, (B, T)),), {"norm": True})
    assert report.norms[0].producers == ("pos.weight", "tok.weight")
    assert folded.tok.weight.double().mean(1).abs().max() < 1e-6


class Attention(nn.Module):
    """softmax(q·kᵀ)·v then a LayerNorm: the output rows are combinations of v's rows."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(C, C) for _ in range(3))
        self.norm = nn.LayerNorm(C)

    def forward(self, x):  # (B, T, C)
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-2, -1), dim=-1)  # (B, T, T)
        return self.norm(scores @ self.v(x))


def test_attention_output_folds_by_centering_the_value_projection_only():
    _, report = fold_checked(Attention(), (_x(B, T, C),), {"norm": True})
    assert report.norms[0].producers == ("v.bias", "v.weight")


# --------------------------------------------------------------------------- sums, products


class Residual(nn.Module):
    def __init__(self, add_input: bool = False, constant: float = 0.0):
        super().__init__()
        self.emb = nn.Parameter(torch.zeros(T, C))  # a learned table used as a tensor
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.add_input, self.constant = add_input, constant

    def forward(self, x):  # (B, T, C)
        h = self.emb + self.fc(torch.relu(x)) - self.fc(x) * 0.5
        if self.add_input:
            h = h + x
        return self.norm(h + self.constant)


def test_sums_and_differences_of_centerable_terms_fold():
    _, report = fold_checked(Residual(), (_x(B, T, C),), {"norm": True})
    assert report.norms[0].producers == ("emb", "fc.bias", "fc.weight")


def test_adding_a_model_input_blocks():
    _, report = fold_checked(Residual(add_input=True), (_x(B, T, C),), {"norm": False})
    assert "model input" in report.norms[0].reason


def test_adding_a_nonzero_constant_blocks():
    _, report = fold_checked(Residual(constant=1.0), (_x(B, T, C),), {"norm": False})
    assert "constant" in report.norms[0].reason


class Scaled(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.gain = nn.Parameter(torch.ones(C))
        self.norm = nn.LayerNorm(C)
        self.how = how

    def forward(self, x):  # (B, T, C)
        h = self.fc(x)
        if self.how == "scalar":
            h = 3.0 * h / 2.0
        elif self.how == "per_row":
            h = h * x.square().mean(-1, keepdim=True)  # (B, T, 1): one scale per row
        elif self.how == "vector":  # (C,): a different scale per feature, not right after the Linear
            h = (2.0 * h) * self.gain  # (a layer scale there would merge into it: tests/engine/test_layer_scale.py)
        return self.norm(h)


@pytest.mark.parametrize("how", ["scalar", "per_row"])
def test_multiplying_by_a_scalar_or_a_per_row_scalar_keeps_zero_mean(how: str):
    fold_checked(Scaled(how), (_x(B, T, C),), {"norm": True})


def test_multiplying_by_a_feature_vector_blocks():
    _, report = fold_checked(Scaled("vector"), (_x(B, T, C),), {"norm": False})
    assert "varies along the normalized dim" in report.norms[0].reason


class WithZeros(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        h = self.fc(x)
        return self.norm(h + torch.zeros_like(h))


def test_literal_zeros_are_zero_mean_sources():
    fold_checked(WithZeros(), (_x(B, T, C),), {"norm": True})


# --------------------------------------------------------------------------- layout ops


class PerHead(nn.Module):
    """A per-head LayerNorm over D after splitting C into (H, D); or over C after merging heads."""

    def __init__(self, merge: bool):
        super().__init__()
        self.merge = merge
        self.fc = nn.Linear(D if merge else C, D if merge else C)
        self.norm = nn.LayerNorm(C if merge else D)

    def forward(self, x):
        if self.merge:  # x (B, T, H, D) -> per-head linear -> (B, T, C)
            return self.norm(self.fc(x).reshape(B, T, C))
        return self.norm(self.fc(x).view(B, T, H, D).transpose(1, 2))  # (B, H, T, D)


def test_split_heads_fold_with_the_weight_centered_per_head_group():
    folded, report = fold_checked(PerHead(merge=False), (_x(B, T, C),), {"norm": True})
    assert report.plan.center[0].group == D
    per_head = folded.fc.weight.double().view(H, D, C).mean(1)
    assert per_head.abs().max() < 1e-6 and folded.fc.weight.double().mean(0).abs().max() < 1e-6


def test_merging_per_head_outputs_into_the_normalized_dim_blocks():
    # one Linear shared by every head cannot make the merged (H·D) rows zero-mean jointly
    _, report = fold_checked(PerHead(merge=True), (_x(B, T, H, D),), {"norm": False})
    assert "jointly over dims (2, 3)" in report.norms[0].reason


class Interleave(nn.Module):
    """Features permuted by split → transpose → merge: the mean over the whole dim is unchanged."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        h = self.fc(x).view(B, T, 2, C // 2).transpose(-1, -2)  # (B, T, C/2, 2)
        return self.norm(h.reshape(B, T, C))


class PlainHeadNorms(nn.Module):
    """Weightless per-head norms, heads merged back: rows are zero-mean over every head, hence jointly."""

    def __init__(self):
        super().__init__()
        self.head_norm = nn.LayerNorm(D, elementwise_affine=False)
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        heads = self.head_norm(x.view(B, T, H, D))  # (B, T, H, D), zero-mean over D
        return self.norm(heads.reshape(B, T, C) + self.fc(x))


def test_merged_weightless_head_norm_outputs_are_zero_mean_sources():
    _, report = fold_checked(PlainHeadNorms(), (_x(B, T, C),), {"head_norm": False, "norm": True})
    assert reason_of(report, "norm").startswith("input zero-mean: centered 2 producers")


def test_a_permutation_of_the_features_through_views_folds():
    folded, report = fold_checked(Interleave(), (_x(B, T, C),), {"norm": True})
    assert report.plan.center[0].group is None and folded.fc.weight.double().mean(0).abs().max() < 1e-6


class Concat(nn.Module):
    def __init__(self, along_features: bool):
        super().__init__()
        self.along_features = along_features
        self.a = nn.Linear(C, C // 2 if along_features else C)
        self.b = nn.Linear(C, C // 2 if along_features else C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        return self.norm(torch.cat([self.a(x), self.b(x)], dim=-1 if self.along_features else 1))


def test_concatenation_along_tokens_folds():
    fold_checked(Concat(along_features=False), (_x(B, T, C),), {"norm": True})


def test_concatenation_along_the_normalized_dim_blocks():
    # cat(P·a, P·b) is zero-mean but is not P·cat(a, b): the LayerNorm would see a different input
    _, report = fold_checked(Concat(along_features=True), (_x(B, T, C),), {"norm": False})
    assert "cat along the normalized dim" in report.norms[0].reason


class ClsToken(nn.Module):
    """ViT-style: patches from a conv, a cls token parameter, a position table parameter."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, C, 2, stride=2)
        self.cls = nn.Parameter(torch.zeros(1, 1, C))
        self.pos = nn.Parameter(torch.zeros(1, 5, C))
        self.drop = nn.Dropout(0.5)
        self.norm = nn.LayerNorm(C)

    def forward(self, img):  # (B, 3, 4, 4)
        patches = self.patch(img).flatten(2).transpose(1, 2)  # (B, 4, C)
        tokens = torch.cat([self.cls.expand(img.shape[0], -1, -1), patches], dim=1) + self.pos  # (B, 5, C)
        return self.norm(self.drop(tokens))


def test_cls_token_and_position_table_are_centered_parameters():
    _, report = fold_checked(ClsToken(), (_x(B, 3, 4, 4),), {"norm": True})
    assert set(report.norms[0].producers) == {"cls", "pos", "patch.weight", "patch.bias"}


class Padded(nn.Module):
    def __init__(self, pad_features: bool, value: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(C, C - 2 if pad_features else C)
        self.norm = nn.LayerNorm(C)
        self.pad = (0, 2) if pad_features else (0, 0, 1, 0)  # features, or one token in front
        self.value = value

    def forward(self, x):
        return self.norm(F.pad(self.fc(x), self.pad, value=self.value))


def test_zero_padding_along_tokens_folds():
    fold_checked(Padded(pad_features=False), (_x(B, T, C),), {"norm": True})


@pytest.mark.parametrize("pad_features, value", [(True, 0.0), (False, 1.0)])
def test_padding_the_normalized_dim_or_padding_with_nonzero_blocks(pad_features: bool, value: float):
    _, report = fold_checked(Padded(pad_features, value), (_x(B, T, C),), {"norm": False})
    assert "pad" in report.norms[0].reason


class FusedQKV(nn.Module):
    """One linear makes q, k, v; only v (a whole third of the features) reaches the norm."""

    def __init__(self, use_q: bool):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.norm = nn.LayerNorm(C)
        self.use_q = use_q

    def forward(self, x):
        q, k, v = self.qkv(x).split(C, dim=-1)
        out = self.norm(v)
        return out + q if self.use_q else out


def test_a_split_part_folds_when_the_other_parts_are_unused():
    folded, report = fold_checked(FusedQKV(use_q=False), (_x(B, T, C),), {"norm": True})
    assert report.plan.center_groups[0].group == C and report.plan.center_groups[0].groups == (2,)  # v's rows only


def test_a_split_part_folds_when_a_sibling_part_is_read_since_only_its_rows_are_centered():
    folded, report = fold_checked(FusedQKV(use_q=True), (_x(B, T, C),), {"norm": True})
    assert report.plan.center_groups[0].groups == (2,) and not report.plan.center


# --------------------------------------------------------------------------- closedness, sources


class SharedProducer(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.other = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.how = how

    def forward(self, x):
        h = self.fc(x)
        if self.how == "output":
            return self.norm(h), h
        if self.how == "consumer":
            return self.norm(h) + self.other(h)
        return self.norm(h) + self.other(self.norm(h))  # "norm": h only reaches the norm


def test_a_producer_read_only_by_norms_folds():
    fold_checked(SharedProducer("norm"), (_x(B, T, C),), {"norm": True})


def test_a_producer_that_is_also_a_model_output_is_not_closed():
    _, report = fold_checked(SharedProducer("output"), (_x(B, T, C),), {"norm": False})
    assert "model output" in report.norms[0].reason


def test_a_producer_that_also_feeds_another_layer_is_not_closed_and_names_it():
    _, report = fold_checked(SharedProducer("consumer"), (_x(B, T, C),), {"norm": False})
    assert "aten.linear at other" in report.norms[0].reason


class TwoNormsOneStream(nn.Module):
    """Post-LN chain: the second norm reads the first's (affine) output; the first folds alone."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(C, C), nn.Linear(C, C)
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, x):
        h = self.ln1(self.fc1(x))
        return self.ln2(h + self.fc2(torch.relu(h)))


def test_a_norm_whose_input_holds_another_norms_affine_output_is_blocked():
    _, report = fold_checked(TwoNormsOneStream(), (_x(B, T, C),), {"ln1": True, "ln2": False})
    assert "aten.layer_norm at ln1" in reason_of(report, "ln2")


class ConflictingGroups(nn.Module):
    """One producer read by a whole-dim norm and by a per-head norm: no centering satisfies both, but
    the per-head norm, kept, absorbs the whole-dim centering shift (constant over each head)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.whole, self.per_head = nn.LayerNorm(C), nn.LayerNorm(D)

    def forward(self, x):
        h = self.fc(x)
        return self.whole(h), self.per_head(h.view(B, T, H, D))


def test_a_parameter_needed_along_two_groupings_keeps_the_grouped_norm():
    _, report = fold_checked(ConflictingGroups(), (_x(B, T, C),), {"whole": True, "per_head": False})
    assert "its centering is per group of 4" in reason_of(report, "per_head"), str(report)


class BufferSource(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(T, C), persistent=False)
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        return self.norm(self.fc(x) + self.table)


def test_a_non_persistent_buffer_cannot_be_centered():
    _, report = fold_checked(BufferSource(), (_x(B, T, C),), {"norm": False})
    assert "buffer table" in report.norms[0].reason


class Tied(nn.Module):
    """Embedding table shared with an output head, as in GPT-2."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, C)
        self.norm = nn.LayerNorm(C)
        self.head = nn.Linear(C, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


def test_tied_head_is_untied_and_keeps_the_original_table():
    model = Tied()
    folded, report = fold_checked(model, (torch.randint(0, 11, (B, T)),), {"norm": True}, precompute=False)
    assert report.untied == ["head.weight (copy of emb.weight)"]
    assert folded.head.weight is not folded.emb.weight and isinstance(folded.norm, normfold.RMSNorm)
    assert folded.emb.weight.double().mean(1).abs().max() < 1e-6


def test_a_norm_right_after_a_lookup_is_precomputed_into_the_table():
    model = Tied()
    folded, report = fold_checked(model, (torch.randint(0, 11, (B, T)),), {"norm": True})
    assert isinstance(folded.norm, nn.Identity) and report.norms[0].reason.startswith("precomputed")
    assert report.untied == ["head.weight (copy of emb.weight)"]
    expected = F.layer_norm(model.emb.weight.double(), (C,), model.norm.weight.double(), model.norm.bias.double())
    assert torch.allclose(folded.emb.weight.double(), expected, atol=1e-6)
    assert torch.equal(folded.head.weight, model.head.weight)


class LookupThenStream(nn.Module):
    """BLOOM-style: a norm on the lookup, whose (affine) output is the residual stream of later norms."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, C)
        self.emb_norm, self.pre_norm, self.final_norm = nn.LayerNorm(C), nn.LayerNorm(C), nn.LayerNorm(C)
        self.fc = nn.Linear(C, C)

    def forward(self, ids):
        h = self.emb_norm(self.emb(ids))
        h = h + self.fc(torch.relu(self.pre_norm(h)))  # a pre-LN block
        return self.final_norm(h)


@pytest.mark.parametrize("precompute", [True, False])
def test_precomputing_the_lookup_norm_lets_the_stream_after_it_fold(precompute: bool):
    _, report = fold_checked(LookupThenStream(), (torch.randint(0, 11, (B, T)),),
                             {"emb_norm": True, "pre_norm": precompute, "final_norm": precompute},
                             precompute=precompute)
    if not precompute:
        assert "aten.layer_norm at emb_norm" in reason_of(report, "final_norm")


class Unknown(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        return self.norm(torch.cumsum(self.fc(x), dim=1))


def test_an_op_missing_from_the_table_breaks():
    _, report = fold_checked(Unknown(), (_x(B, T, C),), {"norm": False})
    assert "aten.cumsum is not in the rules table" in report.norms[0].reason


def test_every_rule_key_is_an_aten_packet_or_getitem():
    import operator

    from normfold.engine.rules import RULES
    for key in RULES:
        assert key is operator.getitem or str(key).startswith("aten."), key


# --------------------------------------------------------------------------- norms themselves


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return F.layer_norm(self.fc(x), (C,))


def test_a_functional_layer_norm_has_no_module_to_swap_and_is_kept():
    _, report = fold_checked(Functional(), (_x(B, T, C),), {"<root>:layer_norm": False})
    assert "functional" in report.norms[0].reason


class TwoDimNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm((T, C))

    def forward(self, x):
        return self.norm(self.fc(x))


def test_a_norm_over_several_dims_is_kept():
    _, report = fold_checked(TwoDimNorm(), (_x(B, T, C),), {"norm": False})
    assert "several dims" in report.norms[0].reason


class ReusedNorm(nn.Module):
    """One LayerNorm module called on two streams: it can only be swapped if both fold."""

    def __init__(self, second_foldable: bool):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.second_foldable = second_foldable

    def forward(self, x):
        second = self.fc(x) * 2.0 if self.second_foldable else x
        return self.norm(self.fc(x)), self.norm(second)


def test_a_norm_module_called_twice_folds_only_if_every_call_does():
    fold_checked(ReusedNorm(True), (_x(B, T, C),), {"norm": True})
    _, report = fold_checked(ReusedNorm(False), (_x(B, T, C),), {"norm": False})
    assert "model input" in report.norms[0].reason


# --------------------------------------------------------------------------- grouped convs, a − a, dead readers


class GroupedConvHeads(nn.Module):
    """A grouped 1x1 conv over channels, then a LayerNorm per head of ``head`` channels."""

    def __init__(self, groups: int, head: int):
        super().__init__()
        self.conv = nn.Conv1d(C, C, 1, groups=groups)
        self.head = head
        self.norm = nn.LayerNorm(head)

    def forward(self, x):  # (B, T, C)
        y = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.norm(y.reshape(B, T, C // self.head, self.head))


@pytest.mark.parametrize("groups, head", [(2, 4), (2, 2), (4, 2)])
def test_a_head_norm_inside_one_conv_group_folds_and_one_spanning_conv_groups_is_refused(groups, head):
    """Each head's channels read the same inputs: centering W and b per head is exact. With conv groups of
    half a head, a head spans two, whose channels read different inputs: refused, saying why."""
    folded, _ = fold_checked(GroupedConvHeads(groups, head), (_x(B, T, C),), {"norm": True})
    w = folded.conv.weight.double().reshape(C // head, head, -1)
    assert w.mean(1).abs().max() < 1e-6 and folded.conv.bias.double().reshape(-1, head).mean(1).abs().max() < 1e-6
    _, report = fold_checked(GroupedConvHeads(2 * C // head, head), (_x(B, T, C),), {"norm": False})  # head/2 per group
    assert "inside one conv group" in report.norms[0].reason


class SelfDifference(nn.Module):
    """LN(a − b) where a and b hold the same values (``same``), or not."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.scale = nn.Parameter(torch.ones(C))
        self.drop = nn.Dropout(0.1)
        self.kind = kind
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        h = F.gelu(self.fc(x))
        if self.kind == "same":
            d = h - h
        elif self.kind == "same_times_param":
            d = (h - h) * self.scale
        elif self.kind == "cat_through_eval_dropout":
            d = torch.cat([h, self.drop(h)], -1) - torch.cat([self.drop(h), h], -1)
        elif self.kind == "cat_of_different_values":
            d = torch.cat([h, 2 * h], -1) - torch.cat([2 * h, h], -1)
        elif self.kind == "alpha":
            d = torch.sub(h, h, alpha=2)
        else:  # "copy_then_in_place": the clone keeps h's old values, h is doubled afterwards
            c = h.clone()
            h.mul_(2)
            d = c - h
        if d.shape[-1] != C:
            d = d[..., :C]
        return self.norm(d), h


@pytest.mark.parametrize("same, different", [("same", "alpha"), ("same_times_param", "copy_then_in_place"),
                                              ("cat_through_eval_dropout", "cat_of_different_values")])
def test_a_value_minus_itself_is_zero_and_its_norm_folds_but_values_not_proved_equal_are_refused(same, different):
    """h − h, (h − h)·w and cat(h, drop(h)) − cat(drop(h), h) in eval are zero: the norm folds with
    nothing centered. h − 2h, cat(h, 2h) − cat(2h, h) and clone(h) − h after h.mul_(2) are not."""
    _, report = fold_checked(SelfDifference(same), (_x(B, T, C),), {"norm": True})
    assert report.norms[0].producers == ()
    _, report = fold_checked(SelfDifference(different), (_x(B, T, C),), {"norm": False})
    assert "gelu" in report.norms[0].reason


class InPlaceAfterDeadReader(nn.Module):
    """h.mul_ after another op read h: harmless when that reader's result is never used."""

    def __init__(self, reader_used: bool):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.reader_used = reader_used
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        h = self.fc(x)
        seen = F.silu(h)
        h.mul_(0.5)
        return (self.norm(h), seen) if self.reader_used else self.norm(h)


def test_an_in_place_op_after_a_dead_reader_folds_and_after_a_live_one_is_refused():
    """silu(h) then h.mul_(0.5): a silu result nothing uses sees nothing; a returned one reads h, which centering changes."""
    fold_checked(InPlaceAfterDeadReader(reader_used=False), (_x(B, T, C),), {"norm": True})
    _, report = fold_checked(InPlaceAfterDeadReader(reader_used=True), (_x(B, T, C),), {"norm": False})
    assert "silu" in report.norms[0].reason


class CancellingSum(nn.Module):
    """LN of a sum in which gelu(fc(x)) cancels exactly (``cancels``) or not; ``shared`` also returns h + p."""

    def __init__(self, kind: str):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.proj = nn.Linear(C, C)
        self.kind = kind
        self.norm = nn.LayerNorm(C)

    def forward(self, x):
        h, p = F.gelu(self.fc(x)), self.proj(x)
        if self.kind in ("cancels", "shared"):
            s = h + p
            out = self.norm(h - s)  # = −p
            return (out, s) if self.kind == "shared" else out
        if self.kind == "cancels_in_quarters":
            return self.norm(h - (h / 4 + p) - h * 0.75)  # 1 − 1/4 − 3/4 = 0 exactly (h/3 + h·(2/3) would not be)
        return self.norm(h - (h * 0.5 + p) - h * 0.25)  # "leaves_a_quarter": h·0.25 − p


def test_a_term_that_cancels_exactly_in_a_sum_needs_no_zero_mean_and_the_rest_folds():
    """h − (h + p) = −p: only p needs zero mean. Refused when h's coefficients leave 1/4, or when h + p is
    also returned (centering p would change it)."""
    for kind in ("cancels", "cancels_in_quarters"):
        _, report = fold_checked(CancellingSum(kind), (_x(B, T, C),), {"norm": True})
        assert report.norms[0].producers == ("proj.bias", "proj.weight")
    _, report = fold_checked(CancellingSum("leaves_a_quarter"), (_x(B, T, C),), {"norm": False})
    assert "gelu" in report.norms[0].reason
    _, report = fold_checked(CancellingSum("shared"), (_x(B, T, C),), {"norm": False})
    assert "model output" in report.norms[0].reason


class _ZerosFilledThroughAView(nn.Module):
    """pe = zeros; pe[:, :k] = sin(...): Pegasus-X's positions. ``zeros`` is not zero any more."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = self.embed(ids)
        pe = torch.zeros(ids.shape[1], h.shape[-1], dtype=h.dtype)
        pe[:, : h.shape[-1] // 2] = torch.sin(torch.arange(ids.shape[1], dtype=h.dtype))[:, None]
        return self.head(self.norm(h + pe))


def test_a_zeros_tensor_written_through_a_view_is_not_a_zero_source():
    model = _ZerosFilledThroughAView().eval()
    ids = torch.randint(0, 16, (2, 5))
    folded, report = normfold.fold(model, (ids,), verify=False)
    (norm,) = report.norms
    assert not norm.foldable and "written in place through a view by aten.copy_" in norm.reason
    with torch.no_grad():  # and the model is unchanged, as the refusal promises
        torch.testing.assert_close(folded(ids), model(ids))


# --------------------------------------------------------------------------- sizes the input decides


class _RowsAMaskKeeps(nn.Module):
    """Idefics3 / SmolVLM keep the images that are not padding (``pixel_values[real]``): every size after
    that is a symbol of the trace, while the normalized dim stays a number. ``after`` is what the kept
    rows go through before the norm."""

    def __init__(self, after: str):
        super().__init__()
        self.after = after
        self.proj = nn.Linear(C, C)
        self.cls = nn.Parameter(torch.zeros(1, C))
        self.norm = nn.LayerNorm(C // 2 if after == "half_rows" else C)
        self.head = nn.Linear(C // 2 if after == "half_rows" else C, 3)

    def forward(self, x, keep):  # x (N, C), keep (N,) bool
        h = self.proj(x[keep])  # (u0, C): u0 is the number of True entries
        if self.after == "half_rows":
            h = h.reshape(-1, C // 2)  # (2·u0, C/2): each row's halves become rows
        elif self.after == "cls_then_slice":
            h = torch.cat([self.cls, h], 0)[1:]  # (u0 + 1, C) then rows 1..: needs u0 + 1 as a number
        elif self.after == "split_per_image":  # PaddleOCR-VL: the kept rows split into images of sizes the input decides
            counts = torch.stack([keep[:3].sum(), keep[3:].sum()]).tolist()
            h = torch.split(h, counts)[0]  # (u1, C): the first image's rows
        return self.head(self.norm(h))


_KEEP = torch.tensor([True, False, True, True, False, True])


@pytest.mark.parametrize("after", ["nothing", "half_rows", "split_per_image"])
def test_a_norm_folds_when_only_its_row_count_depends_on_the_input(after):
    _, report = fold_checked(_RowsAMaskKeeps(after), (_x(6, C), _KEEP), {"norm": True})
    assert report.norms[0].affine_folded, report.norms[0].reason  # its width is a number: γ/β move to head


def test_a_rule_that_needs_a_size_the_input_decides_breaks_and_names_it():
    _, report = fold_checked(_RowsAMaskKeeps("cls_then_slice"), (_x(6, C), _KEEP), {"norm": False})
    assert "depends on the input's values" in report.norms[0].reason, report.norms[0].reason


class _NormOfATable(nn.Module):
    """A LayerNorm applied straight to a parameter (SEW-D / DeBERTa's relative position table), whose rows
    the attention then reads: centering the table is the whole fold."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, C))
        self.norm = nn.LayerNorm(C)

    def forward(self, x):  # (B, T, C)
        return x @ self.norm(self.table).t()  # (B, T, 6)


def test_a_layernorm_applied_straight_to_a_parameter_folds_by_centering_it():
    """Was a FoldError ("planning the centering step: no use of parameter table ... was found"; before that
    an IndexError): the norm itself is the parameter's reader whose name gets centered."""
    _, report = fold_checked(_NormOfATable(), (_x(B, T, C),), {"norm": True})
    assert report.norms[0].producers == ("table",)
