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

import functools
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
DISCRETE_ONLY = ("the centered parameters reach no output through differentiable ops (a discrete step, argmax or "
                 "sampling, between): unchanged outputs prove nothing")
INSENSITIVE = ("no output changes when the centered parameters are jittered (a tiny random model's dead ReLU head "
               "outputs zeros everywhere): unchanged outputs prove nothing")


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
    verdict: str           # "folded" | "wrong" | "confirmed" | "missed" | "not judged"
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


def worst_mean_ratio(calls: list[Tensor], dim: int = -1) -> float:
    """:func:`mean_ratio` of a module's input at the call where it is largest: a norm folds only where every
    call's input is zero-mean."""
    return max(mean_ratio(x, dim) for x in calls)


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
    """Forward pre-hook that keeps a copy of every input of one module (a copy: a later in-place op may
    overwrite the tensor itself; clone() keeps the autograd link); ``value`` is the last."""

    def __init__(self, module: nn.Module):
        self.values: list[Tensor] = []
        self.handle = module.register_forward_pre_hook(self)

    def __call__(self, module, inputs):
        self.values.append(inputs[0].clone())

    @property
    def value(self) -> Tensor | None:
        return self.values[-1] if self.values else None


class _Reached(BaseException):
    """Raised by a recording hook once every awaited input is recorded: the rest of the forward is not needed
    (a BaseException, so that a model's own ``except Exception`` does not swallow it)."""


class Recorders:
    """Forward pre-hooks on the modules at ``paths``: each keeps a copy of its module's input at every call
    in a run (:meth:`run`; a module that runs twice, as PEGASUS-X's layer norms do on its local and global
    streams, is folded for both calls, so both are judged), and a run can be cut short once each awaited
    module has run as often as it does in a whole forward (a zero-mean check reads the norm's inputs, not
    the outputs)."""

    def __init__(self, model: nn.Module, paths):
        self.values: dict[str, list[Tensor]] = {}
        self.calls: dict[str, int] = {}
        self.stop_after: dict[str, int] | None = None
        self.handles = [model.get_submodule(p).register_forward_pre_hook(functools.partial(self._record, p))
                        for p in paths]

    def _record(self, path: str, module, inputs):
        self.values.setdefault(path, []).append(inputs[0].clone())
        self.calls[path] = len(self.values[path])
        if self.stop_after and all(self.calls.get(p, 0) >= n for p, n in self.stop_after.items()):
            raise _Reached

    def run(self, model: nn.Module, call, values: dict[str, Tensor] | None = None,
            stop_after: dict[str, int] | None = None):
        """(the outputs, or None for a run cut short; {path: its inputs, one per call}; {path: calls}) of ``model`` on
        ``call`` with ``values``, stopped once each module of ``stop_after`` ran that many times."""
        self.values, self.calls, self.stop_after = {}, {}, stop_after
        try:
            out = call_model(model, call, values)
        except _Reached:
            out = None
        finally:
            self.stop_after = None
        return out, self.values, self.calls

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def brute_force(model: nn.Module, recipes: dict[str, tuple[int, int | None]], path: str, inputs: list,
                reference: list, norm_dim: int = -1) -> NormVerdict:
    """:func:`judge_norms` for the one norm at ``path``."""
    return next(iter(judge_norms(model, recipes, {path: norm_dim}, inputs, reference)))


