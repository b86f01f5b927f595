"""Seeds 004 / 001: which placements and norms train at high learning rates, and what grows inside.

Grid: peak learning rate (half-decade log grid) × placement {pre, post, sandwich} × QK-norm {off, on} × three
variants, 3 seeds: LayerNorm with gradient clipping 1.0 and no warmup (the base), normfold RMSNorm with clipping,
and LayerNorm without clipping (the norm and clipping are varied one at a time from the base, not crossed, to fit
the budget). Seed 004's warmup question gets one more variant: the base with a linear warmup, for Pre- and Post-LN
with QK-norm off (seed 004: "Post-LN diverges without warmup while Pre-LN does not").

A run is *stable* when its loss stays finite, it learned from context (validation loss more than STALL_MARGIN
below the byte-unigram entropy) and its validation loss is within SPIKE of the best of its cell and seed at this
or a lower learning rate: a rate that ends SPIKE worse than a smaller one is too high for the cell (a rate below
the best is slow, not unstable). A cell's largest stable learning rate is the largest at which every seed was
stable; per seed, its *stable step* (the grid index of the seed's largest stable rate, -1 when none) pairs cells
over seeds, so "QK-norm raises the largest stable rate" is a paired 95% interval, not a count.

After training, forward hooks on one fixed validation batch measure the largest attention logit |q·k|/√d (after
QK-norm where it is on) and the RMS of the residual stream after every block.

Budget: ≤ 60 min on one core: 360 runs of a 4 × 32 GPT, 400 steps of 16 × 32 tokens (≈ 9 s each on the 2-core
AVX2 machine, 3169 s in all, while other jobs shared it; an earlier run took 1657 s; Pre-LN at lr 0.003 reaches
≈ 2.56 nats/byte, the byte-unigram entropy is 3.26).

    python experiments/stability.py            # 6 lrs × 20 cells × 3 seeds (≤ 60 min, one core)
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
from stats import Interval, compare, mean_ci, paired_ci

from normfold.train import GPT, TrainConfig
from normfold.train.model import Block
from normfold.train.data import TokenSplits, load_documents
from normfold.train.trainer import build_model

FULL = dict(n_layer=4, n_head=2, n_embd=32, block_size=32, batch_size=16, max_steps=400, eval_interval=400,
            eval_iters=8, log_interval=50)
QUICK = dict(FULL, n_layer=2, n_embd=16, max_steps=4, eval_interval=4, eval_iters=1)
FULL_LRS = (3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # half-decade steps; 1.0 stops even sandwich
QUICK_LRS = (1e-2, 1e-1)
BUDGET_MIN = 60  # minutes on one core, full run (45 until the 2-core AVX2 machine took 53)
PLACEMENTS = ("pre", "post", "sandwich")
NORMS = ("layernorm", "rmsnorm")
WARMUP_FRACTION = 0.1  # the warmup variant warms up over the first 10% of the steps
# (norm, grad_clip, warmup): the base first; the warmup variant only for WARMUP_PLACEMENTS with QK-norm off
VARIANTS = (("layernorm", 1.0, False), ("rmsnorm", 1.0, False), ("layernorm", 0.0, False))
BASE = VARIANTS[0]
WARMUP = ("layernorm", 1.0, True)
WARMUP_PLACEMENTS = ("pre", "post")
SPIKE = 0.2  # nats/byte worse than a smaller learning rate of the same cell and seed: too high a rate
REFERENCE_LR = 3e-3  # the depth profile is drawn at this learning rate
HIGH_LR = 1e-1  # attention logits with and without QK-norm are compared here too


def capture(model: GPT) -> tuple[dict, list]:
    """Forward hooks recording each block's q, k (after QK-norm when present) and output: (store, handles)."""
    store, handles = {}, []

    def keep(key):
        return lambda module, args, out: store.__setitem__(key, out.detach())

    def keep_stream(key):  # a block returns the stream as (x, branch)
        return lambda module, args, out: store.__setitem__(key, Block.stream(out).detach())

    for i, block in enumerate(model.transformer.h):
        handles.append(block.attn.c_attn.register_forward_hook(keep(("qkv", i))))
        if block.attn.q_norm is not None:
            handles.append(block.attn.q_norm.register_forward_hook(keep(("q", i))))
            handles.append(block.attn.k_norm.register_forward_hook(keep(("k", i))))
        handles.append(block.register_forward_hook(keep_stream(("out", i))))
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


