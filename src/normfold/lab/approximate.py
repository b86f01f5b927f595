"""Approximate folding: replace LayerNorms that the exact fold cannot touch, within a measured
output tolerance chosen by the user.

A LayerNorm whose input is not zero-mean by construction (every Post-LN norm of a BERT-style
encoder) changes its output when it becomes an RMSNorm. Three corrections, each folded into
weights that exist already, make the replacement close:

1. **Centre the producer.** When the norm's input is ``x = linear(h) + rest`` and the linear's
   output reaches the model only through that input, centring the linear's weight columns and its
   bias (W ← W − 1·mean_rows(W), b ← b − mean(b)) removes the linear's share of the per-token mean
   μ(x). LayerNorm ignores per-token shifts, so this step alone changes nothing.
2. **Calibrated shift.** The rest of μ(x) is estimated on calibration data as one number
   c = E_tokens[μ(x)] and folded into the same bias: b ← b − c·1, so the norm sees x − c.
3. **Refit γ/β.** Per feature i, (γ'_i, β'_i) minimise Σ_tokens (γ'_i·z_i + β'_i − LN(x)_i)², with
   z = (x − c)/rms(x − c): ordinary least squares, in closed form, in float64.

Norms are then chosen greedily: each norm's effect alone (min cosine of the model's outputs on the
calibration batches, for the plain and the corrected replacement; the better one is used) orders
them, and a norm is switched only if the model with it and all norms switched before still keeps
``min_cosine``. The producer of step 1–2 is found by probing, not by
reading the architecture: add a random δ to a candidate linear's bias, subtract it again at the
norm's input; the linear qualifies only if the norm's input moved by exactly δ and the model's
outputs did not move at all.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from .._progress import progress as progress_bar  # `progress` is approximate_fold's callback argument
from ..engine.cosine_bar import DEFAULT_MIN_COSINE, check_cosine_bar
from ..engine.plan import FoldConfig
from ..engine.steps import StepContext, register_step
from ..engine.transform import norm_like
from ..nn import RMSNorm
from ..nn.kinds import norm_modules
from ..ops.reference import rms_norm_ref
from ._common import as_batches, call, first_tensor, rows

OutputFn = Callable[[nn.Module, object], Tensor]

_MAX_PRODUCER_CANDIDATES = 2  # linears executed just before a norm that are probed as its producer


# ------------------------------------------------------------------------------------ measurement

@dataclass
class OutputChange:
    """How far a model's outputs moved from the original's, over all output rows (tokens or sentences)."""

    max_abs_error: float
    mean_abs_error: float
    min_cosine: float
    mean_cosine: float


def compare_outputs(reference: Tensor, other: Tensor) -> OutputChange:
    """Errors and cosine similarities between two (N, C) output matrices, row by row."""
    if reference.shape != other.shape:
        raise ValueError(f"outputs must have the same shape, got {tuple(reference.shape)} and {tuple(other.shape)}")
    a, b = reference.double(), other.double()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    diff = (a - b).abs()
    return OutputChange(diff.max().item(), diff.mean().item(), cos.min().item(), cos.mean().item())


def retrieval_agreement(reference: Tensor, other: Tensor) -> float:
    """Fraction of rows whose nearest other row (cosine, itself excluded) is the same under both
    embeddings: top-1 retrieval agreement of a corpus searched with its own members."""
    if reference.shape != other.shape or reference.dim() != 2 or reference.shape[0] < 2:
        raise ValueError(f"expected two (N ≥ 2, C) embedding matrices of one shape, got {tuple(reference.shape)} and {tuple(other.shape)}")

    def nearest(e: Tensor) -> Tensor:
        e = torch.nn.functional.normalize(e.double(), dim=-1)
        sim = e @ e.T  # (N, N)
        sim.fill_diagonal_(-2.0)
        return sim.argmax(-1)

    return (nearest(reference) == nearest(other)).double().mean().item()


def token_outputs(model: nn.Module, batch) -> Tensor:
    """The model's main output as (N, C) rows, padded tokens dropped: the default output function."""
    return rows(first_tensor(call(model, batch)), batch)


def mean_pooled(model: nn.Module, batch) -> Tensor:
    """Sentence embeddings (B, C): the main output averaged over the real tokens (sentence-transformers' pooling)."""
    h = first_tensor(call(model, batch))  # (B, T, C)
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if mask is None:
        return h.mean(1)
    m = mask.unsqueeze(-1).to(h.dtype)  # (B, T, 1)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


