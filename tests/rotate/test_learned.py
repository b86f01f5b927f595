"""method="learned": a rotation trained for the quantized model, still orthogonal, still proved exact,
lower in quantized calibration loss than the Hadamard basis it starts from; and its refusals."""
from __future__ import annotations

import json

import pytest
import torch

import normfold
from normfold import LearnConfig, QuantizeConfig
from normfold.rotate import learn_rotation
from normfold.rotate.learned import ORTHOGONALITY_BOUND, cayley, nearest_orthogonal

from tiny_models import tiny_gpt2

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]

W4A4 = QuantizeConfig(weight_bits=4, activation_bits=4, exclude=("lm_head",))


def _calls(n: int, seq: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 96, (2, seq), generator=g), "use_cache": False} for _ in range(n)]


@pytest.fixture(scope="module")
def learned():
    model = tiny_gpt2(0).eval().double()  # rotated in float64, so the proof on fresh inputs is float64's
    example = {"input_ids": _calls(1)[0]["input_ids"][:, :8], "use_cache": False}
    rotated, report = normfold.rotate(model, example, method="learned", seed=0, calibration=_calls(2),
                                      learning=LearnConfig(quantize=W4A4, steps=20, lr=1e-2))
    return model, rotated, report


def test_a_learned_rotation_lowers_the_quantized_calibration_loss_below_its_hadamard_start(learned):
    _, _, report = learned
    learning = report.learning
    assert learning.end_loss < 0.98 * learning.start_loss, (learning.start_loss, learning.end_loss)
    assert len(learning.step_losses) == 20 and learning.calibration_calls == 2


def test_a_learned_rotation_is_orthogonal_not_the_identity_nor_its_start_and_proved_exact(learned):
    model, rotated, report = learned
    stream = report.streams[0]
    assert stream.orthogonality_error <= ORTHOGONALITY_BOUND and stream.identity_distance > 0.5
    hadamard, _ = normfold.rotate(model, {"input_ids": _calls(1)[0]["input_ids"][:, :8], "use_cache": False})
    assert "from the randomised Hadamard" in stream.how
    assert report.verification.ok and report.verification.max_rel_error <= 1e-9
    fresh = {"input_ids": torch.randint(0, 96, (3, 11), generator=torch.Generator().manual_seed(9)), "use_cache": False}
    result = normfold.verify(model, rotated, fresh, rms_norm_paths=[])
    assert result.why is None and result.max_rel_error <= 1e-9, result
    hadamard_weight = hadamard.transformer.wte.weight
    assert (rotated.transformer.wte.weight - hadamard_weight).abs().max().item() > 1e-3


def test_the_report_records_seed_steps_calibration_and_losses(learned):
    _, _, report = learned
    record = report.to_dict()["learning"]
    assert record["steps"] == 20 and record["lr"] == 1e-2 and record["scheme"] == "W4A4"
    assert record["start"] == "randomised Hadamard, seed 0" and record["calibration_calls"] == 2
    assert record["calibration_shapes"] == ["[2, 16]", "[2, 16]"] and len(record["calibration_sha256"]) == 64
    assert record["end_loss"] < record["start_loss"] and "KL(unquantized ‖ W4A4)" in record["objective"]
    json.dumps(report.to_dict())
    assert "Cayley-Adam steps" in str(report) and "learned for W4A4" in str(report)


def test_the_same_seed_and_data_learn_the_same_rotation(learned):
    model, _, report = learned
    example = {"input_ids": _calls(1)[0]["input_ids"][:, :8], "use_cache": False}
    _, again = normfold.rotate(model, example, method="learned", seed=0, calibration=_calls(2),
                               learning=LearnConfig(quantize=W4A4, steps=20, lr=1e-2))
    assert torch.equal(again.streams[0].basis, report.streams[0].basis)


def test_cayley_is_orthogonal_for_any_square_matrix_and_the_identity_at_zero():
    m = torch.randn(24, 24, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    q = cayley(m)
    assert (q.T @ q - torch.eye(24, dtype=torch.float64)).abs().max().item() < 1e-12
    assert torch.equal(cayley(torch.zeros(5, 5)), torch.eye(5))


def test_a_basis_that_drifted_from_orthogonal_is_replaced_by_its_polar_factor():
    q = torch.linalg.qr(torch.randn(16, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64))[0]
    kept, replaced = nearest_orthogonal(q)
    assert kept is q and not replaced
    repaired, replaced = nearest_orthogonal(q + 1e-9 * torch.ones(16, 16, dtype=torch.float64))
    assert replaced and (repaired.T @ repaired - torch.eye(16, dtype=torch.float64)).abs().max().item() <= 1e-12
    assert (repaired - q).abs().max().item() < 1e-8


@pytest.mark.parametrize("kwargs, error, message", [
    ({"method": "learned"}, ValueError, "method='learned' needs calibration: a call or a list of calls on which the "
                                        "quantized model's loss is minimised"),
    ({"method": "hadamard", "learning": LearnConfig()}, ValueError,
     "learning is used only by method='learned', got method='hadamard'"),
    ({"method": "learned", "calibration": {"input_ids": torch.zeros(1, 4, dtype=torch.long)}, "learning": "W4"},
     TypeError, "learning must be a LearnConfig, got str"),
])
def test_bad_learned_rotation_arguments_raise_before_any_work(kwargs, error, message):
    with pytest.raises(error) as raised:
        normfold.RotateConfig(**kwargs)
    assert message in str(raised.value)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"steps": 0}, ValueError, "steps must be at least 1, got 0"),
    ({"steps": 2.0}, TypeError, "steps must be an int, got 2.0"),
    ({"lr": float("nan")}, ValueError, "lr must be a positive finite number, got nan"),
    ({"lr": "fast"}, TypeError, "lr must be a number, got 'fast'"),
    ({"quantize": {"weight_bits": 4}}, TypeError, "quantize must be a QuantizeConfig"),
])
def test_bad_learn_configs_are_refused_naming_expected_and_received(kwargs, error, message):
    with pytest.raises(error) as raised:
        LearnConfig(**kwargs)
    assert message in str(raised.value)


