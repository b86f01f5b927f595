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
        elif self.how == "where 0":
            h = torch.where(rows, 0.0, h)
        elif self.how == "where rows":
            h = torch.where(rows, source.view(B, T, C), h)
        elif self.how == "where 1":
            h = torch.where(rows, h, 1.0)
        elif self.how == "where per channel":
            h = torch.where(source.view(B, T, C) > 0, source.view(B, T, C), h)
        return self.norm(h)


@pytest.mark.parametrize("how", ["fill 0", "scatter rows", "where 0", "where rows"])
def test_masked_fill_with_zero_and_masked_scatter_of_whole_rows_fold(how: str):
    _, report = fold_checked(RowWrite(how), (_ids(), _x(B * T, C, seed=1)), {"norm": True})
    assert "tok.weight" in report.norms[0].producers
    assert ("proj.weight" in report.norms[0].producers) == (how in ("scatter rows", "where rows"))


@pytest.mark.parametrize("how, reason", [
    ("fill 1", "aten.masked_fill fills with 1.0, not 0"),
    ("fill per channel", "aten.masked_fill with a mask that varies along the normalized dim"),
    ("scatter per channel", "aten.masked_scatter with a mask that varies along the normalized dim"),
    ("scatter short rows", "source rows of 16 entries do not fill whole rows of 8"),
    ("where 1", "aten.where picks the number 1.0, not 0"),
    ("where per channel", "aten.where with a mask that varies along the normalized dim"),
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


class MaskedRowsZeroed(nn.Module):
    """Wav2Vec2-Conformer's padding: ``h[~mask.unsqueeze(-1).repeat(1, 1, C)] = fill``, a bool mask over all of
    h's dims that is constant along the features (``per_feature``: one that is not)."""

    def __init__(self, fill: float = 0.0, per_feature: bool = False):
        super().__init__()
        self.fill, self.per_feature = fill, per_feature
        self.proj = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x, keep):  # (B, T, C), (B, T) bool
        h = self.proj(x)
        mask = keep.unsqueeze(-1).repeat(1, 1, C)  # (B, T, C), the same along C
        if self.per_feature:
            mask = mask & (torch.arange(C) % 2 == 0)
        h[~mask] = self.fill
        return self.norm(h)


def _keep(seed: int = 0) -> torch.Tensor:
    keep = torch.rand(B, T, generator=torch.Generator().manual_seed(seed)) > 0.3
    keep[:, 0] = True
    return keep  # (B, T)


def test_zeroing_whole_rows_by_a_bool_mask_folds():
    _, report = fold_checked(MaskedRowsZeroed(), (_x(B, T, C), _keep()), {"norm": True})
    assert report.norms[0].producers == ("proj.bias", "proj.weight")


@pytest.mark.parametrize("fill, per_feature", [(1.0, False), (0.0, True)])
def test_a_bool_mask_write_of_a_number_or_of_part_of_a_row_breaks(fill: float, per_feature: bool):
    _, report = fold_checked(MaskedRowsZeroed(fill, per_feature), (_x(B, T, C), _keep()), {"norm": False})
    assert "aten.index_put_ writes along the normalized dim" in reason_of(report, "norm")


class Moved(nn.Module):
    """A projection whose rows are moved, copied or permuted by one op before a LayerNorm of ``width``."""

    def __init__(self, how: str, width: int = C, out: int = C):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(C, out)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):  # (B, T, C)
        h = self.proj(x)
        order = torch.arange(T - 1, -1, -1)
        if self.how == "gather tokens":
            h = h.gather(1, order.view(1, T, 1).expand(B, T, C))
        elif self.how == "gather features":
            h = h.gather(2, torch.arange(C - 1, -1, -1).expand(B, T, C))
        elif self.how == "gather varying index":
            h = h.gather(1, torch.arange(B * T * C).view(B, T, C) % T)
        elif self.how == "repeat tokens":
            h = h.repeat(1, 2, 1)
        elif self.how == "repeat features":
            h = h.repeat(1, 1, 2)
        elif self.how == "tile":
            h = torch.tile(h, (2, 1))
        elif self.how == "repeat a single entry":
            h = h.repeat(1, 1, C)
        elif self.how == "roll tokens":
            h = h.roll(2, 1)
        elif self.how == "roll features":
            h = h.roll(3, -1)
        elif self.how == "roll flattened":
            h = h.roll(3)
        return self.norm(h)


@pytest.mark.parametrize("how, width", [
    ("gather tokens", C), ("repeat tokens", C), ("repeat features", 2 * C), ("tile", C),
    ("roll tokens", C), ("roll features", C)])
