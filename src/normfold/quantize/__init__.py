"""Fake-quantize a model's linear layers (normfold's own, as torchao's ``quantize_`` picks layers by name).

    quantized, report = normfold.quantize(model, QuantizeConfig(weight_bits=4, activation_bits=8,
                                                                exclude=("lm_head",)), data=held_out_calls)
    print(report)   # which layers, and the held-out loss / perplexity before and after

Weights are rounded once onto a symmetric grid (``fake.py``: per output channel, or per group of
input entries) and stored in the model's dtype; activations, when ``activation_bits`` is set, are
rounded per token at every call (a forward pre-hook on each quantized layer, dynamic). The
arithmetic stays floating point: this measures what a quantized model loses, it does not make it
smaller or faster. Linear layers are ``nn.Linear`` and Hugging Face's ``Conv1D`` (weight (in, out)).
Also a step (``normfold.convert(model, x, RotateConfig(), QuantizeConfig())``): approximate, so
measured (the loss before and after on the example calls, when they make the model return one),
never proved. Only torch is imported here.
"""
from __future__ import annotations

import copy
import fnmatch
import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from .._progress import progress
from ..engine.graph import eval_mode, split_example_calls
from ..engine.steps import StepContext, register_step
from ..engine.verify import flatten_outputs
from .fake import fake_quantize, fake_quantize_ste, grid_max, group_scales

WEIGHT_BITS = (2, 8)       # the weight grids offered, inclusive
ACTIVATION_BITS = (2, 16)  # the activation grids offered, inclusive


@dataclass(frozen=True)
class QuantizeConfig:
    """What to fake-quantize (:func:`quantize`), checked when built (TypeError / ValueError).

    ``weight_bits``: symmetric round-to-nearest weights, 2-8 bits; ``group_size``: one scale per
    ``group_size`` input entries of each output channel (None: one per output channel);
    ``activation_bits``: each quantized layer's input rounded per token, 2-16 bits (None: not
    quantized, "W4A16"); ``include`` / ``exclude``: shell patterns (``fnmatch``) over the layers'
    fully-qualified names: a linear layer is quantized when some ``include`` pattern matches its
    name and no ``exclude`` pattern does (``exclude=("lm_head",)`` keeps the head, as QuaRot does).
    """

    weight_bits: int = 4
    activation_bits: int | None = None
    group_size: int | None = None
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_bits("weight_bits", self.weight_bits, WEIGHT_BITS, optional=False)
        _check_bits("activation_bits", self.activation_bits, ACTIVATION_BITS, optional=True)
        if self.group_size is not None:
            if not isinstance(self.group_size, numbers.Integral) or isinstance(self.group_size, bool):
                raise TypeError(f"group_size must be an int or None (one scale per output channel), got "
                                f"{self.group_size!r}")
            if self.group_size < 1:
                raise ValueError(f"group_size must be at least 1, got {self.group_size}")
        for name in ("include", "exclude"):
            patterns = getattr(self, name)
            if not isinstance(patterns, (tuple, list)) or not all(isinstance(p, str) for p in patterns):
                raise TypeError(f"{name} must be a tuple of name patterns (str), e.g. ('lm_head',), got {patterns!r}")
            object.__setattr__(self, name, tuple(patterns))
        if not self.include:
            raise ValueError("include must hold at least one name pattern ('*' for every linear layer), got ()")

    @property
    def scheme(self) -> str:
        """"W4A8 g128": the weight bits, the activation bits (16: unquantized) and the group size."""
        group = "" if self.group_size is None else f" g{self.group_size}"
        return f"W{self.weight_bits}A{self.activation_bits or 16}{group}"

    def selects(self, fqn: str) -> bool:
        """Whether a linear layer of this fully-qualified name is quantized."""
        return (any(fnmatch.fnmatchcase(fqn, p) for p in self.include)
                and not any(fnmatch.fnmatchcase(fqn, p) for p in self.exclude))


def _check_bits(name: str, bits, allowed: tuple[int, int], *, optional: bool) -> None:
    if bits is None and optional:
        return
    if not isinstance(bits, numbers.Integral) or isinstance(bits, bool):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {bits!r}")
    if not allowed[0] <= bits <= allowed[1]:
        raise ValueError(f"{name} must be in [{allowed[0]}, {allowed[1]}], got {bits}")


