"""Shared plumbing of the experiment scripts: run one training, write CSV / markdown / plots."""
from __future__ import annotations

import csv
import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from normfold.bench import cpu_model

from normfold.train import GPT, TrainConfig, resolve_config, train
from normfold.train.data import TokenSplits, corpus_sha256, load_documents
from normfold.train.model import set_dropout
from normfold.train.trainer import build_model

RESULTS = Path(__file__).resolve().parent / "results"


def run(out_dir: Path, model: Callable[[TrainConfig], torch.nn.Module] | None = None, **values: Any) -> dict[str, Any]:
    """One training run (no checkpoint, no progress bar); returns the trainer's summary. ``model``, when given,
    builds the model from the resolved config (otherwise the trainer's ``build_model``)."""
    config = resolve_config(out_dir=str(out_dir), progress=False, save_checkpoint=False, **values)
    return train(config, model(config) if model is not None else None)


def without_dropout(config: TrainConfig) -> TrainConfig:
    """``config`` with dropout 0 (everything else, the seed included, the same)."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dropout=0.0))


def cbwc_model(config: TrainConfig) -> GPT:
    """The CBWC model of ``config`` (norm="cbwc_rmsnorm") with dropout, as seed 002 trains it: ``cbwc_`` is proved
    on the dropout-free twin (the fold engine will not center through dropout, whose rescaling breaks the zero
    mean), then the config's dropout is switched on. Same seed, same initial weights as the LayerNorm run."""
    model = build_model(without_dropout(config))
    set_dropout(model, config.model.dropout)
    return model


def machine() -> str:
    cpu = cpu_model()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() and torch.cuda.is_initialized() else ""
    return (f"{cpu}, {os.cpu_count()} logical CPUs{gpu}, torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads, Python {platform.python_version()}; 1-min load average at the end: {load:.1f}")


def command_line() -> str:
    return "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def corpus_line(block_size: int, val_fraction: float = 0.1) -> str:
    """What the trainer reads (default corpus): documents, bytes, SHA-256 and the validation split made."""
    documents = load_documents()
    splits = TokenSplits.from_documents(documents, block_size, val_fraction)
    size = sum(len(d.encode("utf-8")) for d in documents)
    return (f"CPython {platform.python_version()}'s pydoc topics, {len(documents)} documents, {size:,} bytes, "
            f"SHA-256 `{corpus_sha256(documents)}`; validation: {splits.description}, {len(splits.val):,} tokens "
            f"({len(splits.train):,} for training)")


STALL_MARGIN = 0.05  # nats/byte: a run ending this close to the unigram entropy learned no context


def unigram_loss() -> float:
    """Entropy (nats/byte) of the training split's byte frequencies: the loss of a model that ignores context."""
    train_tokens = TokenSplits.from_documents(load_documents(), block_size=8).train
    p = torch.bincount(train_tokens, minlength=256).double() / len(train_tokens)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def outcome(summary: dict[str, Any], unigram: float) -> str:
    """"diverged" (a non-finite loss), "failed" (validation loss not STALL_MARGIN below ``unigram``), or "trained"."""
    val = summary["final_val_loss"]
    if summary["diverged"]:
        return "diverged"
    return "failed" if val is None or val >= unigram - STALL_MARGIN else "trained"


def provenance(budget: str, data: str, clock: "Stopwatch") -> str:
    """The lines every report carries: command, machine, the budget and what was spent, the data and its hash."""
    return "\n".join([f"Command: `{command_line()}`.", f"Machine: {machine()}.",
                      f"Budget: {budget}; wall time {clock}.", f"Data: {data}."])


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value); NaN when empty."""
    values = [v for v in values if v is not None]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def write_csv(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    rows = list(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("the experiment plots need matplotlib: pip install 'normfold[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, axes, path: Path) -> None:
    """Grid every axis, add a legend where something is labelled, lay out, write ``path`` (PNG) and close."""
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    pyplot().close(fig)


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.start:.0f} s"
