"""ONNX export with the runtime's own norm kernels, proved in ONNX Runtime against the PyTorch model.

    report = normfold.export_onnx(folded, example_inputs, "model.onnx", original=model)

``translations.py``: normfold's norm op as ONNX Runtime's ``SimplifiedLayerNormalization`` /
``SkipSimplifiedLayerNormalization`` (or the standard ``RMSNormalization``, opset >= 23) for the dynamo
exporter, registered only through ``onnx_translations`` (no import-time effect); ``runtime.py``: ONNX
Runtime sessions and the graph it optimizes; ``graph_passes.py``: the exported graph made as fused
as the original's (norms off normfold's 2-D views, residual adds into Skip kernels); ``pipeline.py``:
export, prove within the dtype rule, write atomically, and the fold's options for an export; ``decoder.py``: decoders with their KV cache as graph inputs/outputs and greedy
generation with them in ONNX Runtime. Needs the ``onnx`` extra: ``pip install 'normfold[onnx]'``.
"""
from __future__ import annotations

from .decoder import KV_CACHE_MODEL_TYPES, check_decoder, generate_greedy_ort
from .pipeline import (BATCH_AXIS, SEQUENCE_AXIS, OnnxExportReport, export_onnx, fold_config_for_export,
                       require_onnx_extra)
from .translations import (DEFAULT_OPSET, LAYER_NORM_NODE_TYPES, RMS_NODE_TYPES, TARGETS, check_target,
                           onnx_translations)

__all__ = ["export_onnx", "fold_config_for_export", "generate_greedy_ort", "KV_CACHE_MODEL_TYPES", "check_decoder", "OnnxExportReport", "require_onnx_extra", "onnx_translations", "check_target", "TARGETS", "DEFAULT_OPSET",
           "RMS_NODE_TYPES", "LAYER_NORM_NODE_TYPES", "BATCH_AXIS", "SEQUENCE_AXIS"]
