"""Seed 003's comparison at CPU scale: one GPT trained with each norm variant, learning rate per variant from a
grid, 5 seeds, variants trained in lockstep so every paired time ratio sees the same machine.

Seed 003 trained GPT-2 small once per variant and read 0.5–2.5% time differences between LayerNorm and RMSNorm.
The questions here, each answered from a 95% t-interval over seeds (paired: same seed, same initial weights of the
shared tensors, same batches):

- Does normfold's RMSNorm, and CBWC + normfold RMSNorm (a LayerNorm model trained as an RMSNorm model), train in
  at most nn.LayerNorm's time, at the experiment's width and at width 384?
- Is CBWC's loss LayerNorm's (it is the same function of the same weights, so it should be, to float32 rounding)?
- What does RMSNorm cost or gain in validation loss against LayerNorm?

Design. Three phases, each seed in a fresh process (its own memory layout, one intra-op thread):
1. grid: each distinct function (LayerNorm, RMSNorm) at every learning rate of ``GRID``, on ``GRID_SEEDS`` seeds
   that the comparison does not use; each variant takes its function's best rate (lowest mean validation loss).
   Implementations of one function (nn.LayerNorm and CBWC; torch's and normfold's RMSNorm) share the pick.
2. comparison: every variant at its rate, ``SEEDS`` seeds, ≥ 10 training tokens per parameter. Within a seed the
   variants take their optimizer steps in lockstep, in rotating order; the time of a run is the CPU time of its
   steps after the first (``time.thread_time``: time spent descheduled by other jobs drops out).
3. width: the same steps at width 384 (timing only, a few steps per seed, the same lockstep).
A variant's steps are those of ``normfold train`` with its config (same model, batches and schedule): the
comparison calls the trainer's own step, and ``tests/train/test_experiments.py`` checks a run against ``train()``.

    python experiments/norm_comparison.py            # full: ≤ 60 min on 2 cores
    python experiments/norm_comparison.py --quick    # tiny model, few steps (≤ 2 min)
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from _common import RESULTS, Stopwatch, corpus_line, markdown_table, provenance, pyplot, save_figure, write_csv
from stats import compare, mean_ci, paired_ci

from normfold.bench.timing import rotated
from normfold.train import NORMS, resolve_config
from normfold.train.cbwc import project_centering_
from normfold.train.data import TokenSplits, load_documents
from normfold.train.trainer import build_model, estimate_val_loss, lr_at, make_optimizer, step_with_norm

VARIANTS = ("layernorm", "rmsnorm_torch", "rmsnorm", "cbwc_rmsnorm")
# which variants compute the same function of the same weights (they share the grid's learning rate)
FUNCTION = {"layernorm": "layernorm", "layernorm_handrolled": "layernorm", "cbwc_rmsnorm": "layernorm",
            "rmsnorm_torch": "rmsnorm", "rmsnorm_handrolled": "rmsnorm", "rmsnorm": "rmsnorm", "none": "none"}
BASE = "layernorm"

# 3 × 64 GPT, 174,656 parameters with LayerNorm; 860 steps × 16 × 128 = 1.76M tokens: 10.1 tokens per parameter
# (4.2 passes over the ~420k training tokens)
FULL = dict(n_layer=3, n_head=4, n_embd=64, block_size=128, batch_size=16, max_steps=860, warmup_steps=40,
            eval_interval=215, eval_iters=16)
GRID = (2e-3, 4e-3, 8e-3, 1.6e-2)  # doubling steps; min_lr = lr / 10. A first run of (1e-3, 2e-3, 4e-3) picked its edge
GRID_SEEDS = (100, 101)  # not among the comparison's seeds: the pick is not scored on the runs that made it
SEEDS = (0, 1, 2, 3, 4)
WIDE = dict(n_embd=384, n_head=6)  # phase 3: width 384, head size 64
WIDE_STEPS = 8  # timed steps per variant and seed at width 384 (after one untimed)
QUICK = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=8, max_steps=30, warmup_steps=3,
             eval_interval=15, eval_iters=4)
QUICK_GRID, QUICK_GRID_SEEDS, QUICK_SEEDS, QUICK_WIDE, QUICK_WIDE_STEPS = (3e-3, 6e-3), (100,), (0, 1), \
    dict(n_embd=64, n_head=2), 2


@dataclass
class Member:
    """One variant's training inside a lockstep: model, optimizer, batch generator and what it measured."""

    name: str
    config: object
    model: torch.nn.Module = None
    optimizer: torch.optim.Optimizer = None
    generator: torch.Generator = None
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    diverged: bool = False


