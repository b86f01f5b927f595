"""Diagnostics: what each norm of a model actually receives, and how the activation scale moves
through the layers.

    result = normfold.inspect(model, inputs)   # inputs: one batch or a list of batches
    print(result.table()); result.plot("inspect.png"); result.to_dict()

For an RMSNorm replacing a LayerNorm, the number that matters is |μ(x)|/RMS(x) per token:
RMS(x)² = σ(x)² + μ(x)², so the two norms agree when it is 0 and drift apart as it grows. The
per-feature mean profile shows where that mean lives (often a few outlier features). The scale
trace is seed 001's ReLU-MLP decay generalised: the RMS of every norm's input and every
linear-like output (Linear, Hugging Face Conv1D, Conv), in execution order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from .._deps import require
from .._progress import progress
from ..engine.math import mean_over_rms
from ..nn.kinds import norm_modules
from ._common import as_batches, call, rows

_CHANNEL_FIRST = ("GroupNorm", "BatchNorm", "InstanceNorm")  # features on dim 1, not the last dim
_PRODUCERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def is_linear_like(module: nn.Module) -> bool:
    """Linear, Conv1d/2d/3d, or Hugging Face's ``Conv1D`` (GPT-2's projections: a Linear whose weight is
    stored (in, out)), recognised by name so transformers need not be imported."""
    if isinstance(module, _PRODUCERS):
        return True
    weight = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(weight, Tensor) and weight.dim() == 2


@dataclass
class NormInputStats:
    """Statistics of one norm module's input over all inspected batches (padded tokens excluded)."""

    path: str
    kind: str
    num_rows: int                    # feature vectors seen (tokens, or positions for channel norms)
    mean: float                      # mean of all input elements
    rms: float                       # sqrt(mean(x²)) over all input elements
    mean_over_rms: float             # average over rows of |μ(row)| / RMS(row): 0 ⇒ LayerNorm = RMSNorm
    max_mean_over_rms: float
    feature_mean: list[float] = field(repr=False)  # per-feature mean (the mean profile), length C


@dataclass
class ScalePoint:
    """RMS of one activation in execution order."""

    order: int
    path: str
    role: str                        # "norm input" or "linear output" (Linear and Conv)
    rms: float


class _NormAccumulator:
    def __init__(self, path: str, kind: str):
        self.path, self.kind = path, kind
        self.n = 0
        self.elements = 0
        self.sum = 0.0
        self.sum_sq = 0.0
        self.sum_ratio = 0.0
        self.max_ratio = 0.0
        self.feature_sum: Tensor | None = None

    def add(self, x: Tensor, batch) -> None:
        x = x.detach().double()
        if self.kind in _CHANNEL_FIRST and x.dim() >= 2:
            r = x.movedim(1, -1).reshape(-1, x.shape[1])  # (N·spatial, C)
        else:
            r = rows(x, batch)  # (tokens, C)
        ratio = mean_over_rms(r)
        self.n += r.shape[0]
        self.elements += r.numel()
        self.sum += r.sum().item()
        self.sum_sq += r.square().sum().item()
        self.sum_ratio += ratio.sum().item()
        self.max_ratio = max(self.max_ratio, ratio.max().item())
        fs = r.sum(0)
        self.feature_sum = fs if self.feature_sum is None or self.feature_sum.shape != fs.shape else self.feature_sum + fs

    def result(self) -> NormInputStats:
        return NormInputStats(self.path, self.kind, self.n, self.sum / self.elements, (self.sum_sq / self.elements) ** 0.5,
                              self.sum_ratio / self.n, self.max_ratio, (self.feature_sum / self.n).tolist())