def judge_norms(model: nn.Module, recipes: dict[str, tuple[int, int | None]], norm_dims: dict[str, int],
                inputs: list, reference: list):
    """For each norm (``norm_dims``: path -> the dim it normalizes), is there a centering of linear-map
    parameters (those in ``recipes``) that makes its input zero-mean along that dim and keeps every output
    (``reference``: the model's outputs on ``inputs``)? Each name of a tied tensor is its own variable (a
    fold may untie). Judged in the dtype of the model's parameters (:func:`tolerances`).

    Yields one :class:`NormVerdict` per norm, the cheap ones first: a norm whose input is already zero-mean
    ("missed"), one the module never reaches on some input ("not judged"), one that stays not zero-mean
    with every parameter it depends on centered ("confirmed": one run per input judges them all, since
    centering a parameter the input does not depend on leaves it unchanged); then each remaining norm
    searched on its own: the centerings it needs, and whether they keep every output (with these weights
    and jittered ones)."""
    floating = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    mean_tol, rel_tol = tolerances(floating[0].dtype if floating else torch.get_default_dtype())
    names = dict(model.named_parameters(remove_duplicate=False))
    base = {n: p.detach() for n, p in names.items()}
    recorders = Recorders(model, list(norm_dims))
    try:
        with torch.no_grad():
            first = [recorders.run(model, call, base)[1:] for call in inputs]
        counts = [calls for _, calls in first]  # per input: {path: how often the module runs in a whole forward}

        def ratios(values: dict[str, Tensor], paths, call_index: int) -> dict[str, float]:
            """|mean|/rms of each norm's input on one input, the run stopped once all are recorded."""
            stop = {p: counts[call_index][p] for p in paths}
            with torch.no_grad():
                seen = recorders.run(model, inputs[call_index], values, stop)[1]
            return {p: worst_mean_ratio(seen[p], norm_dims[p]) for p in paths}

        def zero_mean(values: dict[str, Tensor], paths) -> set[str]:
            """The norms of ``paths`` whose input is zero-mean on every input under ``values``."""
            left = set(paths)
            for i in range(len(inputs)):
                if left:
                    left = {p for p, r in ratios(values, left, i).items() if r <= mean_tol}
            return left

        def outputs_of(values: dict[str, Tensor], call):
            with torch.no_grad():
                return recorders.run(model, call, values)[0]

        def same_outputs(values: dict[str, Tensor], expected) -> bool:
            """Every floating output under ``values`` equals ``expected``'s (one list per input) within rel_tol."""
            for call, ref in zip(inputs, expected):
                ref, out = floating_outputs(ref), floating_outputs(outputs_of(values, call))
                if len(ref) != len(out) or any(rel_error(r, o) > rel_tol for r, o in zip(ref, out)):
                    return False
            return True

        def keeps_outputs(path, weights, chosen, group_of, expected=None) -> bool:
            """Centering ``chosen`` in ``weights`` keeps the norm's input zero-mean and every output
            (``expected``: the outputs with ``weights`` on ``inputs``, computed when not given)."""
            values = {**weights, **{n: center(weights[n], *group_of[n]) for n in chosen}}
            if path not in zero_mean(values, [path]):
                return False
            return same_outputs(values, expected or [outputs_of(weights, i) for i in inputs])

        def moves_outputs(chosen) -> bool:
            """Jittering ``chosen`` (any change, not a centering) changes some output on some input."""
            return not same_outputs({**base, **jittered({n: base[n] for n in chosen})}, reference)

        pending = []
        for path in norm_dims:
            if any(path not in c for c in counts):
                yield NormVerdict(path, False, "not judged", "the module does not run on every input")
            elif all(worst_mean_ratio(values[path], norm_dims[path]) <= mean_tol for values, _ in first):
                yield NormVerdict(path, False, "missed", "its input is already zero-mean on random inputs")
            else:
                pending.append(path)
        ancestors = _ancestors(model, names, inputs[0], recorders, pending, counts[0])
        widths = {p: first[0][0][p][0].shape[norm_dims[p]] for p in pending}
        # the modes worth a search for each norm: centering whole outputs, or per group of the norm's width
        # (a per-head LayerNorm over D reads a Linear's outputs in groups of D) where that differs
        modes = {p: ["whole"] + (["norm_width"] if any(_group_for(recipes[n], base[n], "norm_width", widths[p])
                                                        != recipes[n] for n in ancestors[p] if n in recipes) else [])
                 for p in pending}
        passed = {p: [] for p in pending}
        for mode in ("whole", "norm_width"):
            by_width: dict[int, list[str]] = {}
            for p in pending:
                if mode in modes[p]:
                    by_width.setdefault(widths[p] if mode == "norm_width" else 0, []).append(p)
            for width, paths in by_width.items():  # one run per input for every norm of this width
                union = {n for p in paths for n in ancestors[p] if n in recipes}
                values = {**base, **{n: center(base[n], *_group_for(recipes[n], base[n], mode, width)) for n in union}}
                for p in zero_mean(values, paths):
                    passed[p].append(mode)
        for p in pending:
            if not passed[p]:
                yield NormVerdict(p, False, "confirmed", "not zero-mean with every parameter it depends on centered")
        searched = [p for p in pending if passed[p]]
        reaching = _reaching_outputs(model, names, inputs[0], recorders) if searched else set()
        for path in searched:
            yield _search(path, passed[path], ancestors[path], recipes, base, widths[path], zero_mean,
                          keeps_outputs, moves_outputs, reference, reaching)
    finally:
        recorders.remove()


