"""Optional dependencies (transformers, safetensors, matplotlib, rich, tqdm, sentence-transformers, onnx),
imported on first use.

A leaf module: every layer may import it.
"""
from __future__ import annotations

import importlib
from types import ModuleType

_EXTRA = {"transformers": "hf", "safetensors": "hf", "matplotlib": "plot", "rich": "cli", "tqdm": "hf",
          "tensorboard": "tensorboard", "sentence_transformers": "sentence-transformers",
          "onnx": "onnx", "onnxscript": "onnx", "onnxruntime": "onnx"}


def require(module: str) -> ModuleType:
    """Import ``module`` or raise an ImportError that says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        raise ImportError(
            f"{top} is needed for this normfold feature: pip install 'normfold[{_EXTRA.get(top, 'hf')}]'"
        ) from err