def test_a_learning_config_that_quantizes_no_layer_is_refused_before_learning():
    model = tiny_gpt2(0).eval()
    with pytest.raises(ValueError, match="select no linear layer"):
        normfold.rotate(model, _calls(1)[0], method="learned", calibration=_calls(1),
                        learning=LearnConfig(quantize=QuantizeConfig(include=("encoder.*",)), steps=1))


def test_a_learning_that_ends_worse_than_its_start_returns_the_start_and_says_so():
    # sharp logits (large weights) and a learning rate far too large: the run ends above its start's loss
    model = tiny_gpt2(0, initializer_range=0.5).eval().double()
    example = {"input_ids": _calls(1)[0]["input_ids"][:, :8], "use_cache": False}
    _, report = normfold.rotate(model, example, method="learned", seed=0, calibration=_calls(2),
                                learning=LearnConfig(quantize=W4A4, steps=8, lr=10.0))
    learning = report.learning
    assert learning.end_loss > 1.05 * learning.start_loss, (learning.start_loss, learning.end_loss)
    assert learning.returned == "start" and "not below the start's" in learning.returned_why
    _, hadamard = normfold.rotate(model, example, seed=0)
    assert torch.equal(report.streams[0].basis, hadamard.streams[0].basis)
    assert "(the learning's start: learning ended at calibration loss" in report.streams[0].how
    assert report.to_dict()["learning"]["returned"] == "start" and "returned: start" in str(report)
    assert report.verification.ok


def test_a_learning_that_lowers_the_loss_returns_the_learned_rotation_and_says_so(learned):
    _, _, report = learned
    assert report.learning.returned == "learned" and "is below the start's" in report.learning.returned_why


def test_bases_learned_before_rotate_to_the_same_model_without_learning_and_are_proved(learned):
    model, rotated, report = learned
    example = {"input_ids": _calls(1)[0]["input_ids"][:, :8], "use_cache": False}
    bases, learning = learn_rotation(model, example, calibration=_calls(2), seed=0,
                                     learning=LearnConfig(quantize=W4A4, steps=20, lr=1e-2))
    assert torch.equal(bases[0], report.streams[0].basis) and learning.step_losses == report.learning.step_losses
    again, given = normfold.rotate(model, example, method="learned", bases=bases)
    assert given.learning is None and given.streams[0].how == "learned before, given as bases"
    assert given.verification.ok and given.verification.max_rel_error <= 1e-9
    assert torch.equal(again.transformer.wte.weight, rotated.transformer.wte.weight)


def _orthogonal(n: int, seed: int) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))[0]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"method": "learned", "bases": [_orthogonal(32, 0) * 1.001]}, ValueError,
     "bases[0] is not orthogonal: max|QᵀQ − I| = 0.002 > 1e-12"),
    ({"method": "learned", "bases": [torch.full((32, 32), float("nan"), dtype=torch.float64)]}, ValueError,
     "bases[0] is not orthogonal: max|QᵀQ − I| = nan > 1e-12"),
    ({"method": "hadamard", "bases": [_orthogonal(32, 0)]}, ValueError,
     "bases are given only for method='learned' (bases learned before), got method='hadamard'"),
    ({"method": "learned", "bases": [_orthogonal(32, 0)], "calibration": {"input_ids": torch.zeros(1, 4, dtype=torch.long)}},
     ValueError, "bases are the learned result: leave out calibration and learning"),
    ({"method": "learned", "bases": _orthogonal(32, 0)}, TypeError, "bases must be a non-empty list of (d, d) tensors"),
    ({"method": "learned", "bases": [torch.zeros(32, 8)]}, TypeError,
     "bases[0] must be a square floating tensor (d, d), got (32, 8)"),
])
def test_bad_given_bases_are_refused_when_the_config_is_built(kwargs, error, message):
    with pytest.raises(error) as raised:
        normfold.RotateConfig(**kwargs)
    assert message in str(raised.value)


def test_given_bases_of_another_width_than_the_stream_are_refused_naming_the_widths():
    model = tiny_gpt2(0).eval()
    with pytest.raises(ValueError, match=r"one \(d, d\) matrix per residual stream, of widths \[32\]; got \[\(16, 16\)\]"):
        normfold.rotate(model, _calls(1)[0], method="learned", bases=[_orthogonal(16, 0)])
