"""Seed 003's comparison at CPU scale: one GPT trained with each norm variant, learning rate per variant from a
grid, 5 seeds, variants trained in lockstep so every paired time ratio sees the same machine.

Seed 003 trained GPT-2 small once per variant and read 0.5–2.5% time differences between LayerNorm and RMSNorm.
The questions here, each answered from a 95% t-interval over seeds (paired: same seed, same initial weights of the
shared tensors, same batches):

- Does normfold's RMSNorm, and CBWC + normfold RMSNorm (a LayerNorm model trained as an RMSNorm model), train in
  at most nn.LayerNorm's time, at the experiment's width and at width 384?
- Is CBWC's loss LayerNorm's? It is the same function of the same weights, so the runs may differ only by
  rounding, but training amplifies rounding: two float32 runs of one LayerNorm model whose weights differ in the
  last bit part by ~1e-2 in loss within a few hundred steps at these learning rates. So the check is made against
  rounding itself: on one seed both are also trained in float64, where a rounding gap must shrink by orders of
  magnitude and a bug would not, and the float32 CBWC gap is compared with how far float32 rounding moves
  LayerNorm's own run (LayerNorm float32 against LayerNorm float64).
- What does RMSNorm cost or gain in validation loss against LayerNorm?

Design. Three phases, each seed in a fresh process (its own memory layout, one intra-op thread):
1. grid: each distinct function (LayerNorm, RMSNorm) at every learning rate of ``GRID``, on ``GRID_SEEDS`` seeds
   that the comparison does not use; each variant takes its function's best rate (lowest mean validation loss).
   Implementations of one function (nn.LayerNorm and CBWC; torch's and normfold's RMSNorm) share the pick.
2. comparison: every variant at its rate, ``SEEDS`` seeds, ≥ 10 training tokens per parameter. Within a seed the
   variants take their optimizer steps in lockstep, in rotating order; the time of a run is the CPU time of its
   steps after the first (``time.thread_time``: time spent descheduled by other jobs drops out).
3. width: the same steps at width 384 (timing only, ``WIDE_STEPS`` steps per seed, the same lockstep).
4. exactness: LayerNorm and CBWC in float64 on the first comparison seed, the whole run (untimed; the two run
   in parallel processes), next to that seed's float32 runs.
A variant's steps are those of ``normfold train`` with its config (same model, batches and schedule): the
comparison calls the trainer's own step, and ``tests/train/test_experiments.py`` checks a run against ``train()``.

    python experiments/norm_comparison.py            # full: ≤ 60 min on 2 cores
    python experiments/norm_comparison.py --grid-from experiments/results/norm_comparison_grid.csv
                                                     # phase 1 read from an earlier run's grid (~10 min less)
    python experiments/norm_comparison.py --quick    # tiny model, few steps (≤ 2 min)
    python experiments/norm_comparison.py --width-only --device cuda --widths 384,1024x32x512 --precision bf16,fp32
                                                     # phase 3 alone on a GPU (what benchmarks/gpu_train.sh runs)
"""
from __future__ import annotations

import argparse
import csv
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
from normfold.train.cbwc import CenteringIndex, project_centering_
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
WIDE_STEPS = 24  # timed steps per variant and seed at width 384 (after one untimed): 8 gave a ±1% interval
CUDA_WIDE_STEPS = 20  # on a GPU a step takes milliseconds (1024 wide, fp32, 16k tokens: ~0.1 s by its FLOPs)
CUDA_UNTIMED = 3  # and its first steps compile the Triton kernels, pick cuBLAS algorithms and grow the allocator
QUICK = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=8, max_steps=30, warmup_steps=3,
             eval_interval=15, eval_iters=4)
QUICK_GRID, QUICK_GRID_SEEDS, QUICK_SEEDS, QUICK_WIDE, QUICK_WIDE_STEPS = (3e-3, 6e-3), (100,), (0, 1), \
    dict(n_embd=64, n_head=2), 2
EXACT = ("layernorm", "cbwc_rmsnorm")  # phase 4: the pair that must compute the same function, also in float64