def test_moving_copying_or_permuting_whole_rows_folds(how: str, width: int):
    _, report = fold_checked(Moved(how, width), (_x(B, T, C),), {"norm": True})
    assert report.norms[0].producers == ("proj.bias", "proj.weight")


@pytest.mark.parametrize("how, out, reason", [
    ("gather features", C, "aten.gather picks entries along the normalized dim"),
    ("gather varying index", C, "aten.gather with an index that varies along the normalized dim"),
    ("repeat a single entry", 1, "aten.repeat fills the normalized dim from a single entry: a constant row"),
    ("roll flattened", C, "aten.roll of the flattened tensor moves entries between rows"),
])
def test_picking_entries_of_a_row_or_making_a_constant_row_breaks(how: str, out: int, reason: str):
    _, report = fold_checked(Moved(how, out=out), (_x(B, T, C),), {"norm": False})
    assert reason in reason_of(report, "norm")


KEEP = 3  # tokens a random masking keeps


class GatherRows(nn.Module):
    """ViT-MAE's random masking: a projection's rows gathered at the tokens that sort first by ``noise``,
    by an index built from those token ids (B, KEEP) in one of the ways that keep it one per row, or
    (the negative cases) not. With noise (B, T, k) the ids are (B, KEEP, k): k orders per row."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(C, C)
        self.norm = nn.LayerNorm(C)

    def forward(self, x, noise):  # (B, T, C), (B, T) or (B, T, k)
        h = self.proj(x)
        ids = torch.argsort(noise, dim=1)[:, :KEEP]
        if self.how == "repeat":  # ViT-MAE: ids_keep.unsqueeze(-1).repeat(1, 1, dim)
            index = ids.unsqueeze(-1).repeat(1, 1, C)
        elif self.how == "tile":
            index = torch.tile(ids.unsqueeze(-1), (1, C))
        elif self.how == "sliced":
            index = ids.unsqueeze(-1).expand(B, KEEP, 2 * C)[:, :, C:]
        elif self.how == "transposed":
            index = ids.unsqueeze(1).repeat(1, C, 1).transpose(1, 2)
        elif self.how == "permuted":
            index = ids.unsqueeze(1).repeat(1, C, 1).permute(0, 2, 1)
        elif self.how == "selected":
            index = ids[:, :, None, None].expand(B, KEEP, 2, C).select(2, 1)
        elif self.how == "offset":
            index = (ids.unsqueeze(-1).repeat(1, 1, C) + 1) % T
        elif self.how == "offset per feature":
            index = (ids.unsqueeze(-1).repeat(1, 1, C) + torch.arange(C)) % T
        elif self.how == "repeat columns":  # (B, KEEP, 2) repeated: two orders alternating along the features
            index = ids.repeat(1, 1, C // 2)
        elif self.how == "per entry":  # a random permutation of the tokens for every feature
            index = ids
        elif self.how == "written":  # one per row, then its first feature overwritten
            index = ids.unsqueeze(-1).expand(B, KEEP, C).clone()
            index[..., 0] = 0
        return self.norm(torch.gather(h, 1, index))


def _noise(*shape):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("how", ["repeat", "tile", "sliced", "transposed", "permuted", "selected", "offset"])
def test_gather_by_an_index_repeated_along_the_features_folds(how: str):
    _, report = fold_checked(GatherRows(how), (_x(B, T, C), _noise(B, T)), {"norm": True})
    assert report.norms[0].producers == ("proj.bias", "proj.weight")


@pytest.mark.parametrize("how, noise", [
    ("per entry", (B, T, C)), ("repeat columns", (B, T, 2)), ("offset per feature", (B, T)), ("written", (B, T))])
def test_gather_by_an_index_that_varies_along_the_features_breaks(how: str, noise: tuple):
    _, report = fold_checked(GatherRows(how), (_x(B, T, C), _noise(*noise)), {"norm": False})
    assert "aten.gather with an index that varies along the normalized dim" in reason_of(report, "norm")


class Spatial(nn.Module):
    """A 1x1 conv over channels, resampled or pooled over space, then a LayerNorm over the channels
    (channels moved last) or, for the negative case, over the last spatial dim."""

    def __init__(self, op, over_space: bool = False):
        super().__init__()
        self.op, self.over_space = op, over_space
        self.conv = nn.Conv2d(C, C, 1)
        self.norm = nn.LayerNorm(8 if over_space else C)

    def forward(self, x):  # (B, C, 4, 4)
        y = self.op(self.conv(x))
        return self.norm(y if self.over_space else y.permute(0, 2, 3, 1))


SPATIAL_OPS = {
    "bilinear": lambda y: F.interpolate(y, scale_factor=2, mode="bilinear"),
    "bicubic": lambda y: F.interpolate(y, scale_factor=2, mode="bicubic", align_corners=True),
    "nearest": lambda y: F.interpolate(y, scale_factor=2, mode="nearest"),
    "avg_pool2d": lambda y: F.avg_pool2d(y, 3, stride=1, padding=1),
    "adaptive_avg_pool2d": lambda y: F.adaptive_avg_pool2d(y, 3),
    "avg_pool1d": lambda y: F.avg_pool1d(y.flatten(2), 2).unflatten(2, (2, 4)),
    "adaptive_avg_pool1d": lambda y: F.adaptive_avg_pool1d(y.flatten(2), 6).unflatten(2, (2, 3)),
}


@pytest.mark.parametrize("name", SPATIAL_OPS)
def test_upsampling_and_average_pooling_over_space_fold_over_channels(name: str):
    _, report = fold_checked(Spatial(SPATIAL_OPS[name]), (_x(B, C, 4, 4),), {"norm": True})
    assert report.norms[0].producers == ("conv.bias", "conv.weight")


def test_upsampling_along_the_normalized_dim_breaks():
    _, report = fold_checked(Spatial(SPATIAL_OPS["bilinear"], over_space=True), (_x(B, C, 4, 4),), {"norm": False})
    assert "aten.upsample_bilinear2d mixes entries along the normalized dim (a spatial dim)" in reason_of(report, "norm")


class WhereBeside(nn.Module):
    """Token embeddings read by a LayerNorm and, through ``where``, by a second LayerNorm beside a model
    input (never zero-mean): centering the embeddings shifts the second norm's input by the rows' means,
    a ones-vector shift where the condition is one per row, which that norm removes."""

    def __init__(self, per_channel: bool):
        super().__init__()
        self.per_channel = per_channel
        self.tok = nn.Embedding(11, C)
        self.norm, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, ids, x):  # ids (B, T), x (B, T, C)
        h = self.tok(ids)
        condition = x > 0 if self.per_channel else (ids == IMAGE_TOKEN).unsqueeze(-1)  # (B, T, C) / (B, T, 1)
        return self.norm(h), self.norm2(torch.where(condition, 0.0, h) + x)


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_shift_through_where_reaches_a_norm_as_a_ones_vector_only_with_a_row_condition(per_channel: bool):
    _, report = fold_checked(WhereBeside(per_channel), (_ids(), _x(B, T, C, seed=1)),
                             {"norm": not per_channel, "norm2": False})
    if per_channel:
        assert "not closed" in reason_of(report, "norm")


class GatherBeside(nn.Module):
    """Token embeddings read by a LayerNorm and, gathered at the tokens that sort first by ``noise``, by a
    second LayerNorm beside a model input (never zero-mean): centering the embeddings shifts the second
    norm's input by the gathered rows' means, a ones-vector shift when the index is one per row."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(11, C)
        self.norm, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, ids, noise, x):  # ids (B, T), noise (B, T) or (B, T, C), x (B, KEEP, C)
        h = self.tok(ids)
        index = torch.argsort(noise, dim=1)[:, :KEEP]
        if index.dim() == 2:
            index = index.unsqueeze(-1).repeat(1, 1, C)
        return self.norm(h), self.norm2(torch.gather(h, 1, index) + x)


