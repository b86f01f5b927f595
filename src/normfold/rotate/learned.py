"""Learned rotations (SpinQuant-style): each residual stream's Q optimised for the *quantized* model.

A rotation changes nothing in exact arithmetic, but it changes what rounding does: the same
function, quantized, loses more or less depending on Q. SpinQuant optimises Q on the Stiefel
manifold (orthogonal matrices) against the quantized model's loss; here each stream's Q is

    Q(M) = Q₀ · (I − A/2)⁻¹ (I + A/2),   A = M − Mᵀ,

the Cayley transform of a skew-symmetric A times the start Q₀ (the seeded randomised Hadamard
basis, or its seeded Haar fallback at a width no Hadamard construction here reaches). For every real M the Cayley factor is orthogonal (A skew ⇒ (I + A/2) and (I − A/2)⁻¹
commute and (I − A/2)ᵀ = I + A/2), so Q(M) never leaves the manifold, and M = 0 gives Q₀ exactly.
M (zero at the start) is trained by Adam: "Cayley-parametrised Adam", which reaches every rotation
near Q₀ (all but those with eigenvalue −1 relative to it) with an unconstrained optimiser, where
Cayley SGD (SpinQuant) retracts each step onto the manifold instead.

The loss: on the calibration calls, the KL divergence from the unquantized model's output
distribution (softmax over the last dim of its first floating output with two or more dims, e.g.
the logits) to the quantized rotated model's, with the weights of the layers a
:class:`~normfold.quantize.QuantizeConfig` selects and, optionally, their inputs fake-quantized
with the straight-through estimator (rounding's gradient taken as 1). The unquantized rotated
model is the original's function for every Q, so the reference is computed once.

The model is rotated functionally (``torch.func.functional_call`` with every stream tensor t·Q
along its stream dim, as ``apply.rotate_along``), in float32; the final Q is rebuilt from M in
float64, checked orthogonal to 1e-12 (re-orthonormalised by its polar factor otherwise) and applied
and proved by ``normfold.rotate`` exactly as a random basis is. Learning can end worse than it started
(a learning rate too large for the model, a last step on a bad call): the learned Q is returned only
when its mean calibration loss is below the start's, else the start is, and the report says which and why.
"""
from __future__ import annotations

import copy
import hashlib
import numbers
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._progress import progress
from ..engine.graph import eval_mode
from ..engine.verify import cast_floats, flatten_outputs
from ..quantize import ActivationQuantizer, QuantizeConfig, fake_quantize_ste, input_dim, selected_layers
from .closure import Stream
from .orthogonal import orthogonality_error

ORTHOGONALITY_BOUND = 1e-12  # max |QᵀQ − I| a learned Q must meet before it is used