@dataclass
class Member:
    """One variant's training inside a lockstep: model, optimizer, batch generator and what it measured."""

    name: str
    config: object
    model: torch.nn.Module = None
    optimizer: torch.optim.Optimizer = None
    generator: torch.Generator = None
    index: CenteringIndex = None  # the CBWC tensors the step centers, found once as the trainer does
    train_losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    diverged: bool = False


def lockstep(specs: list[tuple[str, dict]], steps: int | None = None, evaluate: bool = True,
             device: str = "cpu", untimed: int = 1) -> list[dict]:
    """Train every ``(name, config values)`` of ``specs`` one optimizer step at a time, in rotating order.

    Each member is what ``normfold.train.train`` would run for its config: the same model (``build_model``, CBWC
    by projection), AdamW, schedule (``lr_at``), batches (generator seeded ``seed · 100003``), step
    (``step_with_norm``) and validation batches. ``steps`` (default the config's) may stop early (timing only).
    The first ``untimed`` steps pay for allocation and warm-up and are not timed. On a CUDA ``device`` each step
    is timed between two synchronizations (``wall_s``; the host thread's CPU time says nothing of the GPU's).
    """
    torch.set_num_threads(1)
    configs = [(name, resolve_config(progress=False, save_checkpoint=False, device=device, **values))
               for name, values in specs]
    first = configs[0][1]
    splits = TokenSplits.from_documents(load_documents(first.data), first.model.block_size, first.val_fraction)
    cuda = torch.device(device).type == "cuda"
    members = []
    for name, config in configs:
        model = build_model(config, device)
        project_centering_(model)
        members.append(Member(name, config, model, make_optimizer(model, config),
                              torch.Generator().manual_seed(config.seed * 100_003), CenteringIndex(model)))
    total = first.max_steps if steps is None else steps
    for step in range(total):
        for m in rotated(members, step):
            if m.diverged:
                continue
            for group in m.optimizer.param_groups:
                group["lr"] = lr_at(step, m.config)
            batches = [tuple(t.to(device) for t in splits.batch("train", m.config.batch_size, m.generator))
                       for _ in range(m.config.grad_accum_steps)]
            if cuda:  # the previous member's kernels must not run on this member's clock
                torch.cuda.synchronize()
            cpu, wall = time.thread_time(), time.perf_counter()
            loss = step_with_norm(m.model, m.optimizer, batches, m.config, m.index)[0].item()
            if step >= untimed:  # the first steps pay for allocation and warm-up, as in the trainer
                m.cpu_s += time.thread_time() - cpu
                m.wall_s += time.perf_counter() - wall
            m.train_losses.append(loss)
            m.diverged = not math.isfinite(loss)
            if evaluate and ((step + 1) % m.config.eval_interval == 0 or step == total - 1):
                val = float("nan") if m.diverged else estimate_val_loss(m.model, splits, m.config,
                                                                         torch.device(device))
                m.val_losses.append((step + 1, val))
    return [dict(name=m.name, seed=m.config.seed, lr=m.config.lr, steps=len(m.train_losses),
                 tokens=len(m.train_losses) * m.config.batch_size * m.config.model.block_size,
                 parameters=m.model.num_parameters(), cpu_s=m.cpu_s, wall_s=m.wall_s, diverged=m.diverged,
                 train_losses=m.train_losses, val_losses=m.val_losses,
                 final_val_loss=m.val_losses[-1][1] if m.val_losses else None) for m in members]


def _run_all(jobs: list[tuple], fresh_processes: bool, workers: int = 1) -> list[list[dict]]:
    """``lockstep(*job)`` for every job: each in a fresh process (its own memory layout), or in this one.
    ``workers`` > 1 runs that many at once: only for untimed jobs, timing must not share the cores."""
    if not fresh_processes:
        return [lockstep(*job) for job in jobs]
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            return [future.result() for future in [pool.submit(lockstep, *job) for job in jobs]]
    results = []
    for job in jobs:  # one at a time: the lockstep's timing must not share the cores with another seed
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results.append(pool.submit(lockstep, *job).result())
    return results


