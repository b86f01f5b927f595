"""FoldPlan: what the transform does, in terms of parameter FQNs and module paths only.

A plan is plain data (JSON round-trip via ``to_dict`` / ``from_dict``), so it can be applied to a
model copy (``normfold.fold.transform.apply_plan``) or, step by step, to the tensors of a
checkpoint that does not fit in memory: every step names all the tensors it reads and writes, and
its math is a pure function in ``normfold.fold.math``. Steps apply in this order:

1. ``untie``: the module attribute gets its own copy of the *original* tensor of ``source_fqn``
   (read it before step 2); in a checkpoint, write it under ``module_path + "." + attr``.
2. ``precompute``: an embedding table read only by one LayerNorm becomes that norm applied to its
   rows, ``math.layer_norm_rows(table, γ, β, eps)``; the norm becomes ``Identity`` (a swap step).
3. ``center``: tensor ← ``math.center(tensor, dim, group)`` (after step 2 for precomputed tables).
4. ``affine_fold``: (W, b) ← ``math.fold_affine_into_consumer(W, b, γ, β, in_dim)``; ``b`` is a new
   zero bias named ``bias_fqn`` when ``create_bias`` is true.
5. ``swap``: the norm module at ``path`` becomes ``to`` (RMSNorm / LayerNorm / Identity) with ``eps``; when
   ``elementwise_affine`` is false its weight and bias tensors are dropped (they were folded).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class CenterStep:
    """Subtract the mean of ``fqn`` along ``dim`` (per contiguous ``group`` elements; None = whole dim)."""

    fqn: str
    dim: int
    group: int | None = None


@dataclass(frozen=True)
class UntieStep:
    """Give ``module_path.attr`` its own copy of the original ``source_fqn`` (a tied parameter)."""

    module_path: str
    attr: str
    source_fqn: str


@dataclass(frozen=True)
class PrecomputeStep:
    """Replace the rows of embedding table ``table_fqn`` by LayerNorm(rows) with γ, β, eps of ``norm_path``."""

    norm_path: str
    table_fqn: str
    gamma_fqn: str | None
    beta_fqn: str | None
    eps: float


@dataclass(frozen=True)
class AffineFoldStep:
    """Fold norm ``norm_path``'s γ/β into the consumer weight ``weight_fqn`` (γ meets W along ``in_dim``)."""

    norm_path: str
    gamma_fqn: str | None
    beta_fqn: str | None
    weight_fqn: str
    in_dim: int
    bias_fqn: str
    create_bias: bool = False


@dataclass(frozen=True)
class SwapStep:
    """Replace the norm module at ``path`` by ``to`` ("RMSNorm", "LayerNorm" or "Identity")."""

    path: str
    to: str
    normalized_shape: int
    eps: float
    elementwise_affine: bool
    bias: bool


@dataclass
class FoldPlan:
    center: list[CenterStep] = field(default_factory=list)
    untie: list[UntieStep] = field(default_factory=list)
    precompute: list[PrecomputeStep] = field(default_factory=list)
    affine_fold: list[AffineFoldStep] = field(default_factory=list)
    swap: list[SwapStep] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {name: [asdict(step) for step in getattr(self, name)] for name in _STEP_TYPES}

    @classmethod
    def from_dict(cls, data: dict) -> "FoldPlan":
        unknown = set(data) - set(_STEP_TYPES)
        if unknown:
            raise ValueError(f"unknown plan sections {sorted(unknown)}; expected {list(_STEP_TYPES)}")
        return cls(**{name: [_STEP_TYPES[name](**step) for step in data.get(name, [])] for name in _STEP_TYPES})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __bool__(self) -> bool:
        return any(getattr(self, name) for name in _STEP_TYPES)


_STEP_TYPES = {"untie": UntieStep, "precompute": PrecomputeStep, "center": CenterStep, "affine_fold": AffineFoldStep,
               "swap": SwapStep}
