"""A data-free rotation (Hadamard, Haar) stated per tensor, for checkpoints rewritten one tensor at a
time (``normfold rotate`` on a sharded folder: ``normfold.hf.streaming``).

Q does not depend on data, so the rotated model is the folded one with each stream tensor t ↦ t·Q
along its stream dim (writers' output side, readers' input side; ``rotate.apply``); the streaming
fold runs ``TensorRotations.rotate_tensor`` after the fold's plan with the same executor, as a
row-wise map (``normfold.engine.executor.TensorMap``, slice by slice). What is needed
is read from the fold plan on a skeleton: the plan applied to a copy on the meta device (no memory),
its graph checked closed (``closure.find_streams``) and the bases drawn as :func:`normfold.rotate`
draws them (:func:`normfold.rotate.bases`), so the same method and seed give the same Q.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ..engine.errors import FoldError
from ..engine.graph import check_model_and_inputs
from ..engine.report import FoldReport
from ..engine.transform import apply_plan
from . import bases, closed_streams
from .apply import rotate_along
from .closure import Stream
from .report import RotationReport

DATA_FREE_METHODS = ("hadamard", "random")


@dataclass
class TensorRotations:
    """The rotation of one residual stream, per parameter: ``along[fqn] = dim`` of each tensor to
    rotate by ``q`` (d, d); ``report`` says how Q was made (its ``verification`` is the caller's)."""

    report: RotationReport
    q: Tensor = field(repr=False)  # float64
    along: dict[str, int]

    def rotate_tensor(self, fqn: str, t: Tensor) -> Tensor:
        """t·Q along the tensor's stream dim (float64 math, cast back once), or ``t`` when not a stream tensor."""
        return t if fqn not in self.along else rotate_along(t, self.along[fqn], self.q)

    def rotate_stream(self, x: Tensor) -> Tensor:
        """The rotated model's stream for the folded model's stream ``x`` (..., d): x·Q."""
        return x @ self.q.to(x.dtype)


def plan_rotation(skeleton: nn.Module, fold_report: FoldReport, example_inputs, *, method: str = "hadamard",
                  seed: int = 0) -> TensorRotations:
    """The rotation of ``skeleton`` folded by ``fold_report``'s plan, from its structure alone (its
    weights are never read). ValueError for a method that needs data (PCA); ``FoldError`` when the
    folded stream is not closed under rotation, or when there is more than one stream."""
    if method not in DATA_FREE_METHODS:
        raise ValueError(f"a checkpoint rewritten tensor by tensor can only take a rotation that needs no data "
                         f"({' or '.join(DATA_FREE_METHODS)}), got method={method!r}: PCA needs the stream's "
                         "covariance over calibration text, which needs the whole model in memory")
    calls = check_model_and_inputs(skeleton, example_inputs)
    folded = apply_plan(copy.deepcopy(skeleton).to("meta"), fold_report.plan)  # structure only: no memory
    on_meta = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), calls)  # a conv reads them with meta weights
    streams = closed_streams(folded, on_meta, fold_report)
    if len(streams) != 1:
        raise FoldError(f"cannot rotate this checkpoint tensor by tensor: it has {len(streams)} residual streams "
                        "(e.g. an encoder and a decoder); the streaming proof follows one: rotate it in memory")
    rotations, _ = bases(streams, method, seed)
    (rotation,) = rotations
    return TensorRotations(RotationReport(method, seed, fold_report, rotations), rotation.basis,
                           {t.fqn: t.dim for t in rotation.stream.tensors})


def stream_rotation(method: str, seed: int, width: int) -> TensorRotations:
    """The Q :func:`plan_rotation` drew for a stream of ``width`` (method and seed from a folder's report),
    as a stream map for checking the folder again (``normfold verify``); no tensor to rotate."""
    if method not in DATA_FREE_METHODS:
        raise ValueError(f"only {' or '.join(DATA_FREE_METHODS)} rotations can be drawn again, got {method!r}")
    rotations, _ = bases([Stream(width, (), ())], method, seed)
    return TensorRotations(RotationReport(method, seed, None, rotations), rotations[0].basis, {})
