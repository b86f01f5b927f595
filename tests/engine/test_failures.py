"""Every failure inside analyze / fold / verify is a FoldError naming the model and the step; the
verifier's fresh inputs come from the user's example; a model that cannot run in float64 is checked
in its own dtype, said so in the result, and a wrong fold still fails there (issue 16 item 5)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from normfold.engine import fold
from normfold.engine import ExampleInputsError, FoldError, FoldPlan, transform
from normfold.engine.pipeline import prove_fold
from normfold.engine.verify import fresh_inputs_like, verify

C = 8


class PreLN(nn.Module):
    """Linear → LayerNorm → Linear: the LayerNorm folds."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.ln, self.head = nn.Linear(C, C), nn.LayerNorm(C), nn.Linear(C, C)
        with torch.no_grad():  # γ = 1, β = 0 would hide a wrong affine fold
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.normal_()

    def forward(self, x):
        return self.head(self.ln(self.fc(x)))


class NoFloat64(PreLN):
    """Raises in float64, as XGLM does (torch.full of float64's finfo.min into a float32 tensor)."""

    def forward(self, x):
        if x.dtype == torch.float64:
            raise RuntimeError("value cannot be converted to type float without overflow")
        return super().forward(x)


class NanInFloat64(PreLN):
    """Gives nan in float64 and finite values in float32, as canine does."""

    def forward(self, x):
        out = super().forward(x)
        return out * float("nan") if x.dtype == torch.float64 else out


def _x(batch: int = 3):
    return (torch.randn(batch, C, generator=torch.Generator().manual_seed(0)),)


# ------------------------------------------------------------------------- failures are FoldErrors


def test_an_exception_while_applying_the_plan_is_a_fold_error_naming_the_model_and_the_step(monkeypatch):
    def broken(model, plan):
        raise KeyError("fc.weight")

    monkeypatch.setattr(transform, "apply_plan", broken)
    with pytest.raises(TypeError):  # the user's errors are still checked first, as TypeError/ValueError
        fold(PreLN(), "not inputs")
    with pytest.raises(FoldError, match=r"PreLN: applying the plan failed: KeyError") as caught:
        fold(PreLN(), _x())
    assert isinstance(caught.value.__cause__, KeyError)  # the original stays chained for debugging


# -------------------------------------------------------------------- fresh inputs from the example


def test_fresh_integers_are_the_examples_values_permuted_with_each_row_kept_whole():
    boxes = torch.tensor([[[0, 1, 5, 9], [2, 2, 3, 7], [1, 0, 4, 4]], [[3, 3, 8, 8], [0, 0, 1, 1], [6, 2, 7, 5]]])
    ids = torch.arange(12).reshape(2, 6) * 7
    fresh = fresh_inputs_like({"bbox": boxes, "input_ids": ids}, torch.Generator().manual_seed(0))
    rows = lambda t: sorted(map(tuple, t.reshape(-1, t.shape[-1]).tolist()))  # noqa: E731
    assert rows(fresh["bbox"]) == rows(boxes)                   # each box's corners stay together and ordered
    assert (fresh["bbox"][..., 2:] >= fresh["bbox"][..., :2]).all()
    assert sorted(fresh["input_ids"].flatten().tolist()) == sorted(ids.flatten().tolist())  # same vocabulary
    assert not torch.equal(fresh["input_ids"], ids) and fresh["input_ids"].shape == ids.shape


def test_fresh_floats_are_the_example_perturbed_and_keep_its_infinities():
    x = torch.tensor([[100.0, -100.0, float("-inf")], [50.0, 0.0, 25.0]])
    fresh = fresh_inputs_like((x,), torch.Generator().manual_seed(0))[0]
    finite = torch.isfinite(x)
    assert torch.equal(torch.isfinite(fresh), finite) and fresh[0, 2] == float("-inf")
    change = (fresh - x)[finite].abs()
    assert 0 < change.max() < 0.5 * x[finite].abs().max()  # near the example, not independent N(0, 1) draws


# --------------------------------------------------------------- models that cannot run in float64


