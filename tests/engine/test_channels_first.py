"""Channels-first LayerNorms (issue 33): a norm module that permutes channels last, normalizes and
permutes back (ConvNeXt's, GotOcr2's, LW-DETR's) folds through the permutes into an RMSNorm between
the same permutes; permutes that do not undo each other keep the module, naming what it computes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from normfold.engine.plan import FoldPlan
from normfold.nn import PermutedRMSNorm
from test_rules import B, C, _x, fold_checked, reason_of


class ChannelsFirstNorm(nn.LayerNorm):
    """LayerNorm over dim 1 of (B, C, H, W), as ConvNeXt's ``data_format="channels_first"`` computes it."""

    def __init__(self, width: int, back=(0, 3, 1, 2)):
        super().__init__(width)
        self.back = back

    def forward(self, x):
        return super().forward(x.permute(0, 2, 3, 1)).permute(*self.back)


class ConvThenChannelsFirstNorm(nn.Module):
    def __init__(self, back=(0, 3, 1, 2)):
        super().__init__()
        self.conv = nn.Conv2d(3, C, 2, stride=2)
        self.norm = ChannelsFirstNorm(C, back)

    def forward(self, x):  # (B, 3, 8, 8) -> (B, C, 4, 4)
        return self.norm(self.conv(x))


def test_a_channels_first_norm_folds_into_an_rmsnorm_between_the_same_permutes():
    folded, report = fold_checked(ConvThenChannelsFirstNorm(), (_x(B, 3, 8, 8),), {"norm": True})
    norm = folded.get_submodule("norm")
    assert isinstance(norm, PermutedRMSNorm) and norm.order == (0, 2, 3, 1) and norm.inverse == (0, 3, 1, 2)
    assert report.norms[0].producers == ("conv.bias", "conv.weight")
    swap = next(s for s in report.plan.swap if s.path == "norm")
    assert swap.permute == (0, 2, 3, 1)
    assert FoldPlan.from_dict(report.plan.to_dict()) == report.plan  # the permute survives the plan's JSON


def test_permutes_that_do_not_undo_each_other_keep_the_norm_and_say_what_it_computes():
    _, report = fold_checked(ConvThenChannelsFirstNorm(back=(0, 3, 2, 1)), (_x(B, 3, 8, 8),), {"norm": False})
    assert "computes aten.permute → aten.layer_norm → aten.permute" in reason_of(report, "norm")


def test_a_permuted_rmsnorm_needs_a_permutation():
    with pytest.raises(ValueError, match=r"order must be a permutation of 0..3, got \(0, 2, 2, 1\)"):
        PermutedRMSNorm(C, (0, 2, 2, 1))


class ChannelsLastNorm(nn.LayerNorm):
    """A LayerNorm subclass over the last dim, as ConvNeXt's channels_last ``ConvNextLayerNorm``."""


class ChannelsLastSubclass(nn.Module):
    """A LayerNorm subclass after a nonlinearity (kept) feeding a linear layer (its γ/β move there)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(C, C)
        self.norm = ChannelsLastNorm(C)
        self.head = nn.Linear(C, 3)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.proj(x))))


def test_a_layer_norm_subclass_whose_affine_moves_keeps_its_class():
    folded, report = fold_checked(ChannelsLastSubclass(), (_x(B, 5, C),), {"norm": False})
    assert report.norms[0].affine_folded
    norm = folded.get_submodule("norm")
    assert type(norm) is ChannelsLastNorm and norm.weight is None and norm.bias is None  # stock loaders build this class
