"""FoldPlan: what the transform does, in terms of parameter FQNs and module paths only.

A plan is plain data (JSON round-trip via ``to_dict`` / ``from_dict``), run by one executor
(``normfold.engine.executor``) over a model copy (``normfold.engine.transform.apply_plan``) or, step by
step, over the tensors of a checkpoint that does not fit in memory: every step declares the tensors
it ``reads()``, ``writes()`` and ``creates()`` (by parameter FQN), and its math is a pure function
in ``normfold.engine.math``. Steps apply in this order (``FoldPlan.steps()``):

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
3b. ``center_groups``: tensor ← ``math.center_groups(tensor, dim, group, groups)``: only the groups
   some norm reads (the q/k rows of a fused QKV weight, per head); the others keep their values.
4. ``affine_fold``: (W, b) ← ``math.fold_affine_into_consumer(W, b, γ, β, in_dim)``; ``b`` is a new
   zero bias named ``bias_fqn`` when ``create_bias`` is true.
5. ``swap``: the norm module at ``path`` becomes ``to`` (RMSNorm / LayerNorm / Identity) with ``eps``; when
   ``elementwise_affine`` is false its weight and bias tensors are dropped (they were folded).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch


class Step:
    """What every step declares, by tensor name: what it ``reads`` (the values before the step),
    ``writes`` (changes or creates) and ``creates`` (new name -> (the tensor it is shaped from, the
    dim of that tensor giving its length, or None for its whole shape)). The executor
    (``normfold.engine.executor``) and a checkpoint's store work from these alone."""

    def reads(self) -> tuple[str, ...]:
        raise NotImplementedError

    def writes(self) -> tuple[str, ...]:
        raise NotImplementedError

    def creates(self) -> dict[str, tuple[str, int | None]]:
        return {}


class _InPlaceStep(Step):
    """A step that rewrites the one tensor ``fqn`` from its own values (a centering)."""

    fqn: str

    def reads(self) -> tuple[str, ...]:
        return (self.fqn,)

    def writes(self) -> tuple[str, ...]:
        return (self.fqn,)


@dataclass(frozen=True)
class BatchNormFoldStep(Step):
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

    def reads(self) -> tuple[str, ...]:
        return _names(self.weight_fqn, None if self.create_bias else self.bias_fqn, self.mean_fqn, self.var_fqn,
                      self.gamma_fqn, self.beta_fqn)

    def writes(self) -> tuple[str, ...]:
        kept = (self.mean_fqn, self.var_fqn, self.gamma_fqn, self.beta_fqn) if self.keep_module else ()
        return _names(self.weight_fqn, self.bias_fqn, *kept)

    def creates(self) -> dict[str, tuple[str, int | None]]:
        return {self.bias_fqn: (self.weight_fqn, 0)} if self.create_bias else {}


@dataclass(frozen=True)
class LayerScaleStep(Step):
    """Merge the layer scale ``scale_fqn`` (γ in t = γ ⊙ (W h + b), one value per output channel) into
    the producer: W ← diag(γ)·W along ``weight_fqn``'s dim 0, b ← γ ⊙ b, then γ ← 1."""

    scale_fqn: str
    weight_fqn: str
    bias_fqn: str | None        # None: the producer has no bias (γ ⊙ 0 = 0, nothing to scale)

    def reads(self) -> tuple[str, ...]:
        return _names(self.weight_fqn, self.bias_fqn, self.scale_fqn)

    def writes(self) -> tuple[str, ...]:
        return _names(self.weight_fqn, self.bias_fqn, self.scale_fqn)


@dataclass(frozen=True)
class CenterStep(_InPlaceStep):
    """Subtract the mean of ``fqn`` along ``dim`` (per contiguous ``group`` elements; None = whole dim)."""

    fqn: str
    dim: int
    group: int | None = None


@dataclass(frozen=True)
class CenterGroupsStep(_InPlaceStep):
    """Subtract the mean of ``fqn`` along ``dim`` per contiguous ``group`` elements, in the groups
    numbered ``groups`` only; the others keep their values (the q and k rows of a fused QKV
    projection, per head, whose v rows no norm reads)."""

    fqn: str
    dim: int
    group: int
    groups: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))  # a list after a JSON round trip


