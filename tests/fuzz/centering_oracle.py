"""The brute-force oracle for missed folds, shared by the fuzzer (``fold_fuzz.py``) and the zoo table
(``benchmarks/hf_zoo.py``): is there a centering of the linear-map parameters a norm's input depends on
that makes that input zero-mean and keeps every model output? If so, the norm could have been folded.

It shares no code with the engine: the parameters are found by autograd (or by perturbation), each is
centered along the output dim its caller names (``recipes``: parameter name -> (dim, group)), and
the verdict is numerical (float64: |mean|/rms ≤ MEAN_TOL, outputs within REL_TOL; a model that runs only
in float32 is judged there, at FLOAT32_TOL for both). A plain module beside the fuzz tests: put this
folder on sys.path to import it (tests/fuzz/conftest.py does).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

REL_TOL = 1e-9                # float64: folding is exact up to rounding
MEAN_TOL = 1e-9               # |mean| / rms of a row that counts as zero-mean in float64
JITTER = 0.02                 # std of the noise added to every parameter for the second look (a typical init std)
# float32: a centered input's |mean|/rms is a few eps·sqrt(depth) (~1e-6), a fold's output error a few times the
# model's own rounding (~1e-6 to 1e-5); an input that is not zero-mean is O(0.01 to 1), a missed shift O(1). An
# input only nearly zero-mean passes too: Kosmos-2's inner attention norms with V centered over all heads, under
# near-uniform attention in every head of a tiny random model, were "missed" in float32 and refuted in float64
FLOAT32_TOL = 1e-4


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(the |mean|/rms that counts as zero-mean, the output error that counts as kept) in ``dtype``."""
    if dtype == torch.float64:
        return MEAN_TOL, REL_TOL
    if dtype == torch.float32:
        return FLOAT32_TOL, FLOAT32_TOL
    raise ValueError(f"the oracle judges in float64 or float32, got {dtype}")


@dataclass
class NormVerdict:
    path: str
    claimed: bool          # the engine said foldable
    verdict: str           # "folded" | "wrong" | "confirmed" | "missed"
    detail: str = ""
    engine_reason: str = ""


def rel_error(ref: Tensor, out: Tensor) -> float:
    if ref.shape != out.shape:
        return math.inf
    scale = ref.abs().max().item()
    diff = (ref - out).abs().max().item()
    return diff / scale if scale > 0 else diff


def mean_ratio(x: Tensor, dim: int = -1) -> float:
    """max over rows of |mean| / rms along ``dim`` (the norm's dim)."""
    rms = x.square().mean(dim).sqrt().clamp_min(1e-300)
    return (x.mean(dim).abs() / rms).max().item()


def center(t: Tensor, dim: int, group: int | None) -> Tensor:
    """t minus its mean along dim (per contiguous group). Written here, not imported from the
    engine, so that the brute force shares no code with what it checks."""
    if group is None:
        return t - t.mean(dim, keepdim=True)
    moved = t.movedim(dim, -1)
    parts = moved.reshape(*moved.shape[:-1], -1, group)
    return (parts - parts.mean(-1, keepdim=True)).reshape(moved.shape).movedim(-1, dim)


def floating_outputs(out) -> list[Tensor]:
    """The floating tensors of a model's output (a tensor, a tuple, a transformers ModelOutput), in order."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor) and t.is_floating_point()]


def call_model(model: nn.Module, call, values: dict[str, Tensor] | None = None):
    """``model`` on one call (a tuple of positional inputs or a dict of keyword inputs), with its
    parameters replaced by ``values`` when given (each tied name on its own)."""
    from torch.func import functional_call

    args, kwargs = ((), call) if isinstance(call, dict) else (tuple(call), {})
    if values is None:
        return model(*args, **kwargs)
    return functional_call(model, values, args, kwargs, tie_weights=False, strict=False)


class Recorder:
    """Forward pre-hook that keeps a copy of the last input of one module (a copy: a later in-place op
    may overwrite the tensor itself; clone() keeps the autograd link)."""

    def __init__(self, module: nn.Module):
        self.value = None
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, inputs):
        self.value = inputs[0].clone()


def brute_force(model: nn.Module, recipes: dict[str, tuple[int, int | None]], path: str, inputs: list,
                reference: list, norm_dim: int = -1) -> NormVerdict:
    """Is there a centering of linear-map parameters (those in ``recipes``) that makes the input of the
    norm at ``path`` zero-mean along ``norm_dim`` and keeps every output (``reference``: the model's
    outputs on ``inputs``)? Each name of a tied tensor is its own variable (a fold may untie). Judged in
    the dtype of the model's parameters (:func:`tolerances`)."""
    module = model.get_submodule(path)
    mean_tol, rel_tol = tolerances(next(model.parameters()).dtype)
    names = dict(model.named_parameters(remove_duplicate=False))
    recorder = Recorder(module)

    def run(values: dict[str, Tensor], call):
        with torch.no_grad():
            out = call_model(model, call, values)
        return out, recorder.value

    def ratio_of(values, call) -> float:
        return mean_ratio(run(values, call)[1], norm_dim)

    def keeps_outputs(weights: dict[str, Tensor], chosen: list[str], group_of: dict, expected=None) -> bool:
        """Centering ``chosen`` in ``weights`` keeps the norm's input zero-mean and every output
        (``expected``: the outputs with ``weights`` on ``inputs``, computed when not given)."""
        values = {**weights, **{n: center(weights[n], *group_of[n]) for n in chosen}}
        if any(ratio_of(values, i) > mean_tol for i in inputs):
            return False
        expected = expected or [run(weights, i)[0] for i in inputs]
        return all(rel_error(r, o) <= rel_tol for i, ref in zip(inputs, expected)
                   for r, o in zip(floating_outputs(ref), floating_outputs(run(values, i)[0])))

    try:
        base = {n: p.detach() for n, p in names.items()}
        if max(ratio_of(base, i) for i in inputs) <= mean_tol:
            return NormVerdict(path, False, "missed", "its input is already zero-mean on random inputs")
        ancestors = _ancestors(model, names, inputs[0], recorder)
        width = recorder.value.shape[norm_dim]
        for mode in ("whole", "norm_width"):
            chosen = [n for n in ancestors if n in recipes]
            centered = {n: center(base[n], *_group_for(recipes[n], base[n], mode, width)) for n in chosen}

            def zero_mean(selected) -> bool:
                values = {**base, **{n: centered[n] for n in selected}}
                return all(ratio_of(values, i) <= mean_tol for i in inputs)

            if not chosen or not zero_mean(chosen):
                continue
            chosen = needed(chosen, zero_mean)
            group_of = {n: _group_for(recipes[n], base[n], mode, width) for n in chosen}
            if keeps_outputs(base, chosen, group_of, reference) and keeps_outputs(jittered(base), chosen, group_of):
                return NormVerdict(path, False, "missed", f"centering {sorted(chosen)} ({mode}) folds it")
        return NormVerdict(path, False, "confirmed")
    finally:
        recorder.handle.remove()