def _read_grid(path: Path, functions: dict, grid: tuple | None, grid_seeds: tuple | None, parser) -> list[dict]:
    """Phase 1's rows from an earlier run's grid CSV; it must hold every function × rate × grid seed of this run
    (``grid`` / ``grid_seeds`` None: of the file's own rates and seeds)."""
    try:
        with open(path, newline="") as f:
            rows = [dict(phase=r["phase"], variant=r["variant"], lr=float(r["lr"]), seed=int(r["seed"]),
                         final_val_loss=float(r["final_val_loss"]) if r["final_val_loss"] else None,
                         diverged=r["diverged"] == "True") for r in csv.DictReader(f)]
    except (OSError, KeyError, ValueError) as exc:
        parser.error(f"--grid-from {path}: not a readable grid CSV ({type(exc).__name__}: {exc})")
    have = {(r["variant"], r["lr"], r["seed"]) for r in rows}
    grid = grid or sorted({lr for fn, lr, _ in have if fn in functions})
    grid_seeds = grid_seeds or sorted({seed for fn, _, seed in have if fn in functions})
    if not grid:
        parser.error(f"--grid-from {path}: no rows for the functions {sorted(functions)}")
    missing = [(fn, lr, seed) for fn in functions for lr in grid for seed in grid_seeds if (fn, lr, seed) not in have]
    if missing:
        parser.error(f"--grid-from {path}: no rows for (function, lr, seed) {missing[:4]}"
                     f"{' …' if len(missing) > 4 else ''}; it must come from a run with this grid and these seeds")
    return [r for r in rows if r["variant"] in functions and r["lr"] in grid and r["seed"] in grid_seeds]


