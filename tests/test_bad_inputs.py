"""What each wrong input gets: one test per row of the bad-input table in docs/bad_inputs.md.

Where the current behaviour is wrong (a raw traceback, a silent wrong answer) the test states the
right behaviour and is marked ``xfail(strict=True)`` with the engineer who owns the fix.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import normfold
from normfold import FoldError
from normfold.ops import layer_norm, rms_norm

X = (2, 4, 8)  # (B, T, C) example input of the small models below


def _x(dtype=torch.float32):
    return torch.randn(*X, generator=torch.Generator().manual_seed(0), dtype=dtype)


def _foldable_model() -> nn.Module:
    """Linear -> LayerNorm -> Linear: the LN folds, its affine moves into the last Linear."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))


# ---------------------------------------------------------------------------------------------------- fold engine

class _DataDependentBranch(nn.Module):
    """Its weights its own, no child module: nothing smaller for export to capture instead."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        h = x @ self.weight
        if h.sum() > 0:  # Python control flow on a tensor value: export cannot trace it
            h = h * 2
        return nn.functional.layer_norm(h, (8,))


def test_model_export_cannot_capture_raises_fold_error_with_exports_reason_and_a_hint():
    with pytest.raises(FoldError) as info:
        normfold.analyze(_DataDependentBranch(), (_x(),))
    message = str(info.value)
    assert "torch.export could not capture _DataDependentBranch" in message
    assert "data-dependent" in message        # export's own reason, first line
    assert "Try" in message                   # what to do about it
    assert isinstance(info.value.__cause__, Exception)  # the export error stays attached


def test_example_inputs_the_model_cannot_run_raise_example_inputs_error_with_the_models_own_reason():
    with pytest.raises(normfold.ExampleInputsError, match="the original model itself raises RuntimeError: mat1 and "
                       "mat2 shapes cannot be multiplied"):  # its eager error, not export's
        normfold.fold(_foldable_model(), (torch.randn(2, 5),))  # width 5 into Linear(8, ·)


@pytest.mark.parametrize("example_inputs", [[torch.randn(*X)], torch.randn(*X), None, "x"],
                         ids=["list", "tensor", "None", "str"])
@pytest.mark.parametrize("entry", ["analyze", "fold", "verify"])
def test_example_inputs_of_the_wrong_type_raise_type_error_before_any_work(entry, example_inputs, monkeypatch):
    def no_export(*args, **kwargs):
        raise AssertionError("export ran before the inputs were checked")

    monkeypatch.setattr(torch.export, "export", no_export)
    model = _foldable_model()
    call = {"analyze": lambda: normfold.analyze(model, example_inputs),
            "fold": lambda: normfold.fold(model, example_inputs),
            "verify": lambda: normfold.verify(model, model, example_inputs)}[entry]
    with pytest.raises(TypeError, match="tuple of positional arguments or a dict"):
        call()


@pytest.mark.parametrize("model", [lambda x: x, None, {"weight": torch.ones(8)}], ids=["function", "None", "state_dict"])
def test_model_that_is_not_an_nn_module_raises_type_error(model):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        normfold.analyze(model, (_x(),))


class _InPlace(nn.Module):
    def __init__(self, activation_in_place: bool):
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.shift = nn.Parameter(torch.randn(8))
        self.activation_in_place = activation_in_place

    def forward(self, x):
        h = self.proj(x)
        h.add_(self.shift)
        h.mul_(2.0)
        if self.activation_in_place:
            h.relu_()
        return self.norm(h)


def test_in_place_adds_and_scales_fold_exactly():
    model = _InPlace(activation_in_place=False)
    folded, report = normfold.fold(model, (_x(),))
    assert report.num_foldable == 1 and report.verification.ok
    assert set(report.norms[0].producers) == {"proj.weight", "proj.bias", "shift"}


def test_in_place_nonlinearity_is_refused_by_name():
    folded, report = normfold.fold(_InPlace(activation_in_place=True), (_x(),))
    assert report.num_foldable == 0
    assert "relu_" in report.norms[0].reason


def _hooked_model() -> nn.Module:
    model = _foldable_model()
    model[1].register_forward_hook(lambda module, inputs, output: output * 2.0)  # on the LayerNorm that folds
    return model


@pytest.mark.parametrize("verify", [True, False])
def test_a_norm_carrying_hooks_is_kept_with_the_reason_and_its_hooks_keep_working(verify):
    """Swapping a hooked module would drop its hooks: the norm stays, the report says why."""
    model = _hooked_model()
    folded, report = normfold.fold(model, (_x(),), verify=verify)
    assert report.num_foldable == 0 and "hooks" in report.norms[0].reason
    assert isinstance(folded[1], nn.LayerNorm) and folded[1]._forward_hooks
    x = _x()
    assert torch.equal(folded(x), model(x))


def test_forward_hooks_elsewhere_are_traced_like_code():
    """A hook on a non-norm module runs during export: its ops are analysed like the module's own."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    model[0].register_forward_hook(lambda module, inputs, output: torch.relu(output))
    folded, report = normfold.fold(model, (_x(),))
    assert report.num_foldable == 0 and "relu" in report.norms[0].reason
    assert torch.equal(folded(_x()), model(_x()))


