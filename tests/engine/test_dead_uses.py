"""Dead code and shape-only reads are not readers: closedness ignores them, decided from the graph.

A node with no path to a model output and no side effect (BART's unused ``inputs_embeds[:, :, -1]``)
and a read of the shape only (``expand_as``'s second argument) cannot see a changed
value; the same reads of the values still block the fold.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import normfold

B, T, C = 2, 5, 8


def _x(seed: int = 0) -> torch.Tensor:
    return torch.randn(B, T, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class _Reads(nn.Module):
    """h = W·x feeds a LayerNorm and one other read of ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.w = nn.Linear(C, C)
        self.ln = nn.LayerNorm(C)
        self.kind = kind

    def forward(self, x):
        h = self.w(x)
        y = self.ln(h)
        if self.kind == "dead_select":
            unused = h[:, :, -1]  # noqa: F841  (computed, never read: dead code in the graph)
        elif self.kind == "dead_view":
            unused = h.view(B, T, 2, C // 2).permute(0, 2, 1, 3)  # noqa: F841
        elif self.kind == "expand_as":
            y = y + x[..., :1].expand_as(h)  # h's shape only
        elif self.kind == "live_select":
            return y, h[:, :, -1]            # the same select, returned: its values are read
        elif self.kind == "expand_values":
            y = y + h[..., :1].expand_as(x)  # h's values, expanded
        return y


def _fold(kind: str):
    torch.manual_seed(0)
    model = _Reads(kind).double().eval()
    with torch.no_grad():
        model.ln.weight.normal_()
        model.ln.bias.normal_()
    folded, report = normfold.fold(model, (_x(),))  # proved in float64 inside
    with torch.no_grad():
        want, got = model(_x(3)), folded(_x(3))
    for w, o in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
        assert (w - o).abs().max() <= 1e-9 * w.abs().max()
    return report.norms[0]


@pytest.mark.parametrize("kind", ["dead_select", "dead_view", "expand_as"])
def test_dead_code_and_shape_only_reads_do_not_block_the_fold(kind):
    entry = _fold(kind)
    assert entry.foldable, entry.reason


@pytest.mark.parametrize("kind, reason", [
    ("live_select", "its centering shift reaches aten.select, which does not pass a ones-vector shift"),
    ("expand_values", "its centering shift reaches a model output"),
])
def test_the_same_ops_reading_values_still_block_it(kind, reason):
    entry = _fold(kind)
    assert not entry.foldable and entry.reason.startswith("not closed: aten.linear at w also feeds")
    assert reason in entry.reason, entry.reason


def test_bart_encoder_embedding_norm_folds_past_its_dead_embedding_select():
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                     decoder_ffn_dim=32, max_position_embeddings=32, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.BartModel(config).eval()
    ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    _, report = normfold.fold(model, {"input_ids": ids, "use_cache": False})
    norms = {e.path: e for e in report.norms}
    assert norms["encoder.layernorm_embedding"].foldable, norms["encoder.layernorm_embedding"].reason
    assert norms["decoder.layernorm_embedding"].foldable
