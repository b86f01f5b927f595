"""Pre-LN vs Post-LN, with and without learning-rate warmup, across depth (seeds 001 / 004).

Post-LN puts the norm after the residual add, so every layer's gradient passes through all the
norms above it; without warmup, early large Adam steps can blow it up, more so the deeper the
model. Pre-LN keeps an identity residual path and is expected to train without warmup. Each cell
is one LayerNorm GPT run at an aggressive peak learning rate; a run "diverges" when its loss
becomes non-finite, and "fails" when its final validation loss is no better than a unigram model.

    python experiments/placement.py           # full grid (≤ 30 min on 2 cores)
    python experiments/placement.py --quick   # small grid (≤ 3 min)
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from _common import (RESULTS, STALL_MARGIN, Stopwatch, command_line, machine, markdown_table, outcome, pyplot, run,
                     unigram_loss, write_csv)

from normfold.train import PLACEMENTS

# lr 1e-2 without gradient clipping: aggressive enough that placement and warmup matter at this
# scale (probed: at depth 12, Post-LN stalls at the unigram loss with or without warmup, Pre-LN trains)
FULL = dict(n_head=4, n_embd=64, block_size=64, batch_size=16, max_steps=300, lr=1e-2, min_lr=1e-3,
            eval_interval=50, eval_iters=8, grad_clip=0.0)
FULL_GRID = dict(depths=(2, 6, 12), warmups=(0, 60))
QUICK = dict(n_head=2, n_embd=32, block_size=32, batch_size=8, max_steps=60, lr=1e-2, min_lr=1e-3,
             eval_interval=30, eval_iters=4, grad_clip=0.0)
QUICK_GRID = dict(depths=(2, 8), warmups=(0, 10))

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small grid, tiny model, few steps")
    parser.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    parser.add_argument("--lr", type=float, default=None, help="override the peak learning rate")
    parser.add_argument("--placements", default="pre,post", help=f"comma-separated subset of {PLACEMENTS}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    placements = [p for p in args.placements.split(",") if p]
    if sorted(set(placements) - set(PLACEMENTS)):
        parser.error(f"placements must be a subset of {PLACEMENTS}, got {placements}")
    setup = dict(QUICK if args.quick else FULL)
    grid = QUICK_GRID if args.quick else FULL_GRID
    if args.steps is not None:
        setup["max_steps"] = args.steps
        setup["eval_interval"] = max(1, min(setup["eval_interval"], args.steps))
    if args.lr is not None:
        setup["lr"], setup["min_lr"] = args.lr, args.lr / 10
    warmups = sorted({min(w, setup["max_steps"] // 2) for w in grid["warmups"]})
    name = "placement_quick" if args.quick else "placement"
    args.out.mkdir(parents=True, exist_ok=True)
    clock = Stopwatch()
    failed_above = unigram_loss()

    results, curves = [], []
    with tempfile.TemporaryDirectory(prefix="normfold_placement_") as scratch:
        for depth in grid["depths"]:
            for warmup in warmups:
                for placement in placements:  # alternate the contenders inside each cell
                    s = run(Path(scratch) / f"{placement}_d{depth}_w{warmup}", placement=placement, n_layer=depth,
                            warmup_steps=warmup, seed=args.seed, **setup)
                    first_bad = next((i + 1 for i, x in enumerate(s["train_losses"]) if not math.isfinite(x)), None)
                    val = s["final_val_loss"]
                    result = outcome(s, failed_above)
                    results.append(dict(placement=placement, depth=depth, warmup_steps=warmup, steps=s["steps"],
                                        final_train_loss=s["final_train_loss"], final_val_loss=val,
                                        diverged=s["diverged"], diverged_at_step=first_bad or "", outcome=result,
                                        tokens_per_s=round(s["tokens_per_s"] or float("nan"), 1)))
                    curves += [dict(placement=placement, depth=depth, warmup_steps=warmup, step=i + 1, train_loss=x)
                               for i, x in enumerate(s["train_losses"])]
                    print(f"[{clock}] {placement} depth {depth} warmup {warmup}: {result}, val {val}", flush=True)
    write_csv(args.out / f"{name}.csv", results)
    write_csv(args.out / f"{name}_curves.csv", curves)
    _report(args, setup, grid, warmups, placements, results, curves, name, clock, failed_above)


def _cell(r: dict) -> str:
    if r["outcome"] == "diverged":
        return f"diverged (step {r['diverged_at_step']})"
    text = f"{r['final_val_loss']:.3f}"
    return text + " (failed)" if r["outcome"] == "failed" else text


def _report(args, setup, grid, warmups, placements, results, curves, name, clock, failed_above) -> None:
    header = ["depth"] + [f"{p}, warmup {w}" for w in warmups for p in placements]
    rows = []
    for depth in grid["depths"]:
        row = [depth]
        for w in warmups:
            for p in placements:
                r = next(r for r in results if (r["placement"], r["depth"], r["warmup_steps"]) == (p, depth, w))
                row.append(_cell(r))
        rows.append(row)
    text = f"""# Pre-LN vs Post-LN × warmup × depth ({'quick' if args.quick else 'full'} run)

Final validation loss (nats/byte, {setup['eval_iters']} fixed batches) of a LayerNorm GPT after
{setup['max_steps']} steps at peak learning rate {setup['lr']:g} (cosine decay to {setup['min_lr']:g}),
seed {args.seed}, one run per cell. "diverged": the loss became non-finite (the run stops);
"failed": final validation loss ≥ {failed_above - STALL_MARGIN:.3f}, within {STALL_MARGIN} of the entropy of the\nbyte frequencies ({failed_above:.3f}): the model learned next to nothing from the context.

{markdown_table(header, rows)}

Setup: `{json.dumps(setup)}`, depths {list(grid['depths'])}, warmup steps {warmups}.
Command: `{command_line()}` (wall time {clock}).
Machine: {machine()}. Other engineers' jobs shared this machine during the run (timings noisy;
losses are unaffected). One seed per cell: differences of a few hundredths are inside seed noise
(see `norm_comparison.md` for the seed-to-seed spread).

Curves: `{name}_loss.png` (training loss per cell). Raw data: `{name}.csv`, `{name}_curves.csv`.
"""
    (args.out / f"{name}.md").write_text(text)
    _plot(args.out, name, grid, warmups, placements, curves)
    print(text)


def _plot(out: Path, name: str, grid, warmups, placements, curves) -> None:
    plt = pyplot()
    depths = list(grid["depths"])
    fig, axes = plt.subplots(1, len(depths), figsize=(5 * len(depths), 4), squeeze=False, sharey=True)
    styles = {0: "--"}
    for ax, depth in zip(axes[0], depths):
        for p in placements:
            for w in warmups:
                points = [(c["step"], c["train_loss"]) for c in curves
                          if (c["placement"], c["depth"], c["warmup_steps"]) == (p, depth, w)]
                steps = [s for s, _ in points]
                losses = [min(x, 10.0) if math.isfinite(x) else 10.0 for _, x in points]  # clip blow-ups for display
                ax.plot(steps, losses, styles.get(w, "-"), label=f"{p}-LN, warmup {w}")
        ax.set(title=f"depth {depth}", xlabel="step", ylim=(1.0, 6.0))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("train loss (nats/byte; non-finite drawn at the top)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}_loss.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
