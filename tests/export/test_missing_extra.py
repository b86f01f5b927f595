"""Without the onnx extra, export says which extra to install, before any work (needs no onnx package)."""
from __future__ import annotations

import importlib

import pytest
import torch

import normfold
from normfold import _deps


@pytest.mark.parametrize("missing", ["onnx", "onnxscript", "onnxruntime"])
def test_missing_onnx_package_names_the_onnx_extra(monkeypatch, tmp_path, missing):
    real_import = importlib.import_module

    def import_module(name, *args):
        if name.split(".")[0] == missing:
            raise ImportError(f"No module named {missing!r}")
        return real_import(name, *args)

    monkeypatch.setattr(_deps.importlib, "import_module", import_module)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), normfold.RMSNorm(4)).eval()
    with pytest.raises(ImportError, match=rf"{missing} is needed .* pip install 'normfold\[onnx\]'"):
        normfold.export_onnx(model, (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []
