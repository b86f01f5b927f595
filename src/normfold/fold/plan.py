"""FoldPlan: what the transform does, in terms of parameter FQNs and module paths only.

A plan is plain data (JSON round-trip via ``to_dict`` / ``from_dict``), so it can be applied to a
model copy (``normfold.fold.transform.apply_plan``) or, step by step, to the tensors of a
checkpoint that does not fit in memory: every step names all the tensors it reads and writes, and
its math is a pure function in ``normfold.fold.math``. Steps apply in this order:

0. ``batchnorm``: an eval-mode BatchNorm merges into the Linear/Conv before it,
   (W, b) ← ``math.fold_batchnorm_into_producer(W, b, μ, σ², γ, β, eps)`` (``b`` is a new zero bias
   when ``create_bias``); the BatchNorm becomes ``Identity``, or, with ``keep_module``, stays with
   identity statistics (``math.identity_batchnorm_variance``) for loaders that need its keys.
   The later steps were planned on the model with its BatchNorms merged.
0b. ``layer_scale``: an elementwise scale γ applied right after a Linear/Conv (layer scale, as in
   BEiT and DINOv2) merges into it, (W, b) ← ``math.scale_output_channels(W, b, γ)`` and γ ← 1, so
   the multiply is the identity the analysis saw when it walked through it.
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

import torch


@dataclass(frozen=True)
class BatchNormFoldStep:
    """Merge the eval-mode BatchNorm at ``norm_path`` into the producer at ``producer_path``
    (output channels on dim 0 of ``weight_fqn``); ``bias_fqn`` is created, zero, when ``create_bias``.

    ``keep_module``: the BatchNorm stays, as an exact identity (γ=1, β=0, μ=0, σ²=1 − eps, planned
    only where σ² + eps rounds to 1 in the stored dtype), for a checkpoint whose loader needs its keys.
    """

    norm_path: str
    producer_path: str          # the Linear/Conv whose output the BatchNorm reads
    weight_fqn: str
    bias_fqn: str
    create_bias: bool
    mean_fqn: str               # the running statistics μ, σ² (buffers)
    var_fqn: str
    gamma_fqn: str | None       # None: a BatchNorm without affine
    beta_fqn: str | None
    eps: float
    keep_module: bool = False   # an exact identity BatchNorm stays (see above)


@dataclass(frozen=True)
class LayerScaleStep:
    """Merge the layer scale ``scale_fqn`` (γ in t = γ ⊙ (W h + b), one value per output channel) into
    the producer: W ← diag(γ)·W along ``weight_fqn``'s dim 0, b ← γ ⊙ b, then γ ← 1."""

    scale_fqn: str
    weight_fqn: str
    bias_fqn: str | None        # None: the producer has no bias (γ ⊙ 0 = 0, nothing to scale)


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
    create_bias: bool = False   # the consumer has no bias to take W·β: register one


@dataclass(frozen=True)
class SwapStep:
    """Replace the norm module at ``path`` by ``to`` ("RMSNorm", "LayerNorm" or "Identity").

    ``offset``: the norm scales by (offset + γ), as Nemotron's ``LayerNorm1P`` (γ + 1) does; the
    RMSNorm swapped in computes the same (``normfold.nn.RMSNorm(offset=...)``).
    """

    path: str
    to: str
    normalized_shape: int
    eps: float
    elementwise_affine: bool
    bias: bool
    offset: float = 0.0


@dataclass
class FoldPlan:
    batchnorm: list[BatchNormFoldStep] = field(default_factory=list)
    layer_scale: list[LayerScaleStep] = field(default_factory=list)
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


_STEP_TYPES = {"batchnorm": BatchNormFoldStep, "layer_scale": LayerScaleStep, "untie": UntieStep,
               "precompute": PrecomputeStep, "center": CenterStep, "affine_fold": AffineFoldStep, "swap": SwapStep}


@dataclass(frozen=True)
class PlanConstraints:
    """What a plan may do besides being exact, given to the analysis so that it writes the reasons itself.

    ``fold_affine``: move γ/β into the linear layers that read a norm. ``precompute``: bake a
    LayerNorm applied straight to an embedding lookup into the table (the norm disappears).
    ``fold_batchnorm``: merge eval-mode BatchNorms into the Linear/Conv before them.
    ``loadable_keys``: when set, the checkpoint's loader (a stock architecture) knows only these
    parameter names: no step may create a parameter outside them. ``keep_modules_in``: when set,
    the loader needs every module's keys, stored in that dtype: a merged BatchNorm stays as an exact
    identity there, or is kept when it cannot be exact (see :meth:`for_stock_checkpoint`).
    ``keep``: fnmatch patterns of norm module paths (``"transformer.h.0.*"``) the plan leaves as
    they are: neither swapped nor their γ/β moved, nor their producers centered for them.
    """

    fold_affine: bool = True
    precompute: bool = True
    fold_batchnorm: bool = True
    loadable_keys: frozenset[str] | None = None
    keep_modules_in: torch.dtype | None = None
    keep: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", keep_patterns(self.keep, "keep"))
        for name in ("fold_affine", "precompute", "fold_batchnorm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.loadable_keys is not None:
            if not all(isinstance(k, str) for k in self.loadable_keys):
                raise TypeError("loadable_keys must hold parameter names (str)")
            object.__setattr__(self, "loadable_keys", frozenset(self.loadable_keys))
        if self.keep_modules_in is not None and (not isinstance(self.keep_modules_in, torch.dtype)
                                                 or not self.keep_modules_in.is_floating_point):
            raise TypeError(f"keep_modules_in must be a floating torch.dtype, got {self.keep_modules_in!r}")

    @classmethod
    def for_stock_checkpoint(cls, loadable_keys, stored_dtype: torch.dtype, *, fold_affine: bool = True,
                             fold_batchnorm: bool = True, keep=()) -> "PlanConstraints":
        """A plan whose result stock transformers loads: no precompute (every norm module stays), no
        parameter the architecture lacks (e.g. GPT-2's ``lm_head.bias``), BatchNorms kept as identities."""
        return cls(fold_affine=fold_affine, precompute=False, fold_batchnorm=fold_batchnorm,
                   loadable_keys=frozenset(loadable_keys), keep_modules_in=stored_dtype, keep=keep)

    def may_create(self, fqn: str) -> bool:
        """Whether a step may create the parameter ``fqn`` (the loader knows that name)."""
        return self.loadable_keys is None or fqn in self.loadable_keys


def keep_patterns(patterns, name: str) -> tuple[str, ...]:
    """``patterns`` as a tuple of non-empty strings (fnmatch patterns of norm paths); TypeError or
    ValueError naming ``name`` otherwise (a bare string too: iterating it would give letters; a set has no order)."""
    if not isinstance(patterns, (list, tuple)):
        raise TypeError(f"{name} must be a list of module path patterns (str), got {type(patterns).__name__} "
                        f"{patterns!r:.60}" + (f": write [{patterns!r}]" if isinstance(patterns, str) else ""))
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{name} must hold module path patterns (str), got {type(pattern).__name__} {pattern!r:.60}")
        if not pattern:
            raise ValueError(f"{name} must hold non-empty module path patterns, got ''")
    return tuple(patterns)
