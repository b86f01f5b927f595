"""Partial-output centering: QK-norm after a fused QKV projection (Persimmon's pattern) folds by
centering only the q and k output rows of the fused weight, per head; the v rows stay as they are,
and a norm whose rows something else also reads is refused."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import normfold
from normfold.engine.executor import run
from normfold.engine.math import center, center_groups
from normfold.engine.plan import CenterGroupsStep, FoldPlan
from normfold.engine.transform import ModuleStore

C, HEADS, D = 16, 2, 8


class FusedQKV(nn.Module):
    """qkv = Linear(x).view(B, T, H, 3, D); per-head LayerNorms on q and k; attention; output Linear.

    ``split``: how q, k, v are taken from the (H, 3, D) view: "select" (Persimmon's ``qkv[..., i, :]``),
    "unbind", "split" (an (H, 3·D) view split along its last dim) or "merge_split" (the (H, 3, D) view
    reshaped to (H, 3·D), then split). ``leak_q``: the raw q rows are also returned, so centering them would show.
    """

    def __init__(self, split: str = "select", leak_q: bool = False):
        super().__init__()
        self.split, self.leak_q = split, leak_q
        self.qkv = nn.Linear(C, 3 * C)
        self.q_norm, self.k_norm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.out = nn.Linear(C, C)

    def forward(self, x):
        b, t, _ = x.shape
        fused = self.qkv(x)
        qkv = fused.view(b, t, HEADS, 3, D)
        if self.split == "select":
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        elif self.split == "unbind":
            q, k, v = qkv.unbind(3)
        elif self.split == "split":  # each head's 3·D features split into q, k, v along the normalized dim
            q, k, v = fused.view(b, t, HEADS, 3 * D).split(D, -1)
        else:  # the same, from the (H, 3, D) view merged back
            q, k, v = qkv.reshape(b, t, HEADS, 3 * D).split(D, -1)
        raw_q = q
        q, k = self.q_norm(q), self.k_norm(k)
        attention = torch.softmax(torch.einsum("bthd,bshd->bhts", q, k), -1)
        y = self.out(torch.einsum("bhts,bshd->bthd", attention, v).reshape(b, t, C))
        return (y, raw_q.sum(-1)) if self.leak_q else y


def _model(**options):
    torch.manual_seed(0)
    model = FusedQKV(**options).double().eval()
    with torch.no_grad():  # non-trivial γ/β and a bias far from zero-mean
        for norm in (model.q_norm, model.k_norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_(0.0, 0.1)
        model.qkv.bias.normal_(0.5, 1.0)
    return model, (torch.randn(2, 5, C, dtype=torch.float64),)


def _rows(head: int, slot: int) -> slice:
    """The output rows of the fused weight holding ``slot`` (0 q, 1 k, 2 v) of ``head``."""
    start = (head * 3 + slot) * D
    return slice(start, start + D)


@pytest.mark.parametrize("split", ["select", "unbind", "split", "merge_split"])
def test_qk_norms_after_a_fused_qkv_fold_exactly_by_centering_only_the_q_and_k_rows(split):
    model, inputs = _model(split=split)
    folded, report = normfold.fold(model, inputs)  # proved in float64, or FoldVerificationError
    by_path = {e.path: e for e in report.norms}
    assert by_path["q_norm"].foldable and by_path["k_norm"].foldable, report
    for path, slot in (("q_norm", 0), ("k_norm", 1)):  # the report says which groups reach which norm
        groups = [h * 3 + slot for h in range(HEADS)]
        assert f"qkv.weight groups {groups} of {D}" in by_path[path].reason, by_path[path].reason
    q_and_k = tuple(sorted(h * 3 + s for h in range(HEADS) for s in (0, 1)))
    assert sorted(report.plan.center_groups, key=lambda s: s.fqn) == [
        CenterGroupsStep("qkv.bias", 0, D, q_and_k), CenterGroupsStep("qkv.weight", 0, D, q_and_k)]
    assert not report.plan.center
    assert report.verification.ok and report.verification.max_rel_error < 1e-12
    for head in range(HEADS):
        v = _rows(head, 2)
        assert torch.equal(folded.qkv.weight[v], model.qkv.weight[v]) and torch.equal(folded.qkv.bias[v], model.qkv.bias[v])
        for slot in (0, 1):
            rows = _rows(head, slot)
            assert not torch.equal(folded.qkv.weight[rows], model.qkv.weight[rows])
            assert folded.qkv.weight[rows].mean(0).abs().max() < 1e-15 and abs(folded.qkv.bias[rows].mean()) < 1e-15
    assert isinstance(folded.q_norm, normfold.nn.RMSNorm) and isinstance(folded.k_norm, normfold.nn.RMSNorm)


@pytest.mark.parametrize("split", ["select", "split"])
def test_a_q_norm_whose_rows_are_also_read_elsewhere_is_refused_while_k_folds(split):
    model, inputs = _model(split=split, leak_q=True)
    folded, report = normfold.fold(model, inputs)
    by_path = {e.path: e for e in report.norms}
    assert not by_path["q_norm"].foldable and "not closed" in by_path["q_norm"].reason, by_path["q_norm"].reason
    assert by_path["k_norm"].foldable
    k_only = tuple(h * 3 + 1 for h in range(HEADS))
    assert {s.groups for s in report.plan.center_groups} == {k_only}
    assert torch.equal(folded.qkv.weight[_rows(0, 0)], model.qkv.weight[_rows(0, 0)])  # q rows untouched


def test_a_plan_with_partial_centering_survives_a_json_round_trip():
    plan = FoldPlan(center_groups=[CenterGroupsStep("qkv.weight", 0, D, (0, 1, 3, 4))])
    assert FoldPlan.from_dict(json.loads(plan.to_json())) == plan


def test_center_groups_centers_the_named_groups_and_leaves_the_others_bitwise():
    torch.manual_seed(1)
    t = torch.randn(6 * 4, 3, dtype=torch.float64)
    out = center_groups(t, 0, 4, (1, 4))
    expected = t.clone()
    for g in (1, 4):
        expected[g * 4:(g + 1) * 4] = center(t[g * 4:(g + 1) * 4], 0)
    assert torch.equal(out, expected)
    assert torch.equal(center_groups(t, 0, 4, range(6)), center(t, 0, 4))


@pytest.mark.parametrize("group, groups", [(4, (6,)), (4, (-1,)), (4, ()), (5, (0,)), (None, (0,))])
def test_center_groups_refuses_groups_that_do_not_exist(group, groups):
    with pytest.raises(ValueError, match="group"):
        center_groups(torch.zeros(24, 3), 0, group, groups)


def test_the_executor_centers_groups_slice_by_slice_as_on_the_whole_tensor():
    model, _ = _model()
    whole, sliced = FusedQKV().double(), FusedQKV().double()
    whole.load_state_dict(model.state_dict())
    sliced.load_state_dict(model.state_dict())
    steps = [CenterGroupsStep("qkv.weight", 0, D, (0, 4))]
    run(steps, ModuleStore(whole))
    store = ModuleStore(sliced)
    store.chunk = 3 * C  # slices of one column (3·C rows each): cut along dim 1, the means run along dim 0
    run(steps, store)
    assert torch.equal(whole.qkv.weight, sliced.qkv.weight)
    assert not torch.equal(whole.qkv.weight, model.qkv.weight)


class ClassTokenStream(nn.Module):
    """CvT's last stage: cat(cls, LN(patches)) → a residual block → split → final LN on the cls row.

    The cls row's residual stream is cls + fc(...): zero-mean once cls and fc are centered, while the
    patch rows carry the embedding LN's affine output. ``leak``: the patch rows are also returned (so
    the shift centering fc adds to them would show), or the patches reach the cls row through a sum over
    the tokens (then the cls row is not zero-mean at all).
    """

    def __init__(self, leak: str | None = None):
        super().__init__()
        self.leak = leak
        self.cls = nn.Parameter(torch.zeros(1, 1, C))
        self.embed_ln, self.ln, self.ln_f = nn.LayerNorm(C), nn.LayerNorm(C), nn.LayerNorm(C)
        self.fc, self.head = nn.Linear(C, C), nn.Linear(C, 3)

    def forward(self, x):  # (B, T, C)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), self.embed_ln(x)], 1)  # (B, 1 + T, C)
        if self.leak == "mixing":
            h = h + h.sum(1, keepdim=True)
        h = h + self.fc(self.ln(h))
        cls, patches = torch.split(h, [1, x.shape[1]], 1)
        logits = self.head(self.ln_f(cls))
        return (logits, patches) if self.leak == "output" else logits


def _random_double(model: nn.Module) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return model.double().eval()


def test_a_norm_of_the_class_token_row_folds_by_centering_what_reaches_that_row():
    model = _random_double(ClassTokenStream())
    x = torch.randn(2, 5, C, dtype=torch.float64)
    folded, report = normfold.fold(model, (x,))
    norms = {e.path: e for e in report.norms}
    assert norms["ln_f"].foldable and norms["ln_f"].producers == ("cls", "fc.bias", "fc.weight"), norms["ln_f"]
    assert not norms["embed_ln"].foldable and not norms["ln"].foldable
    fresh = torch.randn(3, 5, C, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(folded(fresh), model(fresh), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("leak, reason", [("output", "a model output"), ("mixing", "aten.layer_norm at embed_ln")])
def test_a_class_token_norm_is_refused_when_the_other_rows_show_or_reach_it(leak, reason):
    model = _random_double(ClassTokenStream(leak))
    _, report = normfold.fold(model, (torch.randn(2, 5, C, dtype=torch.float64),))
    ln_f = next(e for e in report.norms if e.path == "ln_f")
    assert not ln_f.foldable and reason in ln_f.reason, ln_f.reason
