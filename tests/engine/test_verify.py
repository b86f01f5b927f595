"""verify(): it compares every output leaf, fails when it compares nothing or different structures,
judges rounded weights against a tolerance measured from the original's own error, and measures each
output elementwise so that no value (a mask's finfo.min, inf, nan) hides another's error."""
from __future__ import annotations

import copy
import dataclasses
from collections import namedtuple

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import normfold
from normfold.engine import FoldVerificationError
from normfold.engine.verify import OWN_ERROR_MULTIPLE, flatten_outputs, measured_tolerance, output_error, rounding_error

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
    from normfold.engine import transform

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


# ------------------------------------------------------------------------------ the metric: nothing hides an error

class Masked(nn.Module):
    """Logits with their last column masked by ``masked_fill(finfo.min)`` (an action mask, padding)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, C)

    def forward(self, x):
        logits = self.head(self.ln(self.fc(x)))
        mask = torch.zeros(C, dtype=torch.bool, device=x.device)
        mask[-1] = True
        return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def _wrong_head(model: nn.Module) -> nn.Module:
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.head.weight.mul_(3.0)
        wrong.head.bias.add_(10.0)
    return wrong


@pytest.mark.parametrize("judged", [{}, {"stored_dtype": torch.bfloat16}], ids=["float64 bound", "measured bound"])
def test_a_masked_fill_min_column_does_not_hide_a_wrong_head_and_the_worst_element_is_named(judged):
    # before: errors were relative to the largest output, finfo.min: max_rel 7e-308, ok=True (and the
    # own error of the measured bound ~1, so that bound passed anything)
    model = Masked()
    result = normfold.verify(model, _wrong_head(model), _x(), **judged)
    assert not result.ok and result.why is None and result.max_rel_error > 1.0
    worst = result.worst
    assert worst.output == "out" and len(worst.index) == 2 and worst.index[1] != C - 1  # not the masked column
    assert abs(worst.folded - worst.original) > 1.0 and f"out[{worst.index[0]}, {worst.index[1]}]" in str(result)
    if worst.input == 0:  # the example call: the value is the original's output there
        assert worst.original == pytest.approx(model(*_x())[tuple(worst.index)].item(), abs=1e-5)


def test_a_correct_fold_of_a_model_with_a_masked_column_still_passes():
    model = Masked()
    folded, report = normfold.fold(model, _x())
    assert report.verification.ok and report.num_foldable == 1 and report.verification.max_rel_error <= 1e-12
    rounded = normfold.verify(model, _rounded(folded, torch.bfloat16), _x(), stored_dtype=torch.bfloat16)
    assert rounded.ok and 0 < rounded.stored_dtype_own_error < 0.1


SPECIALS = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"), "finfo.min": "min", "finfo.max": "max"}


def _with(value, row: int):
    """An output function putting ``value`` (a number, or "min"/"max" of the output's finfo) at [row, 0]."""
    def put(h):
        fill = torch.finfo(h.dtype).min if value == "min" else torch.finfo(h.dtype).max if value == "max" else value
        h = h.clone()
        h[row, 0] = fill
        return h
    return put


def _returning(model: Returns, value) -> Returns:
    """``model``'s weights, returning ``value(lin(x))``."""
    other = copy.deepcopy(model)
    other.value = value
    return other


@pytest.mark.parametrize("special", SPECIALS)
def test_inf_nan_and_finfo_extremes_must_sit_in_the_same_places_with_the_same_kind(special):
    value = SPECIALS[special]
    original = Returns(_with(value, 0))
    same = normfold.verify(original, _returning(original, _with(value, 0)), _x())
    assert same.ok, same  # the same kind in the same place, even where values are not comparable (nan, finfo.min)
    moved = normfold.verify(original, _returning(original, _with(value, 1)), _x())
    assert not moved.ok and moved.max_rel_error == float("inf") and moved.worst.index == [0, 0]
    finite = normfold.verify(original, _returning(original, lambda h: h), _x())
    assert not finite.ok and finite.worst.index == [0, 0]


def test_a_mask_in_float16_finfo_min_matches_one_in_float64_but_not_a_finite_value():
    ref = torch.tensor([1.0, torch.finfo(torch.float64).min, 2.0], dtype=torch.float64)
    half = torch.tensor([1.0, torch.finfo(torch.float16).min, 2.0], dtype=torch.float16)
    assert output_error(ref, half).error < 1e-3  # both are a mask: the kind matches
    assert output_error(ref, half.double()).error == float("inf")  # -65504 in float64 is an ordinary number
    assert output_error(ref, half.double(), out_dtype=torch.float16).error < 1e-3  # unless said where it came from


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), cols=st.integers(2, 9), masked=st.floats(0.0, 0.5), scale=st.floats(1e-3, 1e3),
       step=st.floats(1e-7, 1e2), seed=st.integers(0, 2 ** 16))