def test_folding_an_already_folded_model_changes_nothing():
    model = _foldable_model()
    once, first = normfold.fold(model, (_x(),))
    assert first.num_foldable == 1
    twice, second = normfold.fold(once, (_x(),))
    assert not second.plan                                   # nothing to do
    assert [e.reason for e in second.norms] == ["already an RMSNorm"]
    for (name, a), (_, b) in zip(once.state_dict().items(), twice.state_dict().items()):
        assert torch.equal(a, b), name


def test_dynamically_quantized_model_raises_fold_error():
    with pytest.warns(Warning):  # torch.ao.quantization is deprecated in favour of torchao
        quantized = torch.ao.quantization.quantize_dynamic(_foldable_model(), {nn.Linear}, dtype=torch.qint8)
    with pytest.raises(FoldError, match="could not capture"):
        normfold.fold(quantized, (_x(),))


def _meta_model() -> nn.Module:
    with torch.device("meta"):
        return _foldable_model()


def test_meta_model_can_be_analysed_for_structure():
    """Analysis needs only shapes: a model on the meta device (no weights loaded) gets its report."""
    report = normfold.analyze(_meta_model(), (_x().to("meta"),))
    assert report.num_foldable == 1


def test_meta_model_with_real_inputs_raises_fold_error():
    with pytest.raises(FoldError, match="meta"):
        normfold.fold(_meta_model(), (_x(),))


def test_fold_of_a_meta_model_says_weights_must_be_loaded():
    with pytest.raises(FoldError, match="meta"):
        normfold.fold(_meta_model(), (_x().to("meta"),))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the behaviour of a machine without CUDA")
def test_cuda_model_on_a_machine_without_cuda_fails_in_torch_before_normfold():
    """Moving a model or inputs to CUDA raises in torch itself; normfold is never reached."""
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        _foldable_model().to("cuda")
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.randn(2, device="cuda")


def test_training_mode_model_is_folded_in_eval_mode_and_keeps_its_mode():
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.LayerNorm(8)).train()
    folded, report = normfold.fold(model, (_x(),))
    assert report.num_foldable == 1 and report.verification.ok
    assert model.training and all(m.training for m in folded.modules())


# ---------------------------------------------------------------------------------------------------- checkpoints / CLI

@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bert") / "model"
    transformers.BertModel(config).save_pretrained(path, safe_serialization=True)
    return path