@dataclass
class InspectResult:
    """``normfold.inspect``'s answer: per-norm input statistics and the activation-scale trace."""

    norms: list[NormInputStats]
    scale: list[ScalePoint]
    num_batches: int

    def to_dict(self) -> dict:
        return {"num_batches": self.num_batches, "norms": [asdict(s) for s in self.norms],
                "scale": [asdict(p) for p in self.scale]}

    def _rows(self) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        head = ("norm", "kind", "rows", "mean", "rms", "|mean|/rms", "max |mean|/rms", "top feature mean")
        body = []
        for s in self.norms:
            fm = torch.tensor(s.feature_mean)
            top = int(fm.abs().argmax()) if fm.numel() else -1
            body.append((s.path, s.kind, str(s.num_rows), f"{s.mean:+.4f}", f"{s.rms:.4f}", f"{s.mean_over_rms:.4f}",
                         f"{s.max_mean_over_rms:.4f}", f"#{top}: {fm[top].item():+.3f}" if top >= 0 else "-"))
        return head, body

    def table(self) -> str:
        """Plain-text table of the norms' input statistics."""
        head, body = self._rows()
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *body]]
        return "\n".join([f"{len(self.norms)} norms, {self.num_batches} batches", *lines])

    def rich_table(self):
        """The same table as a ``rich.table.Table`` (needs ``pip install 'normfold[cli]'``)."""
        table_mod = require("rich.table")
        head, body = self._rows()
        table = table_mod.Table(title=f"norm inputs over {self.num_batches} batches")
        for i, h in enumerate(head):
            table.add_column(h, justify="left" if i < 2 else "right")
        for r in body:
            table.add_row(*r)
        return table

    def __str__(self) -> str:
        return self.table()

    def plot(self, path) -> Path:
        """One PNG: the activation scale through the layers, |mean|/rms per norm, and the
        per-feature mean profile of every norm input. Needs ``pip install 'normfold[plot]'``."""
        matplotlib = require("matplotlib")
        matplotlib.use("Agg")
        plt = require("matplotlib.pyplot")
        path = Path(path)
        fig = plt.figure(figsize=(13, 8.5))
        grid = fig.add_gridspec(2, 2, height_ratios=[1, 1.1], width_ratios=[1.5, 1])
        ax_scale, ax_ratio, ax_prof = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])

        lin = [p for p in self.scale if p.role == "linear output"]
        nrm = [p for p in self.scale if p.role == "norm input"]
        ax_scale.plot([p.order for p in self.scale], [p.rms for p in self.scale], color="#cccccc", lw=1, zorder=1)
        ax_scale.scatter([p.order for p in lin], [p.rms for p in lin], s=14, color="#457b9d", label="Linear/Conv output", zorder=2)
        ax_scale.scatter([p.order for p in nrm], [p.rms for p in nrm], s=30, marker="D", color="#e63946", label="norm input", zorder=3)
        if self.scale and min(p.rms for p in self.scale) > 0:
            ax_scale.set_yscale("log")
        ax_scale.set_xlabel("execution order")
        ax_scale.set_ylabel("RMS of the activation")
        ax_scale.set_title("Activation scale through the model")
        ax_scale.legend(fontsize=8)

        names = [_short(s.path) for s in self.norms]
        ratios = [s.mean_over_rms for s in self.norms]
        y = range(len(self.norms))
        ax_ratio.barh(list(y), ratios, color="#e63946", alpha=0.85, label="average")
        ax_ratio.scatter([s.max_mean_over_rms for s in self.norms], list(y), marker="|", s=80, color="black", label="max")
        ax_ratio.set_yticks(list(y), names, fontsize=7)
        ax_ratio.invert_yaxis()
        ax_ratio.set_xlabel("|mean| / RMS of a row of the norm input")
        ax_ratio.set_title("How far each norm input is from zero-mean\n(0: LayerNorm = RMSNorm)", fontsize=10)
        ax_ratio.legend(fontsize=8)

        width = max((len(s.feature_mean) for s in self.norms), default=0)
        if width:
            profile = torch.full((len(self.norms), width), float("nan"))
            for i, s in enumerate(self.norms):
                fm = torch.tensor(s.feature_mean)
                profile[i, : fm.numel()] = fm / max(s.rms, 1e-30)
            lim = float(torch.nan_to_num(profile.abs(), nan=0.0).max()) or 1.0
            im = ax_prof.imshow(profile.numpy(), aspect="auto", cmap="RdBu_r", vmin=-lim, vmax=lim, interpolation="nearest")
            ax_prof.set_yticks(list(y), names, fontsize=7)
            ax_prof.set_xlabel("feature")
            ax_prof.set_title("Per-feature mean of each norm input, in units of that input's RMS (outlier features stand out)")
            fig.colorbar(im, ax=ax_prof, fraction=0.02, pad=0.01)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _short(path: str) -> str:
    return path if len(path) <= 40 else "…" + path[-39:]


@torch.no_grad()
def inspect(model: nn.Module, inputs) -> InspectResult:
    """Statistics of every norm's input, and the RMS of every norm input and Linear/Conv output in
    execution order, over ``inputs`` (one batch or a list of batches; a batch is a tensor, a tuple
    of positional arguments or a dict of keyword arguments). The model is run as it is (its
    train/eval mode is not changed) and not modified."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    batches = as_batches(inputs)
    norms = norm_modules(model)
    accumulators = {p: _NormAccumulator(p, kind) for p, _m, kind in norms}
    trace: dict[tuple[str, str, int], list[float]] = {}  # (path, role, call index) -> [sum of squares, count]
    state = {"batch": None, "calls": {}}

    def record(path: str, role: str, x: Tensor) -> None:
        key_call = (path, role)
        idx = state["calls"].get(key_call, 0)
        state["calls"][key_call] = idx + 1
        acc = trace.setdefault((path, role, idx), [0.0, 0])
        acc[0] += x.detach().double().square().sum().item()
        acc[1] += x.numel()

    def on_norm(path):
        def hook(_m, args):
            if args and isinstance(args[0], Tensor):
                accumulators[path].add(args[0], state["batch"])
                record(path, "norm input", args[0])
        return hook

    def on_linear(path):
        def hook(_m, _args, out):
            if isinstance(out, Tensor):
                record(path, "linear output", out)
        return hook

    handles = [m.register_forward_pre_hook(on_norm(p)) for p, m, _k in norms]
    handles += [m.register_forward_hook(on_linear(p)) for p, m in model.named_modules() if is_linear_like(m)]
    try:
        for b in progress(batches, desc="inspect: batches", unit="batch"):
            state["batch"], state["calls"] = b, {}
            call(model, b)
    finally:
        for h in handles:
            h.remove()
    stats = [accumulators[p].result() for p, _m, _k in norms if accumulators[p].n]
    scale = [ScalePoint(i, path, role, (ss / max(n, 1)) ** 0.5) for i, ((path, role, _c), (ss, n)) in enumerate(trace.items())]
    return InspectResult(stats, scale, len(batches))


__all__ = ["inspect", "InspectResult", "NormInputStats", "ScalePoint"]
