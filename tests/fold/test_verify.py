"""verify(): it compares every output leaf, fails when it compares nothing or different structures,
and judges rounded weights against a tolerance measured from the original's own error."""
from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import normfold
from normfold.fold import FoldVerificationError
from normfold.fold.verify import OWN_ERROR_MULTIPLE, flatten_outputs, measured_tolerance

C = 8


@dataclasses.dataclass
class PlainOutput:  # not a pytree: before, such outputs flattened to nothing
    hidden: torch.Tensor
    extra: dict


@dataclasses.dataclass
class RegisteredOutput:
    hidden: torch.Tensor


pytree.register_dataclass(RegisteredOutput)
Pair = namedtuple("Pair", "first second")


class Net(nn.Module):
    """Pre-LN block whose forward wraps its output in ``wrap`` (a dataclass, a namedtuple, ...)."""

    def __init__(self, wrap=lambda h: h, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, C)
        self.wrap = wrap

    def forward(self, x):
        return self.wrap(self.head(self.ln(self.fc(x))))


def _x():
    return (torch.randn(3, C, generator=torch.Generator().manual_seed(0)),)


WRAPS = {  # (namedtuples were compared before too; test_flatten_outputs_... names their leaves)
    "plain dataclass": lambda h: PlainOutput(h, {"twice": 2 * h}),
    "registered dataclass": lambda h: RegisteredOutput(h),
}


@pytest.mark.parametrize("wrap", WRAPS, ids=list(WRAPS))
def test_unrelated_models_with_structured_outputs_are_compared_and_differ(wrap):
    result = normfold.verify(Net(WRAPS[wrap], seed=0), Net(WRAPS[wrap], seed=1), _x())
    assert not result.ok and result.why is None and result.max_rel_error > 1e-3
    same = normfold.verify(Net(WRAPS[wrap]), Net(WRAPS[wrap]), _x())
    assert same.ok and same.outputs  # the same model: compared, and equal


def test_flatten_outputs_names_every_leaf_of_dataclasses_pytrees_and_model_outputs():
    h = torch.ones(2)
    assert [n for n, _ in flatten_outputs(PlainOutput(h, {"a": (h, None)}))] == [
        "out.hidden", "out.extra['a'][0]", "out.extra['a'][1]"]
    assert [n for n, _ in flatten_outputs(Pair(h, [RegisteredOutput(h)]))] == ["out.first", "out.second[0].hidden"]
    transformers = pytest.importorskip("transformers")
    output = transformers.modeling_outputs.CausalLMOutputWithPast(logits=h, hidden_states=(h, h))
    assert [n for n, _ in flatten_outputs(output)] == ["out['logits']", "out['hidden_states'][0]",
                                                       "out['hidden_states'][1]"]


class Returns(nn.Module):
    def __init__(self, value):
        super().__init__()
        self.lin = nn.Linear(C, C)
        self.value = value

    def forward(self, x):
        return self.value(self.lin(x))


@pytest.mark.parametrize("value", [lambda h: None, lambda h: {"n": 3, "name": "x"}, lambda h: h[:0]],
                         ids=["None", "no tensors", "empty tensor"])
def test_outputs_holding_no_tensor_element_fail_as_compared_nothing(value):
    result = normfold.verify(Returns(value), Returns(value), _x())
    assert not result.ok and "compared nothing" in result.why
    assert "compared nothing" in str(result) and result.to_dict()["ok"] is False


@pytest.mark.parametrize("a, b, message", [
    (lambda h: (h, h), lambda h: (h,), "different outputs"),
    (lambda h: {"x": h}, lambda h: {"y": h}, "different outputs"),
    (lambda h: h, lambda h: h[:, :2], "shape"),
    (lambda h: h, lambda h: h.long(), "integer"),
    (lambda h: (h, None), lambda h: (h, h), "NoneType"),
    (lambda h: (h, "a"), lambda h: (h, "b"), "differs"),
], ids=["count", "names", "shape", "dtype kind", "None vs tensor", "string"])
def test_outputs_of_different_structure_fail_with_a_reason(a, b, message):
    result = normfold.verify(Returns(a), Returns(b), _x())
    assert not result.ok and message in result.why