def cells(placements) -> list[tuple]:
    """Every cell (placement, QK-norm, norm, clipping, warmup) of the grid: the one-at-a-time variants for both
    QK-norm settings, and the warmup variant for WARMUP_PLACEMENTS with QK-norm off."""
    grid = [(p, qk, *variant) for p, qk, variant in itertools.product(placements, (False, True), VARIANTS)]
    return grid + [(p, False, *WARMUP) for p in placements if p in WARMUP_PLACEMENTS]


def cell_key(r: dict) -> tuple:
    return r["placement"], r["qk_norm"], r["norm"], r["grad_clip"], r["warmup"]


def describe(key: tuple) -> str:
    placement, qk, norm, clip, warmup = key
    return (f"{placement}, QK-norm {'on' if qk else 'off'}, {norm}, clip {clip or 'off'}, "
            f"{'warmup' if warmup else 'no warmup'}")


def mark_stable(rows: list[dict]) -> None:
    """Set each row's ``stable``: finite, learned, and validation loss ≤ SPIKE above the best finite run of its
    cell and seed at a learning rate ≤ its own."""
    for r in rows:
        below = [o["final_val_loss"] for o in rows if (cell_key(o), o["seed"]) == (cell_key(r), r["seed"])
                 and o["lr"] <= r["lr"] and o["outcome"] != "diverged"]
        r["stable"] = r["outcome"] == "trained" and r["final_val_loss"] <= min(below) + SPIKE


def collect(setup: dict, placements, lrs, seeds: int, clock: Stopwatch) -> list[dict]:
    unigram, probe, rows = unigram_loss(), probe_batch(setup["block_size"]), []
    warmup_steps = round(WARMUP_FRACTION * setup["max_steps"])
    held: dict[str, GPT] = {}

    def keep_model(config: TrainConfig) -> GPT:
        held["model"] = build_model(config)
        return held["model"]

    with tempfile.TemporaryDirectory(prefix="normfold_stability_") as scratch:
        for seed in range(seeds):
            for (placement, qk, norm, clip, warmup), lr in itertools.product(cells(placements), lrs):
                s = run(Path(scratch) / f"{placement}_{qk}_{norm}_{clip}_{warmup}_{lr}_s{seed}", keep_model,
                        seed=seed, placement=placement, qk_norm=qk, norm=norm, grad_clip=clip, lr=lr, min_lr=lr / 10,
                        warmup_steps=warmup_steps if warmup else 0, **setup)
                result = outcome(s, unigram)
                logit, rms = (measure(held["model"], probe) if result != "diverged"
                              else (math.nan, [math.nan] * setup["n_layer"]))
                val = s["final_val_loss"] if result != "diverged" else math.nan
                rows.append(dict(placement=placement, qk_norm=qk, norm=norm, grad_clip=clip, warmup=warmup, lr=lr,
                                 seed=seed, outcome=result, learned=result == "trained", final_val_loss=val,
                                 max_attention_logit=round(logit, 3),
                                 **{f"rms_block{i}": round(v, 4) for i, v in enumerate(rms)}))
                print(f"[{clock}] {describe(cell_key(rows[-1]))}, lr={lr:g}, seed {seed}: {result}, val {val:.3f}, "
                      f"max logit {logit:.1f}", flush=True)
    mark_stable(rows)
    return rows


def largest_stable(rows: list[dict], key: tuple, lrs) -> float | None:
    """The largest learning rate at which every seed of the cell was stable (None: not even the smallest)."""
    ok = [lr for lr in lrs if all(r["stable"] for r in rows if cell_key(r) == key and r["lr"] == lr)]
    return max(ok) if ok else None


def stable_steps(rows: list[dict], key: tuple, lrs) -> dict[int, int]:
    """Per seed: the grid index of its largest stable learning rate (-1: stable at none). A seed stable at the
    top rate counts there: the grid's edge, the true value may be higher."""
    steps: dict[int, int] = {}
    for r in rows:
        if cell_key(r) == key:
            steps[r["seed"]] = max(steps.get(r["seed"], -1), lrs.index(r["lr"]) if r["stable"] else -1)
    return steps


def lr_text(lr: float | None) -> str:
    return "none" if lr is None else f"{lr:g}"


def step_comparison(rows: list[dict], lrs, changed: tuple, base: tuple) -> Interval:
    """Paired over seeds: stable step of ``changed`` − that of ``base`` (grid steps of ×√10)."""
    return paired_ci(stable_steps(rows, changed, lrs), stable_steps(rows, base, lrs))


