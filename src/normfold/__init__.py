"""normfold: LayerNorm's behaviour at RMSNorm's cost.

Fused RMSNorm / LayerNorm ops (``normfold.ops``, ``normfold.nn``), an engine that converts the
LayerNorms of any ``torch.export``-able model exactly into RMSNorms (``analyze`` / ``fold`` /
``verify``), Hugging Face checkpoint I/O, CBWC training and diagnostics.

``normfold.fold(model, inputs)`` is the exact fold in one line; ``normfold.convert`` composes it
with fusion and the approximate fold (``FoldConfig``, ``FuseConfig``, ``ApproximateConfig``).

``import normfold`` needs only torch; transformers and safetensors (checkpoint I/O), training and
benchmarks are imported on first use.
"""
from __future__ import annotations

import importlib

from . import nn, ops
from .nn import FusedAddRMSNorm, RMSNorm
from .ops import layer_norm, rms_norm

# Imported eagerly (torch only). ``normfold.fold`` is only the function (the engine it wraps is the
# subpackage ``normfold.engine``); the function ``convert`` shadows the module ``normfold.convert``.
from .engine import ExampleInputsError, FoldError, FoldPlan, FoldReport, FoldVerificationError, NormEntry, VerifyResult, analyze, verify
from .convert import ApproximateConfig, FoldConfig, FuseConfig, QuantizeConfig, RotateConfig, convert, fold
from .rotate import LearnConfig, RotationReport, learn_rotation, rotate  # the function shadows the subpackage, as fold does
from .quantize import QuantizeReport, quantize  # likewise

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily on first attribute access)
_LAZY = {
    # Hugging Face folders
    "from_pretrained": "normfold.hf",
    "save_pretrained": "normfold.hf",
    "verify_folder": "normfold.folders",
    # training
    "cbwc_": "normfold.train.cbwc",
    # faster folded models
    "fuse_residual_norms": "normfold.fuse",
    # ONNX export (the onnx extra)
    "export_onnx": "normfold.export",
    # lab
    "inspect": "normfold.lab",
    "check": "normfold.lab",
    "approximate_fold": "normfold.lab",
    "fold_batchnorms": "normfold.lab",
}
# public submodules reachable as attributes (``normfold.cbwc.bake_``)
_LAZY_MODULES = {"cbwc": "normfold.train.cbwc", "hf": "normfold.hf", "train": "normfold.train", "lab": "normfold.lab",
                 "bench": "normfold.bench", "fuse": "normfold.fuse", "export": "normfold.export"}

__all__ = [
    "ops", "nn", "rms_norm", "layer_norm", "RMSNorm", "FusedAddRMSNorm",
    "analyze", "fold", "verify", "FoldPlan", "FoldReport", "NormEntry", "VerifyResult", "FoldError", "FoldVerificationError",
    "ExampleInputsError",
    "convert", "FoldConfig", "FuseConfig", "ApproximateConfig", "RotateConfig",
    "rotate", "learn_rotation", "RotationReport", "LearnConfig", "quantize", "QuantizeConfig", "QuantizeReport",
    *_LAZY, *_LAZY_MODULES,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
    else:
        raise AttributeError(f"module 'normfold' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
