"""How closely a CBWC model trains like its LayerNorm twin, and where the equivalence breaks.

From the same initial weights and batches, train (a) the LayerNorm GPT, (b) its CBWC twin
(``norm=cbwc_rmsnorm``: centered producers re-parametrized, LayerNorms → RMSNorms), and (c) the
model folded once at initialization and then trained as a plain RMSNorm model (no constraint).
Report the largest relative gap of the per-step training loss to (a), and the final validation
losses (dropout off), in float64 and float32, with and without dropout.

    python experiments/cbwc_equivalence.py           # 150 steps per run
    python experiments/cbwc_equivalence.py --quick   # 20 steps per run
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from _common import (RESULTS, Stopwatch, cbwc_model, corpus_line, markdown_table, provenance, without_dropout,
                     write_csv)

from normfold.train import resolve_config, train
from normfold.train.cbwc import bake_, cbwc_
from normfold.train.model import set_dropout
from normfold.train.trainer import build_model

MODEL = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=8, lr=3e-3, min_lr=3e-4, warmup_steps=10,
             weight_decay=0.1, eval_iters=4)


# a relative loss gap at most this large is rounding, per precision (5e-14 and ~6e-5 measured at dropout 0)
ROUNDING = {"fp64": 1e-10, "fp32": 1e-3}


def _train(scratch: Path, tag: str, mode: str, **values) -> dict:
    config = resolve_config(out_dir=str(scratch / tag), progress=False, save_checkpoint=False,
                            norm="layernorm" if mode == "fold_once" else mode, **values)
    model = None
    if mode == "cbwc_rmsnorm":
        model = cbwc_model(config)
    elif mode == "fold_once":
        model = build_model(without_dropout(config))  # proved without dropout, as cbwc_model
        cbwc_(model, (torch.zeros(1, 8, dtype=torch.long),))
        bake_(model)  # plain centered weights from here on: nothing keeps them centered
        set_dropout(model, config.model.dropout)
    return train(config, model=model)


def reading(rows: list[dict]) -> list[str]:
    """One sentence per run, from its gap: rounding level for the precision, or where the runs part."""
    labels = {"cbwc_rmsnorm": "CBWC", "fold_once": "folded once"}
    out = []
    for r in rows:
        limit = ROUNDING[r["precision"]]
        verdict = (f"at rounding level (≤ {limit:g} for {r['precision']})" if r["max_rel_gap_train_loss"] <= limit
                   else f"above rounding level ({limit:g} for {r['precision']}): the runs part")
        out.append(f"{labels[r['model']]}, {r['precision']}, dropout {r['dropout']}: largest relative gap "
                   f"{r['max_rel_gap_train_loss']:.1e}, {verdict}; validation loss {r['val_loss_model']:.4f} vs "
                   f"LayerNorm {r['val_loss_layernorm']:.4f} (one seed: a difference, not a ranking)")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--precisions", default="fp64,fp32", help="comma-separated subset of fp64,fp32")
    parser.add_argument("--dropouts", default="0,0.1", help="comma-separated dropout rates")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    precisions = [p for p in args.precisions.split(",") if p]
    if not precisions or set(precisions) - {"fp64", "fp32"}:
        parser.error(f"--precisions must be a subset of fp64,fp32, got {args.precisions!r}")
    dropouts = [float(d) for d in args.dropouts.split(",") if d]
    steps = args.steps or (20 if args.quick else 150)
    name = "cbwc_equivalence_quick" if args.quick else "cbwc_equivalence"
    clock = Stopwatch()
    rows = []
    with tempfile.TemporaryDirectory(prefix="normfold_cbwc_") as scratch:
        for precision in precisions:
            for dropout in dropouts:
                common = dict(MODEL, precision=precision, dropout=dropout, max_steps=steps, eval_interval=steps)
                ref = _train(Path(scratch), f"ln_{precision}_{dropout}", "layernorm", **common)
                for mode in ("cbwc_rmsnorm", "fold_once"):
                    s = _train(Path(scratch), f"{mode}_{precision}_{dropout}", mode, **common)
                    gaps = [abs(a - b) / abs(a) for a, b in zip(ref["train_losses"], s["train_losses"])]
                    rows.append(dict(model=mode, precision=precision, dropout=dropout, steps=steps,
                                     max_rel_gap_train_loss=max(gaps), rel_gap_train_loss_last=gaps[-1],
                                     val_loss_layernorm=ref["final_val_loss"], val_loss_model=s["final_val_loss"]))
                    print(f"[{clock}] {mode} {precision} dropout {dropout}: max rel gap {max(gaps):.2e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{name}.csv", rows)
    labels = {"cbwc_rmsnorm": "CBWC (normfold.cbwc_)", "fold_once": "folded once, then plain RMSNorm"}
    table = markdown_table(
        ["model", "precision", "dropout", "max rel. gap of train loss (all steps)", "gap at last step",
         "val loss LayerNorm", "val loss model"],
        [[labels[r["model"]], r["precision"], r["dropout"], f"{r['max_rel_gap_train_loss']:.1e}",
          f"{r['rel_gap_train_loss_last']:.1e}", f"{r['val_loss_layernorm']:.4f}", f"{r['val_loss_model']:.4f}"]
         for r in rows])
    text = f"""# CBWC vs LayerNorm: training equivalence ({'quick' if args.quick else 'full'} run)

Same initial weights, batches and dropout masks; AdamW (weight decay 0.1 on matrices and
embeddings), warmup + cosine, gradient clipping 1.0; {steps} steps. Gap = |loss − loss_LN| / loss_LN.
Validation losses are measured with dropout off.

{table}

Reading (from the gaps above):

{chr(10).join("- " + line for line in reading(rows))}

With dropout, CBWC is proved on the dropout-free model and dropout switched on afterwards (the fold
engine will not center through dropout). Folding once and training the plain RMSNorm model leaves
the weights free to lose their centering and unties the embedding from the head.

Setup: `{json.dumps(MODEL)}`.
{provenance(f"{len(rows) // 2 + len(rows)} runs of {steps} steps (this table holds no timings)", corpus_line(MODEL["block_size"]), clock)}
"""
    (args.out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
