"""``normfold.hf.saved_weights``: stored tensors against the re-derived fold, within one ulp of the stored dtype."""
from __future__ import annotations

import pytest
import torch

from normfold.hf.saved_weights import FLOAT32_REDUCTION_ULPS, compare_weights, tensor_difference, ulp


@pytest.mark.parametrize("dtype, value, expected", [
    (torch.bfloat16, 1.0, 2.0 ** -7), (torch.bfloat16, 1.5, 2.0 ** -7), (torch.bfloat16, 2.0, 2.0 ** -6),
    (torch.float16, 1.0, 2.0 ** -10), (torch.float32, 1.0, 2.0 ** -23), (torch.float32, -0.75, 2.0 ** -24),
    (torch.float16, 0.0, 2.0 ** -24),  # zero: the subnormal spacing, not 0
])
def test_ulp_is_the_spacing_of_the_dtype_at_that_magnitude(dtype, value, expected):
    assert ulp(torch.tensor([value]), dtype).item() == expected
    up = torch.nextafter(torch.tensor([value], dtype=torch.float32), torch.tensor([float("inf")]))
    if dtype == torch.float32 and value > 0:  # the definition agrees with the next representable value
        assert (up - value).item() == expected


def _bf16(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bfloat16)


def test_bit_identical_tensors_differ_in_nothing_nan_matching_nan_included():
    a = _bf16([1.0, -2.0, float("nan"), float("inf")])
    row = tensor_difference("w", a, a.clone())
    assert row["ok"] and row["num_differing"] == 0 and row["max_ulps"] == 0.0


def test_one_ulp_of_the_stored_dtype_passes_and_two_fail():
    derived = _bf16([1.0, 4.0])
    one = _bf16([1.0 + 2.0 ** -7, 4.0])
    two = _bf16([1.0 + 2.0 ** -6, 4.0])
    assert tensor_difference("w", derived, one)["ok"] and tensor_difference("w", derived, one)["max_ulps"] == 1.0
    row = tensor_difference("w", derived, two)
    assert not row["ok"] and row["max_ulps"] == 2.0 and "w differs" in row["why"] and "2 ulp of bfloat16" in row["why"]


def test_float32_elements_near_zero_may_move_by_a_few_float32_ulps_of_the_tensor_scale():
    """A reduction summed in another order moves a value that cancels to ~0 by ulps of its terms."""
    derived = torch.tensor([1.0, 0.0])
    within = torch.tensor([1.0, FLOAT32_REDUCTION_ULPS * 2.0 ** -23])
    beyond = torch.tensor([1.0, 2 * FLOAT32_REDUCTION_ULPS * 2.0 ** -23])
    assert tensor_difference("w", derived, within)["ok"]
    assert not tensor_difference("w", derived, beyond)["ok"]


@pytest.mark.parametrize("stored, why", [
    (_bf16([1.0, float("nan")]), "differs"),        # NaN where the fold has a number
    (_bf16([1.0, 2.0, 3.0]), "has shape (3,)"),
    (torch.tensor([1.0, 2.0]), "stored as float32"),
])
def test_nan_shape_and_dtype_differences_fail(stored, why):
    row = tensor_difference("w", _bf16([1.0, 2.0]), stored)
    assert not row["ok"] and why in row["why"]


def test_integer_tensors_must_be_equal():
    assert tensor_difference("ids", torch.arange(3), torch.arange(3))["ok"]
    assert "1 of 3 values differ" in tensor_difference("ids", torch.arange(3), torch.tensor([0, 1, 5]))["why"]


def test_compare_weights_names_the_worst_tensor_and_accepts_a_tied_name_stored_once():
    derived = {"a": _bf16([1.0, 2.0]), "b": _bf16([4.0]), "tied": _bf16([1.0, 2.0])}
    stored = {"a": _bf16([1.0, 2.0]), "b": _bf16([4.0 * 1.1])}
    aliases = {"a": ["a", "tied"], "tied": ["a", "tied"]}
    result = compare_weights(derived, stored, stored.__getitem__, aliases)
    assert not result["ok"] and result["num_tensors"] == 2 and result["worst"]["name"] == "b"
    assert result["why"].startswith("b differs")
    stored["b"] = _bf16([4.0])
    assert compare_weights(derived, stored, stored.__getitem__, aliases)["ok"]


@pytest.mark.parametrize("stored_names, why", [
    (["a", "b", "extra"], "holds extra, which the fold does not write"),
    (["a"], "lacks b, which the fold writes"),
])
def test_compare_weights_requires_the_same_key_set(stored_names, why):
    derived = {"a": _bf16([1.0]), "b": _bf16([2.0])}
    result = compare_weights(derived, stored_names, lambda name: derived.get(name, _bf16([0.0])), {})
    assert not result["ok"] and result["num_tensors"] == 0 and why in result["why"]


def test_compare_weights_that_compared_nothing_fails():
    result = compare_weights({}, [], lambda name: None, {})
    assert result["ok"] is False and "compared nothing" in result["why"]


@pytest.mark.parametrize("setting", ["1", "0"])
def test_comparing_the_stored_tensors_shows_a_bar_over_them_only_when_progress_is_on(capsys, monkeypatch, setting):
    pytest.importorskip("tqdm")
    monkeypatch.setenv("NORMFOLD_PROGRESS", setting)
    derived = {name: _bf16([1.0, 2.0]) for name in ("a", "b", "c")}
    assert compare_weights(derived, list(derived), lambda name: derived[name].clone(), {})["ok"]
    err = capsys.readouterr().err
    assert ("comparing stored tensors: " in err and "| 0/3 " in err) if setting == "1" else err == ""