@dataclass(frozen=True)
class LearnConfig:
    """How a learned rotation is trained (``RotateConfig(method="learned", learning=...)``), checked when built.

    ``quantize``: the quantized model whose loss is minimised (default W4 per channel, every linear
    layer); ``steps``: Adam steps, one calibration call each, cycling through the calls; ``lr``:
    Adam's learning rate on M (see the module docstring).
    """

    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    steps: int = 100
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if not isinstance(self.quantize, QuantizeConfig):
            raise TypeError(f"quantize must be a QuantizeConfig (what the learned rotation is optimised for), got "
                            f"{type(self.quantize).__name__}")
        if not isinstance(self.steps, numbers.Integral) or isinstance(self.steps, bool):
            raise TypeError(f"steps must be an int, got {self.steps!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if not isinstance(self.lr, numbers.Real) or isinstance(self.lr, bool):
            raise TypeError(f"lr must be a number, got {self.lr!r}")
        if not 0 < self.lr < float("inf"):  # also refuses NaN
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")


@dataclass
class LearningReport:
    """What the learning did: its config, the calibration data (count, shapes, SHA-256 of its tensors),
    the objective, the calibration loss at the Hadamard start and at the end, the loss of each step,
    and which Q was returned (``returned``: "learned" or "start") and why."""

    config: LearnConfig
    start_seed: int
    calibration_calls: int
    calibration_shapes: list[str]
    calibration_sha256: str
    objective: str
    start_loss: float
    end_loss: float
    step_losses: list[float] = field(repr=False)
    reorthonormalised: bool = False
    returned: str = "learned"  # "learned", or "start" when learning did not lower the calibration loss
    returned_why: str = ""

    def to_dict(self) -> dict:
        return {"steps": self.config.steps, "lr": self.config.lr, "quantize": asdict(self.config.quantize),
                "scheme": self.config.quantize.scheme, "start": f"randomised Hadamard, seed {self.start_seed}",
                "calibration_calls": self.calibration_calls, "calibration_shapes": self.calibration_shapes,
                "calibration_sha256": self.calibration_sha256, "objective": self.objective,
                "start_loss": self.start_loss, "end_loss": self.end_loss, "step_losses": self.step_losses,
                "reorthonormalised": self.reorthonormalised, "returned": self.returned,
                "returned_why": self.returned_why}

    def __str__(self) -> str:
        return (f"learned for {self.config.quantize.scheme} ({self.config.steps} Cayley-Adam steps, lr "
                f"{self.config.lr:g}, from the randomised Hadamard of seed {self.start_seed}) on "
                f"{self.calibration_calls} calibration calls (sha256 {self.calibration_sha256[:12]}): {self.objective} "
                f"{self.start_loss:.4g} -> {self.end_loss:.4g}; returned: {self.returned} ({self.returned_why})")


def cayley(m: Tensor) -> Tensor:
    """(I − A/2)⁻¹ (I + A/2) with A = M − Mᵀ: an orthogonal matrix for every square M (I at M = 0)."""
    a = (m - m.T) / 2
    eye = torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    return torch.linalg.solve(eye - a, eye + a)


def learn_rotations(folded: nn.Module, streams: list[Stream], starts: list[Tensor], calls: list[tuple[tuple, dict]],
                    config: LearnConfig, start_seed: int) -> tuple[list[Tensor], LearningReport]:
    """The learned Q (float64, orthogonal to 1e-12) of each stream, from ``starts``, and the report.
    ``folded``: the exact fold's model (not modified); ``calls``: the calibration calls."""
    model = copy.deepcopy(folded).float()
    chosen = selected_layers(model, config.quantize)  # ValueError before any work
    objective = _Objective(model, streams, chosen, config.quantize, calls)
    device = next(model.parameters()).device
    ms = [torch.zeros(q.shape, dtype=torch.float32, device=device, requires_grad=True) for q in starts]
    q0 = [q.to(device=device, dtype=torch.float32) for q in starts]
    optimiser = torch.optim.Adam(ms, lr=config.lr)
    with torch.no_grad():
        start_loss = objective.mean(q0)
    step_losses = []
    for step in progress(range(config.steps), desc="rotate: learning Q for the quantized model", unit="step"):
        optimiser.zero_grad()
        loss = objective.loss([q @ cayley(m) for q, m in zip(q0, ms)], step % len(calls))
        loss.backward()
        optimiser.step()
        step_losses.append(loss.item())
    learned, repaired = zip(*(nearest_orthogonal(q.to(torch.float64) @ cayley(m.detach().cpu().to(torch.float64)))
                              for q, m in zip(starts, ms)))
    with torch.no_grad():
        end_loss = objective.mean([q.to(device=device, dtype=torch.float32) for q in learned])
    returned, why = _returned(start_loss, end_loss)
    return (list(learned) if returned == "learned" else list(starts)), LearningReport(
        config, start_seed, len(calls), [_shapes(c) for c in calls], _calls_sha256(calls), objective.name, start_loss,
        end_loss, step_losses, any(repaired), returned, why)


def _returned(start_loss: float, end_loss: float) -> tuple[str, str]:
    """Which Q a learning returns, and why: the learned one only when its mean calibration loss is below
    the start's (a diverging run, or one that ends on a bad step, returns the start; NaN never wins)."""
    if end_loss < start_loss:
        return "learned", f"its calibration loss {end_loss:.6g} is below the start's {start_loss:.6g}"
    return "start", (f"learning ended at calibration loss {end_loss:.6g}, not below the start's {start_loss:.6g}, "
                     "so the start is returned")


def nearest_orthogonal(q: Tensor) -> tuple[Tensor, bool]:
    """``q`` when max |QᵀQ − I| ≤ 1e-12, else its polar factor U·Vᵀ (the nearest orthogonal matrix),
    and whether it was replaced."""
    if orthogonality_error(q) <= ORTHOGONALITY_BOUND:
        return q, False
    u, _, vh = torch.linalg.svd(q)
    polar = u @ vh
    assert orthogonality_error(polar) <= ORTHOGONALITY_BOUND, orthogonality_error(polar)
    return polar, True


class _Objective:
    """The quantized rotated model's KL to the unquantized model on the calibration calls, as a
    function of the streams' Q (see the module docstring)."""

    def __init__(self, model: nn.Module, streams: list[Stream], chosen: dict[str, nn.Module],
                 quantize: QuantizeConfig, calls: list[tuple[tuple, dict]]) -> None:
        self.model, self.quantize = model.eval().requires_grad_(False), quantize
        self.calls = [cast_floats(call, torch.float32) for call in calls]
        self.names = dict(model.named_parameters(remove_duplicate=False))  # tied tensors under every name
        self.along = {id(model.get_parameter(t.fqn)): (i, t.dim) for i, s in enumerate(streams) for t in s.tensors}
        self.weights = {f"{path}.weight": input_dim(module) for path, module in chosen.items()}
        self.output = None
        with torch.no_grad():  # the reference: unrotated, unquantized (before the activation hooks)
            self.references = [F.log_softmax(self._logits(dict(self.names), i), dim=-1) for i in range(len(calls))]
        if quantize.activation_bits is not None:
            for module in chosen.values():
                module.register_forward_pre_hook(ActivationQuantizer(quantize.activation_bits, straight_through=True))
        self.name = f"KL(unquantized ‖ {quantize.scheme}) over the last dim of {self.output}, per row"

    def _logits(self, parameters: dict[str, Tensor], index: int) -> Tensor:
        args, kwargs = self.calls[index]
        with eval_mode(self.model):
            outputs = flatten_outputs(torch.func.functional_call(self.model, parameters, args, kwargs,
                                                                 tie_weights=False))
        candidates = [(name, v) for name, v in outputs if isinstance(v, Tensor) and v.is_floating_point() and v.dim() >= 2]
        if not candidates:
            raise ValueError("method='learned' needs a model with a floating output of two or more dims (logits) to "
                             f"compare, got outputs {[name for name, _ in outputs][:6]}")
        name, value = candidates[0]
        self.output = self.output or name
        return value.reshape(-1, value.shape[-1])

    def parameters_for(self, qs: list[Tensor]) -> dict[str, Tensor]:
        """Every parameter by every name: stream tensors t·Q along their dim, quantized layers' weights
        fake-quantized with the straight-through gradient."""
        rotated = {}
        for name, p in self.names.items():
            where = self.along.get(id(p))
            rotated[name] = p if where is None else (p.movedim(where[1], -1) @ qs[where[0]]).movedim(-1, where[1])
        for name, dim in self.weights.items():
            rotated[name] = fake_quantize_ste(rotated[name], self.quantize.weight_bits, dim, self.quantize.group_size)
        return rotated

    def loss(self, qs: list[Tensor], index: int) -> Tensor:
        log_q = F.log_softmax(self._logits(self.parameters_for(qs), index), dim=-1)
        log_p = self.references[index]
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()

    def mean(self, qs: list[Tensor]) -> float:
        return sum(self.loss(qs, i).item() for i in range(len(self.calls))) / len(self.calls)


def _shapes(call: tuple[tuple, dict]) -> str:
    args, kwargs = call
    shapes = [tuple(v.shape) for v in [*args, *kwargs.values()] if isinstance(v, Tensor)]
    return " ".join(str(list(s)) for s in shapes)


def _calls_sha256(calls: list[tuple[tuple, dict]]) -> str:
    """SHA-256 over the calibration calls' tensors (argument names, dtypes, shapes and bytes), in order."""
    digest = hashlib.sha256()
    for args, kwargs in calls:
        for name, value in [*enumerate(args), *sorted(kwargs.items())]:
            if isinstance(value, Tensor):
                t = value.detach().cpu().contiguous()
                digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
