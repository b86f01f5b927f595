"""Seed 002's claim: with dropout, does CBWC + RMSNorm land between LayerNorm and RMSNorm?

Without dropout CBWC trains exactly the LayerNorm model (``cbwc_equivalence.md``). Dropout after the
centered output projections zeroes and rescales entries, so the stream a norm reads is no longer
zero-mean and CBWC's RMSNorm stops being LayerNorm (the fold engine therefore refuses to center a model
with dropout: ``_common.cbwc_model`` proves CBWC on the dropout-free twin and then switches dropout on,
which is seed 002's setting). This trains the experiment GPT of
``normfold.train`` with dropout 0.1 as ``layernorm``, ``cbwc_rmsnorm`` and ``rmsnorm`` (normfold's),
the same initial weights and batches per seed, and answers "between?" from paired 95% intervals.

    python experiments/dropout.py            # 3 variants × 6 seeds, 2 × 64 GPT, 400 steps (~20 min on 2 busy cores)
    python experiments/dropout.py --quick    # a smoke run (seconds)
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from _common import RESULTS, Stopwatch, cbwc_model, corpus_line, markdown_table, provenance, pyplot, run, save_figure, write_csv
from stats import between, compare, mean_ci, paired_ci

VARIANTS = ("layernorm", "cbwc_rmsnorm", "rmsnorm")
FULL = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16, max_steps=400, warmup_steps=20,
            lr=3e-3, min_lr=3e-4, eval_interval=100, eval_iters=16, dropout=0.1)
QUICK = dict(FULL, n_embd=16, block_size=32, batch_size=4, max_steps=6, warmup_steps=2, eval_interval=3, eval_iters=2)
TAIL = 0.1  # the train loss reported is the mean over the last 10% of steps (dropout on)


def collect(setup: dict, seeds: int, clock: Stopwatch) -> list[dict]:
    """One run per (seed, variant), variants alternating inside a seed."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="normfold_dropout_") as scratch:
        for seed in range(seeds):
            for variant in VARIANTS:
                build = cbwc_model if variant == "cbwc_rmsnorm" else None
                s = run(Path(scratch) / f"{variant}_s{seed}", build, norm=variant, seed=seed, **setup)
                tail = s["train_losses"][-max(1, int(len(s["train_losses"]) * TAIL)):]
                rows.append(dict(variant=variant, seed=seed, parameters=s["num_parameters"], steps=s["steps"],
                                 tokens=s["tokens"], final_val_loss=s["final_val_loss"],
                                 tail_train_loss=round(statistics.fmean(tail), 6), diverged=s["diverged"],
                                 train_time_s=round(s["train_time_s"], 2)))
                print(f"[{clock}] {variant} seed {seed}: val {s['final_val_loss']:.4f}", flush=True)
    return rows


def by_seed(rows: list[dict], variant: str, key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in rows if r["variant"] == variant and not r["diverged"]}