def _values(setup: dict, norm: str, lr: float, seed: int) -> dict:
    return dict(setup, norm=norm, lr=lr, min_lr=lr / 10, seed=seed)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and budget (smoke run, in this process)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    parser.add_argument("--seeds", type=int, default=None, help="use the first N comparison seeds")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {NORMS}")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    parser.add_argument("--grid-from", type=Path, default=None,
                        help="read phase 1's grid from this CSV (an earlier run's *_grid.csv) instead of running it")
    parser.add_argument("--width-only", action="store_true",
                        help="phase 3 alone, at --widths on --device and --precision (rates from --grid-from, default "
                             "the committed grid); writes <name>_width_<device>.md/.csv")
    parser.add_argument("--widths", default=None,
                        help=f"with --width-only: comma-separated widths W (default {WIDE['n_embd']}; head size 64), "
                             "each optionally WxBxT: at batch B × T tokens (default the experiment's)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="with --width-only: where to train")
    parser.add_argument("--precision", default="fp32",
                        help="with --width-only: fp32, bf16 (autocast), or both comma-separated")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="with --width-only: start no width × precision after the first once this many "
                             "seconds have passed (the skipped ones are listed in the report)")
    parser.add_argument("--wide-steps", type=int, default=None,
                        help=f"timed steps per variant and seed at each width (default {WIDE_STEPS} on the CPU, "
                             f"{CUDA_WIDE_STEPS} on CUDA)")
    args = parser.parse_args(argv)
    if not args.width_only and (args.widths or args.device != "cpu" or args.precision != "fp32"
                                or args.budget_s is not None):
        parser.error("--widths, --device, --precision and --budget-s go with --width-only (the full run is the CPU "
                     "experiment)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    widths, precisions = _width_phase_grid(args, parser)
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
    if args.wide_steps is not None:
        wide_steps = args.wide_steps
    elif args.device == "cuda":
        wide_steps = CUDA_WIDE_STEPS
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
    if args.width_only:  # timing only: the rates the committed comparison trained at, whatever grid made them
        args.grid_from = args.grid_from or RESULTS / "norm_comparison_grid.csv"
        grid_rows = _read_grid(args.grid_from, functions, None, None, parser)
        grid = tuple(sorted({r["lr"] for r in grid_rows}))
        grid_seeds = tuple(sorted({r["seed"] for r in grid_rows}))
    elif args.grid_from is not None:
        grid_rows = _read_grid(args.grid_from, functions, grid, grid_seeds, parser)
    else:
        grid_jobs = [([(f"{fn}@{lr:g}", _values(setup, rep, lr, seed)) for fn, rep in functions.items()
                       for lr in grid],) for seed in grid_seeds]
        grid_rows = [dict(phase="grid", variant=r["name"].split("@")[0], lr=r["lr"], seed=r["seed"],
                          final_val_loss=r["final_val_loss"], diverged=r["diverged"])
                     for rows in _run_all(grid_jobs, fresh) for r in rows]
    best = {}
    for fn in functions:
        score = {lr: _mean_or_inf([r["final_val_loss"] for r in grid_rows if r["variant"] == fn and r["lr"] == lr
                                   and not r["diverged"]], len(grid_seeds)) for lr in grid}
        best[fn] = min(grid, key=lambda lr: (score[lr], lr))
    print(f"[{clock}] grid: " + ", ".join(f"{fn} lr {lr:g}" for fn, lr in best.items()), flush=True)
    if args.width_only:
        _width_only(args, name, setup, variants, best, seeds, wide_steps, widths, precisions, fresh, clock)
        return

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

    # phase 4: the same-function pair in float64 on the first seed (untimed: both at once)
    exact_runs = []
    if all(v in variants for v in EXACT):
        jobs = [([(f"{v}@fp64", dict(_values(setup, v, best[FUNCTION[v]], seeds[0]), precision="fp64"))],)
                for v in EXACT]
        exact_runs = [rows[0] for rows in _run_all(jobs, fresh, workers=len(jobs))]
        print(f"[{clock}] float64 pair: trained", flush=True)

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
    curves += [dict(variant=r["name"], seed=r["seed"], step=i + 1, train_loss=loss, val_loss="")
               for r in exact_runs for i, loss in enumerate(r["train_losses"])]
    write_csv(args.out / f"{name}_curves.csv", curves)
    _report(args, name, setup, wide_setup, wide_steps, variants, grid, grid_seeds, best, grid_rows, runs, wide_runs,
            exact_runs, clock)


def _width_phase_grid(args, parser) -> tuple[list[dict], list[str]]:
    """--width-only's model shapes (``n_embd``, ``n_head`` and maybe ``batch_size``, ``block_size``) and
    precisions, checked before any work starts."""
    widths = []
    for entry in (args.widths or "").split(","):
        if not entry:
            continue
        try:
            numbers = [int(n) for n in entry.split("x")]
        except ValueError:
            numbers = []
        if len(numbers) not in (1, 3) or min(numbers) <= 0:
            parser.error(f"--widths: comma-separated W or WxBxT (positive integers), got {entry!r}")
        if numbers[0] < 64 or numbers[0] % 64:
            parser.error(f"--widths: widths are multiples of 64 (head size 64), got {numbers[0]}")
        shape = dict(n_embd=numbers[0], n_head=numbers[0] // 64)
        widths.append(shape if len(numbers) == 1 else dict(shape, batch_size=numbers[1], block_size=numbers[2]))
    precisions = [p for p in args.precision.split(",") if p]
    if not precisions or set(precisions) - {"fp32", "bf16"}:
        parser.error(f"--precision: fp32, bf16 or both comma-separated, got {args.precision!r}")
    return widths, precisions


def _width_only(args, name, setup, variants, best, seeds, wide_steps, widths, precisions, fresh, clock) -> None:
    """Phase 3 alone at every width × precision on ``args.device``: per-seed lockstep time ratios, their 95%
    t-intervals, a CSV and a report."""
    cuda = args.device == "cuda"
    clock_key, untimed = ("wall_s", CUDA_UNTIMED) if cuda else ("cpu_s", 1)
    wides = widths or [QUICK_WIDE if args.quick else WIDE]
    per_run, rows, sentences, skipped = [], [], [], []
    for precision in precisions:
        for wide in wides:
            wide_setup = dict(setup, **wide, precision=precision)
            if per_run and args.budget_s is not None and time.perf_counter() - clock.start > args.budget_s:
                skipped.append(f"{precision}, width {wide['n_embd']}, batch {wide_setup['batch_size']}×"
                               f"{wide_setup['block_size']}")
                continue
            jobs = [([(v, _values(wide_setup, v, best[FUNCTION[v]], seed)) for v in variants], wide_steps + untimed,
                     False, args.device, untimed) for seed in seeds]
            # CUDA runs share this process (one context, one caching allocator); CPU seeds each get a fresh one
            runs = [r for result in _run_all(jobs, fresh and not cuda) for r in result]
            width, batch = wide["n_embd"], f"{wide_setup['batch_size']}×{wide_setup['block_size']}"
            print(f"[{clock}] {precision}, width {width}, batch {batch}: timed", flush=True)
            per_run += [dict(phase="width", device=args.device, precision=precision, variant=r["name"],
                             seed=r["seed"], lr=r["lr"], width=width, batch_size=wide_setup["batch_size"],
                             block_size=wide_setup["block_size"], parameters=r["parameters"], steps=r["steps"],
                             tokens=r["tokens"], cpu_s=round(r["cpu_s"], 6), wall_s=round(r["wall_s"], 6),
                             diverged=r["diverged"]) for r in runs]
            for v in variants:
                ratio = _time_ratio(runs, v, clock_key)
                mine = [r[clock_key] / (r["steps"] - untimed) for r in runs if r["name"] == v]
                rows.append([precision, width, batch, v, f"{1e3 * sum(mine) / len(mine):.2f}",
                             ratio.text(3, signed=False) if v != BASE else "1 (base)"])
                if v != BASE:
                    sentences.append(f"{precision}, batch {batch}, " + _ratio_sentence(v, ratio, width))
    out = f"{name}_width_{args.device}"
    write_csv(args.out / f"{out}.csv", per_run)
    timing = ("wall time between two CUDA synchronizations" if cuda else
              "this thread's CPU time (`time.thread_time`), one thread" + (", a fresh process per seed" * fresh))
    text = "\n".join([
        f"# Norm comparison, width phase on {'CUDA' if cuda else 'the CPU'}", "",
        f"Phase 3 of `norm_comparison.py` alone: the comparison's {setup['n_layer']}-layer GPT "
        f"(head size {wides[0]['n_embd'] // wides[0]['n_head']}; the experiment's batch is "
        f"{setup['batch_size']} × {setup['block_size']} tokens), every variant at its function's rate "
        f"({', '.join(f'{fn} {lr:g}' for fn, lr in best.items())}). Per seed ({len(seeds)} seeds) the variants take "
        f"{wide_steps} timed optimizer steps each (after {untimed} untimed) in lockstep, in rotating order; a step's "
        f"time is {timing}. A ratio is a variant's time over nn.LayerNorm's in the same lockstep; the interval is "
        "the 95% t-interval over seeds."
        + (" bf16: the trainer's autocast (matmuls in bf16, norms and master weights in float32)."
           if "bf16" in precisions else ""), "",
        markdown_table(["precision", "width", "batch × tokens", "norm", "ms per step (mean of seeds)",
                        "time vs LN (95% CI)"], rows), "",
        "## What the intervals say", "",
        *[f"- {s}" for s in sentences], "",
        *([f"Not run (past the {args.budget_s:g} s budget): {'; '.join(skipped)}.", ""] if skipped else []),
        f"Setup: `{json.dumps(setup)}` with the widths above; AdamW (β = 0.9, 0.95; weight decay 0.1 on matrices), "
        "clipping at 1.0.",
        provenance(f"no shape started after {args.budget_s:g} s (--budget-s)" if args.budget_s is not None else
                   "none set (--budget-s)", corpus_line(setup["block_size"]), clock),
        "", f"Raw data: `{out}.csv` (per run; `{clock_key}` is the time compared).", "",
    ])
    (args.out / f"{out}.md").write_text(text)
    print(text)


def _mean_or_inf(values: list[float], expected: int) -> float:
    """Mean of the validation losses, +inf when a seed diverged (a rate that diverges once is not picked)."""
    return sum(values) / len(values) if len(values) == expected else math.inf


def _time_ratio(runs: list[dict], variant: str, clock: str = "cpu_s"):
    """Time of ``variant`` / LayerNorm's, per seed (same lockstep), as a mean with its 95% t-interval; ``clock``
    ``cpu_s`` (this thread's CPU time) or ``wall_s`` (synchronized wall time: on a GPU)."""
    base = {r["seed"]: r[clock] for r in runs if r["name"] == BASE}
    return mean_ci([r[clock] / base[r["seed"]] for r in runs if r["name"] == variant and r["seed"] in base])


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
            exact_runs, clock) -> None:
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
    gaps = _rounding_gaps(runs, exact_runs) if exact_runs else None
    sentences = []
    for v in variants:
        if v == BASE:
            continue
        sentences.append(_ratio_sentence(v, ratios[v], width))
        sentences.append(_ratio_sentence(v, wide_ratios[v], wide))
        if FUNCTION[v] == FUNCTION[BASE]:  # the same function: the question is equality, not which is lower
            sentences.append(_same_function_sentence(v, paired_ci(val[v], val[BASE]), runs, gaps))
        else:
            sentences.append(compare(v, BASE, paired_ci(val[v], val[BASE]), "validation loss"))
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
        *[f"- {s}" for s in sentences], "",
        *(_exactness_section(gaps, len(exact_runs[0]["train_losses"]), name) if gaps else []),
        f"## Learning-rate grid (seed{'s' * (len(grid_seeds) > 1)} {', '.join(map(str, grid_seeds))}, not used above)", "",
        "Mean final validation loss per rate (∞: a seed diverged). Variants computing the same function share the "
        "pick: nn.LayerNorm and CBWC + normfold RMSNorm (LayerNorm's function), torch's and normfold's RMSNorm.", "",
        grid_table, "",
        f"Setup: `{json.dumps(setup)}`; AdamW (β = 0.9, 0.95; weight decay 0.1 on matrices), warmup then cosine "
        "decay to lr/10, clipping at 1.0.",
        provenance(f"≤ 60 min on 2 cores (full run)", corpus_line(setup["block_size"]), clock), "",
        *([f"Grid: read from `{args.grid_from}` (`--grid-from`), the grid phase of an earlier run with the same "
           "setup, rates and seeds; not rerun here.", ""] if args.grid_from is not None else []),
        f"Curves: `{name}_loss.png` (train loss, mean over seeds; validation points); `{name}_time.png` (time "
        f"ratios with their intervals)" + (f"; `{name}_exactness.png` (the rounding gaps per step)" if gaps else "")
        + f". Raw data: `{name}.csv` (per run), `{name}_grid.csv`, `{name}_curves.csv` (float64 runs: `@fp64`).",
        "",
    ])
    (args.out / f"{name}.md").write_text(text)
    _plots(args.out, name, variants, runs, ratios, wide_ratios, width, wide, gaps)
    print(text)


