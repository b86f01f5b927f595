"""Prove a fold: run the original and the folded model on the same inputs and compare outputs."""
from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from .graph import eval_mode, split_example_inputs
from .report import VerifyResult


def verify(original: nn.Module, folded: nn.Module, example_inputs, *, dtype: torch.dtype = torch.float64,
           num_random: int = 2, tolerance: float = 1e-9, seed: int = 0,
           rms_norm_paths=None, folded_exact: nn.Module | None = None) -> VerifyResult:
    """Compare outputs on the example inputs and ``num_random`` fresh inputs of the same shapes.

    Both models run as float64 copies (float inputs cast too); the relative error of each output is
    ‖a−b‖∞ / ‖a‖∞. The same comparison runs in the model's own dtype. Forward pre-hooks measure
    how far from zero-mean the inputs of the folded model's RMSNorms at ``rms_norm_paths`` (default:
    every normfold RMSNorm) are, as max |mean|/rms. ``folded_exact``: the same fold built in float64
    (``fold`` passes its plan applied to a float64 copy), used for the float64 comparison so that
    rounding the folded weights to the model's dtype does not count against the transform.
    """
    args, kwargs = split_example_inputs(example_inputs)
    if num_random < 0:
        raise ValueError(f"num_random must be >= 0, got {num_random}")
    generator = torch.Generator().manual_seed(seed)
    inputs = [(args, kwargs)] + [_random_like((args, kwargs), generator) for _ in range(num_random)]
    model_dtype = _float_dtype(original)

    outputs, max_rel, max_abs, mean_ratio = [], 0.0, 0.0, 0.0
    a64, b64 = (_cast_copy(m, dtype) for m in (original, folded if folded_exact is None else folded_exact))
    hooks, ratios = _watch_rms_inputs(b64, rms_norm_paths)
    try:
        for i, (a, k) in enumerate(inputs):
            for name, ref, out in _compare(a64, b64, _cast(a, dtype), _cast(k, dtype)):
                rel, abs_ = _errors(ref, out)
                outputs.append({"input": i, "name": name, "dtype": str(dtype), "max_abs": abs_, "max_rel": rel,
                                "argmax_agreement": _argmax_agreement(ref, out)})
                max_rel, max_abs = max(max_rel, rel), max(max_abs, abs_)
    finally:
        for h in hooks:
            h.remove()
    own_rel = None
    if model_dtype is not None and model_dtype != dtype:
        own_rel = 0.0
        for i, (a, k) in enumerate(inputs):
            for name, ref, out in _compare(original, folded, a, k):
                rel, abs_ = _errors(ref, out)
                outputs.append({"input": i, "name": name, "dtype": str(model_dtype), "max_abs": abs_, "max_rel": rel,
                                "argmax_agreement": _argmax_agreement(ref, out)})
                own_rel = max(own_rel, rel)
    return VerifyResult(outputs, max_rel, max_abs, own_rel, max(ratios) if ratios else None,
                        tolerance=tolerance, num_runs=len(inputs))


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _cast_copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    return copy.deepcopy(model).to(dtype)


def _cast(value, dtype):
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _random_like(value, generator):
    """Fresh values of the same shapes: normal floats, ints in [0, max+1), bools and others copied."""
    if isinstance(value, Tensor):
        if value.is_floating_point():
            return torch.randn(value.shape, generator=generator, dtype=torch.float64).to(value.dtype)
        if value.dtype != torch.bool and not value.is_complex() and value.numel():
            high = int(value.max()) + 1
            low = min(int(value.min()), 0)
            return torch.randint(low, max(high, low + 1), value.shape, generator=generator, dtype=value.dtype)
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_random_like(v, generator) for v in value)
    if isinstance(value, dict):
        return {k: _random_like(v, generator) for k, v in value.items()}
    return value


def _flatten(value, prefix="out"):
    """(name, tensor) pairs of a nested output: tuples, lists, dicts, Hugging Face ModelOutput."""
    if isinstance(value, Tensor):
        yield prefix, value
    elif hasattr(value, "items"):
        for k, v in value.items():
            yield from _flatten(v, f"{prefix}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _flatten(v, f"{prefix}[{i}]")


def _compare(a_model, b_model, args, kwargs):
    with eval_mode(a_model), eval_mode(b_model), torch.no_grad():
        ref = dict(_flatten(a_model(*args, **kwargs)))
        out = dict(_flatten(b_model(*args, **kwargs)))
    if ref.keys() != out.keys():
        raise ValueError(f"the models return different outputs: {sorted(ref)} vs {sorted(out)}")
    return [(name, ref[name], out[name]) for name in ref]


def _errors(ref: Tensor, out: Tensor) -> tuple[float, float]:
    if ref.shape != out.shape:
        return float("inf"), float("inf")
    if not ref.is_floating_point():
        bad = float((ref != out).any())
        return bad, bad
    ref, out = ref.double(), out.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(out)) or not torch.equal(ref[~finite].nan_to_num(), out[~finite].nan_to_num()):
        return float("inf"), float("inf")  # inf/nan in different places
    if not finite.any():
        return 0.0, 0.0
    diff = (ref[finite] - out[finite]).abs().max().item()
    scale = ref[finite].abs().max().item()
    return (diff / scale if scale > 0 else diff), diff


def _argmax_agreement(ref: Tensor, out: Tensor) -> float | None:
    if ref.dim() < 2 or not ref.is_floating_point() or ref.shape != out.shape or not ref.numel():
        return None
    return (ref.argmax(-1) == out.argmax(-1)).double().mean().item()


def _watch_rms_inputs(model: nn.Module, paths):
    """Forward pre-hooks on normfold RMSNorms recording max |mean(x)| / rms(x) over rows."""
    from ..nn import RMSNorm

    ratios: list[float] = []

    def hook(module, inputs):
        x = inputs[0].double()
        rms = x.square().mean(-1).sqrt().clamp_min(torch.finfo(torch.float64).tiny)
        ratios.append((x.mean(-1).abs() / rms).max().item())

    wanted = None if paths is None else set(paths)
    hooks = [m.register_forward_pre_hook(hook) for path, m in model.named_modules()
             if isinstance(m, RMSNorm) and (wanted is None or path in wanted)]
    return hooks, ratios
