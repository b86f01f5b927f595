"""Closedness with shift absorption: centering a producer adds a ones-vector shift (x − m·1) to every
reader outside its zero-mean graph; the fold is allowed when that shift reaches only LayerNorms that
stay LayerNorms (LN(x + c·1) = LN(x)), decided as a fixed point over which norms fold.

Each positive case folds and is exact in float64 on fresh inputs; each negative case names the first
op that does not absorb the shift (a model output, a ReLU, an RMSNorm, a LayerNorm over two dims, an
in-place op whose tensor is seen through a view after it changes).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normfold
from normfold.engine.graph import capture
from normfold.engine.rules import shift_passes

B, T, C, V = 2, 5, 8, 11  # batch, tokens, features, vocabulary


def _randomized(model: nn.Module, seed: int = 0) -> nn.Module:
    """γ = 1, β = 0 and zero biases would hide a wrong fold: every parameter random, float64, eval."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return model.double().eval()


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _fold(model: nn.Module, example: tuple):
    """Fold (proved in float64 inside), then compare every output on fresh inputs once more."""
    model = _randomized(model)
    folded, report = normfold.fold(model, example)
    fresh = tuple(_x(seed=9) if a.is_floating_point() else torch.randint(0, V, a.shape) for a in example)
    with torch.no_grad():
        want, got = model(*fresh), folded(*fresh)
    for w, o in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert (w - o).abs().max() <= 1e-9 * w.abs().max(), "the fold changed an output"
    return {e.path: e for e in report.norms}


class _Sandwich(nn.Module):
    """Peri-LN / sandwich blocks: x = x + LN_post(MLP(LN_pre(x))), then a final LN and a head."""

    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln_pre": nn.LayerNorm(C), "fc1": nn.Linear(C, 2 * C),
                                                   "fc2": nn.Linear(2 * C, C), "ln_post": nn.LayerNorm(C)})
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(C)
        self.head = nn.Linear(C, V)

    def forward(self, ids):
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b["ln_post"](b["fc2"](F.gelu(b["fc1"](b["ln_pre"](x)))))
        return self.head(self.ln_f(x))


def test_sandwich_first_pre_norm_folds_because_the_later_layer_norms_absorb_the_embedding_shift():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    norms = _fold(_Sandwich(), (ids,))
    folded = {path for path, e in norms.items() if e.foldable}
    assert folded == {"blocks.0.ln_pre", "blocks.0.ln_post", "blocks.1.ln_post"}, norms
    # the embedding's shift runs down the residual stream to blocks.1.ln_pre and ln_f, which stay
    for kept in ("blocks.1.ln_pre", "ln_f"):
        assert "aten.layer_norm output with an affine transform is not zero-mean" in norms[kept].reason
    assert norms["blocks.0.ln_pre"].producers == ("emb.weight",)


class _ReluBranch(nn.Module):
    """h = W1·x feeds LN1 and a residual sum with a ReLU branch, read by LN2 (which cannot fold: ReLU)."""

    def __init__(self, leak: str | None = None):
        super().__init__()
        self.w1, self.w2 = nn.Linear(C, C), nn.Linear(C, C)
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.rms = nn.RMSNorm(C)
        self.ln2d = nn.LayerNorm((T, C))
        self.leak = leak

    def forward(self, x):
        h = self.w1(x)
        y = h + F.relu(self.w2(self.ln1(h)))
        outputs = (self.ln2(y),)
        if self.leak == "output":
            outputs += (y,)
        elif self.leak == "relu":
            outputs += (F.relu(h * 2.0),)
        elif self.leak == "rms_norm":
            outputs += (self.rms(y),)
        elif self.leak == "layer_norm_2d":
            outputs += (self.ln2d(y),)
        return outputs


def test_a_norm_folds_when_its_producer_also_feeds_a_layer_norm_that_stays_through_an_add():
    norms = _fold(_ReluBranch(), (_x(),))
    assert norms["ln1"].foldable and norms["ln1"].producers == ("w1.bias", "w1.weight")
    assert not norms["ln2"].foldable and "aten.relu" in norms["ln2"].reason