def input_dim(module: nn.Module) -> int:
    """The dim of a linear layer's weight that meets its input: 1 for ``nn.Linear`` (out, in), 0 for
    Hugging Face's ``Conv1D`` (in, out)."""
    return 0 if type(module).__name__ == "Conv1D" else 1


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every ``nn.Linear`` and Hugging Face ``Conv1D`` (recognised by name: transformers is not imported), by name."""
    return {path: m for path, m in model.named_modules()
            if isinstance(m, nn.Linear) or (type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None
                                            and m.weight.dim() == 2)}


def selected_layers(model: nn.Module, config: QuantizeConfig) -> dict[str, nn.Module]:
    """The linear layers ``config`` quantizes, checked before any work: ValueError when its patterns
    match none, or when ``group_size`` does not divide a layer's input width."""
    every = linear_layers(model)
    chosen = {path: m for path, m in every.items() if config.selects(path)}
    if not chosen:
        names = ", ".join(list(every)[:6]) + (", ..." if len(every) > 6 else "") if every else "none"
        raise ValueError(f"include={config.include} / exclude={config.exclude} select no linear layer; the model's "
                         f"linear layers (nn.Linear, Conv1D): {names}")
    for path, module in chosen.items():
        width = module.weight.shape[input_dim(module)]
        if config.group_size is not None and width % config.group_size:
            raise ValueError(f"group_size {config.group_size} must divide every quantized layer's input width, got "
                             f"{path} with {width} inputs")
    return chosen


@dataclass
class HeldOutLoss:
    """The mean loss a model returns on held-out calls, and its perplexity exp(loss)."""

    loss: float
    calls: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    def to_dict(self) -> dict:
        return {"loss": self.loss, "perplexity": self.perplexity, "calls": self.calls}


def held_out_loss(model: nn.Module, data) -> HeldOutLoss:
    """The mean over ``data`` (a call, or a list of calls, as ``example_inputs``) of the loss the
    model returns: its scalar output named like a loss (a causal LM given ``labels``), or a scalar
    output alone. ValueError when a call gives none."""
    calls = split_example_calls(data)
    total = 0.0
    with eval_mode(model), torch.no_grad():
        for i, (args, kwargs) in enumerate(progress(calls, desc="quantize: held-out loss", unit="call")):
            total += _loss_of(flatten_outputs(model(*args, **kwargs)), i)
    return HeldOutLoss(total / len(calls), len(calls))


def _loss_of(outputs: list[tuple[str, object]], call: int) -> float:
    scalars = [(name, v) for name, v in outputs if isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point()]
    named = [v for name, v in scalars if "loss" in name.lower()]
    if named or len(outputs) == 1 == len(scalars):
        return (named or [scalars[0][1]])[0].item()
    raise ValueError(f"held-out call {call}: the model must return a loss (a scalar output named like 'loss', e.g. "
                     f"labels=input_ids for a causal LM), got outputs {[name for name, _ in outputs][:6]}")


@dataclass
class QuantizeReport:
    """What :func:`quantize` did: the config, the layers it quantized, and the held-out loss before
    and after (None without data). Approximate: measured, never proved."""

    config: QuantizeConfig
    layers: list[str]
    before: HeldOutLoss | None = None
    after: HeldOutLoss | None = None
    # per layer, in ``layers``' order: ‖Ŵ − W‖_F / ‖W‖_F, the relative error rounding put in its weight
    weight_errors: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "scheme": self.config.scheme, "layers": self.layers,
                "weight_errors": dict(self.weight_errors),
                "before": None if self.before is None else self.before.to_dict(),
                "after": None if self.after is None else self.after.to_dict()}

    def __str__(self) -> str:
        line = f"quantize ({self.config.scheme}, fake quantization): {len(self.layers)} linear layers"
        if self.weight_errors:
            worst = max(self.weight_errors, key=self.weight_errors.get)
            line += f" (weight error ‖Ŵ−W‖/‖W‖ at most {self.weight_errors[worst]:.4f}, {worst})"
        if self.before is None or self.after is None:
            return line + "; no held-out loss measured (pass data=calls that return a loss)"
        return (f"{line}; held-out loss on {self.after.calls} calls {self.before.loss:.4f} -> {self.after.loss:.4f} "
                f"(perplexity {self.before.perplexity:.3f} -> {self.after.perplexity:.3f})")


