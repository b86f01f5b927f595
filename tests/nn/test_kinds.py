"""normfold.nn.kinds: the one answer to "is this module a norm, and of which kind"."""
import pytest
import torch
from torch import nn

from normfold.nn import FusedAddRMSNorm, LayerNorm, RMSNorm
from normfold.nn.kinds import LAYER_NORM_TYPES, RMS_NORM_TYPES, norm_kind, norm_modules


class T5LayerNorm(nn.Module):  # no bias, no mean subtraction: an RMSNorm by another name
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))


class MyLayerNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.bias = nn.Parameter(torch.zeros(4))


@pytest.mark.parametrize("module, kind", [
    (nn.LayerNorm(4), "LayerNorm"),
    (nn.LayerNorm(4, bias=False), "LayerNorm"),
    (LayerNorm(4), "LayerNorm"),
    (nn.RMSNorm(4), "RMSNorm"),
    (RMSNorm(4), "RMSNorm"),
    (FusedAddRMSNorm(4), "RMSNorm"),
    (nn.GroupNorm(2, 4), "GroupNorm"),
    (nn.BatchNorm1d(4), "BatchNorm"),
    (nn.SyncBatchNorm(4), "BatchNorm"),
    (nn.InstanceNorm2d(4), "InstanceNorm"),
    (T5LayerNorm(), "RMSNorm"),
    (MyLayerNorm(), "LayerNorm"),
])
def test_norm_kind_names_each_norm_class(module, kind):
    assert norm_kind(module) == kind


@pytest.mark.parametrize("module", [LayerNorm(4, bias=False), LayerNorm(4, elementwise_affine=False)])
def test_normfold_layernorm_without_bias_is_a_layernorm_not_an_rmsnorm(module):
    # It subtracts the mean: recognising it by its class name alone called it an RMSNorm.
    assert norm_kind(module) == "LayerNorm"


@pytest.mark.parametrize("module", [nn.Linear(2, 2), nn.Sequential(MyLayerNorm()), nn.Dropout()])
def test_non_norms_have_no_kind(module):
    assert norm_kind(module) is None


def test_type_tuples_hold_torch_and_normfold_classes():
    assert set(LAYER_NORM_TYPES) == {nn.LayerNorm, LayerNorm}
    assert set(RMS_NORM_TYPES) == {nn.RMSNorm, RMSNorm}


def test_norm_modules_lists_paths_in_registration_order():
    model = nn.Sequential(nn.Linear(4, 4), LayerNorm(4), nn.Sequential(RMSNorm(4), nn.BatchNorm1d(4)))
    assert [(p, k) for p, _m, k in norm_modules(model)] == [("1", "LayerNorm"), ("2.0", "RMSNorm"),
                                                            ("2.1", "BatchNorm")]