@dataclass(frozen=True)
class UntieStep(Step):
    """Give ``module_path.attr`` its own copy of the original ``source_fqn`` (a tied parameter)."""

    module_path: str
    attr: str
    source_fqn: str

    @property
    def fqn(self) -> str:
        """The name of the copy."""
        return f"{self.module_path}.{self.attr}"

    def reads(self) -> tuple[str, ...]:
        return (self.source_fqn,)

    def writes(self) -> tuple[str, ...]:
        return (self.fqn,)

    def creates(self) -> dict[str, tuple[str, int | None]]:
        return {self.fqn: (self.source_fqn, None)}


@dataclass(frozen=True)
class PrecomputeStep(Step):
    """Replace the rows of embedding table ``table_fqn`` by LayerNorm(rows) with γ, β, eps of ``norm_path``."""

    norm_path: str
    table_fqn: str
    gamma_fqn: str | None
    beta_fqn: str | None
    eps: float

    def reads(self) -> tuple[str, ...]:
        return _names(self.table_fqn, self.gamma_fqn, self.beta_fqn)

    def writes(self) -> tuple[str, ...]:
        return (self.table_fqn,)


@dataclass(frozen=True)
class AffineFoldStep(Step):
    """Fold norm ``norm_path``'s γ/β into the consumer weight ``weight_fqn`` ((gamma_offset + γ) meets W
    along ``in_dim``)."""

    norm_path: str
    gamma_fqn: str | None
    beta_fqn: str | None
    weight_fqn: str
    in_dim: int
    bias_fqn: str
    create_bias: bool = False   # the consumer has no bias to take W·β: register one
    gamma_offset: float = 0.0   # the norm scales by (gamma_offset + γ) (Gemma's 1 + w): that moves into W

    def reads(self) -> tuple[str, ...]:
        return _names(self.weight_fqn, None if self.create_bias else self.bias_fqn, self.gamma_fqn, self.beta_fqn)

    def writes(self) -> tuple[str, ...]:
        return _names(self.weight_fqn, self.bias_fqn)

    def creates(self) -> dict[str, tuple[str, int | None]]:
        return {self.bias_fqn: (self.weight_fqn, 1 - self.in_dim)} if self.create_bias else {}


@dataclass(frozen=True)
class SwapStep(Step):
    """Replace the norm module at ``path`` by ``to`` ("RMSNorm", "LayerNorm" or "Identity").

    ``offset``: the norm scales by (offset + γ), as Nemotron's ``LayerNorm1P`` (γ + 1) does; the
    RMSNorm swapped in computes the same (``normfold.nn.RMSNorm(offset=...)``). ``permute``: the norm
    normalizes the last dim of ``x.permute(permute)`` and permutes back, as a channels-first LayerNorm
    does (``normfold.nn.PermutedRMSNorm``); empty for a norm of its input's last dim.
    """

    path: str
    to: str
    normalized_shape: int
    eps: float
    elementwise_affine: bool
    bias: bool
    offset: float = 0.0
    permute: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "permute", tuple(self.permute))  # a plan read back from JSON holds a list

    def reads(self) -> tuple[str, ...]:
        return ()

    def writes(self) -> tuple[str, ...]:
        """The γ/β a weightless norm drops, where the norm has them (a module-level step: the module
        store replaces the module, a checkpoint keeps the keys it stores as γ = 1, β = 0)."""
        return () if self.elementwise_affine else (f"{self.path}.weight", f"{self.path}.bias")


@dataclass
class FoldPlan:
    batchnorm: list[BatchNormFoldStep] = field(default_factory=list)
    layer_scale: list[LayerScaleStep] = field(default_factory=list)
    center: list[CenterStep] = field(default_factory=list)
    center_groups: list[CenterGroupsStep] = field(default_factory=list)
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

    def steps(self) -> list[Step]:
        """Every step, in the order they apply (the order of the sections: see the module docstring)."""
        return [step for name in _STEP_TYPES for step in getattr(self, name)]


_STEP_TYPES = {"batchnorm": BatchNormFoldStep, "layer_scale": LayerScaleStep, "untie": UntieStep,
               "precompute": PrecomputeStep, "center": CenterStep, "center_groups": CenterGroupsStep,
               "affine_fold": AffineFoldStep, "swap": SwapStep}


def _names(*fqns: str | None) -> tuple[str, ...]:
    """The tensor names given, without the absent ones (None, or "" for no bias)."""
    return tuple(f for f in fqns if f)