def quantize(model: nn.Module, config: QuantizeConfig | None = None, *, data=None) -> tuple[nn.Module, QuantizeReport]:
    """``(a fake-quantized copy, report)``: the linear layers ``config`` selects get their weights
    rounded (each its own parameter: a tie to a layer left alone is broken) and, with
    ``activation_bits``, their inputs rounded per token at every call. ``data``: held-out calls that
    make the model return a loss; the report then gives the loss and perplexity before and after.
    TypeError / ValueError before any work for a bad model, config or selection."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    config = QuantizeConfig() if config is None else config
    if not isinstance(config, QuantizeConfig):
        raise TypeError(f"config must be a QuantizeConfig, got {type(config).__name__}")
    chosen = list(selected_layers(model, config))
    return _quantized(model, config, chosen, data, None if data is None else held_out_loss(model, data))


def _quantized(model: nn.Module, config: QuantizeConfig, chosen: list[str], data,
               before: HeldOutLoss | None) -> tuple[nn.Module, QuantizeReport]:
    quantized = quantize_layers_(copy.deepcopy(model), config, chosen)
    after = None if before is None else held_out_loss(quantized, data)
    errors = {path: relative_weight_error(model.get_submodule(path).weight, quantized.get_submodule(path).weight)
              for path in chosen}
    return quantized, QuantizeReport(config, chosen, before, after, errors)


def relative_weight_error(weight: torch.Tensor, rounded: torch.Tensor) -> float:
    """‖rounded − weight‖_F / ‖weight‖_F in float64 (0 for an all-zero weight left as it is)."""
    w, r = weight.detach().double(), rounded.detach().double()
    norm = torch.linalg.norm(w)
    return 0.0 if norm == 0 else float(torch.linalg.norm(r - w) / norm)


def quantize_layers_(model: nn.Module, config: QuantizeConfig, paths: Sequence[str]) -> nn.Module:
    """In place: the layers at ``paths`` quantized as ``config`` says (see :func:`quantize`)."""
    with torch.no_grad():
        for path in paths:
            module = model.get_submodule(path)
            rounded = fake_quantize(module.weight, config.weight_bits, input_dim(module), config.group_size)
            module.weight = nn.Parameter(rounded, requires_grad=module.weight.requires_grad)
            if config.activation_bits is not None:
                module.register_forward_pre_hook(ActivationQuantizer(config.activation_bits))
    return model


class ActivationQuantizer:
    """A forward pre-hook rounding a layer's first input per token (its last dim) onto a ``bits``-bit
    grid; ``straight_through``: with the straight-through gradient (for learning through it)."""

    def __init__(self, bits: int, straight_through: bool = False) -> None:
        self.bits, self.straight_through = bits, straight_through

    def __call__(self, module: nn.Module, inputs: tuple) -> tuple:
        rounding = fake_quantize_ste if self.straight_through else fake_quantize
        return (rounding(inputs[0], self.bits, -1), *inputs[1:])

    def __repr__(self) -> str:
        return f"ActivationQuantizer(bits={self.bits})"


def quantize_step(model: nn.Module, calls: list, config: QuantizeConfig,
                  context: StepContext) -> tuple[nn.Module, QuantizeReport]:
    """The registered step of a :class:`QuantizeConfig`: :func:`quantize`, with the loss before and
    after measured on the example calls when they make the model return one."""
    chosen = list(selected_layers(model, config))
    try:
        before = held_out_loss(model, calls)
    except ValueError:
        before = None  # the example calls give no loss: nothing to measure on
    return _quantized(model, config, chosen, calls, before)


register_step(QuantizeConfig, quantize_step, section="quantization", section_type=QuantizeReport, proof=None)

__all__ = ["quantize", "QuantizeConfig", "QuantizeReport", "HeldOutLoss", "held_out_loss", "quantize_layers_",
           "selected_layers", "linear_layers", "input_dim", "ActivationQuantizer", "fake_quantize",
           "fake_quantize_ste", "group_scales", "grid_max", "WEIGHT_BITS", "ACTIVATION_BITS"]
