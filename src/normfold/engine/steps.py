"""The registry of steps and its one runner (as torchao's ``quantize_``: a config type names its handler).

    model, sections = run_steps(model, example_inputs, [FoldConfig(), FuseConfig()])

Each transformation is one frozen config dataclass, checked in its ``__post_init__``, and one
handler ``handler(model, calls, config, context) -> (model, section)`` that the layer owning the
step registers when its package is imported (``register_step``). Holding a config means its
layer is imported, so the runner finds every handler while importing no layer above the engine:
``normfold.convert``, the sugar (``normfold.fold``, ``normfold.rotate``,
``normfold.fuse_residual_norms``, ``normfold.fold_batchnorms``) and ``normfold.hf`` all run steps
through :func:`run_steps`.

The runner checks that every config names a registered step and the model and example inputs
(once), before any work; runs the handlers in order, each on the previous one's output (never
modifying the model it was given); and proves every exact step's section through the one
:func:`~normfold.engine.verify.prove_or_raise` (``FoldVerificationError``, built from the
verification's reason), unless its config says ``verify=False``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .graph import check_model_and_inputs
from .submodules import CapturedCalls
from .verify import prove_or_raise

__all__ = ["Step", "StepContext", "register_step", "registered_steps", "step_for", "run_steps"]


@dataclass
class StepContext:
    """What a handler may read besides its input model and the example calls: the model the runner
    was given (untouched), the sections of the steps run before it, by config type, and ``captured``:
    the graphs of the example calls that the step just before it captured (the fold's ``torch.export``
    capture, of the model it folded: the forwards and module paths of the model the handler is given,
    only norm classes and weights changed), so a later step reads the graph instead of capturing it
    again. The runner clears ``captured`` after every step that does not set it: a graph is handed
    to the next step only."""

    original: nn.Module
    sections: dict[type, Any] = field(default_factory=dict)
    captured: CapturedCalls | None = None


Handler = Callable[[nn.Module, list, Any, StepContext], "tuple[nn.Module, Any]"]


@dataclass(frozen=True)
class Step:
    """A registered step. ``proof``: what a failed proof of its section says (the section holds a
    ``verification``); None for a step that is not exact (it measures, and proves nothing).
    ``section``: the name its report section is filed under (``report.fuse``, ...);
    ``section_type``: that section's class (a :class:`~normfold.engine.report.ReportSection`)."""

    config_type: type
    handler: Handler
    proof: str | None
    section: str
    section_type: type


_STEPS: dict[type, Step] = {}


def register_step(config_type: type, handler: Handler, *, section: str, section_type: type,
                  proof: str | None) -> None:
    """Register ``handler`` as the step run for configs of ``config_type`` (once per config type:
    a second, different handler for it is a ValueError; importing the module again re-registers it)."""
    if not isinstance(config_type, type) or not callable(handler):
        raise TypeError(f"register_step takes a config class and a callable handler, got "
                        f"{type(config_type).__name__} and {type(handler).__name__}")
    known = _STEPS.get(config_type)
    if known is not None and _qualified(known.handler) != _qualified(handler):
        raise ValueError(f"{config_type.__name__} already runs {_qualified(known.handler)}, got a second handler "
                         f"{_qualified(handler)}: one handler per config type")
    _STEPS[config_type] = Step(config_type, handler, proof, section, section_type)


def _qualified(function) -> str:
    return f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', repr(function))}"


def registered_steps() -> tuple[type, ...]:
    """The config types that name a step, in registration order."""
    return tuple(_STEPS)


def step_for(config) -> Step:
    """The step ``config`` names, or TypeError naming the registered config types."""
    step = _STEPS.get(type(config))
    if step is None:
        names = ", ".join(t.__name__ for t in _STEPS)
        raise TypeError(f"a step is configured by one of the registered configs ({names}), got "
                        f"{type(config).__name__} {config!r}")
    return step


def run_steps(model: nn.Module, example_inputs, configs: Sequence, *, original: nn.Module | None = None,
              earlier: dict[type, Any] | None = None) -> tuple[nn.Module, dict[type, Any]]:
    """Run the steps ``configs`` name, in order, on ``model`` (never modified): ``(the last step's
    model, the sections by config type)``. TypeError / ValueError before any work for a config that
    names no step, a step given twice, or bad model or inputs; ``FoldVerificationError`` as soon as an
    exact step's proof fails (nothing returned).

    ``original`` and ``earlier``: ``model`` is what ``original`` became through steps already run,
    whose sections ``earlier`` holds (a caller that checks something between two steps, as
    ``normfold.hf`` does between the exact and the approximate fold); the handlers see them as if one
    run had made them."""
    steps = [step_for(config) for config in configs]
    given = [*(earlier or {}), *(s.config_type for s in steps)]
    repeated = sorted({t.__name__ for t in given if given.count(t) > 1})
    if repeated:
        raise ValueError(f"each step runs at most once, got {', '.join(repeated)} more than once")
    calls = check_model_and_inputs(model, example_inputs)  # TypeError before any work
    context = StepContext(model if original is None else original, dict(earlier or {}))
    for config, step in zip(configs, steps):
        handed = context.captured
        model, section = step.handler(model, calls, config, context)
        if context.captured is handed:  # this step captured nothing: the graph describes no model now
            context.captured = None
        assert isinstance(section, step.section_type), (step, type(section))
        if step.proof is not None and getattr(config, "verify", True):
            assert section.verification is not None, f"{step.handler} proved nothing"
            prove_or_raise(section.verification, step.proof, str(section))
        context.sections[step.config_type] = section
    return model, context.sections
