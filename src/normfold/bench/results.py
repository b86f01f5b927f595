"""Benchmark results: ``BenchRow``, and the CSV, markdown table and PNG chart written from (and read back into) rows."""
from __future__ import annotations

import csv
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..ops import cpu_kernel_available
from .stats import verdict

CONTENDERS = ("original", "control", "folded", "fused")  # the columns a row may hold, in table order


@dataclass
class BenchRow:
    """One (model, shape, mode) measurement; times in milliseconds."""

    model: str
    mode: str                 # "eager" or "compile"
    batch: int
    seq: int                  # 1 = one decode step after ``prefill`` tokens
    kind: str                 # "decode", "prefill" or "image"
    median_ms: dict = field(default_factory=dict)    # contender -> median
    iqr_ms: dict = field(default_factory=dict)       # contender -> (q1, q3)
    ratio: dict = field(default_factory=dict)        # contender -> original median / contender median
    ratio_ci: dict = field(default_factory=dict)     # contender -> (low, high)
    norm_share: dict = field(default_factory=dict)   # contender -> fraction of forward time in norms + residual adds
    norm_ms: dict = field(default_factory=dict)      # contender -> ms per forward in norms + residual adds

    def flat(self) -> dict:
        """One CSV row: scalar columns per contender."""
        out = {"model": self.model, "mode": self.mode, "batch": self.batch, "seq": self.seq, "kind": self.kind}
        for c in self.median_ms:
            out[f"{c}_median_ms"] = round(self.median_ms[c], 4)
            out[f"{c}_q1_ms"], out[f"{c}_q3_ms"] = (round(v, 4) for v in self.iqr_ms[c])
            if c != "original":
                out[f"{c}_speedup"] = round(self.ratio[c], 4)
                out[f"{c}_ci_low"], out[f"{c}_ci_high"] = (round(v, 4) for v in self.ratio_ci[c])
            if c == "fused" and "fused" in self.ratio_ci:
                out["fused_verdict"] = verdict(self)
            if c in self.norm_share:
                out[f"{c}_norm_add_share"] = round(self.norm_share[c], 4)
                out[f"{c}_norm_add_ms"] = round(self.norm_ms[c], 4)
        return out