def _damaged_copy(source, tmp_path, how: str):
    import shutil

    target = tmp_path / "damaged"
    shutil.copytree(source, target)
    weights = target / "model.safetensors"
    if how == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        weights.write_bytes(b"\x00\xff not a safetensors file" * 10)
    elif how == "no_weights":
        weights.unlink()
    elif how == "bad_config":
        (target / "config.json").write_text("{ this is not json")
    elif how == "no_config":
        (target / "config.json").unlink()
    elif how == "config_of_other_sizes":
        import json

        config = json.loads((target / "config.json").read_text())
        config["intermediate_size"] = 24
        (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("how", [
    "truncated", "garbage", "no_weights", "no_config",
    "bad_config", "config_of_other_sizes",
])
def test_cli_fold_of_a_corrupt_checkpoint_exits_2_with_one_clear_line(how, tiny_bert_dir, tmp_path, capsys):
    from normfold.cli import main

    damaged = _damaged_copy(tiny_bert_dir, tmp_path, how)
    out = tmp_path / "out"
    code = main(["fold", str(damaged), "-o", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and err.startswith("normfold: error:"), err
    assert "Traceback" not in err
    assert not out.exists()  # nothing half-written


def test_weights_of_other_shapes_than_the_config_builds_are_named_in_the_one_line(tiny_bert_dir, tmp_path, capsys):
    """transformers raises 'For details look at the above report!' with its report in the log, which the one
    line does not show: the line names the tensors and both shapes instead."""
    from normfold.cli import main

    code = main(["fold", str(_damaged_copy(tiny_bert_dir, tmp_path, "config_of_other_sizes")), "-o",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "above report" not in err, err
    assert "encoder.layer.0.intermediate.dense.weight stored [32, 16], model [24, 16]" in err, err


def test_cli_fold_of_a_missing_folder_exits_2(tmp_path, capsys):
    from normfold.cli import main

    assert main(["fold", str(tmp_path / "nope"), "-o", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().startswith("normfold: error:")


# ---------------------------------------------------------------------------------------------------- ops

NORMS = [pytest.param(rms_norm, id="rms_norm"), pytest.param(layer_norm, id="layer_norm")]


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("kwargs, match", [
    ({"weight": torch.ones(9)}, r"weight must have shape \(8,\)"),
    ({"weight": torch.ones(2, 8)}, r"weight must have shape \(8,\)"),
    ({"bias": torch.ones(7)}, r"bias must have shape \(8,\)"),
    ({"residual": torch.ones(2, 4, 7)}, r"residual must have x's shape"),
    ({"eps": 0.0}, "eps must be a finite number > 0"),
    ({"eps": -1e-5}, "eps must be a finite number > 0"),
    ({"eps": float("nan")}, "eps must be a finite number > 0"),
    ({"eps": float("inf")}, "eps must be a finite number > 0"),
    ({"weight": torch.ones(8, device="meta")}, "weight must be on x's device"),
], ids=["weight-len", "weight-2d", "bias-len", "residual-shape", "eps-0", "eps-neg", "eps-nan", "eps-inf",
        "weight-device"])
def test_op_bad_argument_raises_value_error_naming_expected_and_received(norm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        norm(torch.randn(2, 4, 8), **kwargs)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("shape", [(2, 0), (0,), ()], ids=["empty-last-dim", "empty-1d", "0-d"])
def test_op_empty_or_scalar_input_raises_value_error(norm, shape):
    with pytest.raises(ValueError, match="dimension"):
        norm(torch.randn(shape))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")  # deprecated in torch, still a dtype users hold
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("make_x", [
    lambda: torch.ones(2, 8, dtype=torch.int64),
    lambda: torch.ones(2, 8, dtype=torch.bool),
    lambda: torch.ones(2, 8, dtype=torch.complex64),
    lambda: torch.quantize_per_tensor(torch.randn(2, 8), 0.1, 0, torch.qint8),
    lambda: [[1.0] * 8],
], ids=["int64", "bool", "complex64", "qint8", "list"])
def test_op_non_float_input_raises_type_error(norm, make_x):
    with pytest.raises(TypeError, match="x must be a"):
        norm(make_x())


@pytest.mark.parametrize("norm", NORMS)
def test_op_integer_weight_raises_type_error(norm):
    with pytest.raises(TypeError, match="weight must be floating-point"):
        norm(torch.randn(2, 8), torch.ones(8, dtype=torch.int64))


@pytest.mark.parametrize("norm", NORMS)
def test_op_on_meta_tensors_returns_meta_shapes(norm):
    """Meta inputs propagate shapes (what torch.export / torch.compile tracing needs), no error."""
    y = norm(torch.randn(2, 8, device="meta"), torch.ones(8, device="meta"))
    assert y.device.type == "meta" and y.shape == (2, 8)


def test_module_input_of_the_wrong_width_raises_value_error():
    with pytest.raises(ValueError, match=r"shape \(7,\)"):
        normfold.nn.RMSNorm(8)(torch.randn(2, 7))


@pytest.mark.parametrize("kwargs", [{"normalized_shape": 0}, {"normalized_shape": 8, "eps": -1.0}],
                         ids=["empty", "eps-neg"])
def test_module_with_bad_construction_arguments_raises_value_error_at_construction(kwargs):
    with pytest.raises(ValueError):
        normfold.nn.RMSNorm(**kwargs)