@pytest.mark.parametrize("model_class", [NoFloat64, NanInFloat64], ids=["raises", "nan"])
def test_a_model_that_cannot_run_in_float64_is_verified_in_float32_and_the_result_says_so(model_class):
    folded, report = fold(model_class(), _x())  # before: RuntimeError / "compared nothing"
    result = report.verification
    assert [n.foldable for n in report.norms] == [True]
    assert result.ok and result.compared_in == "float32" and "cannot run in float64" in result.fallback
    assert 0 < result.tolerance < 1e-5 and "unit in the last place" in result.tolerance_rule
    assert "checked in float32 instead" in str(result) and "float32 max rel err" in str(result)


@pytest.mark.parametrize("model_class", [NoFloat64, NanInFloat64], ids=["raises", "nan"])
def test_a_wrong_fold_of_a_model_that_cannot_run_in_float64_still_fails_in_float32(model_class):
    model = model_class()
    folded, _ = fold(model, _x())
    with torch.no_grad():
        folded.head.weight.mul_(1 + 1e-4)  # far below anything visible, far above float32 rounding
    result = verify(model, folded, _x())
    assert not result.ok and result.compared_in == "float32" and result.max_rel_error > result.tolerance


def test_a_float64_model_that_raises_is_a_fold_error_not_a_fallback():
    model = NoFloat64().double()  # its own dtype is float64: there is no lower dtype to fall back to
    inputs = tuple(t.double() for t in _x())
    with pytest.raises(ExampleInputsError, match=r"not valid for NoFloat64: the original model itself raises "
                       r"RuntimeError: value cannot be converted"):
        fold(model, inputs)  # it raises eagerly too: the inputs are at fault, not export
    with pytest.raises(ExampleInputsError, match=r"not valid for NoFloat64: the original model itself raises "
                       r"RuntimeError"):
        prove_fold(model, model, inputs, FoldPlan())  # the proof says the same of an example the original rejects


def test_a_model_that_runs_in_float64_is_still_compared_in_float64():
    _, report = fold(PreLN(), _x())
    assert report.verification.compared_in == "float64" and report.verification.fallback is None


def test_verify_called_directly_names_the_model_and_step_when_a_model_raises():
    model = NoFloat64().double()
    with pytest.raises(ExampleInputsError, match=r"not valid for NoFloat64: the original model itself raises "
                       r"RuntimeError"):
        verify(model, model, tuple(t.double() for t in _x()))  # before: the model's RuntimeError, raw
    broken = NoFloat64()  # runs in float32; its folded stand-in raises on every input
    folded = copy.deepcopy(broken)
    folded.forward = lambda *args: (_ for _ in ()).throw(RuntimeError("the folded model broke"))
    with pytest.raises(FoldError, match=r"NoFloat64: verifying \(running both models\) failed: RuntimeError: "
                       r"the folded model broke"):
        verify(broken, folded, _x())