def cpu_model() -> str:
    """The processor's marketing name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def result_paths(stem, *, plot: bool = True) -> list[Path]:
    """The files :func:`write_results` writes: ``stem`` with ``.csv``, ``.md`` (and ``.png``) appended,
    never replacing a suffix of its own (``notes.v2`` gives ``notes.v2.csv``, not ``notes.csv``)."""
    stem = Path(stem)
    return [stem.with_name(stem.name + suffix) for suffix in (".csv", ".md", ".png")[: 3 if plot else 2]]


def write_results(rows: list[BenchRow], stem, *, command: str, plot: bool = True) -> list:
    """:func:`result_paths`: ``stem``.csv, ``stem``.md (with the command and the machine) and
    ``stem``.png; returns the paths."""
    paths = result_paths(stem, plot=plot)
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    flat = [r.flat() for r in rows]
    columns = list(dict.fromkeys(k for f in flat for k in f))
    with open(paths[0], "w", newline="") as fh:
        writer = csv.DictWriter(fh, columns)
        writer.writeheader()
        writer.writerows(flat)
    machine = (f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} "
               f"torch threads, load average {os.getloadavg()[0]:.1f} at the end, torch {torch.__version__}, "
               f"Python {platform.python_version()}, fused C++ CPU kernel "
               f"{'loaded' if cpu_kernel_available() else 'UNAVAILABLE (reference fallback)'}")
    lines = [f"# End-to-end: original vs folded vs folded+fused", "", f"command: `{command}`", "",
             f"machine: {machine}", "",
             "speedup = original median / contender median (> 1 is faster), [95% bootstrap CI]; "
             "control = a deep copy of the original timed alongside (A/A): how far this run's noise moves "
             "a ratio; fused vs noise = `faster` / `slower` when the fused CI clears the control's CI (widened to "
             "include 1), else `within noise`; "
             "norm+add = profiler: forward CPU time in the ops norm calls run (aten::layer_norm, normfold::rms_norm, "
             "...; not the module call around them) and in residual adds (aten::add whose result has the size "
             "and row length of a norm's input), its share of the forward, and how much of it fusing cut", "",
             "| model | mode | batch | seq | original ms | control (A/A) | folded | fused | fused vs noise "
             "| norm+add share orig → fused | norm+add ms orig → fused (cut) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r.ratio[c]:.3f} [{r.ratio_ci[c][0]:.3f}, {r.ratio_ci[c][1]:.3f}]" if c in r.ratio else "n/a"
                 for c in ("control", "folded", "fused")]
        share = (f"{r.norm_share['original']:.1%} → {r.norm_share['fused']:.1%}" if r.norm_share else "n/a")
        spent = "n/a"
        if r.norm_ms and r.norm_ms["original"] > 0:
            o, f = r.norm_ms["original"], r.norm_ms["fused"]
            spent = f"{o:.3f} → {f:.3f} ({1 - f / o:.0%})"
        lines.append(f"| {r.model} | {r.mode} | {r.batch} | {r.kind} {r.seq} | {r.median_ms['original']:.3f} | "
                     f"{cells[0]} | {cells[1]} | {cells[2]} | {verdict(r)} | {share} | {spent} |")
    paths[1].write_text("\n".join(lines) + "\n")
    if plot:
        plot_rows(rows, paths[2])
    return paths


def read_rows(path) -> list[BenchRow]:
    """The rows of a CSV written by ``write_results`` (medians, ratios, CIs, norm shares)."""
    rows = []
    with open(Path(path)) as fh:
        for rec in csv.DictReader(fh):
            row = BenchRow(rec["model"], rec["mode"], int(rec["batch"]), int(rec["seq"]), rec["kind"])
            for c in CONTENDERS:
                if not rec.get(f"{c}_median_ms"):
                    continue
                row.median_ms[c] = float(rec[f"{c}_median_ms"])
                row.iqr_ms[c] = (float(rec[f"{c}_q1_ms"]), float(rec[f"{c}_q3_ms"]))
                if c != "original":
                    row.ratio[c] = float(rec[f"{c}_speedup"])
                    row.ratio_ci[c] = (float(rec[f"{c}_ci_low"]), float(rec[f"{c}_ci_high"]))
                if rec.get(f"{c}_norm_add_share"):
                    row.norm_share[c] = float(rec[f"{c}_norm_add_share"])
                    row.norm_ms[c] = float(rec[f"{c}_norm_add_ms"])
            rows.append(row)
    return rows


RATIO_AXIS = (0.5, 2.0)  # the plot's widest y range: a noisy CI beyond it is clipped and labelled


def ratio_axis(extremes: list[float], widest: tuple[float, float] = RATIO_AXIS) -> tuple[float, float]:
    """The y range of a speed-up plot (log scale): the data's range with 1 in it, padded by 2%, but
    never wider than ``widest``, so that one noisy row (a CI to 70× on a busy machine) cannot squash
    every other bar into a line."""
    low, high = min(extremes + [1.0]) / 1.02, max(extremes + [1.0]) * 1.02
    return max(low, widest[0]), min(high, widest[1])


def plot_rows(rows: list[BenchRow], path):
    """Bar chart of every contender's speed-up with its CI (PNG at ``path``); needs matplotlib.
    Log y axis around 1 (no change), limited to :data:`RATIO_AXIS`; a value beyond it is drawn at the
    edge with its number."""
    try:
        import matplotlib  # not at the top: optional dependency
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'normfold[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # not at the top: optional dependency

    labels = [f"{r.model} {r.mode}\nb{r.batch} {r.kind} {r.seq}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows)), 4.5))
    shown = [c for c in ("control", "folded", "fused") if all(c in r.ratio for r in rows)]
    extremes = [v for r in rows for c in shown for v in r.ratio_ci[c]]
    low, high = ratio_axis(extremes)
    width = 0.8 / len(shown)
    colors = {"control": "0.7", "folded": "tab:blue", "fused": "tab:orange"}
    for k, c in enumerate(shown):
        xs = [i + (k - (len(shown) - 1) / 2) * width for i in range(len(rows))]
        ys = [min(max(r.ratio[c], low), high) for r in rows]
        cis = [(min(max(r.ratio_ci[c][0], low), high), min(max(r.ratio_ci[c][1], low), high)) for r in rows]
        # a point estimate outside its bootstrap interval (a few rounds) gets no bar on that side
        err = [[max(y - ci[0], 0.0) for y, ci in zip(ys, cis)], [max(ci[1] - y, 0.0) for y, ci in zip(ys, cis)]]
        # bars grow from 1 (no change) so that a few percent either way is visible
        ax.bar(xs, [y - 1 for y in ys], width, bottom=1.0, yerr=err, capsize=2, color=colors[c],
               label="control (A/A copy)" if c == "control" else c)
        for x, r in zip(xs, rows):
            for value in r.ratio_ci[c]:
                if not low <= value <= high:  # clipped: say where it really goes
                    ax.annotate(f"{value:.2g}", (x, high if value > high else low), fontsize=6, ha="center",
                                va="bottom" if value > high else "top")
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")  # 0.9, 1, 1.1: not 9x10^-1
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("speed-up over original (median, 95% CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