def conclusions(rows: list[dict], key: str, quantity: str) -> list[str]:
    """Pairwise sentences and the "between?" answer for one metric, all from the intervals. The outer pair is
    ordered by its observed means, so "between" asks LN ≤ CBWC ≤ RMS or RMS ≤ CBWC ≤ LN, whichever applies."""
    ln, cbwc, rms = (by_seed(rows, v, key) for v in VARIANTS)
    sentences = [compare("cbwc_rmsnorm", "layernorm", paired_ci(cbwc, ln), quantity),
                 compare("rmsnorm", "layernorm", paired_ci(rms, ln), quantity),
                 compare("rmsnorm", "cbwc_rmsnorm", paired_ci(rms, cbwc), quantity)]
    low, high = (("layernorm", ln), ("rmsnorm", rms))
    if statistics.fmean(rms.values()) < statistics.fmean(ln.values()):
        low, high = high, low
    sentences.append(f"{quantity}: " + between("cbwc_rmsnorm", low[0], high[0], paired_ci(cbwc, low[1]),
                                               paired_ci(high[1], cbwc)))
    return sentences


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model, a few steps, 2 seeds (smoke run)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default 6; quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: the machine is shared)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = args.seeds or (2 if args.quick else 6)
    setup = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        setup.update(max_steps=args.steps, warmup_steps=min(setup["warmup_steps"], args.steps // 2),
                     eval_interval=max(1, min(setup["eval_interval"], args.steps)))
    if seeds < 2:
        parser.error(f"paired intervals need at least 2 seeds, got {seeds}")
    clock = Stopwatch()
    rows = collect(setup, seeds, clock)
    name = "dropout_quick" if args.quick else "dropout"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows)
    table = [[v, f"{next(r['parameters'] for r in rows if r['variant'] == v):,}",
              mean_ci(list(by_seed(rows, v, "final_val_loss").values())).text(signed=False),
              mean_ci(list(by_seed(rows, v, "tail_train_loss").values())).text(signed=False),
              sum(r["diverged"] for r in rows if r["variant"] == v)] for v in VARIANTS]
    val = conclusions(rows, "final_val_loss", "validation loss")
    tail = conclusions(rows, "tail_train_loss", "train loss (last 10% of steps, dropout on)")
    budget = (f"{len(VARIANTS)} variants × {seeds} seeds × {setup['max_steps']} steps "
              f"({rows[0]['tokens']:,} tokens per run, {rows[0]['tokens'] / rows[0]['parameters']:.1f} per parameter)")
    text = "\n".join([
        f"# Dropout 0.1: LayerNorm vs CBWC + RMSNorm vs RMSNorm ({'quick' if args.quick else 'full'} run)", "",
        "Seed 002 says that with dropout CBWC lands between LayerNorm and RMSNorm. Same GPT, initial weights and "
        "batches per seed; validation loss (nats/byte, dropout off) after the last step on fixed batches; mean "
        "and 95% t-interval over seeds.", "",
        markdown_table(["variant", "params", "val loss [95% CI]", "train loss, last 10% [95% CI]", "diverged"],
                       table), "",
        "## Conclusions (paired by seed, from the 95% intervals)", "",
        *[f"- {s}" for s in val + tail], "",
        f"Setup: `{json.dumps(setup)}`.", f"Plot: `{name}.png`. Raw data: `{name}.csv` (one row per run).", "",
        provenance(budget, corpus_line(setup["block_size"]), clock), ""])
    (args.out / f"{name}.md").write_text(text)
    plot(args.out / f"{name}.png", rows)
    print(text)


def plot(path: Path, rows: list[dict]) -> None:
    """Left: each seed's validation loss per variant (lines join a seed). Right: paired differences, 95% CIs."""
    plt = pyplot()
    fig, (ax_runs, ax_diff) = plt.subplots(1, 2, figsize=(11, 4))
    seeds = sorted({r["seed"] for r in rows})
    for seed in seeds:
        ys = [by_seed(rows, v, "final_val_loss").get(seed, float("nan")) for v in VARIANTS]
        ax_runs.plot(range(len(VARIANTS)), ys, marker="o", alpha=0.6)
    ax_runs.set_xticks(range(len(VARIANTS)), VARIANTS)
    ax_runs.set(ylabel="validation loss (nats/byte)", title="per seed (lines join a seed)")
    pairs = [("cbwc_rmsnorm", "layernorm"), ("rmsnorm", "layernorm"), ("rmsnorm", "cbwc_rmsnorm")]
    cis = [paired_ci(by_seed(rows, a, "final_val_loss"), by_seed(rows, b, "final_val_loss")) for a, b in pairs]
    ax_diff.errorbar(range(len(pairs)), [c.mean for c in cis], capsize=5, fmt="o",
                     yerr=[[c.mean - c.low for c in cis], [c.high - c.mean for c in cis]])
    ax_diff.axhline(0, color="gray", lw=1)
    ax_diff.set_xticks(range(len(pairs)), [f"{a}\n− {b}" for a, b in pairs], fontsize=8)
    ax_diff.set(ylabel="Δ validation loss", title="paired differences, 95% CI")
    save_figure(fig, (ax_runs, ax_diff), path)


if __name__ == "__main__":
    main()