@pytest.mark.parametrize("per_entry", [False, True])
def test_a_shift_through_gather_reaches_a_norm_as_a_ones_vector_only_with_a_row_index(per_entry: bool):
    noise = _noise(B, T, C) if per_entry else _noise(B, T)
    _, report = fold_checked(GatherBeside(), (_ids(), noise, _x(B, KEEP, C, seed=1)),
                             {"norm": not per_entry, "norm2": False})
    if per_entry:
        assert "aten.gather, which does not pass a ones-vector shift" in reason_of(report, "norm")


class GridSampled(nn.Module):
    """A learned position table (1, C, 4, 4) resampled by ``grid_sample`` at per-image grid points and
    added to a 1x1-conv patch embedding, then a LayerNorm over the channels (GLM-Image's vision
    embeddings); for the negative case, the sampled table alone is normalized over its last spatial dim."""

    def __init__(self, mode: str, padding_mode: str, over_space: bool = False):
        super().__init__()
        self.mode, self.padding_mode, self.over_space = mode, padding_mode, over_space
        self.conv = nn.Conv2d(C, C, 1)
        self.pos = nn.Parameter(torch.randn(1, C, 4, 4))
        self.norm = nn.LayerNorm(3 if over_space else C)

    def forward(self, x, grid):  # x (B, C, 3, 3), grid (B, 3, 3, 2) in [-1.2, 1.2]: some points outside
        pos = F.grid_sample(self.pos.expand(x.shape[0], -1, -1, -1), grid, mode=self.mode,
                            padding_mode=self.padding_mode, align_corners=False)  # (B, C, 3, 3)
        if self.over_space:
            return self.norm(pos)
        return self.norm((self.conv(x) + pos).permute(0, 2, 3, 1))


