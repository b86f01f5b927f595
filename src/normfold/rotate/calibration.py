"""What calibration inputs tell about a stream: its second moment (for the PCA basis) and how far
a sliced model's outputs move (cosine, relative error, any loss the model returns)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from .._progress import progress
from ..engine.graph import eval_mode
from ..engine.verify import cast_floats, model_outputs
from .closure import Stream


def stream_second_moments(model: nn.Module, streams: list[Stream], calls: list[tuple[tuple, dict]]) -> list[Tensor]:
    """Σ xᵀx over every row x entering each stream's norms, summed over the calls (float64; the
    uncentered second moment, as SliceGPT's PCA uses: RMSNorm sees x, not x − mean)."""
    sums = [torch.zeros(s.width, s.width, dtype=torch.float64) for s in streams]

    def accumulate(index: int):
        def hook(module, inputs):
            rows = inputs[0].detach().to(torch.float64).reshape(-1, streams[index].width)
            sums[index].add_((rows.T @ rows).cpu())
        return hook

    hooks = [model.get_submodule(path).register_forward_pre_hook(accumulate(i))
             for i, stream in enumerate(streams) for path in stream.norms]
    try:
        with eval_mode(model), torch.no_grad():
            for args, kwargs in progress(calls, desc="rotate: calibration (PCA basis)", unit="batch"):
                args, kwargs = cast_floats((args, kwargs), torch.float64)
                model(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    return sums


def run_error(model: nn.Module, call: tuple[tuple, dict]) -> Exception | None:
    """The error ``model`` raises on ``call`` (run in float64), or None when it runs: a sliced model
    whose own code takes a size from the stream's width fails here."""
    args, kwargs = cast_floats(call, torch.float64)
    try:
        model_outputs(model, args, kwargs)
    except (RuntimeError, ValueError, IndexError) as error:  # the model's own code, at the sliced width
        return error
    return None


@dataclass
class OutputAgreement:
    """How close a candidate's outputs stay to a reference's on calibration inputs (float64).

    ``min_cosine`` / ``mean_cosine``: cosine similarity of each output row (last dim) of every
    floating output with two or more dims; ``max_rel_error``: ‖a−b‖∞/‖a‖∞ over those outputs;
    ``losses``: for scalar outputs named like a loss (pass labels in the calibration calls), the
    mean over calls, reference and candidate.
    """

    min_cosine: float
    mean_cosine: float
    max_rel_error: float
    losses: dict[str, tuple[float, float]] = field(default_factory=dict)


def output_agreement(reference: nn.Module, candidate: nn.Module, calls: list[tuple[tuple, dict]]) -> OutputAgreement:
    """Compare two float64 models on the calls (see :class:`OutputAgreement`)."""
    cosines, worst, losses = [], 0.0, {}
    for args, kwargs in calls:
        args, kwargs = cast_floats((args, kwargs), torch.float64)
        ref, out = dict(model_outputs(reference, args, kwargs)), dict(model_outputs(candidate, args, kwargs))
        for name, a in ref.items():
            b = out.get(name)
            if not isinstance(a, Tensor) or not isinstance(b, Tensor) or not a.is_floating_point():
                continue
            if a.dim() == 0 and "loss" in name.lower():
                sums = losses.setdefault(name, [0.0, 0.0])
                sums[0], sums[1] = sums[0] + a.item(), sums[1] + b.item()
            elif a.dim() >= 1 and a.shape == b.shape and a.numel():
                rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
                cosines.append(torch.nn.functional.cosine_similarity(rows_a, rows_b, dim=-1))
                scale = a.abs().max().item()
                worst = max(worst, (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item())
    if not cosines:
        raise ValueError("the calibration calls give no floating output of two or more dims to compare")
    every = torch.cat(cosines)
    return OutputAgreement(every.min().item(), every.mean().item(), worst,
                           {name: (a / len(calls), b / len(calls)) for name, (a, b) in losses.items()})