def verdict(diff: Interval, up: str = "raises", down: str = "lowers") -> str:
    """The word for a paired difference of stable steps: resolved up / down, "keeps" when every seed's difference
    is 0 (a zero-width interval at 0), or not resolved (the interval contains 0)."""
    if diff.n < 2:
        return "not resolved (fewer than 2 seeds)"
    if diff.low == diff.high == 0:
        return "keeps"
    if not diff.resolved:
        return "not resolved"
    return up if diff.mean > 0 else down


# each factor: (name, the changed cell for a base cell or None); compared pairwise over seeds
FACTORS = (
    ("QK-norm on vs off", lambda k: (k[0], True, *k[2:]) if not k[1] and not k[4] else None),
    ("sandwich vs pre", lambda k: ("sandwich", *k[1:]) if k[0] == "pre" and not k[4] else None),
    ("sandwich vs post", lambda k: ("sandwich", *k[1:]) if k[0] == "post" and not k[4] else None),
    ("post vs pre", lambda k: ("post", *k[1:]) if k[0] == "pre" else None),
    ("RMSNorm vs LayerNorm", lambda k: (*k[:2], *VARIANTS[1]) if k[2:] == BASE else None),
    ("no clipping vs clipping 1.0", lambda k: (*k[:2], *VARIANTS[2]) if k[2:] == BASE else None),
    ("warmup vs none", lambda k: (*k[:2], *WARMUP) if k[2:] == BASE else None),
)


def factor_rows(rows: list[dict], lrs) -> list[dict]:
    """Every pair of cells that differ in one factor: the paired difference of stable steps and its verdict."""
    keys = sorted({cell_key(r) for r in rows})
    out = []
    for name, changed in FACTORS:
        for key in keys:
            other = changed(key)
            if other is not None and other in keys:
                diff = step_comparison(rows, lrs, other, key)
                out.append(dict(factor=name, base=key, changed=other, diff=diff, verdict=verdict(diff)))
    return out


def factor_sentences(pairs: list[dict]) -> list[str]:
    """Per factor: in how many cells it raises / lowers the largest stable rate (resolved) or is not resolved."""
    sentences = []
    for name in dict.fromkeys(p["factor"] for p in pairs):
        mine = [p for p in pairs if p["factor"] == name]
        count = {v: sum(p["verdict"] == v for p in mine) for v in ("raises", "lowers", "keeps")}
        unresolved = len(mine) - sum(count.values())
        changed, base = name.split(" vs ")
        sentences.append(f"{changed} instead of {base} raises the largest stable learning rate in {count['raises']} "
                         f"of {len(mine)} cells, lowers it in {count['lowers']}, keeps it in every seed in "
                         f"{count['keeps']}, not resolved in {unresolved} (paired 95% CIs of the stable step over "
                         "seeds, table below)")
    return sentences


def val_by_seed(rows: list[dict], key: tuple, lr: float) -> dict[int, float]:
    return {r["seed"]: r["final_val_loss"] for r in rows if cell_key(r) == key and r["lr"] == lr}


def stable_everywhere(rows: list[dict], key: tuple, lr: float) -> bool:
    at = [r for r in rows if cell_key(r) == key and r["lr"] == lr]
    return bool(at) and all(r["stable"] for r in at)


def warmup_sentences(rows: list[dict], lrs) -> list[str]:
    """Seed 004: does Post-LN without warmup fail at rates where Pre-LN trains, and does warmup change that?"""
    pre, post = ("pre", False, *BASE), ("post", False, *BASE)
    keys = {cell_key(r) for r in rows}
    sentences = []
    if {pre, post} <= keys:
        sentences.append(f"Seed 004, LayerNorm, clipping 1.0, QK-norm off, no warmup: largest stable learning rate "
                         f"Pre-LN {lr_text(largest_stable(rows, pre, lrs))}, "
                         f"Post-LN {lr_text(largest_stable(rows, post, lrs))}")
        gap = [lr for lr in lrs if stable_everywhere(rows, pre, lr) and not stable_everywhere(rows, post, lr)]
        if not gap:
            sentences.append("Post-LN without warmup fails at no learning rate where Pre-LN is stable in every seed")
        for lr in gap:
            post_runs = [r for r in rows if cell_key(r) == post and r["lr"] == lr]
            loss = paired_ci(val_by_seed(rows, post, lr), val_by_seed(rows, pre, lr))
            sentences.append(f"Post-LN without warmup fails at lr {lr:g} where Pre-LN is stable in every seed "
                             f"({sum(not r['stable'] for r in post_runs)} of {len(post_runs)} Post-LN seeds "
                             "unstable): " + compare("post", "pre", loss, "validation loss"))
    for placement in ("post", "pre"):
        cold, warm = (placement, False, *BASE), (placement, False, *WARMUP)
        if {cold, warm} <= keys:
            diff = step_comparison(rows, lrs, warm, cold)
            word = verdict(diff)
            sentences.append(f"{placement}, with warmup: largest stable learning rate "
                             f"{lr_text(largest_stable(rows, warm, lrs))} (without: "
                             f"{lr_text(largest_stable(rows, cold, lrs))}); stable step warmup − none = "
                             f"{diff.text(2)} (95% CI, {diff.n} paired seeds): warmup {word}"
                             + ("" if word.startswith("not resolved") else " the largest stable rate"))
    return sentences