def _grid(seed: int = 0):
    return torch.rand(B, 3, 3, 2, generator=torch.Generator().manual_seed(seed)) * 2.4 - 1.2


@pytest.mark.parametrize(("mode", "padding_mode"), [("bilinear", "zeros"), ("bicubic", "border"),
                                                    ("nearest", "reflection")])
def test_grid_sampling_a_position_table_folds_over_channels(mode: str, padding_mode: str):
    _, report = fold_checked(GridSampled(mode, padding_mode), (_x(B, C, 3, 3), _grid()), {"norm": True})
    assert report.norms[0].producers == ("conv.bias", "conv.weight", "pos")


def test_grid_sampling_along_the_normalized_dim_breaks():
    _, report = fold_checked(GridSampled("bilinear", "zeros", over_space=True), (_x(B, C, 3, 3), _grid()),
                             {"norm": False})
    assert "mixes entries along the normalized dim (its weights vary along every dim but the channels)" in reason_of(
        report, "norm")


class BaggedPositions(nn.Module):
    """A position table mixed per token by an embedding bag (each token's 4 nearest rows, bilinear weights:
    Kimi-K2.5's interpolated positions) added to a patch projection, then a LayerNorm."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        self.proj = nn.Linear(C, C)
        self.table = nn.Parameter(torch.randn(9, C))
        self.norm = nn.LayerNorm(C)

    def forward(self, x, rows, weights):  # x (B, T, C), rows (B·T, 4) table rows, weights (B·T, 4)
        per_sample = weights if self.mode == "sum" else None  # torch takes per-sample weights with sum only
        pos = F.embedding_bag(rows, self.table, mode=self.mode, per_sample_weights=per_sample)  # (B·T, C)
        return self.norm(self.proj(x) + pos.view(x.shape))


def _bags(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 9, (B * T, 4), generator=gen), torch.rand(B * T, 4, generator=gen)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_an_embedding_bag_summing_or_averaging_whole_table_rows_folds(mode: str):
    _, report = fold_checked(BaggedPositions(mode), (_x(B, T, C), *_bags()), {"norm": True})
    assert report.norms[0].producers == ("proj.bias", "proj.weight", "table")


def test_an_embedding_bag_taking_each_features_max_breaks():
    _, report = fold_checked(BaggedPositions("max"), (_x(B, T, C), *_bags()), {"norm": False})
    assert "with mode max: each feature comes from its own row" in reason_of(report, "norm")


class SlidingWindows(nn.Module):
    """A projection cut into overlapping windows of 3 tokens, stride 2 (``unfold`` along the tokens, Granite
    Speech 5's block attention), each window's token vectors normalized over the features; for the negative
    case, windows cut along the features and normalized over the window."""

    def __init__(self, along_features: bool = False):
        super().__init__()
        self.along_features = along_features
        self.proj = nn.Linear(C, C)
        self.norm = nn.LayerNorm(2 if along_features else C)

    def forward(self, x):  # (B, T, C)
        h = self.proj(x)
        if self.along_features:
            return self.norm(h.unfold(2, 2, 2))  # (B, T, C/2, 2): each window 2 features of one token
        return self.norm(h.unfold(1, 3, 2).transpose(-1, -2))  # (B, windows, 3, C)


def test_sliding_windows_along_the_tokens_fold_a_norm_over_the_features():
    _, report = fold_checked(SlidingWindows(), (_x(B, T, C),), {"norm": True})
    assert report.norms[0].producers == ("proj.bias", "proj.weight")


def test_sliding_windows_along_the_features_break():
    _, report = fold_checked(SlidingWindows(along_features=True), (_x(B, T, C),), {"norm": False})
    assert "along its window dim: each window takes entries of several rows" in reason_of(report, "norm")


class WindowsOfAResidual(nn.Module):
    """The projection feeds a norm directly and, added to the raw input (not zero-mean: that norm stays a
    LayerNorm), a norm over the features of sliding windows: centering the projection for the first norm
    shifts the second's input by a constant along the features, which it absorbs only if the shift passes
    the windows as such."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(C, C)
        self.norm1, self.norm2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def forward(self, x):  # (B, T, C)
        h = self.proj(x)
        windows = (h + x).unfold(1, 3, 2).transpose(-1, -2)  # (B, windows, 3, C)
        return self.norm1(h), self.norm2(windows)


def test_a_centering_shift_passes_sliding_windows_to_a_norm_that_absorbs_it():
    fold_checked(WindowsOfAResidual(), (_x(B, T, C),), {"norm1": True, "norm2": False})