@dataclass(frozen=True)
class FoldConfig:
    """The exact fold's options, the one definition planning, ``normfold.convert`` and hf read: what
    a plan may do besides being exact, given to the analysis so that it writes the reasons itself.

    ``fold_affine``: move γ/β into the linear layers that read a norm. ``precompute``: bake a
    LayerNorm applied straight to an embedding lookup into the table (the norm disappears).
    ``fold_batchnorm``: merge eval-mode BatchNorms into the Linear/Conv before them first.
    ``verify``: prove the result in float64 before returning it (``FoldVerificationError`` otherwise).

    ``stock_compatible``: plan only what the model's own transformers class loads from a folder, so
    that ``folded.save_pretrained(d)`` then stock ``from_pretrained(d)`` is the same model: no
    parameter the class lacks (GPT-2's ln_f keeps its γ/β, applied inside its RMSNorm, rather than
    creating an ``lm_head.bias``), no norm precomputed away, merged BatchNorms kept as exact
    identities; the report gives each kept γ/β's reason. ``None`` (default): on for a transformers
    ``PreTrainedModel``, off for any other module (``True`` there is a TypeError). ``False``: the
    whole plan, whose folder only ``normfold.from_pretrained`` rebuilds (saving it warns).
    ``normfold.convert`` turns it into the two fields below (``normfold.hf.saving.stock_constraints``).

    ``loadable_keys``: when set, the checkpoint's loader (a stock architecture) knows only these
    parameter names: no step may create a parameter outside them. ``keep_modules_in``: when set,
    the loader needs every module's keys, stored in that dtype: a merged BatchNorm stays as an exact
    identity there, or is kept when it cannot be exact (see :meth:`for_stock_checkpoint`).
    ``move_every_gamma``: every γ a rotation needs moved moves: into a linear layer whose weight is a
    tied name (a tied output head, which then gets its own copy, said in the report's ``untied``), and
    an RMSNorm's (offset + γ) (Gemma's 1 + w), which leaves a folder stock transformers would rebuild
    as another model (its norm's stored weight reads as γ = 1); ``normfold.rotate`` sets it.
    ``keep``: fnmatch patterns of norm module paths (``"transformer.h.0.*"``) the plan leaves as
    they are: neither swapped nor their γ/β moved, nor their producers centered for them.
    """

    fold_affine: bool = True
    precompute: bool = True
    fold_batchnorm: bool = True
    verify: bool = True
    stock_compatible: bool | None = None
    loadable_keys: frozenset[str] | None = None
    keep_modules_in: torch.dtype | None = None
    keep: tuple[str, ...] = ()
    move_every_gamma: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "keep", keep_patterns(self.keep, "keep"))
        for name in _FLAGS:
            _require_bool(name, getattr(self, name))
        if self.stock_compatible is not None:
            _require_bool("stock_compatible", self.stock_compatible)
        if self.loadable_keys is not None:
            if isinstance(self.loadable_keys, str) or not all(isinstance(k, str) for k in self.loadable_keys):
                raise TypeError(f"FoldConfig.loadable_keys must be None or a collection of parameter names (str), "
                                f"got {self.loadable_keys!r}")
            object.__setattr__(self, "loadable_keys", frozenset(self.loadable_keys))
        if self.keep_modules_in is not None and (not isinstance(self.keep_modules_in, torch.dtype)
                                                 or not self.keep_modules_in.is_floating_point):
            raise TypeError(f"FoldConfig.keep_modules_in must be None or a floating torch.dtype, "
                            f"got {self.keep_modules_in!r}")

    def for_stock_checkpoint(self, loadable_keys, stored_dtype: torch.dtype) -> "FoldConfig":
        """These options within what a stock checkpoint's loader loads: no precompute (every norm
        module stays), no parameter the architecture lacks (e.g. GPT-2's ``lm_head.bias``),
        BatchNorms kept as identities stored in ``stored_dtype``."""
        return replace(self, precompute=False, stock_compatible=True, loadable_keys=frozenset(loadable_keys),
                       keep_modules_in=stored_dtype)

    def may_create(self, fqn: str) -> bool:
        """Whether a step may create the parameter ``fqn`` (the loader knows that name)."""
        return self.loadable_keys is None or fqn in self.loadable_keys


_FLAGS = ("fold_affine", "precompute", "fold_batchnorm", "verify", "move_every_gamma")


def _require_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"FoldConfig.{name} must be a bool, got {type(value).__name__} {value!r}")


# The name the planning modules use for the options they plan within: the same class, not a second definition.
PlanConstraints = FoldConfig


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
