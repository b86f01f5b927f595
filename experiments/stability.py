"""Seeds 004 / 001: which placements and norms train at high learning rates, and what grows inside.

Grid: peak learning rate × placement {pre, post, sandwich} × QK-norm {off, on}, no warmup (seed 004:
Post-LN needs warmup, Pre-LN does not), for three variants: LayerNorm with gradient clipping 1.0 (the
base), normfold RMSNorm with clipping, and LayerNorm without clipping (the norm and clipping are
varied one at a time from the base, not crossed, to fit the budget); 3 seeds. A run is *stable* when
its loss stays finite and its validation loss ends within 0.1 nats/byte of the best learning rate's
for the same cell and seed (a larger gap is a learning rate too high for that cell); the largest
stable learning rate of a cell is the largest at which every seed was stable. "learned" marks runs
whose validation loss ends more than 0.05 below the byte-unigram entropy. After
training, forward hooks on one fixed validation batch measure the largest attention logit
|q·k|/√d (after QK-norm where it is on) and the RMS of the residual stream after every block.

The grid is shrunk to fit ≤ 30 min on 2 shared cores (load 6-9 from other work): a 4-layer, 32-wide
GPT, 80 steps of 16 × 32 tokens, 3 learning rates, the one-at-a-time variants above.

    python experiments/stability.py            # 3 lrs × 3 × 2 × 2 × 2 cells × 3 seeds (≤ 30 min, 2 busy cores)
    python experiments/stability.py --quick    # a smoke run (seconds)
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from _common import (RESULTS, STALL_MARGIN, Stopwatch, corpus_line, markdown_table, outcome, provenance, pyplot,
                     run, save_figure, unigram_loss, write_csv)
from stats import compare, mean_ci, paired_ci

from normfold.train import GPT, TrainConfig
from normfold.train.data import TokenSplits, load_documents
from normfold.train.trainer import build_model

FULL = dict(n_layer=4, n_head=2, n_embd=32, block_size=32, batch_size=16, max_steps=80, warmup_steps=0,
            eval_interval=80, eval_iters=4)
QUICK = dict(FULL, n_layer=2, n_embd=16, max_steps=4, eval_interval=4, eval_iters=1)
FULL_LRS = (3e-3, 1e-2, 3e-2)
QUICK_LRS = (1e-2, 1e-1)
PLACEMENTS = ("pre", "post", "sandwich")
NORMS = ("layernorm", "rmsnorm")
VARIANTS = (("layernorm", 1.0), ("rmsnorm", 1.0), ("layernorm", 0.0))  # (norm, grad_clip): base first
BASE = VARIANTS[0]
SPIKE = 0.1  # nats/byte above the best learning rate's validation loss: too high a learning rate
REFERENCE_LR = 3e-3  # the depth profile is drawn at this learning rate


def capture(model: GPT) -> tuple[dict, list]:
    """Forward hooks recording each block's q, k (after QK-norm when present) and output: (store, handles)."""
    store, handles = {}, []

    def keep(key):
        return lambda module, args, out: store.__setitem__(key, out.detach())

    for i, block in enumerate(model.transformer.h):
        handles.append(block.attn.c_attn.register_forward_hook(keep(("qkv", i))))
        if block.attn.q_norm is not None:
            handles.append(block.attn.q_norm.register_forward_hook(keep(("q", i))))
            handles.append(block.attn.k_norm.register_forward_hook(keep(("k", i))))
        handles.append(block.register_forward_hook(keep(("out", i))))
    return store, handles


