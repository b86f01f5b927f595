"""ONNX export with the runtime's own norm kernels.

``translations.py``: normfold's norm op as ONNX Runtime's ``SimplifiedLayerNormalization`` /
``SkipSimplifiedLayerNormalization`` (or the standard ``RMSNormalization``, opset >= 23) for the dynamo
exporter, registered only through ``onnx_translations`` (no import-time effect). Needs the ``onnx``
extra: ``pip install 'normfold[onnx]'``.
"""
from __future__ import annotations

from .translations import (DEFAULT_OPSET, LAYER_NORM_NODE_TYPES, RMS_NODE_TYPES, TARGETS, check_target,
                           onnx_translations)

__all__ = ["onnx_translations", "check_target", "TARGETS", "DEFAULT_OPSET", "RMS_NODE_TYPES", "LAYER_NORM_NODE_TYPES"]