@pytest.mark.parametrize("leak, blocker", [
    ("output", "its centering shift reaches a model output"),
    ("relu", "its centering shift reaches aten.relu, which does not pass a ones-vector shift"),
    ("rms_norm", "its centering shift reaches aten.rms_norm at rms, an RMSNorm (an RMSNorm does not absorb a shift)"),
    ("layer_norm_2d", "its centering shift reaches aten.layer_norm at ln2d, a LayerNorm over 2 dims together"),
])
def test_a_shift_that_reaches_something_other_than_a_kept_layer_norm_is_refused_naming_it(leak, blocker):
    norms = _fold(_ReluBranch(leak), (_x(),))
    assert not norms["ln1"].foldable
    assert norms["ln1"].reason.startswith("not closed: aten.linear at w1 also feeds"), norms["ln1"].reason
    assert blocker in norms["ln1"].reason, norms["ln1"].reason


class _AbsorberDroppedLater(nn.Module):
    """LN2 is a candidate sharing h with LN1, but its other producer w2 is also a model output: LN2 is
    dropped, stays a LayerNorm, and then absorbs the shift of h (the fixed point's second round)."""

    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(C, C), nn.Linear(C, C)
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, x):
        h = self.w1(x)
        a = self.ln1(h)
        t = self.w2(a)
        return self.ln2(h + t), t


def test_a_norm_dropped_in_a_later_round_becomes_an_absorber_and_is_not_folded():
    norms = _fold(_AbsorberDroppedLater(), (_x(),))
    assert norms["ln1"].foldable
    assert not norms["ln2"].foldable and norms["ln2"].reason.startswith("not closed: aten.linear at w2 is a model output")