@torch.no_grad()
def _outputs(model: nn.Module, batches: Sequence, output_fn: OutputFn, *, desc: str | None = None) -> Tensor:
    """output_fn over all batches, as one (N, C) matrix (with a progress bar when ``desc`` is given)."""
    outs = [output_fn(model, b) for b in (batches if desc is None else progress_bar(batches, desc=desc, unit="batch"))]
    return torch.cat([y.reshape(-1, y.shape[-1]) for y in outs])


# ------------------------------------------------------------------------------------------ report

@dataclass
class ApproxEntry:
    """One norm of the model after approximate folding."""

    path: str
    status: str                          # "exact" (exact fold), "approximate" (replaced here), "kept" (still a LayerNorm)
    producer: str | None = None          # linear whose weights were centred and whose bias absorbed the shift
    correction: str = ""                 # what was folded where
    cosine_alone: float | None = None    # min output cosine on calibration with only this norm replaced, corrected
    cosine_alone_naive: float | None = None  # the same for a plain RMSNorm with the LayerNorm's γ/β
    reason: str = ""


@dataclass
class ApproximateReport:
    """Per-norm outcome of ``approximate_fold`` and the output change of the whole result."""

    entries: list[ApproxEntry]
    min_cosine: float                    # the threshold that was asked for
    calibration: OutputChange | None = None  # final model vs original, on the calibration batches
    extra: dict = field(default_factory=dict)

    @property
    def num_exact(self) -> int:
        return sum(e.status == "exact" for e in self.entries)

    @property
    def num_approximate(self) -> int:
        return sum(e.status == "approximate" for e in self.entries)

    @property
    def num_kept(self) -> int:
        return sum(e.status == "kept" for e in self.entries)

    def to_dict(self) -> dict:
        return {"num_exact": self.num_exact, "num_approximate": self.num_approximate, "num_kept": self.num_kept,
                "min_cosine": self.min_cosine, "entries": [asdict(e) for e in self.entries],
                "calibration": None if self.calibration is None else asdict(self.calibration), **self.extra}

    def table(self) -> str:
        """A plain-text table, one row per norm."""
        def fmt(v):
            return "-" if v is None else f"{v:.6f}"
        head = ("norm", "status", "alone (naive)", "alone (corrected)", "producer")
        body = [(e.path, e.status, fmt(e.cosine_alone_naive), fmt(e.cosine_alone), e.producer or "-") for e in self.entries]
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines = [f"{self.num_exact} exact, {self.num_approximate} approximate, {self.num_kept} kept "
                 f"(threshold: min output cosine ≥ {self.min_cosine})"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
        if self.calibration is not None:
            c = self.calibration
            lines.append(f"calibration: min cosine {c.min_cosine:.6f}, mean cosine {c.mean_cosine:.6f}, "
                         f"max abs err {c.max_abs_error:.3e}, mean abs err {c.mean_abs_error:.3e}")
        return "\n".join(lines)

    __str__ = table


# ---------------------------------------------------------------------------- the tensor math

def center_linear_(linear: nn.Linear) -> None:
    """Make the linear's output zero-mean over its features for every input (column-centred W, zero-mean b)."""
    with torch.no_grad():
        linear.weight -= linear.weight.mean(0, keepdim=True)  # weight: (out, in); each column sums to 0
        if linear.bias is not None:
            linear.bias -= linear.bias.mean()


def fit_rms_affine(x: Tensor, target: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(γ', β') minimising ‖γ'·rms_norm(x) + β' − target‖² per feature over the rows of x (N, C), in float64.

    γ'_i = cov(z_i, t_i) / var(z_i), β'_i = mean(t_i) − γ'_i·mean(z_i), z = rms_norm(x).
    """
    z = rms_norm_ref(x.double(), eps=eps)  # (N, C)
    t = target.double()
    z_mean, t_mean = z.mean(0), t.mean(0)
    zc, tc = z - z_mean, t - t_mean
    var = zc.square().sum(0)
    gamma = (zc * tc).sum(0) / var.clamp_min(torch.finfo(torch.float64).tiny)
    beta = t_mean - gamma * z_mean
    return gamma, beta


# --------------------------------------------------------------------------------- module surgery

def _eps(norm: nn.Module) -> float:
    for name in ("eps", "variance_epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 1e-5


def _rms_like(norm: nn.Module, weight: Tensor, bias: Tensor) -> RMSNorm:
    """An RMSNorm in place of ``norm`` holding the fitted (or kept) γ/β."""
    return norm_like(norm, RMSNorm, weight.shape[0], _eps(norm), weight=weight, bias=bias)


@torch.no_grad()
def _capture(model: nn.Module, path: str, batches: Sequence) -> tuple[Tensor, Tensor]:
    """The norm's input and output rows (N, C) over all batches, padded tokens dropped."""
    module = model.get_submodule(path)
    seen: list[tuple[Tensor, Tensor]] = []
    handle = module.register_forward_hook(lambda _m, args, out: seen.append((args[0].detach(), out.detach())))
    try:
        per_batch = []
        for b in batches:
            seen.clear()
            call(model, b)
            # rows() uses the batch's mask only when the norm ran once on (B, T, C) activations
            per_batch += [(rows(x, b if len(seen) == 1 else None), rows(y, b if len(seen) == 1 else None)) for x, y in seen]
    finally:
        handle.remove()
    if not per_batch:
        raise ValueError(f"{path} did not run on the calibration batches")
    return torch.cat([x for x, _ in per_batch]), torch.cat([y for _, y in per_batch])


class _Undo:
    """Restores the parameters and the module a correction changed."""

    def __init__(self, model: nn.Module, norm_path: str, producer: nn.Linear | None):
        self.model, self.norm_path = model, norm_path
        self.norm = model.get_submodule(norm_path)
        self.producer = producer
        self.saved = None if producer is None else {n: p.detach().clone() for n, p in producer.named_parameters()}

    def __call__(self) -> None:
        self.model.set_submodule(self.norm_path, self.norm)
        if self.producer is not None:
            with torch.no_grad():
                for n, p in self.producer.named_parameters():
                    p.copy_(self.saved[n])


def _replace(model: nn.Module, path: str, producer_path: str | None, batches: Sequence, *, corrected: bool) -> _Undo:
    """Swap the LayerNorm at ``path`` for an RMSNorm (corrected or plain); returns how to undo it."""
    norm = model.get_submodule(path)
    producer = model.get_submodule(producer_path) if (corrected and producer_path) else None
    undo = _Undo(model, path, producer)
    if not corrected:
        bias = norm.bias if getattr(norm, "bias", None) is not None else torch.zeros_like(norm.weight)
        model.set_submodule(path, _rms_like(norm, norm.weight.detach(), bias.detach()))
        return undo
    if producer is not None:
        center_linear_(producer)
    x, y = _capture(model, path, batches)  # (N, C) each; y is the LayerNorm's own output
    if producer is not None:
        shift = x.double().mean().item()  # c = E_tokens[μ(x)] after centring
        with torch.no_grad():
            producer.bias -= shift
        x = x - shift
    gamma, beta = fit_rms_affine(x, y, _eps(norm))
    model.set_submodule(path, _rms_like(norm, gamma, beta))
    return undo


# ------------------------------------------------------------------------------ finding producers

@torch.no_grad()
def _execution_order(model: nn.Module, batch, watched: set[str]) -> list[str]:
    """Paths of the Linear modules and ``watched`` modules in the order they ran on ``batch``."""
    order: list[str] = []
    handles = [m.register_forward_pre_hook(lambda _m, _a, p=p: order.append(p))
               for p, m in model.named_modules() if isinstance(m, nn.Linear) or p in watched]
    try:
        call(model, batch)
    finally:
        for h in handles:
            h.remove()
    return order


@torch.no_grad()
def _probe_producer(model: nn.Module, norm_path: str, linear_path: str, batch, output_fn: OutputFn) -> bool:
    """True if the linear's output reaches the model only by being added into the norm's input."""
    norm, linear = model.get_submodule(norm_path), model.get_submodule(linear_path)
    if linear.bias is None:
        return False
    seen: list[Tensor] = []
    handle = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    try:
        out0 = output_fn(model, batch)
    finally:
        handle.remove()
    x0 = list(seen)
    if len(x0) != 1:
        return False
    scale = x0[0].abs().max().item() + 1.0
    delta = torch.randn(linear.bias.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    delta = (delta * 0.25 * scale).to(linear.bias.dtype)
    saved = linear.bias.detach().clone()
    seen.clear()

    def undo_delta(_m, args):
        seen.append(args[0].detach())
        return (args[0] - delta,) + tuple(args[1:])

    linear.bias += delta
    handle = norm.register_forward_pre_hook(undo_delta)
    try:
        out1 = output_fn(model, batch)
    finally:
        handle.remove()
        linear.bias.copy_(saved)
    if len(seen) != 1 or seen[0].shape != x0[0].shape:
        return False
    tol = 1e-4 * scale
    moved_by_delta = torch.allclose(seen[0] - x0[0], delta.expand_as(x0[0]), atol=tol, rtol=0)
    out_scale = out0.abs().max().item() + 1.0
    outputs_same = torch.allclose(out1, out0, atol=1e-4 * out_scale, rtol=0)
    return bool(moved_by_delta and outputs_same)


def _find_producer(model: nn.Module, norm_path: str, order: list[str], batch, output_fn: OutputFn) -> str | None:
    if norm_path not in order:
        return None
    before = [p for p in reversed(order[: order.index(norm_path)]) if isinstance(model.get_submodule(p), nn.Linear)]
    for linear_path in before[:_MAX_PRODUCER_CANDIDATES]:
        if _probe_producer(model, norm_path, linear_path, batch, output_fn):
            return linear_path
    return None


# --------------------------------------------------------------------------------------- the fold

def approximate_fold(model: nn.Module, folded_model: nn.Module, report, calibration, *,
                     min_cosine: float = DEFAULT_MIN_COSINE, output_fn: OutputFn | None = None,
                     candidates: Sequence[str] | None = None,
                     progress: Callable[[str], None] | None = None) -> tuple[nn.Module, ApproximateReport]:
    """Replace the LayerNorms still in ``folded_model`` by corrected RMSNorms while the model's
    outputs keep a cosine similarity ≥ ``min_cosine`` to ``model``'s on every calibration row.

    model:        the original model (the reference outputs).
    folded_model: ``model`` after the exact fold (or ``model`` itself); not modified.
    report:       the exact fold's ``FoldReport`` (its foldable norms are listed as "exact"), or None.
    calibration:  a batch or a list of batches (tensor / tuple of args / dict of kwargs).
    output_fn:    ``(model, batch) -> Tensor`` whose rows are compared; default: the main output,
                  one row per real token. Use ``mean_pooled`` for sentence-embedding models.
    candidates:   restrict replacement to these module paths (default: every LayerNorm left).
    progress:     called with a short message before each step (e.g. ``print``). Progress bars
                  on stderr (per calibration batch for the reference, per norm for each phase) show
                  on a terminal or with ``NORMFOLD_PROGRESS=1`` either way (``normfold._progress``).

    Returns ``(approx_model, ApproximateReport)``.
    """
    check_cosine_bar(min_cosine)
    batches = as_batches(calibration)
    output_fn = output_fn or token_outputs
    say = progress or (lambda _message: None)
    approx = copy.deepcopy(folded_model).eval()
    model.eval()

    entries: dict[str, ApproxEntry] = {}
    for e in getattr(report, "norms", None) or []:
        if e.foldable:
            entries[e.path] = ApproxEntry(e.path, "exact", reason=e.reason)
    still_layer_norm = {p for p, _m, kind in norm_modules(approx) if kind == "LayerNorm"}
    if still_layer_norm & set(entries):
        raise ValueError(f"folded_model must be the exact fold's output: the report marks "
                         f"{sorted(still_layer_norm & set(entries))} foldable but they are still LayerNorms")
    layer_norms = [p for p, _m, kind in norm_modules(approx) if kind == "LayerNorm" and p not in entries]
    if candidates is not None:
        unknown = sorted(set(candidates) - set(layer_norms))
        if unknown:
            raise ValueError(f"candidates must be LayerNorm paths left after the exact fold ({layer_norms}), got {unknown}")
    todo = [p for p in layer_norms if candidates is None or p in candidates]
    for p in layer_norms:
        if p not in todo:
            entries[p] = ApproxEntry(p, "kept", reason="not among the candidates")

    reference = _outputs(model, batches, output_fn, desc="approximate fold: reference outputs")
    order = _execution_order(approx, batches[0], set(todo))
    alone: dict[str, tuple[float, float]] = {}
    producers: dict[str, str | None] = {}
    for path in progress_bar(todo, desc="approximate fold: each norm alone", unit="norm"):
        norm = approx.get_submodule(path)
        if getattr(norm, "weight", None) is None or norm.weight.dim() != 1:
            entries[path] = ApproxEntry(path, "kept", reason="no 1-D γ: only last-dimension LayerNorms with weights are replaced")
            continue
        say(f"sensitivity of {path}")
        producers[path] = _find_producer(approx, path, order, batches[0], output_fn)
        scores = []
        for corrected in (False, True):
            undo = _replace(approx, path, producers[path], batches, corrected=corrected)
            scores.append(compare_outputs(reference, _outputs(approx, batches, output_fn)).min_cosine)
            undo()
        alone[path] = (scores[0], scores[1])

    # Greedy: least sensitive first; keep a switch only if the whole model still meets the bar.
    # Each norm uses the variant (plain or corrected) that cost less alone: a correction fitted on
    # one norm's output can still cost more at the model's output.
    greedy_order = sorted(alone, key=lambda p: -max(alone[p]))
    for path in progress_bar(greedy_order, desc="approximate fold: switching", unit="norm"):
        naive, corrected = alone[path]
        use_correction = corrected >= naive
        producer = producers[path] if use_correction else None
        say(f"switching {path}")
        undo = _replace(approx, path, producer, batches, corrected=use_correction)
        cos = compare_outputs(reference, _outputs(approx, batches, output_fn)).min_cosine
        if not use_correction:
            correction = "plain RMSNorm with the LayerNorm's γ/β (it cost less than the corrected one)"
        elif producer:
            correction = f"centred {producer} and folded the calibrated mean into its bias; γ/β refit by least squares"
        else:
            correction = "no producer linear found (no centring, no shift); γ/β refit by least squares"
        if cos >= min_cosine:
            entries[path] = ApproxEntry(path, "approximate", producer, correction, corrected, naive,
                                        reason=f"min output cosine {cos:.6f} with it and the norms switched before it")
        else:
            undo()
            entries[path] = ApproxEntry(path, "kept", producers[path], "", corrected, naive,
                                        reason=f"switching it would drop the min output cosine to {cos:.6f} < {min_cosine}")

    final = compare_outputs(reference, _outputs(approx, batches, output_fn))
    ordered = [entries[p] for p, _m, _k in norm_modules(model) if p in entries]
    ordered += [e for p, e in entries.items() if e not in ordered]
    return approx, ApproximateReport(ordered, float(min_cosine), final)


@dataclass(frozen=True, eq=False)  # eq=False: calibration holds tensors, which do not compare to a bool
class ApproximateConfig:
    """Options of the approximate fold (:func:`approximate_fold`): not exact.

    ``calibration``: a batch or a list of batches (tensor, tuple of positional or dict of keyword
    arguments) on which norms are chosen and corrected. ``min_cosine``: every output row keeps at
    least this cosine similarity to the original's, in (0, 1]. ``output_fn``: ``(model, batch) ->
    Tensor`` whose rows are compared (default: the main output, one row per real token; e.g.
    :func:`mean_pooled` for sentence embeddings).
    """

    calibration: object = field(repr=False)
    min_cosine: float = DEFAULT_MIN_COSINE
    output_fn: OutputFn | None = None

    def __post_init__(self) -> None:
        if self.calibration is None:
            raise ValueError("ApproximateConfig.calibration must be a batch or a list of batches "
                             "(inputs like example_inputs), got None")
        as_batches(self.calibration)  # TypeError / ValueError naming what a batch may be
        check_cosine_bar(self.min_cosine, "ApproximateConfig.min_cosine")
        if self.output_fn is not None and not callable(self.output_fn):
            raise TypeError(f"ApproximateConfig.output_fn must be None or a callable (model, batch) -> Tensor, "
                            f"got {type(self.output_fn).__name__}")


def approximate_step(model: nn.Module, calls: list, config: ApproximateConfig,
                     context: StepContext) -> tuple[nn.Module, ApproximateReport]:
    """The registered step of an :class:`ApproximateConfig`: :func:`approximate_fold` of ``model``
    (the previous step's output) against the original the runner was given, with the exact fold's
    report when a fold ran before. Not exact: the report measures the change, nothing is proved."""
    return approximate_fold(context.original, model, context.sections.get(FoldConfig), config.calibration,
                            min_cosine=config.min_cosine, output_fn=config.output_fn)


register_step(ApproximateConfig, approximate_step, section="approximate", section_type=ApproximateReport, proof=None)


__all__ = ["approximate_fold", "ApproximateConfig", "ApproximateReport", "ApproxEntry", "OutputChange",
           "compare_outputs",
           "retrieval_agreement", "token_outputs", "mean_pooled", "center_linear_", "fit_rms_affine"]
