"""What ``normfold.rotate`` did: per stream, the basis and how it was made; the proof or the slicing's cost."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from ..engine.report import FoldReport, VerifyResult
from .calibration import OutputAgreement
from .closure import Stream
from .learned import LearningReport


@dataclass
class StreamRotation:
    """One rotated stream: x ↦ x·Q with Q = ``basis`` (d, k), k = ``kept`` (k < d: sliced)."""

    stream: Stream
    basis: Tensor = field(repr=False)  # float64
    how: str                           # "randomised Hadamard (Sylvester 128) ...", "seeded Haar ...", "PCA ..."
    orthogonality_error: float         # max |QᵀQ − I|
    identity_distance: float           # max |Q − I|: 0 would mean nothing was rotated
    kept: int
    kept_energy: float | None = None   # PCA: share of the calibration stream's energy in the kept directions

    def to_dict(self) -> dict:
        return {"stream": self.stream.to_dict(), "how": self.how, "orthogonality_error": self.orthogonality_error,
                "identity_distance": self.identity_distance, "kept": self.kept, "kept_energy": self.kept_energy}


@dataclass
class SliceReport:
    """What slicing cost on the calibration calls (the sliced model is not exact, so not proved)."""

    fraction: float
    calibration_calls: int
    agreement: OutputAgreement

    def to_dict(self) -> dict:
        a = self.agreement
        return {"fraction": self.fraction, "calibration_calls": self.calibration_calls, "min_cosine": a.min_cosine,
                "mean_cosine": a.mean_cosine, "max_rel_error": a.max_rel_error,
                "losses": {k: list(v) for k, v in a.losses.items()}}


@dataclass
class RotationReport:
    """``fold``: the exact fold that came first; ``streams``: each rotated stream; ``verification``:
    the float64 proof of the rotated model against the original (when sliced: of the whole rotation
    the slicing then cut); ``slicing``: what slicing cost on the calibration calls; ``learning``: how a
    learned basis was trained (``method="learned"``)."""

    method: str
    seed: int
    fold: FoldReport
    streams: list[StreamRotation]
    verification: VerifyResult | None = None
    slicing: SliceReport | None = None
    learning: LearningReport | None = None

    @property
    def exact(self) -> bool:
        return self.slicing is None

    def to_dict(self) -> dict:
        return {"method": self.method, "seed": self.seed, "exact": self.exact,
                "streams": [s.to_dict() for s in self.streams],
                "verification": None if self.verification is None else self.verification.to_dict(),
                "slicing": None if self.slicing is None else self.slicing.to_dict(),
                "learning": None if self.learning is None else self.learning.to_dict()}

    def __str__(self) -> str:
        lines = [f"rotate ({self.method}, seed {self.seed}): {len(self.streams)} residual "
                 f"stream{'s' * (len(self.streams) != 1)}"]
        for s in self.streams:
            width = s.stream.width if s.kept == s.stream.width else f"{s.stream.width} -> {s.kept}"
            lines.append(f"  width {width}: {len(s.stream.norms)} RMSNorms, {len(s.stream.tensors)} tensors rotated; "
                         f"{s.how}; max|QᵀQ − I| {s.orthogonality_error:.1e}, max|Q − I| {s.identity_distance:.2f}"
                         + ("" if s.kept_energy is None else f"; kept energy {s.kept_energy:.4f}"))
        if self.learning is not None:
            lines.append(str(self.learning))
        if self.verification is not None:
            lines.append(("the whole rotation, before slicing: " if self.slicing is not None else "")
                         + str(self.verification))
        if self.slicing is not None:
            a = self.slicing.agreement
            lines.append(f"sliced {self.slicing.fraction:.0%} (approximate, not proved): on "
                         f"{self.slicing.calibration_calls} calibration calls min cosine {a.min_cosine:.6f}, mean "
                         f"{a.mean_cosine:.6f}, max rel err {a.max_rel_error:.2e}"
                         + "".join(f"; {name} {x:.4f} -> {y:.4f}" for name, (x, y) in a.losses.items()))
        return "\n".join(lines)
