"""engine.math's measure of how far a norm input is from zero-mean (shared by verify and inspect)."""
import torch

from normfold.engine.math import mean_over_rms


def test_mean_over_rms_is_zero_for_zero_mean_rows_and_one_for_constant_rows():
    x = torch.randn(5, 16, dtype=torch.float64)
    centered = x - x.mean(-1, keepdim=True)
    assert mean_over_rms(centered).max() < 1e-15
    assert torch.allclose(mean_over_rms(torch.full((3, 8), -2.0)), torch.ones(3, dtype=torch.float64))


def test_mean_over_rms_is_per_row_float64_and_zero_for_all_zero_rows():
    x = torch.stack([torch.zeros(4), torch.tensor([1.0, 1.0, 1.0, -1.0])]).half()
    ratio = mean_over_rms(x)
    assert ratio.dtype == torch.float64 and ratio.tolist() == [0.0, 0.5]
