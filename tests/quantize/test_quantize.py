"""normfold.quantize: round-to-nearest fake quantization within its error bound against a float64
reference, the layers a QuantizeConfig selects, the held-out loss before and after, and the refusals."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import normfold
from normfold import QuantizeConfig
from normfold.quantize import fake_quantize, fake_quantize_ste, group_scales

from tiny_models import tiny_gpt2

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]


def _reference(t: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Symmetric round-to-nearest of each row's groups, element by element in float64 (the oracle)."""
    out = torch.empty_like(t, dtype=torch.float64)
    levels = 2 ** (bits - 1) - 1
    for r in range(t.shape[0]):
        for start in range(0, t.shape[1], group):
            chunk = t[r, start:start + group].double()
            scale = chunk.abs().max().item() / levels
            out[r, start:start + group] = torch.tensor(
                [max(-levels, min(levels, round(x / scale))) * scale for x in chunk.tolist()], dtype=torch.float64)
    return out


@pytest.mark.parametrize("bits, group", [(4, None), (4, 8), (8, 16), (2, 4)])
def test_fake_quantize_matches_the_float64_reference_within_half_a_step(bits, group):
    t = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 5, 32)
    got = fake_quantize(t, bits, dim=1, group_size=group)
    expected = _reference(t, bits, group or 32)
    step = group_scales(t, bits, 1, group).expand(6, 32 // (group or 32), group or 32).reshape(6, 32).double()
    eps = torch.finfo(torch.float32).eps
    assert (got.double() - expected).abs().max().item() <= 4 * eps * t.abs().max().item()  # float32's own rounding
    assert ((got.double() - t.double()).abs() <= step / 2 * (1 + 1e-6)).all()         # each entry within s/2
    levels = got.double() / step
    assert (levels - levels.round()).abs().max().item() < 1e-4 and levels.abs().max().item() <= 2 ** (bits - 1) - 1 + 1e-4


def test_fake_quantize_along_dim_0_is_the_transpose_and_keeps_zeros_and_dtype():
    t = torch.randn(8, 5, generator=torch.Generator().manual_seed(1)).half()
    t[:, 2] = 0
    got = fake_quantize(t, 4, dim=0)
    assert got.dtype == torch.float16 and torch.equal(got, fake_quantize(t.T, 4, dim=1).T)
    assert (got[:, 2] == 0).all()


def test_straight_through_gradient_is_the_identity():
    t = torch.randn(4, 8, requires_grad=True)
    fake_quantize_ste(t, 3, -1).mul(torch.arange(8.0)).sum().backward()
    assert torch.equal(t.grad, torch.arange(8.0).expand(4, 8))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"weight_bits": 4.0}, TypeError, "weight_bits must be an int, got 4.0"),
    ({"weight_bits": True}, TypeError, "weight_bits must be an int, got True"),
    ({"weight_bits": 1}, ValueError, "weight_bits must be in [2, 8], got 1"),
    ({"weight_bits": 16}, ValueError, "weight_bits must be in [2, 8], got 16"),
    ({"activation_bits": "8"}, TypeError, "activation_bits must be an int or None, got '8'"),
    ({"activation_bits": 32}, ValueError, "activation_bits must be in [2, 16], got 32"),
    ({"group_size": 0}, ValueError, "group_size must be at least 1, got 0"),
    ({"group_size": 1.5}, TypeError, "group_size must be an int or None"),
    ({"exclude": "lm_head"}, TypeError, "exclude must be a tuple of name patterns (str), e.g. ('lm_head',), got 'lm_head'"),
    ({"include": ()}, ValueError, "include must hold at least one name pattern"),
])
def test_bad_quantize_configs_are_refused_naming_expected_and_received(kwargs, error, message):
    with pytest.raises(error) as raised:
        QuantizeConfig(**kwargs)
    assert message in str(raised.value)


def _calls(n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"input_ids": (ids := torch.randint(0, 96, (2, 12), generator=g)), "labels": ids, "use_cache": False}
            for _ in range(n)]


