"""Seed 003's comparison at CPU scale: the same GPT trained with each norm variant, 3 seeds.

Seed 003 trained GPT-2 small once per variant (hand-rolled vs PyTorch LayerNorm / RMSNorm) and
found built-in vs hand-rolled mattered (~10% time) far more than LN vs RMS (0.5–2.5%). Here every
variant sees the same token budget, initial weights (per seed) and batches; runs alternate between
variants so machine noise spreads evenly. Reports training time, tokens/s and validation loss as
mean ± std over seeds, next to LayerNorm.

    python experiments/norm_comparison.py            # full: ~1M-parameter GPT, 3 seeds (≤ 30 min, 2 cores)
    python experiments/norm_comparison.py --quick    # tiny model, few steps (≤ 3 min)
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import (RESULTS, Stopwatch, command_line, corpus_line, machine, markdown_table, mean_std, pyplot, run,
                     write_csv)
from stats import compare, mean_ci, paired_ci

from normfold.train import NORMS

# ~1.05M parameters (4 × 12 · 144² in the blocks + 384 · 144 embeddings): inside the 1–5M budget
FULL = dict(n_layer=4, n_head=4, n_embd=144, block_size=128, batch_size=16, max_steps=200, warmup_steps=20,
            lr=2e-3, min_lr=2e-4, eval_interval=50, eval_iters=8)
QUICK = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, batch_size=8, max_steps=30, warmup_steps=3,
             lr=3e-3, min_lr=3e-4, eval_interval=15, eval_iters=4)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and budget (smoke run)")
    parser.add_argument("--steps", type=int, default=None, help="override the number of optimizer steps")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(NORMS), help=f"comma-separated subset of {NORMS}")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(variants) - set(NORMS))
    if bad:
        parser.error(f"unknown variants {bad}; choose from {NORMS}")
    setup = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        setup["max_steps"] = args.steps
        setup["eval_interval"] = max(1, min(setup["eval_interval"], args.steps))
        setup["warmup_steps"] = min(setup["warmup_steps"], args.steps // 2)
    name = "norm_comparison_quick" if args.quick else "norm_comparison"
    args.out.mkdir(parents=True, exist_ok=True)
    clock = Stopwatch()

    runs, curves = [], []
    scratch = tempfile.TemporaryDirectory(prefix="normfold_norm_comparison_")  # per-run logs; the CSVs keep it all
    for seed in range(args.seeds):
        for variant in variants:  # alternate contenders inside one seed
            summary = run(Path(scratch.name) / f"{variant}_s{seed}", norm=variant, seed=seed, **setup)
            runs.append(dict(variant=variant, seed=seed, parameters=summary["num_parameters"], steps=summary["steps"],
                             tokens=summary["tokens"], train_time_s=round(summary["train_time_s"], 3),
                             tokens_per_s=round(summary["tokens_per_s"] or float("nan"), 1),
                             final_val_loss=summary["final_val_loss"], diverged=summary["diverged"]))
            curves += [dict(variant=variant, seed=seed, step=i + 1, train_loss=loss)
                       for i, loss in enumerate(summary["train_losses"])]
            curves += [dict(variant=variant, seed=seed, step=step, val_loss=loss) for step, loss in summary["val_losses"]]
            print(f"[{clock}] {variant} seed {seed}: val {summary['final_val_loss']:.4f}, "
                  f"{summary['tokens_per_s'] or float('nan'):,.0f} tok/s", flush=True)
    scratch.cleanup()
    write_csv(args.out / f"{name}.csv", runs)
    write_csv(args.out / f"{name}_curves.csv", [dict(variant=c["variant"], seed=c["seed"], step=c["step"],
                                                     train_loss=c.get("train_loss", ""), val_loss=c.get("val_loss", ""))
                                                for c in curves])
    _report(args, setup, variants, runs, curves, name, clock)


def _report(args, setup, variants, runs, curves, name, clock) -> None:
    stats = {}
    for v in variants:
        mine = [r for r in runs if r["variant"] == v]
        stats[v] = dict(time=mean_std([r["train_time_s"] for r in mine]), tps=mean_std([r["tokens_per_s"] for r in mine]),
                        val=mean_std([r["final_val_loss"] for r in mine if not r["diverged"]]),
                        diverged=sum(r["diverged"] for r in mine), params=mine[0]["parameters"])
    base = stats.get("layernorm")
    base_val = {r["seed"]: r["final_val_loss"] for r in runs if r["variant"] == "layernorm" and not r["diverged"]}
    rows = []
    for v in variants:
        s = stats[v]
        rel_time = f"{s['time'][0] / base['time'][0]:.2f}×" if base else "n/a"
        # paired by seed: same initial weights and batches, so seed-to-seed spread cancels
        paired = [r["final_val_loss"] - base_val[r["seed"]] for r in runs
                  if r["variant"] == v and not r["diverged"] and r["seed"] in base_val]
        d_mean, d_std = mean_std(paired)
        d_val = f"{d_mean:+.4f} ± {d_std:.4f}" if paired else "n/a"
        rows.append([v, f"{s['params']:,}", f"{s['time'][0]:.1f} ± {s['time'][1]:.1f}", rel_time,
                     f"{s['tps'][0]:,.0f} ± {s['tps'][1]:,.0f}", f"{s['val'][0]:.4f} ± {s['val'][1]:.4f}", d_val,
                     s["diverged"]])
    table = markdown_table(["norm", "params", "train time s (mean ± std)", "time vs LN", "tokens/s",
                            "val loss (mean ± std)", "Δ val vs LN, paired by seed", "diverged runs"], rows)
    tokens = runs[0]["tokens"]
    text = f"""# Norm comparison ({'quick' if args.quick else 'full'} run)

