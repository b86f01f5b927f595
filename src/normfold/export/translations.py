"""ONNX translations of normfold's norm op for the dynamo exporter (``torch.onnx.export(..., dynamo=True)``).

``normfold::norm_fwd`` (x, weight?, bias?, residual?, eps, offset, is_rms) -> (y, s, mean, rstd) becomes
one runtime norm kernel per call:

=================  ==========================================  =====================================
call               target ``"onnxruntime"``                    target ``"onnx"`` (opset >= 23)
=================  ==========================================  =====================================
RMS                ``SimplifiedLayerNormalization``            ``RMSNormalization``
RMS + residual     ``SkipSimplifiedLayerNormalization`` (ms)   ``Add`` + ``RMSNormalization``
LayerNorm          ``LayerNormalization``                      ``LayerNormalization``
LN + residual      ``SkipLayerNormalization`` (ms)             ``Add`` + ``LayerNormalization``
=================  ==========================================  =====================================

(ms: domain ``com.microsoft``; ONNX Runtime registers ``SimplifiedLayerNormalization`` in the ONNX
domain itself.) Every kernel keeps its statistics in float32 (``stash_type=1``; float64 inputs in
float64), like normfold's kernels. γ becomes ``offset + γ`` (computed in float32, cast to x's dtype;
ones when there is no γ); a bias the kernel has no input for is an ``Add`` after it. The op's
statistics outputs (mean, rstd), which only the backward reads, are computed apart from plain ONNX
ops, so the exporter drops them when nothing reads them.

The legacy TorchScript exporter is refused in ``ops/_library.norm``.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from .._deps import require

__all__ = ["TARGETS", "MIN_OPSET", "DEFAULT_OPSET", "check_target", "onnx_translations", "RMS_NODE_TYPES",
           "LAYER_NORM_NODE_TYPES"]

TARGETS = ("onnxruntime", "onnx")
# torch's ONNX functions start at opset 18; the standard RMSNormalization at 23
MIN_OPSET = {"onnxruntime": 18, "onnx": 23}
DEFAULT_OPSET = {"onnxruntime": 20, "onnx": 23}

# node types a norm becomes (in the exported graph or after ONNX Runtime's optimizer, which may fuse a
# preceding Add into a Skip* node)
RMS_NODE_TYPES = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization")
LAYER_NORM_NODE_TYPES = ("LayerNormalization", "SkipLayerNormalization")

_MS_DOMAIN = "com.microsoft"
_FLOAT_STASH = 1  # stash_type: statistics in float32


def check_target(target: str, opset: int | None) -> int:
    """The opset to export ``target`` at (``opset``, or the target's default), or ValueError/TypeError."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if opset is None:
        return DEFAULT_OPSET[target]
    if isinstance(opset, bool) or not isinstance(opset, int):
        raise TypeError(f"opset must be an int, got {type(opset).__name__} {opset!r}")
    if opset < MIN_OPSET[target]:
        why = "the standard RMSNormalization" if target == "onnx" else "torch's ONNX functions"
        raise ValueError(f"opset for target {target!r} must be >= {MIN_OPSET[target]} ({why}), got {opset}")
    return opset


def onnx_translations(target: str = "onnxruntime", opset: int | None = None) -> dict:
    """``custom_translation_table`` for ``torch.onnx.export(..., dynamo=True)`` of a model with normfold norms.

    ``torch.onnx.export(model, args, dynamo=True, opset_version=opset,
    custom_translation_table=normfold.export.onnx_translations("onnxruntime", opset))``; the model must
    be exported at the same opset. Needs the ``onnx`` extra (onnx, onnxscript).
    """
    return {torch.ops.normfold.norm_fwd.default: _norm_fwd_translation(target, check_target(target, opset))}


@functools.cache
def _norm_fwd_translation(target: str, opset: int) -> Callable:
    """The translation of ``normfold::norm_fwd`` for ``target`` at ``opset`` (traced by the exporter)."""
    onnx = require("onnx")
    onnxscript = require("onnxscript")
    op = onnxscript.values.Opset("", opset)
    ort_ops = _ort_contrib_ops(onnx, onnxscript, opset) if target == "onnxruntime" else None
    ir_float, ir_double = onnxscript.ir.DataType.FLOAT, onnxscript.ir.DataType.DOUBLE

    def stat_type(x):
        return ir_double if x.dtype == ir_double else ir_float

    def scale(param, offset: float, x):
        """``offset + param`` in float32 (ones without ``param``), in x's dtype."""
        if param is None:
            return op.Expand(op.CastLike(op.Constant(value_float=1.0), x), op.Shape(x, start=-1))
        if offset:
            param = op.Add(op.Cast(param, to=stat_type(x)), op.Constant(value_float=float(offset)))
        return op.CastLike(param, x)

    def stats(s, eps: float, is_rms: bool):
        """The op's (mean, rstd) per row of 2-D ``s``, in float32 (mean empty for RMS)."""
        t = op.Cast(s, to=stat_type(s))
        if is_rms:
            mean = op.Cast(op.Constant(value_floats=[0.0]), to=stat_type(s))
            mean, centred = op.Slice(mean, [0], [0]), t
        else:
            mean = op.ReduceMean(t, [-1], keepdims=0)
            centred = op.Sub(t, op.Unsqueeze(mean, [-1]))
        variance = op.ReduceMean(op.Mul(centred, centred), [-1], keepdims=0)
        eps_value = op.CastLike(op.Constant(value_float=eps), t)
        return mean, op.Reciprocal(op.Sqrt(op.Add(variance, eps_value)))

    def norm_fwd(x, weight, bias, residual, eps: float, offset: float, is_rms: bool):
        gamma = scale(weight, offset, x)
        beta = None if bias is None else op.CastLike(bias, x)
        if residual is not None:
            residual = op.CastLike(residual, x)
        if ort_ops is not None and residual is not None:
            name = "SkipSimplifiedLayerNormalization" if is_rms else "SkipLayerNormalization"
            extra = () if is_rms else (beta,)  # SkipLayerNormalization takes β; its "bias" is added before the norm
            y, _, _, s = ort_ops[name](x, residual, gamma, *extra, epsilon=eps)
            if is_rms and beta is not None:
                y = op.Add(y, beta)
        else:
            s = x if residual is None else op.Add(x, residual)
            if not is_rms:
                y, _, _ = op.LayerNormalization(s, gamma, beta, axis=-1, epsilon=eps, stash_type=_FLOAT_STASH)
            elif ort_ops is not None:
                y = ort_ops["SimplifiedLayerNormalization"](s, gamma, axis=-1, epsilon=eps, stash_type=_FLOAT_STASH)
            else:
                y = op.RMSNormalization(s, gamma, axis=-1, epsilon=eps, stash_type=_FLOAT_STASH)
            if is_rms and beta is not None:
                y = op.Add(y, beta)
        mean, rstd = stats(s, eps, is_rms)
        # without residual the op's s output is an empty tensor
        s_out = s if residual is not None else op.Slice(op.Reshape(x, [-1]), [0], [0])
        return y, s_out, mean, rstd

    return norm_fwd


def _ort_contrib_ops(onnx, onnxscript, opset: int) -> dict:
    """ONNX Runtime's fused norm ops as onnxscript ops (onnx has no schema for them: ours, unregistered)."""
    OpSchema = onnx.defs.OpSchema
    single, optional = OpSchema.FormalParameterOption.Single, OpSchema.FormalParameterOption.Optional
    types = [("T", ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"], "data"),
             ("U", ["tensor(float)", "tensor(double)"], "statistics")]

    def make(name: str, domain: str, inputs: list[str], outputs: list[str], attributes: dict):
        def formal(spec: str):
            # "name:T" required, "name:T?" optional
            name_, type_ = spec.rstrip("?").split(":")
            return OpSchema.FormalParameter(name_, type_, param_option=optional if spec.endswith("?") else single)

        schema = OpSchema(name, domain, 1, inputs=[formal(i) for i in inputs], outputs=[formal(o) for o in outputs],
                          type_constraints=types,
                          attributes=[OpSchema.Attribute(a, onnx.helper.make_attribute(a, v), "")
                                      for a, v in attributes.items()])
        version = opset if domain == "" else 1
        return onnxscript.values.Op(onnxscript.values.Opset(domain, version), name, schema)

    skip_outputs = ["output:T", "mean:U?", "inv_std_var:U?", "input_skip_bias_sum:T?"]
    return {
        "SimplifiedLayerNormalization": make("SimplifiedLayerNormalization", "", ["X:T", "scale:T"],
                                             ["Y:T"],
                                             {"axis": -1, "epsilon": 1e-5, "stash_type": _FLOAT_STASH}),
        "SkipSimplifiedLayerNormalization": make("SkipSimplifiedLayerNormalization", _MS_DOMAIN,
                                                 ["input:T", "skip:T", "gamma:T", "bias:T?"], skip_outputs,
                                                 {"epsilon": 1e-5}),
        "SkipLayerNormalization": make("SkipLayerNormalization", _MS_DOMAIN,
                                       ["input:T", "skip:T", "gamma:T", "beta:T?", "bias:T?"], skip_outputs,
                                       {"epsilon": 1e-5}),
    }