def test_quantize_rounds_only_the_selected_layers_and_reports_the_held_out_loss_before_and_after():
    model = tiny_gpt2(0).eval()
    config = QuantizeConfig(weight_bits=3, activation_bits=8, exclude=("lm_head", "*.mlp.*"))
    quantized, report = normfold.quantize(model, config, data=_calls())
    assert report.layers == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                             "transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj"]
    for path, module in quantized.named_modules():
        original = model.get_submodule(path)
        if path in report.layers:  # Conv1D: weight (in, out), one scale per output column
            assert torch.equal(module.weight, fake_quantize(original.weight, 3, dim=0))
            assert not torch.equal(module.weight, original.weight)
        elif hasattr(module, "weight") and isinstance(module.weight, torch.Tensor):
            assert torch.equal(module.weight, original.weight)
    assert quantized.lm_head.weight is quantized.transformer.wte.weight  # the head was not selected: still tied
    before, after = report.before, report.after
    assert before.calls == after.calls == 2 and before.loss != after.loss
    assert math.isclose(after.perplexity, math.exp(after.loss))
    with torch.no_grad():
        direct = sum(model(**c).loss.item() for c in _calls()) / 2
    assert math.isclose(before.loss, direct, rel_tol=1e-6)
    assert "held-out loss on 2 calls" in str(report) and report.to_dict()["scheme"] == "W3A8"


def test_the_report_gives_each_layers_relative_weight_error_and_more_bits_lower_it():
    model = tiny_gpt2(0).eval()
    _, w3 = normfold.quantize(model, QuantizeConfig(weight_bits=3, exclude=("lm_head",)))
    _, w8 = normfold.quantize(model, QuantizeConfig(weight_bits=8, exclude=("lm_head",)))
    assert list(w3.weight_errors) == w3.layers  # one figure per quantized layer, in order
    path = "transformer.h.1.mlp.c_fc"
    weight = model.get_submodule(path).weight.detach().double()
    expected = torch.linalg.norm(fake_quantize(weight, 3, dim=0) - weight) / torch.linalg.norm(weight)
    assert math.isclose(w3.weight_errors[path], expected.item(), rel_tol=1e-5)
    assert all(0 < w8.weight_errors[p] < w3.weight_errors[p] < 1 for p in w3.layers)
    assert "weight error" in str(w3) and w3.to_dict()["weight_errors"] == w3.weight_errors


def test_activation_bits_round_each_layer_input_per_token():
    layer = nn.Sequential(nn.Linear(16, 4))
    quantized, _ = normfold.quantize(layer, QuantizeConfig(weight_bits=8, activation_bits=4))
    x = torch.randn(3, 16)
    expected = nn.functional.linear(fake_quantize(x, 4, -1), quantized[0].weight, quantized[0].bias)
    unrounded_input = nn.functional.linear(x, quantized[0].weight, quantized[0].bias)
    assert torch.equal(quantized(x), expected) and not torch.equal(quantized(x), unrounded_input)


def test_quantizing_a_tied_head_breaks_the_tie_in_the_copy_only():
    model = tiny_gpt2(0).eval()
    quantized, report = normfold.quantize(model, QuantizeConfig(include=("lm_head",)))
    assert report.layers == ["lm_head"]
    assert quantized.lm_head.weight is not quantized.transformer.wte.weight
    assert torch.equal(quantized.transformer.wte.weight, model.transformer.wte.weight)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_quantize_is_a_step_of_convert_with_its_section():
    model = tiny_gpt2(0).eval()
    _, report = normfold.convert(model, _calls(1)[0], normfold.RotateConfig(), QuantizeConfig(exclude=("lm_head",)))
    section = report.sections["quantization"]
    assert section.before is not None and section.after.loss != section.before.loss and len(section.layers) == 8


def test_a_selection_matching_nothing_is_refused_naming_the_linear_layers():
    with pytest.raises(ValueError, match=r"select no linear layer; the model's linear layers \(nn.Linear, Conv1D\): "
                                         r"transformer.h.0.attn.c_attn"):
        normfold.quantize(tiny_gpt2(0), QuantizeConfig(include=("encoder.*",)))


def test_a_group_size_that_does_not_divide_a_width_is_refused_before_any_work():
    with pytest.raises(ValueError, match="group_size 12 must divide every quantized layer's input width, got "
                                         "transformer.h.0.attn.c_attn with 32 inputs"):
        normfold.quantize(tiny_gpt2(0), QuantizeConfig(group_size=12))


def test_held_out_data_that_gives_no_loss_is_refused_naming_the_outputs():
    with pytest.raises(ValueError, match=r"held-out call 0: the model must return a loss .* got outputs \[\"out\['logits'\]\"\]"):
        normfold.quantize(tiny_gpt2(0).eval(), data={"input_ids": torch.zeros(1, 4, dtype=torch.long),
                                                      "use_cache": False})


@pytest.mark.parametrize("model, config, message", [
    ("not a model", None, "model must be a torch.nn.Module, got str"),
    (nn.Linear(2, 2), {"weight_bits": 4}, "config must be a QuantizeConfig, got dict"),
])
def test_quantize_refuses_a_wrong_model_or_config_type(model, config, message):
    with pytest.raises(TypeError, match=message):
        normfold.quantize(model, config)
