"""normfold.export_onnx on small modules: every branch of the translation (γ absent, bias, (1 + w) offset,
residual, LayerNorm) equals PyTorch in ONNX Runtime for both targets, and what must be refused is refused
before anything is written."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import normfold
from normfold import FoldVerificationError

onnxruntime = pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")
pytest.importorskip("onnxscript", reason="the onnx extra (pip install 'normfold[onnx]') is not installed")

from normfold.export import export_onnx, onnx_translations  # noqa: E402

WIDTH = 16


class _Block(nn.Module):
    """A linear layer, then the norm under test called with (or without) the residual."""

    def __init__(self, norm: nn.Module, residual: bool) -> None:
        super().__init__()
        self.linear, self.norm, self.residual = nn.Linear(WIDTH, WIDTH), norm, residual

    def forward(self, x):
        h = self.linear(x)
        if not self.residual:
            return self.norm(h)
        y, s = self.norm(h, residual=x)
        return y + 0.5 * s  # both outputs reach the graph's output


def _random_affine(norm: nn.Module) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (0.7 if p is norm.weight else 0.0))
    return norm


NORMS = {
    "rms": lambda: normfold.RMSNorm(WIDTH),
    "rms_no_weight": lambda: normfold.RMSNorm(WIDTH, elementwise_affine=False),
    "rms_bias_offset": lambda: normfold.RMSNorm(WIDTH, bias=True, offset=1.0),
    "layer_norm": lambda: normfold.nn.LayerNorm(WIDTH),
}


def _every_norm_form() -> nn.Module:
    """Each norm of NORMS once without and once with the residual, chained: a wrong branch changes the output."""
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(_random_affine(make()), residual) for make in NORMS.values()
                           for residual in (False, True))).eval()


EXPECTED_NODES = {  # per target: the node each of the 8 calls becomes in the graph ONNX Runtime runs
    "onnxruntime": {"SimplifiedLayerNormalization": 3, "SkipSimplifiedLayerNormalization": 3,
                    "LayerNormalization": 1, "SkipLayerNormalization": 1},
    "onnx": {"RMSNormalization": 6, "LayerNormalization": 2},
}


@pytest.mark.parametrize("target", ["onnxruntime", "onnx"])
def test_each_norm_form_exports_to_its_kernel_and_equals_pytorch(tmp_path, target):
    model = _every_norm_form()
    report = export_onnx(model, (torch.randn(3, 5, WIDTH),), tmp_path / "m.onnx", target=target)
    assert report.error <= report.tolerance and report.compared == 2
    assert report.dynamic_axes == {report.input_names[0]: {0: "batch"}}  # a float input: batch only
    assert {t: n for t, n in report.node_counts.items() if n} == EXPECTED_NODES[target]
    # the written file runs at another batch size and agrees with PyTorch there
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    x7 = torch.randn(7, 5, WIDTH)
    (got,) = session.run(None, {report.input_names[0]: x7.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(x7), rtol=1e-5, atol=1e-5)


def test_an_export_that_differs_from_the_original_is_refused_and_nothing_is_written(tmp_path):
    torch.manual_seed(0)
    model = _Block(normfold.RMSNorm(WIDTH), residual=False).eval()
    other = _Block(normfold.RMSNorm(WIDTH), residual=False).eval()  # other weights: not what model was made from
    with pytest.raises(FoldVerificationError, match="differs from the PyTorch model"):
        export_onnx(model, (torch.randn(2, 3, WIDTH),), tmp_path / "m.onnx", original=other,
                    original_path=tmp_path / "o.onnx")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_kept_without_overwrite(tmp_path):
    model = _Block(normfold.RMSNorm(WIDTH), residual=False).eval()
    path = tmp_path / "m.onnx"
    path.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        export_onnx(model, (torch.randn(2, 3, WIDTH),), path)
    assert path.read_bytes() == b"keep me" and list(tmp_path.iterdir()) == [path]
    export_onnx(model, (torch.randn(2, 3, WIDTH),), path, overwrite=True)
    assert path.read_bytes() != b"keep me" and list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"target": "tensorrt"}, ValueError, "target must be one of onnxruntime, onnx"),
    ({"target": "onnx", "opset": 20}, ValueError, r"must be >= 23 \(the standard RMSNormalization\)"),
    ({"opset": "20"}, TypeError, "opset must be an int"),
    ({"original_path": "o.onnx"}, ValueError, "original_path needs original="),
    ({"threads": 0}, ValueError, "threads must be an int >= 1"),
])
def test_bad_arguments_are_refused_before_any_work(tmp_path, kwargs, error, match):
    model = _Block(normfold.RMSNorm(WIDTH), residual=False).eval()
    with pytest.raises(error, match=match):
        export_onnx(model, (torch.randn(2, 3, WIDTH),), tmp_path / "m.onnx", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_path_not_ending_in_onnx_or_in_a_missing_folder_is_refused(tmp_path):
    model = _Block(normfold.RMSNorm(WIDTH), residual=False).eval()
    with pytest.raises(ValueError, match=r"must end in \.onnx"):
        export_onnx(model, (torch.randn(2, 3, WIDTH),), tmp_path / "m.bin")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_onnx(model, (torch.randn(2, 3, WIDTH),), tmp_path / "missing" / "m.onnx")


def test_the_translation_table_works_with_torch_onnx_export_directly(tmp_path):
    torch.manual_seed(0)
    model = _Block(normfold.RMSNorm(WIDTH, bias=True), residual=True).eval()
    x = torch.randn(2, 3, WIDTH)
    program = torch.onnx.export(model, (x,), dynamo=True, opset_version=20, verbose=False,
                                custom_translation_table=onnx_translations("onnxruntime", 20))
    program.save(tmp_path / "m.onnx")
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"))
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(got), model(x), rtol=1e-5, atol=1e-5)


def test_the_legacy_torchscript_exporter_is_refused_naming_the_dynamo_route():
    model = _Block(normfold.RMSNorm(WIDTH), residual=False).eval()
    with pytest.raises(NotImplementedError, match=r"only through the dynamo exporter.*normfold\.export_onnx"):
        torch.onnx.export(model, (torch.randn(2, 3, WIDTH),), io.BytesIO(), dynamo=False)