def logit_sentences(rows: list[dict], placements, lrs: list[float]) -> list[str]:
    """Paired over seeds, the base variant at each of ``lrs``: max attention logit with QK-norm − without."""
    sentences = []
    for lr in lrs:
        for placement in placements:
            on, off = (placement, True, *BASE), (placement, False, *BASE)
            logit = {k: {r["seed"]: r["max_attention_logit"] for r in rows if cell_key(r) == k and r["lr"] == lr}
                     for k in (on, off)}
            if set(logit[on]) & set(logit[off]):
                sentences.append(f"{placement}, LayerNorm, clipping, lr {lr:g}: " + compare(
                    "QK-norm on", "off", paired_ci(logit[on], logit[off]), "max attention logit", digits=2))
    return sentences


def depth_runs(rows: list[dict], placement: str, norm: str, lr: float) -> list[dict]:
    """Finite runs of (placement, norm) at ``lr`` with QK-norm off, clipping on, no warmup."""
    key = (placement, False, norm, 1.0, False)
    return [r for r in rows if cell_key(r) == key and r["lr"] == lr and r["outcome"] != "diverged"]


def n_blocks(rows: list[dict]) -> int:
    return sum(k.startswith("rms_block") for k in rows[0])


def depth_table(rows: list[dict], placements, lr: float) -> tuple[list[str], list[list[str]], list[str]]:
    """Residual-stream RMS after each block with 95% CIs over seeds, and the last/first ratio's verdict."""
    blocks = n_blocks(rows)
    header = ["placement", "norm", *[f"RMS after block {i + 1}" for i in range(blocks)], "last / first"]
    table, sentences = [], []
    for placement in placements:
        for norm in NORMS:
            mine = depth_runs(rows, placement, norm, lr)
            if not mine:
                continue
            per_block = [mean_ci([r[f"rms_block{i}"] for r in mine]) for i in range(blocks)]
            ratio = mean_ci([r[f"rms_block{blocks - 1}"] / r["rms_block0"] for r in mine])
            table.append([placement, norm, *[b.text(2, signed=False) for b in per_block], ratio.text(2, signed=False)])
            shift = mean_ci([r[f"rms_block{blocks - 1}"] / r["rms_block0"] - 1 for r in mine])
            trend = ("grows with depth" if shift.resolved and shift.mean > 0 else
                     "shrinks with depth" if shift.resolved else "not resolved (the interval contains 1)")
            sentences.append(f"{placement}, {norm}, lr {lr:g}: residual-stream RMS last / first block = "
                             f"{ratio.text(2, signed=False)} (95% CI, {ratio.n} seeds): {trend}")
    return header, table, sentences


def grid_table(rows: list[dict], lrs) -> tuple[list[str], list[list[str]]]:
    """Per cell and learning rate: seeds stable, mean validation loss; the largest stable rate; logits at it."""
    header = ["placement", "QK-norm", "norm", "clip", "warmup", *[f"lr {lr:g}" for lr in lrs],
              "largest stable lr", "per-seed largest", "max attn logit there"]
    table = []
    for key in sorted({cell_key(r) for r in rows}):
        mine = [r for r in rows if cell_key(r) == key]
        per_lr = []
        for lr in lrs:
            at = [r for r in mine if r["lr"] == lr]
            val = mean_ci([r["final_val_loss"] for r in at])
            per_lr.append(f"{sum(r['stable'] for r in at)}/{len(at)}, {val.mean:.2f}" if val.n else
                          f"0/{len(at)}, diverged")
        best = largest_stable(rows, key, lrs)
        logits = mean_ci([r["max_attention_logit"] for r in mine if r["lr"] == best])
        per_seed = stable_steps(rows, key, lrs)
        table.append([key[0], "on" if key[1] else "off", key[2], key[3] or "off", "yes" if key[4] else "no",
                      *per_lr, lr_text(best), " ".join(lr_text(lrs[s] if s >= 0 else None) for _, s in
                                                       sorted(per_seed.items())),
                      logits.text(1, signed=False) if logits.n else "—"])
    return header, table