def test_fresh_inputs_permute_related_integer_inputs_together_and_keep_float_masks_as_masks():
    """Kosmos-2.5 on main 4025376: noise on its 0/1 float mask and ids permuted apart from their token
    types made inputs the original itself fails on, and the fold was refused ("shape mismatch")."""
    ids = torch.arange(12).reshape(2, 6)
    token_types = ids * 100  # a value tied to each id's position
    mask = torch.tensor([[1.0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    fresh = fresh_inputs_like({"input_ids": ids, "token_type_ids": token_types, "attention_mask": mask},
                              torch.Generator().manual_seed(0))
    assert not torch.equal(fresh["input_ids"], ids)
    assert torch.equal(fresh["token_type_ids"], fresh["input_ids"] * 100)  # permuted together
    assert torch.equal(fresh["attention_mask"], mask)  # still the 0/1 mask it was
    zeros = fresh_inputs_like((torch.zeros(2, 3),), torch.Generator().manual_seed(0))[0]
    assert zeros.abs().max() > 0  # all zeros is an example like any other, not a mask


class NanWithIntegerOutput(nn.Module):
    """Parakeet in float64: an all-NaN hidden state beside an integer output (lengths)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(x) * float("nan"), torch.full((x.shape[0],), x.shape[1])


def test_an_integer_output_beside_an_all_nan_one_compares_nothing():
    """Fails on main 4025376: the integer output counted as compared, and the proof read "OK, 0.0"."""
    model = NanWithIntegerOutput().eval()
    result = verify(model, copy.deepcopy(model), (torch.randn(2, 3, 4),), tolerance=1e-9)
    assert not result.ok and "compared nothing" in result.why


class NoisyInEval(nn.Module):
    """Adds fresh noise in eval mode too (VITS's stochastic durations, ViLT's multinomial patch sampling)."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.proj(x)) + 0.1 * torch.randn(x.shape)


def test_a_model_random_in_eval_mode_folds_proved_on_the_same_draws_and_says_so():
    """Fails on main 38f76e7: refused as "the original model itself gives other outputs on a second run"
    (VITS, ViLT), although the fold is the same function of input and noise."""
    model = NoisyInEval().eval()
    _, report = fold(model, (torch.randn(2, 3, 4),))
    assert report.num_foldable == 1 and report.verification.ok and report.verification.random_draws
    assert "draws random numbers" in str(report.verification)


def test_a_wrong_fold_of_a_random_model_fails_with_its_error_figure_on_the_same_draws():
    model = NoisyInEval().eval()
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.proj.weight.mul_(1.01)
    result = verify(model, wrong, (torch.randn(2, 3, 4),))
    assert not result.ok and result.why is None and result.random_draws
    assert "max relative error" in result.failure() and "same draws" in result.failure()


class RandomMasking(nn.Module):
    """ViT-MAE's masking: random noise (in the default dtype) ranks the tokens, two are kept, and which ones
    is an output (``ids_restore``): float64 draws are other numbers than float32 ones, so other tokens."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):  # (B, T, C)
        kept = torch.rand(x.shape[:2]).argsort(dim=1)[:, :2]  # (B, 2) token indices
        tokens = torch.gather(x, 1, kept[..., None].expand(-1, -1, x.shape[-1]))  # (B, 2, C)
        return self.norm(self.proj(tokens)), kept


def test_the_returned_model_of_a_random_forward_is_judged_against_the_original_on_the_same_draws():
    """Fails on main 8b97997: the float32 model was compared with the float64 original, which masked other
    tokens (error inf at the kept indices): refused (ViT-MAE and VITS folders, found by benchmarks/cli_zoo.py)."""
    model = RandomMasking().eval()
    _, report = fold(model, (torch.randn(2, 6, 4),))
    check = report.verification.model_dtype_check
    assert report.num_foldable == 1 and report.verification.ok and check.ok
    assert "same draws" in check.tolerance_rule and check.error <= check.tolerance < 1e-5


def test_a_wrong_returned_model_of_a_random_forward_still_fails_its_own_dtype_check():
    model = RandomMasking().eval()
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.norm.bias.add_(1e-3)  # a float32-visible error
    exact = copy.deepcopy(model).double()  # the float64 transform is right: only the returned model is wrong
    result = verify(model, wrong, (torch.randn(2, 6, 4),), folded_exact=exact, judge_model_dtype=True)
    assert result.random_draws and result.max_rel_error <= 1e-9
    assert not result.ok and not result.model_dtype_check.ok


def test_a_proof_leaves_the_callers_random_number_generator_where_it_was():
    model, x = NoisyInEval().eval(), torch.randn(2, 3, 4)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    verify(model, copy.deepcopy(model), (x,))
    assert torch.equal(torch.rand(3), expected)


def test_a_deterministic_model_is_not_said_to_draw_random_numbers():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).eval()
    result = verify(model, copy.deepcopy(model), (torch.randn(2, 4),))
    assert result.ok and not result.random_draws and "random" not in str(result)


def test_a_deterministic_model_that_fails_its_proof_keeps_the_error_figure():
    model = NoisyInEval().eval()
    wrong = copy.deepcopy(model)
    model.forward = lambda x: model.norm(model.proj(x))  # deterministic from here on
    wrong.forward = lambda x: wrong.norm(wrong.proj(x)) * 1.5
    result = verify(model, wrong, (torch.randn(2, 3, 4),), tolerance=1e-9)
    assert not result.ok and result.why is None and "max relative error" in result.failure()


class ReorderedSums(nn.Module):
    """Deterministic up to rounding: each run adds noise of a few float32 ulps, as a GPU reduction whose
    order varies between runs (atomics) does."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, x):
        y = self.norm(self.proj(x))
        return y + y.abs() * 4 * torch.finfo(y.dtype).eps * torch.randn(y.shape, dtype=y.dtype)


def test_runs_that_differ_by_rounding_only_are_not_called_random_and_the_failure_keeps_its_figure():
    """Fails on main af93d81: any difference between two runs, rounding too, made the failure "random"."""
    model = ReorderedSums().eval()
    wrong = copy.deepcopy(model)
    with torch.no_grad():
        wrong.proj.weight.mul_(1.01)
    result = verify(model, wrong, (torch.randn(2, 3, 4),))
    assert not result.ok and result.why is None and "max relative error" in result.failure()


class GridSized(nn.Module):
    """Takes per-image grid sizes (t, h, w) as integers it checks, as Qwen2-VL's ``image_grid_thw``."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = nn.Linear(4, 4), nn.LayerNorm(4)
        self.register_buffer("per_temporal_size", torch.tensor([0.0, 2.0]))  # sizes 0 and 1 only

    def forward(self, x, grid):
        # a permuted grid is no grid the model was given: its temporal sizes index past the table
        return self.norm(self.proj(x)) * self.per_temporal_size[grid[:, 0]].unsqueeze(-1)


def test_a_fresh_input_the_original_rejects_keeps_the_examples_integers_and_varies_its_floats():
    """Fails on main ad1184d: the proof's fresh inputs permuted the grid's numbers, the original raised on
    them, and the fold ended in "verifying failed: IndexError" (Qwen2-VL's image_grid_thw)."""
    grid = torch.tensor([[1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 8, 9]])
    _, report = fold(GridSized().eval(), {"x": torch.randn(4, 4), "grid": grid})
    assert report.verification.ok and report.verification.num_runs == 3
    assert report.num_foldable == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_proof_says_which_fresh_inputs_kept_the_examples_integers_in_any_model_dtype(dtype):
    """Fails on main af93d81: the remade inputs went unreported, and a float64 model (no lower dtype to run
    the fresh inputs in first) ended in "verifying failed: IndexError"."""
    grid = torch.tensor([[1, 2, 3], [1, 4, 5], [1, 6, 7], [1, 8, 9]])
    model = GridSized().to(dtype).eval()
    result = verify(model, copy.deepcopy(model), {"x": torch.randn(4, 4, dtype=dtype), "grid": grid}, num_random=2)
    assert result.ok and result.num_runs == 3
    assert result.integers_kept.startswith("input 1, 2: the original rejects the example's integers permuted (IndexError")
    assert result.integers_kept in str(result) and result.to_dict()["integers_kept"] == result.integers_kept


def test_fresh_inputs_the_original_runs_are_not_reported_as_remade():
    model = GridSized().eval()
    grid = torch.ones(4, 3, dtype=torch.long)  # permuted: the same grid
    result = verify(model, copy.deepcopy(model), {"x": torch.randn(4, 4), "grid": grid}, num_random=2)
    assert result.ok and result.integers_kept is None and "kept" not in str(result)


class AlsoOnNoRows(PreLN):
    """PreLN whose norm also runs on a slice of no rows (HiggsAudio v2 normalizes an audio segment of no tokens)."""

    def forward(self, x):
        h = self.fc(x)
        return self.head(self.ln(h)), self.ln(h[:0])


def test_a_norm_called_on_no_rows_is_folded_and_proved_on_its_other_calls():
    """The proof's watch of the RMSNorm inputs took the max of an empty tensor and the fold was refused with
    "verifying (running both models) failed: RuntimeError: max(): Expected reduction dim" (found by cli_zoo)."""
    folded, report = fold(AlsoOnNoRows(), _x())
    assert [n.foldable for n in report.norms] == [True] and report.verification.ok
    assert report.verification.max_input_mean_ratio is not None and report.verification.max_input_mean_ratio < 1e-9