class _WholeAndPerHead(nn.Module):
    """h feeds a LayerNorm over C and a per-head LayerNorm over D = C/2: h cannot be centered both whole
    and per head; the per-head norm stays and absorbs the whole-dim shift (constant over both heads)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(C, C)
        self.ln, self.ln_head = nn.LayerNorm(C), nn.LayerNorm(C // 2)

    def forward(self, x):
        h = self.w(x)
        heads = self.ln_head(h.view(B, T, 2, C // 2).transpose(1, 2))  # (B, 2, T, D)
        return self.ln(h), heads.transpose(1, 2).reshape(B, T, C)


def test_a_whole_dim_norm_folds_when_the_per_head_norm_it_conflicts_with_stays_and_absorbs_its_shift():
    norms = _fold(_WholeAndPerHead(), (_x(),))
    assert norms["ln"].foldable
    assert not norms["ln_head"].foldable
    assert "its centering is per group of 4 along dim 2: no LayerNorm over a whole dim absorbs that" in norms["ln_head"].reason


class _Interleaved(nn.Module):
    """Features permuted through view/transpose/reshape before a kept LayerNorm: the shift is constant
    over the split dims and again over the merged one."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(C, C)
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, x):
        h = self.w(x)
        mixed = h.view(B, T, 2, C // 2).transpose(-1, -2).reshape(B, T, C)
        return self.ln1(h), self.ln2(torch.tanh(x) + mixed * 0.5)


def test_a_shift_passes_a_feature_permutation_and_scaling_to_a_kept_layer_norm():
    norms = _fold(_Interleaved(), (_x(),))
    assert norms["ln1"].foldable and not norms["ln2"].foldable


class _ScaledInPlaceAfterItsNorm(nn.Module):
    """h feeds a LayerNorm, then is scaled in place (h.mul_(0.5)) and read by a kept LayerNorm: the norm
    ran before h changed, and h is new memory (a Linear's output), so mul_ acts like mul."""

    def __init__(self, view_first: bool = False):
        super().__init__()
        self.w = nn.Linear(C, C)
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.view_first = view_first

    def forward(self, x):
        h = self.w(x)
        alias = h.view(B, T, C) if self.view_first else h  # a view read after mul_ sees it
        a = self.ln1(h)
        h.mul_(0.5)
        return a, self.ln2(torch.tanh(x) + alias)


def test_an_in_place_op_after_every_other_reader_acts_like_its_out_of_place_form_unless_a_view_sees_it():
    norms = _fold(_ScaledInPlaceAfterItsNorm(), (_x(),))
    assert norms["ln1"].foldable, norms["ln1"].reason
    norms = _fold(_ScaledInPlaceAfterItsNorm(view_first=True), (_x(),))
    assert not norms["ln1"].foldable
    assert "its centering shift reaches aten.mul_, which does not pass a ones-vector shift" in norms["ln1"].reason


def _graph_node(fn, *args, target: str):
    """The first node of ``fn``'s exported graph whose op is ``target`` (e.g. 'aten.mul')."""
    class M(nn.Module):
        def forward(self, *xs):
            return fn(*xs)
    captured = capture(M(), args)
    return next(n for n in captured.graph.nodes if n.op == "call_function" and str(n.target.overloadpacket) == target)


@pytest.mark.parametrize("fn, target, dims, expected", [
    (lambda a, b: a + b, "aten.add", (2,), (2,)),
    (lambda a, b: a * 3.0, "aten.mul", (2,), (2,)),
    (lambda a, b: a * b, "aten.mul", (2,), None),                       # b varies along the dim
    (lambda a, b: a * b[..., :1], "aten.mul", (2,), (2,)),              # b constant along it
    (lambda a, b: a.view(B, T, 2, C // 2), "aten.view", (2,), (2, 3)),  # split: constant along both parts
    (lambda a, b: a.view(B, T * C), "aten.view", (2,), None),           # merged with tokens: not constant
    (lambda a, b: a.transpose(1, 2), "aten.transpose", (2,), (1,)),
    (lambda a, b: a[:, 0], "aten.select", (2,), (1,)),
    (lambda a, b: a[:, :, 0], "aten.select", (2,), None),               # one entry of the dim
    (lambda a, b: a[:, :, 2:5], "aten.slice", (2,), (2,)),
    (lambda a, b: torch.cat([a, b], dim=-1), "aten.cat", (2,), None),   # joined along the dim itself
    (lambda a, b: torch.cat([a, b], dim=1), "aten.cat", (2,), (2,)),
    (lambda a, b: a.sum(1), "aten.sum", (2,), (1,)),
    (lambda a, b: a.sum(-1), "aten.sum", (2,), None),
    (lambda a, b: F.relu(a), "aten.relu", (2,), None),
    (lambda a, b: F.layer_norm(a, (C,)), "aten.layer_norm", (2,), None),  # absorbs: decided by closedness
])
def test_the_shift_column_passes_a_ones_vector_shift_exactly_where_the_math_allows(fn, target, dims, expected):
    node = _graph_node(fn, _x(0), _x(1), target=target)
    assert shift_passes(node, node.args[0] if target != "aten.cat" else node.args[0][0], dims) == expected


class _CancelledReader(nn.Module):
    """LN(−1.5·h) folds by centering fc; h is also read by (h + e) − c·h, a model output."""

    def __init__(self, c: float):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.emb = nn.Embedding(V, C)
        self.c = c
        self.norm = nn.LayerNorm(C)

    def forward(self, ids, x):
        h = self.fc(x)
        return (h + self.emb(ids)) - self.c * h, self.norm(h * -1.5)


class _SumMinusPart(nn.Module):
    """LN(h + e) folds by centering fc and emb, but (h + e) − e = h, a model output, changes with fc."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)
        self.emb = nn.Embedding(V, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, ids, x):
        e = self.emb(ids)
        s = self.fc(x) + e
        return s - e, self.norm(s)


def test_a_reader_in_which_the_centered_tensor_cancels_sees_no_change_and_one_where_it_does_not_blocks():
    """(h + e) − h = e whatever centering does to h: not a reader. With (h + e) − h/2 the shift reaches the
    output; so it does through (h + e) − e, where the sum, not the cancelled e, carries h's change."""
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    assert _fold(_CancelledReader(1.0), (ids, _x()))["norm"].foldable
    refused = _fold(_CancelledReader(0.5), (ids, _x()))["norm"]
    assert not refused.foldable and "model output" in refused.reason
    refused = _fold(_SumMinusPart(), (ids, _x()))["norm"]
    assert not refused.foldable and "model output" in refused.reason


class _SharedTransform(nn.Module):
    """One linear applied to two streams (BridgeTower's cross-modal transform): LN1 reads t(x) + e,
    LN2 reads t(y) + ReLU(w(y)) and stays (the ReLU term). Centering t for LN1 shifts its weight and
    bias, so t(y) moves by y·δWᵀ + δb, a ones-vector along the features, which
    LN2 absorbs. ``leak`` sends t(y) somewhere that does not."""

    def __init__(self, leak: str | None = None):
        super().__init__()
        self.t, self.w = nn.Linear(C, C), nn.Linear(C, C)
        self.e = nn.Parameter(torch.zeros(C))
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.leak = leak

    def forward(self, x, y):
        ty = self.t(y)
        outputs = (self.ln1(self.t(x) + self.e), self.ln2(ty + F.relu(self.w(y))))
        if self.leak == "output":
            outputs += (ty,)
        elif self.leak == "input of t":  # t applied to its own centered output: x and W change together
            outputs += (self.ln2(self.t(self.t(x) + self.e)),)
        elif self.leak == "after a kept norm":  # t read after LN2, which absorbs the shift of t(y): x unchanged
            outputs += (self.ln2(self.t(outputs[1]) + F.relu(self.w(y))),)
        return outputs


@pytest.mark.parametrize("leak", [None, "after a kept norm"])
def test_a_shared_linear_folds_when_its_other_call_reaches_a_kept_layer_norm(leak):
    norms = _fold(_SharedTransform(leak), (_x(), _x(seed=1)))
    assert norms["ln1"].foldable and norms["ln1"].producers == ("e", "t.bias", "t.weight"), norms["ln1"]
    assert not norms["ln2"].foldable and "aten.relu" in norms["ln2"].reason


@pytest.mark.parametrize("leak, blocker", [
    ("output", "a model output"),
    ("input of t", "aten.linear at t, whose other operand changes too"),  # δx·δWᵀ: not a ones-vector
])
def test_a_shared_linear_whose_other_call_leaks_the_shift_is_refused(leak, blocker):
    norms = _fold(_SharedTransform(leak), (_x(), _x(seed=1)))
    assert not norms["ln1"].foldable and blocker in norms["ln1"].reason, norms["ln1"].reason


@pytest.mark.parametrize("operand, dims, expected", [
    (1, (0,), (2,)),        # W + δ, δ constant along the output rows: x·δᵀ is constant along the features
    (1, (1,), None),        # δ constant along the inputs: x·δᵀ varies with the output feature
    (2, (0,), (0, 1, 2)),   # b + c·1: the same c·1 at every token
])
def test_the_shift_column_passes_a_linear_layers_weight_and_bias_shift_where_the_math_allows(operand, dims, expected):
    w, b = torch.randn(C, C, dtype=torch.float64), torch.randn(C, dtype=torch.float64)
    node = _graph_node(lambda a, w_, b_: F.linear(a, w_, b_), _x(0), w, b, target="aten.linear")
    out = shift_passes(node, node.args[operand], dims)
    assert (tuple(sorted(out)) if out is not None else None) == expected
    # the math the rule states, numerically: the change of the output is constant along the dims it returns
    c = torch.randn(C, dtype=torch.float64)
    delta = c.expand(C, C) if operand == 1 and dims == (0,) else (c[:, None].expand(C, C) if operand == 1 else c * 0 + c[0])
    args = [_x(0), w, b]
    args[operand] = args[operand] + delta
    change = F.linear(*args) - F.linear(_x(0), w, b)  # (B, T, C)
    for d in expected or ():
        assert torch.allclose(change, change.mean(d, keepdim=True).expand_as(change), atol=1e-12)
    if expected is None:
        assert not torch.allclose(change, change.mean(2, keepdim=True).expand_as(change), atol=1e-12)


class _MessageToken(nn.Module):
    """X-CLIP's cross-frame message: m = fc(h[:, 0]) is normalized by LN_m, appended to the tokens, run
    through a block (LN1 absorbs its shift) and sliced off again, so centering fc for LN_m shifts only
    a row nobody keeps. ``keep``: which tokens the block returns (all of them, or the message too)."""

    def __init__(self, keep: str = "tokens"):
        super().__init__()
        self.fc, self.mix, self.attn = nn.Linear(C, C), nn.Linear(C, C), nn.Linear(C, C)
        self.ln_m, self.ln1 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.keep = keep

    def forward(self, h):  # (B, T, C)
        m = self.fc(h[:, 0])                         # (B, C)
        m = m + self.mix(self.ln_m(m))
        x = torch.cat([h, m[:, None]], 1)            # (B, T + 1, C)
        if self.keep == "joined twice":
            x = torch.cat([x, x], 1)[:, T + 1:]  # one tensor joined twice: the second message row is kept
        a = self.ln1(x)
        x = x + self.attn(torch.softmax(a @ a.transpose(1, 2), -1) @ a)  # tokens mixed after LN1 only
        return {"tokens": x[:, :T], "all": x, "last two": x[:, T - 1:], "joined twice": x}[self.keep]


def test_a_shift_confined_to_a_token_that_is_sliced_off_is_absorbed():
    norms = _fold(_MessageToken(), (_x(),))
    assert norms["ln_m"].foldable and norms["ln_m"].producers == ("fc.bias", "fc.weight"), norms["ln_m"]


@pytest.mark.parametrize("keep", ["all", "last two", "joined twice"])
def test_a_shift_on_a_token_that_is_kept_reaches_the_output(keep):
    norms = _fold(_MessageToken(keep), (_x(),))
    assert not norms["ln_m"].foldable and "a model output" in norms["ln_m"].reason, norms["ln_m"].reason
