"""Does a learned rotation lower the quantized held-out loss below the Hadamard basis it starts from?

SpinQuant trains the residual rotation for the quantized model (``normfold.rotate(method="learned")``:
Cayley-parametrised Adam from the seeded randomised Hadamard basis, minimising the KL of the
fake-quantized model to the unquantized one on calibration windows). This script compares three
bases under normfold's fake quantization (``normfold.quantize``, every linear layer but the output
head): none (the model as trained), "hadamard" (seed s) and "learned" (from Hadamard seed s, trained
for that scheme), at W4 (per output channel), W4A8 and W4A4 (per-token dynamic activations).

Models: the bundled byte-level GPT-2 (4 × 128) and, unless ``--models bundled``, the larger GPT
(4 × 256) ``rotation.py`` trains (about 12 minutes on 2 cores; ``--model-cache`` keeps it).
Held-out: the first ``--val-windows`` 128-byte windows of the validation split; calibration:
``--calibration-calls`` × 4 seeded training windows (seed 1234 + s), never validation text.
Seeds vary the Hadamard signs and the calibration windows; learned − hadamard is paired by seed,
with a 95% t-interval over seeds (``stats.py``; "not resolved" when it contains 0); each seed's
difference also gets a window-paired interval.

    python experiments/learned_rotation.py                                 # both models, 3 seeds, 100 steps
    python experiments/learned_rotation.py --models bundled --steps 40     # minutes: what results/ holds
    python experiments/learned_rotation.py --quick                         # smoke run, seconds to a minute
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from _common import RESULTS, Stopwatch, command_line, machine, markdown_table, write_csv
from rotation import (LARGER, QUICK, bundled_subject, calibration_ids, corpus_splits, paired_difference,
                      trained_subject, validation_windows, window_losses)
from stats import compare, mean_ci, paired_ci

import normfold
from normfold import LearnConfig, QuantizeConfig

SCHEMES = {"W4": QuantizeConfig(weight_bits=4, exclude=("lm_head",)),
           "W4A8": QuantizeConfig(weight_bits=4, activation_bits=8, exclude=("lm_head",)),
           "W4A4": QuantizeConfig(weight_bits=4, activation_bits=4, exclude=("lm_head",))}
BASES = ("none", "hadamard", "learned")


def measure(subject, splits, args, log) -> list[dict]:
    """One row per scheme × basis × seed: the quantized held-out loss (and, for learned, the
    calibration KL at the Hadamard start and at the end)."""
    data = validation_windows(splits, args.val_windows)
    example = subject.call(data[0][:2, :32])
    unquantized = window_losses(subject.model, subject, data)
    quantized_none = {name: window_losses(normfold.quantize(subject.model, scheme)[0], subject, data)
                      for name, scheme in SCHEMES.items()}
    rows = []
    for seed in range(args.seeds):
        calibration = [subject.call(ids) for ids in calibration_ids(splits, args.calibration_calls, 4, 1234 + seed)]
        hadamard, proof = normfold.rotate(subject.model, example, seed=seed)
        for name, scheme in SCHEMES.items():
            learned, report = normfold.rotate(subject.model, example, method="learned", seed=seed,
                                              calibration=calibration,
                                              learning=LearnConfig(quantize=scheme, steps=args.steps, lr=args.lr))
            losses = {"none": quantized_none[name],
                      "hadamard": window_losses(normfold.quantize(hadamard, scheme)[0], subject, data),
                      "learned": window_losses(normfold.quantize(learned, scheme)[0], subject, data)}
            delta, half_width = paired_difference(losses["learned"], losses["hadamard"])
            for basis, per_window in losses.items():
                rows.append(dict(model=subject.name, scheme=name, basis=basis, seed=seed,
                                 val_loss=per_window.mean().item(), unquantized_val_loss=unquantized.mean().item(),
                                 learned_minus_hadamard=delta if basis == "learned" else None,
                                 window_ci95=half_width if basis == "learned" else None,
                                 calibration_kl_start=report.learning.start_loss if basis == "learned" else None,
                                 calibration_kl_end=report.learning.end_loss if basis == "learned" else None,
                                 proof_max_rel_error=(report if basis == "learned" else proof).verification.max_rel_error
                                 if basis != "none" else None,
                                 calibration_sha256=report.learning.calibration_sha256 if basis == "learned" else None))
            log(f"{subject.name} seed {seed} {name}: none {losses['none'].mean():.4f}, hadamard "
                f"{losses['hadamard'].mean():.4f}, learned {losses['learned'].mean():.4f} (calibration KL "
                f"{report.learning.start_loss:.4g} -> {report.learning.end_loss:.4g})")
    return rows


def findings(rows: list[dict]) -> tuple[list[list], list[str]]:
    """The table (mean quantized loss per basis with its interval over seeds) and the sentences."""
    table, sentences = [], []
    for model in dict.fromkeys(r["model"] for r in rows):
        for scheme in SCHEMES:
            cell = [r for r in rows if r["model"] == model and r["scheme"] == scheme]
            by = {b: {r["seed"]: r["val_loss"] for r in cell if r["basis"] == b} for b in BASES}
            learned_vs_hadamard = paired_ci(by["learned"], by["hadamard"])
            hadamard_vs_none = paired_ci(by["hadamard"], by["none"])
            table.append([model, scheme, f"{cell[0]['unquantized_val_loss']:.4f}",
                          *[mean_ci(list(by[b].values())).text(4, signed=False) for b in BASES],
                          learned_vs_hadamard.text(4), hadamard_vs_none.text(4)])
            sentences.append(f"- {model}, {scheme}: " + compare("learned", "hadamard", learned_vs_hadamard,
                                                                "quantized held-out loss"))
            sentences.append(f"- {model}, {scheme}: " + compare("hadamard", "none", hadamard_vs_none,
                                                                "quantized held-out loss"))
    return table, sentences


def write_markdown(path: Path, rows: list[dict], subjects, args, elapsed: str) -> None:
    table, sentences = findings(rows)
    per_seed = [[r["model"], r["scheme"], r["seed"], f"{r['learned_minus_hadamard']:+.4f} ± {r['window_ci95']:.4f}",
                 f"{r['calibration_kl_start']:.4g} → {r['calibration_kl_end']:.4g}", f"{r['proof_max_rel_error']:.1e}"]
                for r in rows if r["basis"] == "learned"]
    text = ["# Learned rotations under fake quantization\n",
            f"Command: `{command_line()}`  ",
            f"Machine: {machine()}  ",
            f"Whole run: {elapsed}. Seeds: {args.seeds} (Hadamard signs and calibration windows); learning: "
            f"{args.steps} Cayley-Adam steps, lr {args.lr}, on {args.calibration_calls} calls × 4 training windows "
            f"of 128 bytes; held-out: the first {args.val_windows} validation windows of 128 bytes.\n",
            "Models:", *[f"- **{s.name}**: {s.about}" for s in subjects], "",
            "Quantized: every linear layer but the output head (normfold.quantize, symmetric round-to-nearest, W4 per "
            "output channel, activations per token). Every rotated model (Hadamard and learned) is proved equal to "
            "the original in float64 before quantization (`proof` column below).", "",
            "## Quantized held-out loss (nats/byte), mean [95% CI over seeds]", "",
            markdown_table(["model", "scheme", "unquantized", *BASES, "learned − hadamard", "hadamard − none"], table),
            "", "## Conclusions (from the intervals over seeds)", "", *sentences, "",
            "## Per seed", "",
            "learned − hadamard on the held-out windows, ± the 95% half-width over windows (paired); the learning's "
            "calibration KL(unquantized ‖ quantized) at the Hadamard start and at the end.", "",
            markdown_table(["model", "scheme", "seed", "learned − hadamard", "calibration KL", "proof"], per_seed), ""]
    path.write_text("\n".join(text))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny trained model, 2 seeds, few steps (smoke run)")
    parser.add_argument("--models", choices=["both", "bundled"], default="both")
    parser.add_argument("--seeds", type=int, default=None, help="rotation seeds (default 3; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="Cayley-Adam steps per learned rotation (default 100)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate on the Cayley parameter")
    parser.add_argument("--val-windows", type=int, default=None, help="held-out windows of 128 bytes (default 32)")
    parser.add_argument("--calibration-calls", type=int, default=8, help="calibration calls of 4 training windows")
    parser.add_argument("--model-cache", type=Path, default=None, help="folder to keep the trained model in")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    args.seeds = args.seeds or (2 if args.quick else 3)
    args.steps = args.steps or (4 if args.quick else 100)
    args.val_windows = args.val_windows or (8 if args.quick else 32)
    if args.quick:
        args.calibration_calls = min(args.calibration_calls, 2)
    if args.seeds < 2:
        parser.error(f"--seeds must be at least 2 (an interval over seeds needs two), got {args.seeds}")
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    clock = Stopwatch()
    log = lambda message: print(f"[{clock}] {message}", flush=True)  # noqa: E731
    splits = corpus_splits(128)
    validation_windows(splits, args.val_windows)  # a bad --val-windows fails here, before any work
    if args.quick:
        makers = [lambda: trained_subject(QUICK, args.model_cache)[0]]
    else:
        makers = [bundled_subject] + ([] if args.models == "bundled" else
                                      [lambda: trained_subject(LARGER, args.model_cache)[0]])
    subjects, rows = [], []
    for make in makers:
        subjects.append(make())
        log(f"{subjects[-1].name}: {subjects[-1].about}")
        rows += measure(subjects[-1], splits, args, log)
    stem = "learned_rotation_quick" if args.quick else "learned_rotation"
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"{stem}.csv", rows)
    write_markdown(args.out / f"{stem}.md", rows, subjects, args, str(clock))
    log(f"wrote {args.out / stem}.md")


if __name__ == "__main__":
    main()