def max_attention_logit(qkv: Tensor, n_head: int, q: Tensor | None, k: Tensor | None) -> float:
    """max over heads and causal pairs (s ≤ t) of |q_t · k_s| / √d, the logit softmax sees."""
    B, T, C = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    if q is None:
        q, k, _ = qkv.split(C, dim=2)
        q, k = q.view(B, T, n_head, C // n_head), k.view(B, T, n_head, C // n_head)
    logits = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) / math.sqrt(C // n_head)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return logits.abs().masked_select(causal).max().item()


@torch.no_grad()
def measure(model: GPT, x: Tensor) -> tuple[float, list[float]]:
    """(largest attention logit over all layers, residual-stream RMS after each block) on the batch ``x``."""
    store, handles = capture(model)
    was_training = model.training
    model.eval()
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    n_layer, n_head = len(model.transformer.h), model.config.n_head
    logits = [max_attention_logit(store[("qkv", i)], n_head, store.get(("q", i)), store.get(("k", i)))
              for i in range(n_layer)]
    rms = [store[("out", i)].double().pow(2).mean().sqrt().item() for i in range(n_layer)]
    return max(logits), rms


def probe_batch(block_size: int) -> Tensor:
    """A fixed validation batch (the same for every run)."""
    splits = TokenSplits.from_documents(load_documents(), block_size)
    return splits.batch("val", 8, torch.Generator().manual_seed(0))[0]


def cells(placements, lrs) -> list[tuple]:
    """Every (placement, QK-norm, norm, clipping, lr) of the grid."""
    return [(p, qk, norm, clip, lr) for p, qk, (norm, clip), lr in itertools.product(placements, (False, True),
                                                                                      VARIANTS, lrs)]


def mark_stable(rows: list[dict]) -> None:
    """Set each row's ``stable``: finite, and validation loss within SPIKE of the best over learning rates of
    its cell and seed."""
    best: dict[tuple, float] = {}
    for r in rows:
        if r["outcome"] != "diverged":
            k = (cell_key(r), r["seed"])
            best[k] = min(best.get(k, math.inf), r["final_val_loss"])
    for r in rows:
        r["stable"] = r["outcome"] != "diverged" and r["final_val_loss"] <= best[(cell_key(r), r["seed"])] + SPIKE


def collect(setup: dict, placements, lrs, seeds: int, clock: Stopwatch) -> list[dict]:
    unigram, probe, rows = unigram_loss(), probe_batch(setup["block_size"]), []
    held: dict[str, GPT] = {}

    def keep_model(config: TrainConfig) -> GPT:
        held["model"] = build_model(config)
        return held["model"]

    with tempfile.TemporaryDirectory(prefix="normfold_stability_") as scratch:
        for seed in range(seeds):
            for placement, qk, norm, clip, lr in cells(placements, lrs):
                s = run(Path(scratch) / f"{placement}_{qk}_{norm}_{clip}_{lr}_s{seed}", keep_model, seed=seed,
                        placement=placement, qk_norm=qk, norm=norm, grad_clip=clip, lr=lr, min_lr=lr / 10, **setup)
                result = outcome(s, unigram)
                logit, rms = (measure(held["model"], probe) if result != "diverged"
                             else (math.nan, [math.nan] * setup["n_layer"]))
                rows.append(dict(placement=placement, qk_norm=qk, norm=norm, grad_clip=clip, lr=lr, seed=seed,
                                 outcome=result, learned=result == "trained", final_val_loss=s["final_val_loss"],
                                 max_attention_logit=round(logit, 3),
                                 **{f"rms_block{i}": round(v, 4) for i, v in enumerate(rms)}))
                print(f"[{clock}] {placement} qk={qk} {norm} clip={clip} lr={lr:g} seed {seed}: {result}, "
                      f"val {s['final_val_loss']}, max logit {logit:.1f}", flush=True)
    mark_stable(rows)
    return rows


def cell_key(r: dict) -> tuple:
    return r["placement"], r["qk_norm"], r["norm"], r["grad_clip"]


def largest_stable(rows: list[dict], key: tuple, lrs) -> float | None:
    """The largest learning rate at which every seed of the cell was stable (None: not even the smallest)."""
    ok = [lr for lr in lrs if all(r["stable"] for r in rows if cell_key(r) == key and r["lr"] == lr)]
    return max(ok) if ok else None


def growth(rows: list[dict], placement: str, norm: str, lr: float) -> list[float]:
    """Per seed with a finite run (QK-norm off, clipping on): RMS after the last block / RMS after the first."""
    return [r[f"rms_block{_last_block(r)}"] / r["rms_block0"] for r in rows
            if (r["placement"], r["norm"], r["lr"], r["qk_norm"], r["grad_clip"]) == (placement, norm, lr, False, 1.0)
            and r["outcome"] != "diverged"]


def _last_block(r: dict) -> int:
    return max(int(k.removeprefix("rms_block")) for k in r if k.startswith("rms_block") and r[k] != "")


def conclusions(rows: list[dict], lrs, reference_lr: float) -> list[str]:
    """Sentences from the grid: what QK-norm and clipping change in the largest stable lr, activation growth."""
    learned = sum(r["learned"] for r in rows)
    sentences = [f"{learned} of {len(rows)} runs learned from context (validation loss below the unigram entropy "
                 f"− {STALL_MARGIN})" + (": fewer than half at this budget, so a largest stable learning rate says "
                                          "which rate a cell tolerates best, not that its training succeeded"
                                          if 2 * learned < len(rows) else "")]
    keys = sorted({cell_key(r) for r in rows})
    # each factor against its base: (name, the changed cell from a base cell)
    factors = (("QK-norm", lambda k: (k[0], True, k[2], k[3]) if not k[1] else None),
               ("RMSNorm instead of LayerNorm", lambda k: (k[0], k[1], "rmsnorm", 1.0) if k[2:] == BASE else None),
               ("no clipping instead of clipping 1.0", lambda k: (k[0], k[1], "layernorm", 0.0) if k[2:] == BASE else None))
    for factor, changed in factors:
        counts = {"raises": 0, "lowers": 0, "keeps": 0}
        for key in keys:
            other = changed(key)
            if other is None or other not in keys:
                continue
            with_, without = largest_stable(rows, other, lrs) or 0.0, largest_stable(rows, key, lrs) or 0.0
            counts["raises" if with_ > without else "lowers" if with_ < without else "keeps"] += 1
        sentences.append(f"{factor} raises the largest stable learning rate in {counts['raises']} of "
                         f"{sum(counts.values())} cells, lowers it in {counts['lowers']}, keeps it in {counts['keeps']}")
    top = max(lrs)
    val = {}
    for r in rows:
        if r["lr"] == top and r["outcome"] != "diverged":
            val.setdefault(cell_key(r), {})[r["seed"]] = r["final_val_loss"]
    for placement in [p for p in PLACEMENTS if any(r["placement"] == p for r in rows)]:
        off, on = val.get((placement, False, *BASE), {}), val.get((placement, True, *BASE), {})
        if set(off) & set(on):
            sentences.append(f"{placement}, LayerNorm, clipping, lr {top:g}: " + compare(
                "QK-norm on", "off", paired_ci(on, off), "validation loss"))
    for placement in ("post", "sandwich"):
        mine, pre = val.get((placement, False, *BASE), {}), val.get(("pre", False, *BASE), {})
        if set(mine) & set(pre):
            sentences.append(f"LayerNorm, clipping, lr {top:g}: " + compare(placement, "pre", paired_ci(mine, pre),
                                                                            "validation loss"))
    placements = [p for p in PLACEMENTS if any(r["placement"] == p for r in rows)]
    for placement in placements:
        best = [largest_stable(rows, k, lrs) for k in keys if k[0] == placement]
        sentences.append(f"{placement}: largest stable learning rate over its {len(best)} cells: "
                         + ", ".join("none" if b is None else f"{b:g}" for b in best))
    for placement in placements:
        for norm in NORMS:
            ratio = mean_ci(growth(rows, placement, norm, reference_lr))
            if ratio.n < 2:
                sentences.append(f"{placement}, {norm}, lr {reference_lr:g}: fewer than 2 finite runs, no growth estimate")
                continue
            shift = mean_ci([g - 1 for g in growth(rows, placement, norm, reference_lr)])
            trend = ("grows with depth" if shift.resolved and shift.mean > 0 else
                     "shrinks with depth" if shift.resolved else "not resolved (the interval contains 1)")
            sentences.append(f"{placement}, {norm}, clipping, lr {reference_lr:g}: stream RMS last/first block = "
                             f"{ratio.text(3, signed=False)} (95% CI, {ratio.n} seeds): {trend}")
    logit = {}
    for r in rows:
        if r["outcome"] != "diverged" and r["grad_clip"] == 1.0:
            logit.setdefault((r["placement"], r["norm"], r["qk_norm"], r["lr"]), {})[r["seed"]] = r["max_attention_logit"]
    for lr in sorted({reference_lr, top}):
        for placement in placements:
            for norm in NORMS:
                on, off = logit.get((placement, norm, True, lr), {}), logit.get((placement, norm, False, lr), {})
                if set(on) & set(off):
                    sentences.append(f"{placement}, {norm}, clipping, lr {lr:g}: " + compare(
                        "QK-norm on", "off", paired_ci(on, off), "max attention logit", digits=2))
    return sentences


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 lrs, a few steps, 2 seeds (smoke run)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3; quick 2)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma-separated subset of {PLACEMENTS}")
    parser.add_argument("--lrs", default=None, help="comma-separated peak learning rates (default: the grid's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    seeds = args.seeds or (2 if args.quick else 3)
    if seeds < 2:
        parser.error(f"intervals need at least 2 seeds, got {seeds}")
    torch.set_num_threads(args.threads)
    setup, lrs = (dict(QUICK), QUICK_LRS) if args.quick else (dict(FULL), FULL_LRS)
    if args.lrs:
        lrs = tuple(sorted(float(lr) for lr in args.lrs.split(",") if lr))
    if not lrs or min(lrs) <= 0:
        parser.error(f"learning rates must be positive, got {args.lrs!r}")
    placements = tuple(p for p in PLACEMENTS if p in args.placements.split(","))
    if not placements or set(args.placements.split(",")) - set(PLACEMENTS):
        parser.error(f"placements must be a subset of {PLACEMENTS}, got {args.placements!r}")
    reference_lr = REFERENCE_LR if REFERENCE_LR in lrs else lrs[0]
    clock = Stopwatch()
    rows = collect(setup, placements, lrs, seeds, clock)
    name = "stability_quick" if args.quick else "stability"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows)
    table = []
    for key in sorted({cell_key(r) for r in rows}):
        mine = [r for r in rows if cell_key(r) == key]
        per_lr = [f"{sum(r['stable'] for r in at)}/{len(at)}, {mean_ci([r['final_val_loss'] for r in at]).mean:.3f}, "
                  f"{sum(r['learned'] for r in at)}"
                  for lr in lrs for at in [[r for r in mine if r["lr"] == lr]]]
        best = largest_stable(rows, key, lrs)
        logits = [r["max_attention_logit"] for r in mine if r["lr"] == best and r["outcome"] != "diverged"]
        table.append([*key[:3], key[3] or "off", *per_lr, "none" if best is None else f"{best:g}",
                      f"{statistics.fmean(logits):.1f}" if logits else "—"])
    header = ["placement", "QK-norm", "norm", "clip", *[f"lr {lr:g}: stable, val loss, learned" for lr in lrs],
              "largest stable lr",
              "max attn logit there"]
    runs = len(rows)
    budget = (f"{runs} runs ({len(lrs)} lrs × {len(placements)} placements × 2 QK-norm × {len(VARIANTS)} variants "
              f"(norm, clipping) × {seeds} seeds), {setup['max_steps']} steps each, ≤ 30 min intended")
    text = "\n".join([
        f"# Stability: learning rate × placement × QK-norm × norm × clipping ({'quick' if args.quick else 'full'} run)",
        "", f"No warmup; cosine decay to lr/10. Per learning rate: seeds stable (finite, validation loss within {SPIKE} "
        f"of the best learning rate's for that cell and seed), mean validation loss (nats/byte), seeds that learned "
        f"(validation loss below the byte-unigram entropy − {STALL_MARGIN}). A cell's largest stable learning rate: "
        "every seed stable there.", "",
        markdown_table(header, table), "",
        "## Conclusions (from the grid and 95% intervals over seeds)", "",
        *[f"- {s}" for s in conclusions(rows, lrs, reference_lr)], "",
        f"Setup: `{json.dumps(setup)}`, learning rates {list(lrs)}.",
        f"Plot: `{name}.png` (left: residual-stream RMS after each block at lr {reference_lr:g}, QK-norm off, "
        "clipping on, mean of finite runs; right: max attention logit vs learning rate, clipping on, mean of "
        f"finite runs). Raw data: `{name}.csv` (one row per run).", "",
        provenance(budget, corpus_line(setup["block_size"]), clock), ""])
    (args.out / f"{name}.md").write_text(text)
    plot(args.out / f"{name}.png", rows, lrs, reference_lr)
    print(text)