def factor_table(pairs: list[dict]) -> tuple[list[str], list[list[str]]]:
    header = ["factor", "cell (base side)", "stable step changed − base (95% CI)", "verdict"]
    return header, [[p["factor"], describe(p["base"]), p["diff"].text(2), p["verdict"]] for p in pairs]


def conclusions(rows: list[dict], placements, lrs, reference_lr: float, pairs: list[dict]) -> list[str]:
    """Sentences from the grid: who trained, seed 004's warmup claim, what each factor does to the largest stable
    rate, attention logits with and without QK-norm."""
    learned = sum(r["learned"] for r in rows)
    diverged = sum(r["outcome"] == "diverged" for r in rows)
    at_ref = [r for r in rows if r["lr"] == reference_lr]
    sentences = [f"{learned} of {len(rows)} runs learned from context (validation loss below the unigram entropy − "
                 f"{STALL_MARGIN}); {diverged} produced a non-finite loss; at lr {reference_lr:g} "
                 f"{sum(r['learned'] for r in at_ref)} of {len(at_ref)} learned, best validation loss "
                 f"{min((r['final_val_loss'] for r in at_ref if r['learned']), default=math.nan):.3f}"]
    sentences += warmup_sentences(rows, lrs)
    sentences += factor_sentences(pairs)
    for placement in placements:
        best = [largest_stable(rows, k, lrs) for k in sorted({cell_key(r) for r in rows}) if k[0] == placement]
        sentences.append(f"{placement}: largest stable learning rate over its {len(best)} cells: "
                         + ", ".join(lr_text(b) for b in best))
    high = [lr for lr in (reference_lr, HIGH_LR) if lr in lrs]
    sentences += logit_sentences(rows, placements, sorted(set(high)) or [max(lrs)])
    return sentences