def lockstep(specs: list[tuple[str, dict]], steps: int | None = None, evaluate: bool = True) -> list[dict]:
    """Train every ``(name, config values)`` of ``specs`` one optimizer step at a time, in rotating order.

    Each member is what ``normfold.train.train`` would run for its config: the same model (``build_model``, CBWC
    by projection), AdamW, schedule (``lr_at``), batches (generator seeded ``seed · 100003``), step
    (``step_with_norm``) and validation batches. ``steps`` (default the config's) may stop early (timing only).
    """
    torch.set_num_threads(1)
    configs = [(name, resolve_config(progress=False, save_checkpoint=False, **values)) for name, values in specs]
    first = configs[0][1]
    splits = TokenSplits.from_documents(load_documents(first.data), first.model.block_size, first.val_fraction)
    members = []
    for name, config in configs:
        model = build_model(config)
        project_centering_(model)
        members.append(Member(name, config, model, make_optimizer(model, config),
                              torch.Generator().manual_seed(config.seed * 100_003)))
    total = first.max_steps if steps is None else steps
    for step in range(total):
        for m in rotated(members, step):
            if m.diverged:
                continue
            for group in m.optimizer.param_groups:
                group["lr"] = lr_at(step, m.config)
            batches = [splits.batch("train", m.config.batch_size, m.generator) for _ in range(m.config.grad_accum_steps)]
            cpu, wall = time.thread_time(), time.perf_counter()
            loss = step_with_norm(m.model, m.optimizer, batches, m.config)[0].item()
            if step > 0:  # the first step pays for allocation and warm-up, as in the trainer
                m.cpu_s += time.thread_time() - cpu
                m.wall_s += time.perf_counter() - wall
            m.train_losses.append(loss)
            m.diverged = not math.isfinite(loss)
            if evaluate and ((step + 1) % m.config.eval_interval == 0 or step == total - 1):
                val = float("nan") if m.diverged else estimate_val_loss(m.model, splits, m.config, torch.device("cpu"))
                m.val_losses.append((step + 1, val))
    return [dict(name=m.name, seed=m.config.seed, lr=m.config.lr, steps=len(m.train_losses),
                 tokens=len(m.train_losses) * m.config.batch_size * m.config.model.block_size,
                 parameters=m.model.num_parameters(), cpu_s=m.cpu_s, wall_s=m.wall_s, diverged=m.diverged,
                 train_losses=m.train_losses, val_losses=m.val_losses,
                 final_val_loss=m.val_losses[-1][1] if m.val_losses else None) for m in members]


def _run_all(jobs: list[tuple], fresh_processes: bool) -> list[list[dict]]:
    """``lockstep(*job)`` for every job: each in a fresh process (its own memory layout), or in this one."""
    if not fresh_processes:
        return [lockstep(*job) for job in jobs]
    results = []
    for job in jobs:  # one at a time: the lockstep's timing must not share the cores with another seed
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results.append(pool.submit(lockstep, *job).result())
    return results


