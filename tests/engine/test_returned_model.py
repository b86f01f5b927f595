"""The model a fold returns is the model judged: a plan that overflows the model's dtype is refused
naming the tensor, and the returned model, run in its own dtype, must match the original within the
tolerance measured from the original's own error there, with no inf/nan where the original is finite."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import normfold
from normfold.engine import FoldError, FoldVerificationError
from normfold.engine.verify import MODEL_DTYPE_OWN_ERROR_MULTIPLE

C = 8


class Net(nn.Module):
    """Linear → LayerNorm → head; ``gamma``: the norm's γ, ``head_scale``: multiplies the head's weight."""

    def __init__(self, gamma: float | None = None, head_scale: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, C)
        self.register_buffer("never_finite", torch.tensor([0.0, float("-inf")]))  # a mask table, -inf already
        with torch.no_grad():
            if gamma is not None:
                self.ln.weight.fill_(gamma)
            self.head.weight.mul_(head_scale)

    def forward(self, x):
        return self.head(self.ln(self.fc(x)))


def _x(dtype=torch.float32):
    return (torch.randn(4, C, generator=torch.Generator().manual_seed(0)).to(dtype),)


def test_a_float16_fold_whose_gamma_times_w_overflows_is_refused_naming_the_tensor():
    # γ = 300 and head weights up to ~350: γ·W reaches ~1e5 > 65504. Before: head.weight came back inf,
    # the model gave inf/nan, and report.verification.ok was True
    model = Net(gamma=300.0, head_scale=1000.0).half().eval()
    with pytest.raises(FoldError, match=r"Net: head\.weight overflows float16 after folding ln's γ/β into it "
                                        r"\(max \|value\| 1\.\d+e\+05 > 65504\): fold in float32 \(model\.float\(\)\) "
                                        r"or with fold_affine=False"):
        normfold.fold(model, _x(torch.float16))
    folded, report = normfold.fold(model, _x(torch.float16), fold_affine=False)  # γ stays in the norm: fits
    assert report.verification.ok and report.verification.model_dtype_check.dtype == "float16"
    assert torch.isfinite(folded.head.weight).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_correct_fold_is_judged_in_the_models_dtype_and_passes(dtype):
    _, report = normfold.fold(Net().to(dtype), _x(dtype))
    check = report.verification.model_dtype_check
    assert report.verification.ok and check.dtype == str(dtype).split(".")[1] and check.ok
    assert 0 < check.error <= check.tolerance and f"{MODEL_DTYPE_OWN_ERROR_MULTIPLE:g} x" in check.tolerance_rule
    assert report.verification.to_dict()["model_dtype_check"]["ok"] is True


def test_a_fold_wrong_only_in_the_models_dtype_is_refused_naming_the_worst_element(monkeypatch):
    # the float64 proof applies the plan to a float64 copy, exact here; the returned float32 model has
    # its weights rounded to bfloat16 on the way. Before: that model came back with ok=True
    from normfold.engine import transform

    real = transform.apply_plan

    def rounded_unless_float64(model, plan):
        real(model, plan)
        with torch.no_grad():
            for p in model.parameters():
                if p.dtype != torch.float64:
                    p.copy_(p.to(torch.bfloat16))
        return model

    monkeypatch.setattr(transform, "apply_plan", rounded_unless_float64)
    with pytest.raises(FoldVerificationError, match=r"folded model differs from the original: the returned model "
                                                    r"in float32: error .* > tolerance .* worst at out\[\d, \d\] on "
                                                    r"input \d: original .*, folded "):
        normfold.fold(Net(), _x())


def test_a_float64_model_is_judged_as_returned_not_as_rebuilt(monkeypatch):
    # a float64 model's proof rebuilt the fold on its own float64 copy: a returned model that differs
    # from that rebuild came back. Now the returned model itself is compared
    from normfold.engine import transform

    real, calls = transform.apply_plan, []

    def wrong_the_first_time(model, plan):
        real(model, plan)
        calls.append(1)
        if len(calls) == 1:  # the copy fold returns
            with torch.no_grad():
                model.head.weight.mul_(1.1)
        return model

    monkeypatch.setattr(transform, "apply_plan", wrong_the_first_time)
    with pytest.raises(FoldVerificationError, match="float64 max relative error"):
        normfold.fold(Net().double(), _x(torch.float64))


class Rescaled(nn.Module):
    """``lin(x)``, or ``lin(x) · 1000 / 1000``: the same function, but in float16 the product overflows."""

    def __init__(self, scale: float = 1.0):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(C, C)
        with torch.no_grad():
            self.lin.weight.mul_(100.0)
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale / self.scale


def test_a_returned_model_giving_inf_where_the_original_is_finite_fails_in_its_dtype():
    original, overflowing = Rescaled().half(), Rescaled(scale=1000.0).half()
    overflowing.load_state_dict(original.state_dict())
    x = _x(torch.float16)
    assert torch.isfinite(original(*x)).all() and not torch.isfinite(overflowing(*x)).all()
    reported = normfold.verify(original, overflowing, x)
    assert reported.ok and reported.model_dtype_check is None  # float64 equal; the own dtype only reported
    judged = normfold.verify(original, overflowing, x, judge_model_dtype=True)
    check = judged.model_dtype_check
    assert not judged.ok and check.error == float("inf") and not torch.isfinite(torch.tensor(check.worst.folded))
    assert "the returned model in float16: error inf" in judged.failure()