def jittered(weights: dict[str, Tensor], seed: int = 0) -> dict[str, Tensor]:
    """``weights`` with JITTER·N(0, 1) added to every floating tensor (the same noise for every name of a
    tied tensor). A fold the engine could prove holds for any weights; one that holds only for these
    (a weight of ~1e-10 whose output an eps-dominated norm flattens, so a shift it carries vanishes in
    the outputs' rounding) is no missed fold, and the second look with these weights refutes it."""
    generator, noise = torch.Generator().manual_seed(seed), {}
    out = {}
    for name, t in weights.items():
        if not t.is_floating_point():
            out[name] = t
            continue
        key = (t.data_ptr(), t.shape, t.stride())
        if key not in noise:
            noise[key] = JITTER * torch.randn(t.shape, generator=generator, dtype=torch.float64).to(t.dtype)
        out[name] = t + noise[key]
    return out


def needed(chosen: list[str], holds) -> list[str]:
    """A subset of ``chosen`` for which ``holds`` still holds and from which no single name can be dropped
    (``holds(chosen)`` must be true): names are dropped in halves, quarters, ... while ``holds`` stays
    true, then one by one (a few dozen runs for a hundred names, where dropping one at a time takes a
    hundred)."""
    kept, size = list(chosen), max(1, len(chosen) // 2)
    while True:
        i = 0
        while i < len(kept):
            rest = kept[:i] + kept[i + size:]
            if rest != kept and holds(rest):
                kept = rest
            else:
                i += size
        if size == 1:
            return kept
        size = max(1, size // 2)


def _group_for(recipe: tuple[int, int | None], t: Tensor, mode: str, width: int) -> tuple[int, int | None]:
    dim, group = recipe
    if mode == "norm_width" and group is None and t.shape[dim] % width == 0 and t.shape[dim] != width:
        return dim, width  # e.g. a per-head LayerNorm over D reads a Linear's outputs in groups of D
    return dim, group


def _ancestors(model: nn.Module, names: dict[str, Tensor], call, recorder: Recorder) -> list[str]:
    """Parameter names the recorded module's input depends on (nonzero gradient of a random
    projection of it), each tied name separately."""
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in names.items()}
    try:
        with torch.enable_grad():
            call_model(model, call, leaves)
            value = recorder.value
            if value is None or not value.requires_grad:
                return []
            probe = torch.randn(value.shape, generator=torch.Generator().manual_seed(0), dtype=value.dtype)
            grads = torch.autograd.grad((value * probe).sum(), list(leaves.values()), allow_unused=True)
    except RuntimeError:  # an in-place op overwrote a value autograd saved: perturb each name instead
        return _ancestors_by_perturbation(model, names, call, recorder)
    return [n for n, g in zip(leaves, grads) if g is not None and g.abs().max().item() > 0]


def _ancestors_by_perturbation(model: nn.Module, names: dict[str, Tensor], call, recorder: Recorder) -> list[str]:
    """Parameter names whose random perturbation changes the recorded module's input."""
    base = {n: p.detach() for n, p in names.items()}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        call_model(model, call, base)
        reference = recorder.value.clone()
        found = []
        for n, p in base.items():
            call_model(model, call, {**base, n: p + torch.randn(p.shape, generator=gen, dtype=p.dtype)})
            if not torch.equal(recorder.value, reference):
                found.append(n)
    return found
