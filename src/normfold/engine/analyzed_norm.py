"""A norm as the analysis sees it and decides about (``analysis.py``), read by γ/β placement (``affine.py``):
in a module of its own so that neither imports the other for it."""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .norm_forms import NormForm
from .plan import AffineFoldStep, PrecomputeStep
from .rules import Need, NormCall


@dataclass
class AnalyzedNorm:
    """One norm module (all the layer_norm nodes it ran) or one functional layer_norm call."""

    path: str
    kind: str
    calls: list[NormCall]
    module: nn.Module | None
    foldable: bool = False
    precompute: PrecomputeStep | None = None
    reason: str = ""
    blocking_path: tuple[str, ...] = ()
    blocker: str | None = None  # what breaks zero mean at blocking_path[-1]
    affine_kept: str | None = None  # why γ/β stay in the norm
    zero_mean_graph: set[Need] = field(default_factory=set)
    params: frozenset = frozenset()
    affine: list[AffineFoldStep] = field(default_factory=list)
    form: NormForm | None = None  # what a LayerNorm module computes, from its traced ops (``norm_forms``)
    forced_keep: bool = False  # kept because another example call cannot fold it (``analyze_calls``)
