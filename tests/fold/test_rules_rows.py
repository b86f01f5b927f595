"""Rules for ops that treat every feature alike (issue 33): whole rows moved, copied, averaged or
zeroed, or a row's entries permuted, each folding a LayerNorm behind it with the float64 proof, and
the case of the same op that must break (it writes part of a row, mixes rows, or makes a constant row)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_rules import B, C, T, _x, fold_checked, reason_of

IMAGE_TOKEN = 3  # token id whose rows are replaced by image features


def _ids(seed=0, vocab=11):
    ids = torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    ids[:, 1] = IMAGE_TOKEN  # at least one row to write in every example call
    return ids


class RowWrite(nn.Module):
    """Token embeddings with some rows overwritten (or zeroed) by another producer, then a LayerNorm."""

    def __init__(self, how: str, width: int = C):
        super().__init__()
        self.how = how
        self.tok = nn.Embedding(11, C)
        self.proj = nn.Linear(C, width)
        self.norm = nn.LayerNorm(C)

    def forward(self, ids, feats):  # ids (B, T), feats (B·T, C)
        h = self.tok(ids)
        rows = (ids == IMAGE_TOKEN).unsqueeze(-1)  # (B, T, 1): one choice per row
        source = self.proj(feats)
        if self.how == "fill 0":
            h = h.masked_fill(rows, 0)
        elif self.how == "fill 1":
            h = h.masked_fill(rows, 1.0)
        elif self.how == "fill per channel":
            h = h.masked_fill(source.view(B, T, C) > 0, 0)
        elif self.how == "scatter rows":
            h = h.masked_scatter(rows.expand_as(h), source)
        elif self.how == "scatter per channel":
            h = h.masked_scatter(source.view(B, T, C) > 0, source)
        elif self.how == "scatter short rows":
            h = h.masked_scatter(rows.expand_as(h), source)
        return self.norm(h)


@pytest.mark.parametrize("how", ["fill 0", "scatter rows"])
def test_masked_fill_with_zero_and_masked_scatter_of_whole_rows_fold(how: str):
    _, report = fold_checked(RowWrite(how), (_ids(), _x(B * T, C, seed=1)), {"norm": True})
    assert "tok.weight" in report.norms[0].producers
    assert ("proj.weight" in report.norms[0].producers) == (how == "scatter rows")


@pytest.mark.parametrize("how, reason", [
    ("fill 1", "aten.masked_fill fills with 1.0, not 0"),
    ("fill per channel", "aten.masked_fill with a mask that varies along the normalized dim"),
    ("scatter per channel", "aten.masked_scatter with a mask that varies along the normalized dim"),
    ("scatter short rows", "source rows of 16 entries do not fill whole rows of 8"),
])
def test_a_fill_that_is_not_zero_or_writes_part_of_a_row_breaks(how: str, reason: str):
    width = 2 * C if how == "scatter short rows" else C
    _, report = fold_checked(RowWrite(how, width), (_ids(), _x(B * T, C, seed=1)), {"norm": False})
    assert reason in reason_of(report, "norm")


class IndexWrite(nn.Module):
    """Rows of a projection written at token positions by index_put_ / index_copy (or along features)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(C, C)
        self.other = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)
        self.register_buffer("where", torch.tensor([0, 3]), persistent=False)

    def forward(self, x, y):  # (B, T, C), (B, 2, C)
        h, v = self.proj(x), self.other(y)
        if self.how == "index_put":
            h[:, self.where] = v
        elif self.how == "index_put accumulate":
            h = h.index_put((torch.arange(B).unsqueeze(1), self.where), v, accumulate=True)
        elif self.how == "index_put features":
            h[:, :, self.where] = x[:, :, :2]
        elif self.how == "index_copy":
            h = h.index_copy(1, self.where, v)
        elif self.how == "index_copy features":
            h = h.index_copy(2, self.where, x[:, :, :2])
        return self.norm(h)


@pytest.mark.parametrize("how", ["index_put", "index_put accumulate", "index_copy"])
def test_writing_whole_rows_by_index_folds_with_both_producers_centered(how: str):
    _, report = fold_checked(IndexWrite(how), (_x(B, T, C), _x(B, 2, C, seed=1)), {"norm": True})
    assert report.norms[0].producers == ("other.bias", "other.weight", "proj.bias", "proj.weight")


@pytest.mark.parametrize("how, reason", [
    ("index_put features", "aten.index_put_ writes along the normalized dim"),
    ("index_copy features", "aten.index_copy copies entries along the normalized dim"),
])
def test_writing_by_index_along_the_features_breaks(how: str, reason: str):
    _, report = fold_checked(IndexWrite(how), (_x(B, T, C), _x(B, 2, C, seed=1)), {"norm": False})
    assert reason in reason_of(report, "norm")