def test_output_error_finds_a_single_changed_element_whatever_else_the_output_holds(rows, cols, masked, scale, step,
                                                                                     seed):
    """One element moved by step·(typical + |a|) gives an error of about step, at that element, however
    large or masked the other elements are; an unchanged output gives 0."""
    generator = torch.Generator().manual_seed(seed)
    a = scale * torch.randn(rows, cols, generator=generator, dtype=torch.float64)
    mask = torch.rand(rows, cols, generator=generator) < masked
    mask.view(-1)[0] = False  # at least one ordinary element
    a[mask] = torch.finfo(torch.float64).min
    ordinary = (~mask).view(-1).nonzero().view(-1)
    where = int(ordinary[torch.randint(len(ordinary), (1,), generator=generator)])
    typical = a.view(-1)[ordinary].abs().median().item() or 1.0
    b = a.clone()
    b.view(-1)[where] += step * (typical + abs(a.view(-1)[where].item()))
    assert output_error(a, a).error == 0.0
    found = output_error(a, b)
    assert found.error == pytest.approx(step, rel=1e-6) and found.index == divmod(where, cols)


class LengthsBeside(nn.Module):
    """A float output beside an integer one (the output lengths of an audio encoder such as Parakeet)."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.proj(x)), torch.full((x.shape[0],), x.shape[1], dtype=torch.int32)


def test_an_integer_output_has_no_rounding_error_and_the_float32_proof_runs():
    """Fails on main e0bdee3: the own-error measure of the model-dtype check asked ``torch.finfo`` of
    the integer output and the proof ended in a TypeError (a FoldError "verifying failed")."""
    assert rounding_error(torch.tensor([3, 4]), torch.tensor([3, 4]), torch.float32) == 0.0
    _, report = normfold.fold(LengthsBeside().eval(), (torch.randn(2, 3, 4),))
    check = report.verification.model_dtype_check
    assert report.num_foldable == 1 and check is not None and 0 < check.own_error < 1e-5


class DefaultDtypeMask(nn.Module):
    """Builds a position mask in torch's default dtype and fills it with the minimum of the input's dtype,
    as XGLM's and Kosmos-2's sinusoidal positions and masks do."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):  # (B, T, C)
        mask = torch.zeros(x.shape[1]).masked_fill(torch.arange(x.shape[1]) > 99, torch.finfo(x.dtype).min)  # (T,)
        return self.norm(self.proj(x) + mask[:, None].to(x.dtype))


def test_a_model_making_tensors_in_the_default_dtype_is_proved_in_float64_with_the_default_restored():
    """Fails on main 61708a4: its float64 copy raised ("value cannot be converted to type float without
    overflow") and the proof fell back to float32."""
    model = DefaultDtypeMask().eval()
    result = normfold.verify(model, copy.deepcopy(model), (torch.randn(2, 3, 4),))
    assert result.ok and result.compared_in == "float64" and result.fallback is None
    assert torch.get_default_dtype() == torch.float32


class _TiedTopK(nn.Module):
    """Rows ordered by a top-k over scores that tie exactly: token 2j reads feature 2j, token 2j + 1 feature
    2j + 1, and the two score weights are equal, so which comes first is decided by rounding (DETR-style
    query selection: D-FINE, DEIMv2, PP-DocLayout)."""

    def __init__(self, pairs: int = 16):
        super().__init__()
        self.score = nn.Linear(2 * pairs, 1, bias=False)
        self.value = nn.Linear(2 * pairs, 4)
        with torch.no_grad():
            self.score.weight.copy_(torch.arange(pairs, dtype=torch.float32).repeat_interleave(2)[None] + 1)

    def forward(self, x):  # (B, T, 2·pairs)
        order = self.score(x).squeeze(-1).topk(x.shape[1], dim=1).indices  # (B, T)
        return self.value(x).gather(1, order[..., None].expand(-1, -1, 4))  # (B, T, 4)


def _one_hot_tokens(pairs: int = 16) -> torch.Tensor:
    return torch.eye(2 * pairs)[None].repeat(2, 1, 1)  # (B, T, 2·pairs)


def test_a_failed_proof_at_an_output_that_jumps_says_the_original_itself_jumps_there():
    torch.manual_seed(0)
    original = _TiedTopK().eval()
    ties_broken = copy.deepcopy(original)
    with torch.no_grad():  # the odd feature of each pair scores higher by one float32 unit: each tie flips
        ties_broken.score.weight[0, 1::2] = torch.nextafter(ties_broken.score.weight[0, 1::2], torch.tensor(1e9))
    result = normfold.verify(original, ties_broken, (_one_hot_tokens(),), num_random=0)
    assert not result.ok and result.original_jump is not None and result.original_jump > result.tolerance
    assert "jumps at this input" in result.failure()


def test_a_wrong_transform_of_a_model_with_ties_is_not_called_a_jump():
    torch.manual_seed(0)
    original = _TiedTopK().eval()
    wrong = copy.deepcopy(original)
    with torch.no_grad():
        wrong.value.bias.add_(1e-3)
    result = normfold.verify(original, wrong, (torch.randn(2, 32, 32),), num_random=0)  # no ties: distinct rows
    assert not result.ok and result.original_jump is not None
    assert result.original_jump < 10 * result.tolerance  # a continuous output moves by about the weights' move
    assert "jumps" not in result.failure()