def parse(argv) -> tuple[argparse.Namespace, dict, tuple, tuple, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 lrs, a few steps, 2 seeds (smoke run)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per cell (default 3; quick 2)")
    parser.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma-separated subset of {PLACEMENTS}")
    parser.add_argument("--lrs", default=None, help="comma-separated peak learning rates (default: the grid's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (2 if args.quick else 3)
    if args.seeds < 2:
        parser.error(f"intervals need at least 2 seeds, got {args.seeds}")
    setup, lrs = (dict(QUICK), QUICK_LRS) if args.quick else (dict(FULL), FULL_LRS)
    if args.lrs:
        lrs = tuple(sorted({float(lr) for lr in args.lrs.split(",") if lr}))
    if not lrs or min(lrs) <= 0:
        parser.error(f"learning rates must be positive, got {args.lrs!r}")
    placements = tuple(p for p in PLACEMENTS if p in args.placements.split(","))
    if not placements or set(args.placements.split(",")) - set(PLACEMENTS):
        parser.error(f"placements must be a subset of {PLACEMENTS}, got {args.placements!r}")
    reference_lr = REFERENCE_LR if REFERENCE_LR in lrs else lrs[0]
    return args, setup, lrs, placements, reference_lr


def main(argv=None) -> None:
    args, setup, lrs, placements, reference_lr = parse(argv)
    torch.set_num_threads(args.threads)
    clock = Stopwatch()
    rows = collect(setup, placements, lrs, args.seeds, clock)
    name = "stability_quick" if args.quick else "stability"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows)
    pairs = factor_rows(rows, lrs)
    depth_header, depth, depth_sentences = depth_table(rows, placements, reference_lr)
    n_cells = len(cells(placements))
    budget = (f"{len(rows)} runs ({len(lrs)} lrs × {n_cells} cells × {args.seeds} seeds), {setup['max_steps']} "
              f"steps each, {args.threads} thread(s), ≤ {BUDGET_MIN} min on one core intended")
    text = "\n".join([
        f"# Stability: learning rate × placement × QK-norm × norm × clipping × warmup "
        f"({'quick' if args.quick else 'full'} run)", "",
        f"Cosine decay to lr/10; warmup (where marked) linear over the first {WARMUP_FRACTION:.0%} of the steps. "
        f"Per learning rate: seeds stable / seeds, mean validation loss (nats/byte). *Stable*: finite, learned "
        f"(validation loss below the byte-unigram entropy − {STALL_MARGIN}) and within {SPIKE} of the best run of "
        "the same cell and seed at this or a smaller rate. A cell's largest stable learning rate: every seed stable "
        "there; per seed, its own largest stable rate (the *stable step* is its index on the grid, each step ×√10, "
        "-1 for none; a seed stable at the top rate counts there, the grid's edge).", "",
        markdown_table(*grid_table(rows, lrs)), "",
        "## Conclusions (from the grid and 95% intervals over seeds)", "",
        *[f"- {s}" for s in conclusions(rows, placements, lrs, reference_lr, pairs)], "",
        "## Each factor's effect on the largest stable learning rate (paired over seeds)", "",
        markdown_table(*factor_table(pairs)), "",
        f"## Residual-stream RMS over depth (lr {reference_lr:g}, QK-norm off, clipping on, no warmup; "
        "mean [95% CI] over seeds)", "",
        markdown_table(depth_header, depth), "",
        *[f"- {s}" for s in depth_sentences], "",
        f"Setup: `{json.dumps(setup)}`, learning rates {list(lrs)}.",
        f"Plot: `{name}.png` (left: residual-stream RMS after each block at lr {reference_lr:g}, mean and 95% CI; "
        "middle: validation loss vs learning rate, base variant; right: max attention logit vs learning rate, base "
        f"variant). Raw data: `{name}.csv` (one row per run).", "",
        provenance(budget, corpus_line(setup["block_size"]), clock), ""])
    (args.out / f"{name}.md").write_text(text)
    plot(args.out / f"{name}.png", rows, placements, lrs, reference_lr)
    print(text)


def lr_curve(rows: list[dict], key: tuple, column: str, lrs) -> list[tuple[float, float]]:
    """(lr, mean of ``column`` over the cell's finite runs) for each learning rate with one."""
    finite = [r for r in rows if cell_key(r) == key and r["outcome"] != "diverged"]
    return [(lr, statistics.fmean(vals)) for lr in lrs if (vals := [r[column] for r in finite if r["lr"] == lr])]


def plot(path: Path, rows: list[dict], placements, lrs, reference_lr: float) -> None:
    plt = pyplot()
    fig, (ax_depth, ax_loss, ax_logit) = plt.subplots(1, 3, figsize=(16, 4.5))
    blocks = n_blocks(rows)
    for j, placement in enumerate(placements):
        color = f"C{j}"  # one colour per placement in every panel
        for norm in NORMS:
            mine = depth_runs(rows, placement, norm, reference_lr)
            if mine:
                per_block = [mean_ci([r[f"rms_block{i}"] for r in mine]) for i in range(blocks)]
                half = [0.0 if math.isnan(b.high) else b.high - b.mean for b in per_block]
                ax_depth.errorbar(range(1, blocks + 1), [b.mean for b in per_block], yerr=half, marker="o",
                                  capsize=3, color=color, ls="-" if norm == "layernorm" else "--",
                                  label=f"{placement}, {norm}")
        for qk in (False, True):
            for ax, column in ((ax_loss, "final_val_loss"), (ax_logit, "max_attention_logit")):
                points = lr_curve(rows, (placement, qk, *BASE), column, lrs)
                if points:
                    ax.plot(*zip(*points), marker="o", ls="-" if qk else "--", color=color,
                            label=f"{placement}, QK-norm {'on' if qk else 'off'}")
        points = lr_curve(rows, (placement, False, *WARMUP), "final_val_loss", lrs)
        if points:
            ax_loss.plot(*zip(*points), marker="s", ls=":", color=color, label=f"{placement}, warmup")
    ax_depth.set(xticks=range(1, blocks + 1), xlabel="block", ylabel="residual stream RMS", title=f"activation RMS over depth (lr {reference_lr:g})")
    ax_loss.set(xscale="log", xlabel="peak learning rate", ylabel="validation loss (nats/byte)",
                title="final validation loss (LayerNorm, clipping on)")
    ax_logit.set(xscale="log", yscale="log", xlabel="peak learning rate", ylabel="max |attention logit|",
                 title="largest attention logit (LayerNorm, clipping on)")
    save_figure(fig, (ax_depth, ax_loss, ax_logit), path)


if __name__ == "__main__":
    main()