def _grid_cell(grid_rows, fn, lr, expected) -> str:
    score = _mean_or_inf([r["final_val_loss"] for r in grid_rows if r["variant"] == fn and r["lr"] == lr
                          and not r["diverged"]], expected)
    return "∞" if math.isinf(score) else f"{score:.4f}"


# When CBWC's loss counts as LayerNorm's (the same function of the same weights, trained alike): its gap to
# LayerNorm must be rounding. Two properties of a rounding gap, each with a wide margin:
SHRINK = 1e-3  # in float64 it is ≥ 1000× smaller than in float32 (the rounding unit is 2^29× smaller); a bug's is not
DRIFT = 2.0  # in float32 it is at most twice what rounding does to LayerNorm's own run (LN float32 vs float64)
FLOOR64 = 1e-10  # a float64 gap below this counts as shrunk whatever the float32 gap (the fp64 tests' bound)


def _max_gap(losses: list[float], reference: list[float]) -> float:
    """The largest |loss − reference| / |reference| over the paired steps."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))


def _loss_gaps(runs: list[dict], variant: str) -> list[float]:
    """The largest relative training-loss gap of ``variant`` to LayerNorm, per seed."""
    base = {r["seed"]: r["train_losses"] for r in runs if r["name"] == BASE}
    return [_max_gap(r["train_losses"], base[r["seed"]]) for r in runs if r["name"] == variant and r["seed"] in base]


def _rounding_gaps(runs: list[dict], exact_runs: list[dict]) -> dict:
    """The exactness phase's numbers: on its seed, CBWC − LN in float32 and in float64, LN float32 − LN float64
    (per step and largest), the largest float32 gap over every seed, and the verdict."""
    seed = exact_runs[0]["seed"]
    fp32 = {r["name"]: r["train_losses"] for r in runs if r["seed"] == seed}
    fp64 = {r["name"].split("@")[0]: r["train_losses"] for r in exact_runs}
    cbwc, ln = EXACT[1], EXACT[0]
    per_step = {"CBWC − LN, float32": [abs(a - b) / abs(b) for a, b in zip(fp32[cbwc], fp32[ln])],
                "CBWC − LN, float64": [abs(a - b) / abs(b) for a, b in zip(fp64[cbwc], fp64[ln])],
                "LN float32 − LN float64 (rounding alone)": [abs(a - b) / abs(b) for a, b in zip(fp32[ln], fp64[ln])]}
    gap32, gap64, drift = (max(v) for v in per_step.values())
    shrinks = gap64 <= max(SHRINK * gap32, FLOOR64)
    within = gap32 <= DRIFT * drift
    return dict(seed=seed, per_step=per_step, gap32=gap32, gap64=gap64, drift=drift, shrinks=shrinks, within=within,
                equal=shrinks and within, all_seeds=max(_loss_gaps(runs, cbwc)))


def _same_function_sentence(variant: str, diff, runs: list[dict], gaps: dict | None) -> str:
    """Validation-loss difference of a variant that computes LayerNorm's function, with the rounding verdict."""
    if gaps is None:
        verdict = "equality not judged (no float64 pair: the exactness phase needs layernorm and cbwc_rmsnorm)"
    elif gaps["equal"]:
        verdict = "equal to rounding (see the exactness section)"
    else:
        verdict = "NOT equal: the gap is not rounding's (see the exactness section; a bug to chase)"
    return (f"validation loss {variant} − layernorm = {diff.mean:+.1e} [{diff.low:+.1e}, {diff.high:+.1e}] "
            f"(95% CI, {diff.n} paired seeds; the same function of the same weights): {verdict}")