Seed 003's table at CPU scale: one GPT, {len(variants)} norm variants, {args.seeds} seeds, the same
{tokens:,} training tokens per run (byte-level tokens from CPython's pydoc topics). Training time
excludes the first step and evaluations; tokens/s is over the timed steps. Validation loss is the
mean cross-entropy (nats/byte) on {setup['eval_iters']} fixed validation batches after the last step.

{table}

Setup: `{json.dumps(setup)}`.
Command: `{command_line()}` (wall time {clock}).
Machine: {machine()}. Runs alternate between variants, so load drifts hit all of them alike;
compare timings only within this table, and read a large ± as load from other work during those runs.

## Paired by seed, 95% t-intervals

{chr(10).join("- " + line for line in _paired_sentences(runs, variants))}

Data: {corpus_line(setup["block_size"])}.

Curves: `{name}_loss.png` (train loss, mean over seeds; validation points), `{name}_speed.png`
(tokens/s, mean ± std). Raw data: `{name}.csv` (per run), `{name}_curves.csv` (per step).
"""
    (args.out / f"{name}.md").write_text(text)
    _plots(args.out, name, variants, stats, curves)
    print(text)


def _paired_sentences(runs: list[dict], variants) -> list[str]:
    """Per variant against LayerNorm: the validation-loss difference and the time ratio, from their intervals."""
    def per_seed(variant: str, key: str) -> dict[int, float]:
        return {r["seed"]: r[key] for r in runs if r["variant"] == variant and not r["diverged"]}

    if "layernorm" not in variants:
        return ["no layernorm runs: nothing to pair with"]
    ln_val, ln_time = per_seed("layernorm", "final_val_loss"), per_seed("layernorm", "train_time_s")
    sentences = []
    for v in variants:
        if v == "layernorm":
            continue
        sentences.append(compare(v, "layernorm", paired_ci(per_seed(v, "final_val_loss"), ln_val), "validation loss"))
        mine = per_seed(v, "train_time_s")
        ratio = mean_ci([mine[k] / ln_time[k] for k in sorted(set(mine) & set(ln_time))])
        allows = "allows" if ratio.n > 1 and ratio.low <= 1.0 else "does not allow"
        sentences.append(f"training time {v} / layernorm = {ratio.text(3, signed=False)} (95% CI, {ratio.n} paired "
                         f"seeds): the interval {allows} ≤ 1.00×")
    return sentences


def _plots(out: Path, name: str, variants, stats, curves) -> None:
    plt = pyplot()
    fig, (ax_train, ax_val) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in variants:
        by_step: dict[int, list[float]] = {}
        val_by_step: dict[int, list[float]] = {}
        for c in curves:
            if c["variant"] != v:
                continue
            if "train_loss" in c:
                by_step.setdefault(c["step"], []).append(c["train_loss"])
            else:
                val_by_step.setdefault(c["step"], []).append(c["val_loss"])
        steps = sorted(by_step)
        mean = [sum(by_step[s]) / len(by_step[s]) for s in steps]
        window = max(1, len(steps) // 20)  # light smoothing of the noisy per-batch loss
        smooth = [sum(mean[max(0, i - window + 1): i + 1]) / len(mean[max(0, i - window + 1): i + 1])
                  for i in range(len(mean))]
        ax_train.plot(steps, smooth, label=v)
        vsteps = sorted(val_by_step)
        ax_val.plot(vsteps, [sum(val_by_step[s]) / len(val_by_step[s]) for s in vsteps], marker="o", label=v)
    ax_train.set(xlabel="step", ylabel="train loss (nats/byte, smoothed, mean of seeds)", title="training loss")
    ax_val.set(xlabel="step", ylabel="validation loss", title="validation loss (mean of seeds)")
    for ax in (ax_train, ax_val):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{name}_loss.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    means = [stats[v]["tps"][0] for v in variants]
    stds = [stats[v]["tps"][1] for v in variants]
    ax.bar(variants, means, yerr=stds, capsize=4, color="tab:blue")
    ax.set(ylabel="training tokens/s (mean ± std over seeds)", title="training throughput per norm variant")
    ax.tick_params(axis="x", rotation=25)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{name}_speed.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