def _search(path, modes, ancestors, recipes, base, width, zero_mean, keeps_outputs, moves_outputs, reference,
            reaching: set[str]) -> NormVerdict:
    """The per-norm search of :func:`judge_norms`: in each mode, the centerings the norm's input needs to be
    zero-mean, and whether they keep every output with these weights and with jittered ones. Outputs that no
    centered parameter reaches through differentiable ops (``reaching``: the names that do) stay the same
    whatever the centering does upstream of a discrete step (CLVP's speech decoder: only the ids it picks by
    argmax reach the outputs), so keeping them proves nothing: such a norm is "not judged"; so is one whose
    centering keeps outputs that no change of those parameters moves (``moves_outputs``: DPT's depth head in
    a tiny random model, a ReLU that outputs zeros everywhere)."""
    for mode in modes:
        chosen = [n for n in ancestors if n in recipes]
        group_of = {n: _group_for(recipes[n], base[n], mode, width) for n in chosen}

        def holds(selected) -> bool:
            return path in zero_mean({**base, **{n: center(base[n], *group_of[n]) for n in selected}}, [path])

        if not chosen or not holds(chosen):
            continue
        if not any(n in reaching for n in chosen):
            return NormVerdict(path, False, "not judged", DISCRETE_ONLY)
        chosen = needed(chosen, holds)
        if keeps_outputs(path, base, chosen, group_of, reference) and keeps_outputs(path, jittered(base), chosen, group_of):
            if any(n not in reaching for n in chosen):
                return NormVerdict(path, False, "not judged", DISCRETE_ONLY)
            if not moves_outputs(chosen):
                return NormVerdict(path, False, "not judged", INSENSITIVE)
            return NormVerdict(path, False, "missed", f"centering {sorted(chosen)} ({mode}) folds it")
    return NormVerdict(path, False, "confirmed")


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


def _ancestors(model: nn.Module, names: dict[str, Tensor], call, recorders: Recorders, paths: list[str],
               calls: dict[str, int]) -> dict[str, list[str]]:
    """For each norm of ``paths``, the parameter names its input depends on (each tied name separately), in
    the model's order: the leaves its autograd graph reaches, from one run (no backward pass)."""
    if not paths:
        return {}
    run = _graph_run(model, names, call, recorders, {p: calls[p] for p in paths})
    if run is None:
        return _ancestors_by_perturbation(model, names, call, recorders, paths, calls)
    _, seen, name_of = run
    return {p: _leaves_reached(seen[p], name_of) for p in paths}


def _reaching_outputs(model: nn.Module, names: dict[str, Tensor], call, recorders: Recorders) -> set[str]:
    """The parameter names the model's floating outputs reach through differentiable ops (every name where the
    grad-enabled run raises, as :func:`_ancestors` falls back)."""
    run = _graph_run(model, names, call, recorders)
    if run is None:
        return set(names)
    out, _, name_of = run
    return set(_leaves_reached([t for t in floating_outputs(out) if t.requires_grad], name_of))


def _graph_run(model: nn.Module, names: dict[str, Tensor], call, recorders: Recorders,
               stop_after: dict[str, int] | None = None):
    """One grad-enabled run with each parameter name a leaf of its own: (outputs, recorded inputs, id of a
    leaf -> its name), or None where the run raises (an in-place op on a leaf that requires grad)."""
    leaves = {n: p.detach().clone().requires_grad_(True) for n, p in names.items()}
    try:
        with torch.enable_grad():
            out, seen, _ = recorders.run(model, call, leaves, stop_after)
    except RuntimeError:
        return None
    return out, seen, {id(t): n for n, t in leaves.items()}


def _leaves_reached(values: list[Tensor], name_of: dict[int, str]) -> list[str]:
    """The names (``name_of``: id of a leaf tensor -> name) of the leaves the autograd graphs of ``values``
    reach, in ``name_of``'s order (one walk over the shared graph)."""
    found, visited, stack = set(), set(), [v.grad_fn for v in values]
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        leaf = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
        if leaf is not None and id(leaf) in name_of:
            found.add(name_of[id(leaf)])
        stack.extend(fn for fn, _ in node.next_functions)
    return [n for n in name_of.values() if n in found]


def _ancestors_by_perturbation(model: nn.Module, names: dict[str, Tensor], call, recorders: Recorders,
                               paths: list[str], calls: dict[str, int]) -> dict[str, list[str]]:
    """For each norm of ``paths``, the parameter names whose random perturbation changes its input."""
    base = {n: p.detach() for n, p in names.items()}
    stop = {p: calls[p] for p in paths}
    gen = torch.Generator().manual_seed(0)
    found = {p: [] for p in paths}
    with torch.no_grad():
        reference = recorders.run(model, call, base, stop)[1]
        for n, p in base.items():
            seen = recorders.run(model, call, {**base, n: p + torch.randn(p.shape, generator=gen, dtype=p.dtype)}, stop)[1]
            for path in paths:
                if path not in seen or len(seen[path]) != len(reference[path]) or not all(
                        torch.equal(a, b) for a, b in zip(seen[path], reference[path])):
                    found[path].append(n)
    return found