def _values(setup: dict, norm: str, lr: float, seed: int) -> dict:
    return dict(setup, norm=norm, lr=lr, min_lr=lr / 10, seed=seed)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and budget (smoke run, in this process)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    parser.add_argument("--seeds", type=int, default=None, help="use the first N comparison seeds")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {NORMS}")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(variants) - set(NORMS))
    if bad:
        parser.error(f"unknown variants {bad}; choose from {NORMS}")
    if BASE not in variants:
        parser.error(f"the variants must include {BASE!r}: every ratio and difference is against it")
    setup = dict(QUICK if args.quick else FULL)
    grid, grid_seeds, seeds, wide, wide_steps = ((QUICK_GRID, QUICK_GRID_SEEDS, QUICK_SEEDS, QUICK_WIDE,
                                                  QUICK_WIDE_STEPS) if args.quick else (GRID, GRID_SEEDS, SEEDS, WIDE,
                                                                                        WIDE_STEPS))
    if args.seeds is not None:
        seeds = tuple(range(args.seeds))
    if args.steps is not None:
        setup.update(max_steps=args.steps, eval_interval=max(1, min(setup["eval_interval"], args.steps)),
                     warmup_steps=min(setup["warmup_steps"], args.steps // 2))
    name = "norm_comparison_quick" if args.quick else "norm_comparison"
    fresh = not args.quick
    clock = Stopwatch()

    # phase 1: the learning rate of each function, from the grid seeds
    functions = {}
    for v in variants:
        functions.setdefault(FUNCTION[v], v)  # the first variant of each function stands for it in the grid
    grid_jobs = [([(f"{fn}@{lr:g}", _values(setup, rep, lr, seed)) for fn, rep in functions.items() for lr in grid],)
                 for seed in grid_seeds]
    grid_rows = [dict(phase="grid", variant=r["name"].split("@")[0], lr=r["lr"], seed=r["seed"],
                      final_val_loss=r["final_val_loss"], diverged=r["diverged"])
                 for rows in _run_all(grid_jobs, fresh) for r in rows]
    best = {}
    for fn in functions:
        score = {lr: _mean_or_inf([r["final_val_loss"] for r in grid_rows if r["variant"] == fn and r["lr"] == lr
                                   and not r["diverged"]], len(grid_seeds)) for lr in grid}
        best[fn] = min(grid, key=lambda lr: (score[lr], lr))
    print(f"[{clock}] grid: " + ", ".join(f"{fn} lr {lr:g}" for fn, lr in best.items()), flush=True)

    # phase 2: the comparison, every variant at its function's rate, in lockstep per seed
    runs = []
    for rows in _run_all([([(v, _values(setup, v, best[FUNCTION[v]], seed)) for v in variants],) for seed in seeds],
                         fresh):
        runs += rows
        print(f"[{clock}] seed {rows[0]['seed']}: " + ", ".join(f"{r['name']} val {r['final_val_loss']:.4f} "
                                                                f"{r['cpu_s']:.1f} s" for r in rows), flush=True)

    # phase 3: time at width ≥ 384, the same lockstep, a few steps per seed
    wide_setup = dict(setup, **wide)
    wide_runs = []
    for rows in _run_all([([(v, _values(wide_setup, v, best[FUNCTION[v]], seed)) for v in variants],
                           wide_steps + 1, False) for seed in seeds], fresh):
        wide_runs += rows
    print(f"[{clock}] width {wide_setup['n_embd']}: timed", flush=True)

    per_run = [dict(phase="comparison", variant=r["name"], seed=r["seed"], lr=r["lr"], width=setup["n_embd"],
                    parameters=r["parameters"], steps=r["steps"], tokens=r["tokens"], cpu_s=round(r["cpu_s"], 4),
                    wall_s=round(r["wall_s"], 4), final_val_loss=r["final_val_loss"], diverged=r["diverged"])
               for r in runs]
    per_run += [dict(phase="width", variant=r["name"], seed=r["seed"], lr=r["lr"], width=wide_setup["n_embd"],
                     parameters=r["parameters"], steps=r["steps"], tokens=r["tokens"], cpu_s=round(r["cpu_s"], 4),
                     wall_s=round(r["wall_s"], 4), final_val_loss="", diverged=r["diverged"]) for r in wide_runs]
    write_csv(args.out / f"{name}.csv", per_run)
    write_csv(args.out / f"{name}_grid.csv", grid_rows)
    curves = [dict(variant=r["name"], seed=r["seed"], step=i + 1, train_loss=loss, val_loss="")
              for r in runs for i, loss in enumerate(r["train_losses"])]
    curves += [dict(variant=r["name"], seed=r["seed"], step=step, train_loss="", val_loss=loss)
               for r in runs for step, loss in r["val_losses"]]
    write_csv(args.out / f"{name}_curves.csv", curves)
    _report(args, name, setup, wide_setup, wide_steps, variants, grid, grid_seeds, best, grid_rows, runs, wide_runs,
            clock)


def _mean_or_inf(values: list[float], expected: int) -> float:
    """Mean of the validation losses, +inf when a seed diverged (a rate that diverges once is not picked)."""
    return sum(values) / len(values) if len(values) == expected else math.inf


def _time_ratio(runs: list[dict], variant: str):
    """CPU time of ``variant`` / LayerNorm's, per seed (same lockstep), as a mean with its 95% t-interval."""
    base = {r["seed"]: r["cpu_s"] for r in runs if r["name"] == BASE}
    return mean_ci([r["cpu_s"] / base[r["seed"]] for r in runs if r["name"] == variant and r["seed"] in base])


def _ratio_sentence(variant: str, ratio, width: int) -> str:
    if ratio.n < 2:
        verdict = "not resolved (fewer than 2 seeds)"
    elif ratio.high < 1.0:
        verdict = "faster than nn.LayerNorm (the interval is below 1)"
    elif ratio.low > 1.0:
        verdict = "slower than nn.LayerNorm (the interval is above 1)"
    else:
        verdict = f"not resolved (the interval contains 1; at most {100 * (ratio.high - 1):.1f}% slower)"
    return (f"width {width}: training time {variant} / layernorm = {ratio.text(3, signed=False)} "
            f"(95% CI, {ratio.n} paired seeds): {verdict}")


def _report(args, name, setup, wide_setup, wide_steps, variants, grid, grid_seeds, best, grid_rows, runs, wide_runs,
            clock) -> None:
    width, wide = setup["n_embd"], wide_setup["n_embd"]
    val = {v: {r["seed"]: r["final_val_loss"] for r in runs if r["name"] == v and not r["diverged"]} for v in variants}
    ratios = {v: _time_ratio(runs, v) for v in variants}
    wide_ratios = {v: _time_ratio(wide_runs, v) for v in variants}
    first = next(r for r in runs if r["name"] == BASE)
    rows = []
    for v in variants:
        mine = [r for r in runs if r["name"] == v]
        loss = mean_ci(list(val[v].values()))
        rows.append([v, f"{best[FUNCTION[v]]:g}", f"{mine[0]['parameters']:,}",
                     f"{sum(r['cpu_s'] for r in mine) / len(mine):.1f}", f"{ratios[v].text(3, signed=False)}",
                     f"{wide_ratios[v].text(3, signed=False)}", loss.text(4, signed=False),
                     paired_ci(val[v], val[BASE]).text(4) if v != BASE else "—",
                     sum(r["diverged"] for r in mine)])
    table = markdown_table(["norm", "lr", "params", "train CPU s (mean)", f"time vs LN, width {width} (95% CI)",
                            f"time vs LN, width {wide} (95% CI)", "val loss (95% CI)", "Δ val vs LN (paired, 95% CI)",
                            "diverged"], rows)
    grid_table = markdown_table(
        ["function (grid stand-in)"] + [f"lr {lr:g}" for lr in grid] + ["picked"],
        [[fn] + [_grid_cell(grid_rows, fn, lr, len(grid_seeds)) for lr in grid] + [f"{best[fn]:g}"] for fn in best])
    sentences = []
    for v in variants:
        if v == BASE:
            continue
        sentences.append(_ratio_sentence(v, ratios[v], width))
        sentences.append(_ratio_sentence(v, wide_ratios[v], wide))
        if FUNCTION[v] == FUNCTION[BASE]:  # the same function: the question is equality, not which is lower
            sentences.append(_same_function_sentence(v, paired_ci(val[v], val[BASE]), runs))
        else:
            sentences.append(compare(v, BASE, paired_ci(val[v], val[BASE]), "validation loss"))
    exact = _exactness(runs, "cbwc_rmsnorm") if "cbwc_rmsnorm" in variants else None
    tokens = first["tokens"]
    text = "\n".join([
        f"# Norm comparison ({'quick' if args.quick else 'full'} run)", "",
        f"Seed 003's table at CPU scale: a {setup['n_layer']}-layer GPT of width {width}, {len(variants)} norm "
        f"variants, {len(runs) // len(variants)} seeds, {tokens:,} training tokens per run "
        f"({tokens / first['parameters']:.1f} per parameter of the LayerNorm model), each variant at the learning "
        f"rate its function won on the grid. Within a seed the variants step in lockstep (rotating order, one thread, "
        "a fresh process per seed); a run's time is the CPU time of its optimizer steps after the first. Validation "
        f"loss: mean cross-entropy (nats/byte) on {setup['eval_iters']} fixed validation batches after the last step.",
        "", table, "",
        f"Width {wide}: the same depth and lockstep, {wide_steps} timed steps per variant and seed (timing only).", "",
        "## What the intervals say", "",
        *[f"- {s}" for s in sentences],
        *([f"- CBWC against LayerNorm, the same function of the same weights: {exact}"] if exact else []), "",
        f"## Learning-rate grid (seed{'s' * (len(grid_seeds) > 1)} {', '.join(map(str, grid_seeds))}, not used above)", "",
        "Mean final validation loss per rate (∞: a seed diverged). Variants computing the same function share the "
        "pick: nn.LayerNorm and CBWC + normfold RMSNorm (LayerNorm's function), torch's and normfold's RMSNorm.", "",
        grid_table, "",
        f"Setup: `{json.dumps(setup)}`; AdamW (β = 0.9, 0.95; weight decay 0.1 on matrices), warmup then cosine "
        "decay to lr/10, clipping at 1.0.",
        provenance(f"≤ 60 min on 2 cores (full run)", corpus_line(setup["block_size"]), clock), "",
        f"Curves: `{name}_loss.png` (train loss, mean over seeds; validation points); `{name}_time.png` (time "
        f"ratios with their intervals). Raw data: `{name}.csv` (per run), `{name}_grid.csv`, `{name}_curves.csv`.",
        "",
    ])
    (args.out / f"{name}.md").write_text(text)
    _plots(args.out, name, variants, runs, ratios, wide_ratios, width, wide)
    print(text)


def _grid_cell(grid_rows, fn, lr, expected) -> str:
    score = _mean_or_inf([r["final_val_loss"] for r in grid_rows if r["variant"] == fn and r["lr"] == lr
                          and not r["diverged"]], expected)
    return "∞" if math.isinf(score) else f"{score:.4f}"


ROUNDING = 1e-4  # relative loss gap float32 training stays under when two models compute the same function


def _loss_gaps(runs: list[dict], variant: str) -> list[float]:
    """|loss − LayerNorm's loss| / |LayerNorm's| at every paired step of every seed."""
    base = {r["seed"]: r["train_losses"] for r in runs if r["name"] == BASE}
    return [abs(a - b) / abs(b) for r in runs if r["name"] == variant and r["seed"] in base
            for a, b in zip(r["train_losses"], base[r["seed"]])]


def _same_function_sentence(variant: str, diff, runs: list[dict]) -> str:
    """Validation-loss difference of a variant that computes LayerNorm's function: equal to rounding, or not."""
    gaps = _loss_gaps(runs, variant)
    verdict = (f"equal to float32 rounding (every paired step within {ROUNDING:g} relative)"
               if gaps and max(gaps) <= ROUNDING else "NOT equal: a gap beyond float32 rounding (a bug to chase)")
    return (f"validation loss {variant} − layernorm = {diff.mean:+.1e} [{diff.low:+.1e}, {diff.high:+.1e}] "
            f"(95% CI, {diff.n} paired seeds; the same function of the same weights): {verdict}")


def _exactness(runs: list[dict], variant: str) -> str:
    """The largest relative gap of ``variant``'s training loss to LayerNorm's over all steps and seeds."""
    gaps = _loss_gaps(runs, variant)
    finals = [abs(r["final_val_loss"] - next(s for s in runs if s["name"] == BASE and s["seed"] == r["seed"])
                  ["final_val_loss"]) for r in runs if r["name"] == variant and not r["diverged"]]
    if not gaps:
        return "no paired runs"
    return (f"largest relative gap of the training loss over all {len(gaps):,} paired steps {max(gaps):.1e}, largest "
            f"|Δ final validation loss| {max(finals):.1e} (float32 training: rounding differences grow with steps)")


def _plots(out: Path, name: str, variants, runs, ratios, wide_ratios, width: int, wide: int) -> None:
    plt = pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in variants:
        mine = [r for r in runs if r["name"] == v]
        steps = min(len(r["train_losses"]) for r in mine)
        mean = [sum(r["train_losses"][i] for r in mine) / len(mine) for i in range(steps)]
        window = max(1, steps // 40)  # light smoothing of the noisy per-batch loss
        smooth = [sum(mean[max(0, i - window + 1): i + 1]) / len(mean[max(0, i - window + 1): i + 1])
                  for i in range(steps)]
        ax_train.plot(range(1, steps + 1), smooth, label=v, linestyle="--" if v == "cbwc_rmsnorm" else "-")
        points = sorted({s for r in mine for s, _ in r["val_losses"]})
        ax_val.plot(points, [sum(dict(r["val_losses"]).get(s, math.nan) for r in mine) / len(mine) for s in points],
                    marker="o", label=v, linestyle="--" if v == "cbwc_rmsnorm" else "-")
    ax_train.set(xlabel="step", ylabel="train loss (nats/byte, smoothed, mean of seeds)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss (mean of seeds)", title="validation loss")
    save_figure(fig, (ax_train, ax_val), out / f"{name}_loss.png")

    fig, ax = plt.subplots(figsize=(8, 4))
    others = [v for v in variants if v != BASE]
    for k, (w, table) in enumerate(((width, ratios), (wide, wide_ratios))):
        xs = [i + (k - 0.5) * 0.3 for i in range(len(others))]
        means = [table[v].mean for v in others]
        errors = [[m - table[v].low for v, m in zip(others, means)], [table[v].high - m for v, m in zip(others, means)]]
        ax.errorbar(xs, means, yerr=errors, fmt="o", capsize=4, label=f"width {w}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(others)), others)
    ax.set(ylabel="training time / nn.LayerNorm's (mean, 95% CI)", title="paired time ratio over seeds")
    save_figure(fig, (ax,), out / f"{name}_time.png")


if __name__ == "__main__":
    main()