def _exactness_section(gaps: dict, steps: int, name: str) -> list[str]:
    """The report's paragraph on CBWC's equality to LayerNorm, written from the gaps."""
    share = f"{gaps['gap64'] / gaps['gap32']:.0e} of the float32 one" if gaps["gap32"] else "that (float32: 0)"
    shrink = (f"the float64 gap is {share}: it shrinks with the "
              f"rounding unit, as a rounding gap does (needed: ≤ {SHRINK:g}×, or ≤ {FLOOR64:g})" if gaps["shrinks"] else
              f"the float64 gap is not ≤ {SHRINK:g}× the float32 one (nor ≤ {FLOOR64:g}): it does not shrink with the "
              "rounding unit, so it is not rounding")
    within = (f"float32 rounding alone moves LayerNorm's run by {gaps['drift']:.1e} (LayerNorm float32 against "
              f"float64), and CBWC's float32 gap is within {DRIFT:g}× that" if gaps["within"] else
              f"float32 rounding alone moves LayerNorm's run by {gaps['drift']:.1e} (LayerNorm float32 against "
              f"float64): CBWC's float32 gap is more than {DRIFT:g}× that")
    return ["## Is CBWC's loss LayerNorm's?", "",
            f"{'Yes, to rounding' if gaps['equal'] else 'NOT shown'}. Seed {gaps['seed']}, largest relative gap of "
            f"the training loss over {steps:,} steps: {gaps['gap32']:.1e} in float32, {gaps['gap64']:.1e} in "
            f"float64. {shrink[0].upper() + shrink[1:]}; {within}. Training amplifies rounding: a gap of one ulp "
            "grows by orders of magnitude over the run in either precision (see the plot), so the float32 gap is "
            "judged against rounding's own, not against a fixed bound. Over all seeds the float32 gap is at most "
            f"{gaps['all_seeds']:.1e}. Plot: `{name}_exactness.png`.", ""]


def _plots(out: Path, name: str, variants, runs, ratios, wide_ratios, width: int, wide: int, gaps: dict | None) -> None:
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

    if gaps:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, values in gaps["per_step"].items():
            ax.plot(range(1, len(values) + 1), [max(v, 1e-17) for v in values], label=label, linewidth=0.8)
        ax.set_yscale("log")
        ax.set(xlabel="step", ylabel="relative training-loss gap", title=f"CBWC vs LayerNorm, seed {gaps['seed']}: "
               "rounding grows with the steps, in float32 and in float64")
        save_figure(fig, (ax,), out / f"{name}_exactness.png")


if __name__ == "__main__":
    main()