def test_fold_refuses_a_wrong_transform_of_a_model_returning_a_dataclass(monkeypatch):
    from normfold.fold import transform

    real = transform.apply_plan

    def broken(model, plan):
        real(model, plan)
        with torch.no_grad():
            model.head.weight.mul_(1.1)
        return model

    monkeypatch.setattr(transform, "apply_plan", broken)
    with pytest.raises(FoldVerificationError, match="relative error"):
        normfold.fold(Net(WRAPS["registered dataclass"]), _x())


def _rounded(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its weights rounded to ``dtype`` and back (what a saved checkpoint holds)."""
    return copy.deepcopy(model).to(dtype).to(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_stored_dtype_tolerance_passes_rounding_and_fails_a_scaled_head(dtype):
    model = Net()
    stored = _rounded(model, dtype)
    result = normfold.verify(model, stored, _x(), stored_dtype=dtype)
    assert result.ok and result.stored_dtype_own_error > 0
    assert result.tolerance == measured_tolerance(result.stored_dtype_own_error, dtype)[0]
    assert f"{OWN_ERROR_MULTIPLE:g} x" in result.tolerance_rule and str(dtype).split(".")[1] in result.tolerance_rule
    with torch.no_grad():
        stored.head.weight.mul_(1.1)
    assert not normfold.verify(model, stored, _x(), stored_dtype=dtype).ok


def test_measured_tolerance_is_a_multiple_of_the_own_error_plus_one_rounding():
    tolerance, rule = measured_tolerance(1e-3, torch.bfloat16)
    assert tolerance == pytest.approx(OWN_ERROR_MULTIPLE * 1e-3 + 2.0 ** -8)
    assert "bfloat16" in rule and "1.00e-03" in rule


def test_tolerance_and_stored_dtype_exclude_each_other():
    with pytest.raises(ValueError, match="not both"):
        normfold.verify(Net(), Net(), _x(), tolerance=1e-3, stored_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="stored_dtype"):
        normfold.verify(Net(), Net(), _x(), stored_dtype=torch.int8)


def test_exact_transform_folds_a_float64_copy_of_the_original_and_a_wrong_one_fails():
    """The proof's one float64 copy: the original's outputs are recorded on it, then it is folded in
    place by ``exact_transform`` and compared; the user's model is never touched."""
    model = Net()
    before = copy.deepcopy(model.state_dict())
    seen = []

    def same_model(m):  # the fold of a model into itself
        seen.append((m is model, {p.dtype for p in m.parameters()}))
        return m

    def scaled_head(m):
        with torch.no_grad():
            m.head.weight.mul_(1.1)
        return m

    assert normfold.verify(model, model, _x(), exact_transform=same_model).ok
    assert seen == [(False, {torch.float64})]
    wrong = normfold.verify(model, model, _x(), exact_transform=scaled_head)
    assert not wrong.ok and wrong.why is None and wrong.max_rel_error > 1e-3
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_folded_exact_and_exact_transform_exclude_each_other():
    with pytest.raises(ValueError, match="not both"):
        normfold.verify(Net(), Net(), _x(), folded_exact=Net().double(), exact_transform=lambda m: m)


def test_the_fold_copies_the_model_twice_its_own_copy_and_one_float64_copy_for_the_proof(monkeypatch):
    """The float64 side of the proof is the original's float64 copy folded in place after its outputs
    are recorded (before: a float64 copy of the original, another folded, and a copy of that)."""
    model, copies = Net(), []
    deepcopy = copy.deepcopy

    def counting(value, memo=None, _nil=[]):
        copies.append(value is model)
        return deepcopy(value, memo)

    monkeypatch.setattr(copy, "deepcopy", counting)
    _, report = normfold.fold(model, _x())
    assert report.verification.ok and sum(copies) == 2