def plot(path: Path, rows: list[dict], lrs, reference_lr: float) -> None:
    plt = pyplot()
    fig, (ax_depth, ax_logit) = plt.subplots(1, 2, figsize=(12, 4.5))
    for placement in PLACEMENTS:
        for norm in NORMS:
            mine = [r for r in rows if (r["placement"], r["norm"], r["lr"], r["qk_norm"], r["grad_clip"])
                    == (placement, norm, reference_lr, False, 1.0) and r["outcome"] != "diverged"]
            if mine:
                depth = _last_block(mine[0]) + 1
                ax_depth.plot(range(1, depth + 1), [statistics.fmean(r[f"rms_block{i}"] for r in mine)
                                                    for i in range(depth)], marker="o", label=f"{placement}, {norm}")
            for qk in (False, True):
                points = [(lr, statistics.fmean(vals)) for lr in lrs
                          if (vals := [r["max_attention_logit"] for r in rows if r["outcome"] != "diverged" and r["lr"] == lr
                                       and (r["placement"], r["norm"], r["qk_norm"], r["grad_clip"])
                                       == (placement, norm, qk, 1.0)])]
                if points and norm == "layernorm":
                    ax_logit.plot(*zip(*points), marker="o", ls="-" if qk else "--",
                                  label=f"{placement}, QK-norm {'on' if qk else 'off'}")
    ax_depth.set(xlabel="block", ylabel="residual stream RMS", title=f"activation RMS over depth (lr {reference_lr:g})")
    ax_logit.set(xscale="log", yscale="log", xlabel="peak learning rate", ylabel="max |attention logit|",
                 title="largest attention logit (LayerNorm, clipping on)")
    save_figure(fig, (ax_depth, ax_logit), path)


if __name__ == "__main__":
    main()
