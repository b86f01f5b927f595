"""Shared plumbing of the experiment scripts: run one training, write CSV / markdown / plots."""
from __future__ import annotations

import csv
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from normfold.bench import cpu_model

from normfold.train import resolve_config, train
from normfold.train.data import TokenSplits, corpus_sha256, load_documents

RESULTS = Path(__file__).resolve().parent / "results"


def run(out_dir: Path, **values: Any) -> dict[str, Any]:
    """One training run (no checkpoint, no progress bar); returns the trainer's summary."""
    config = resolve_config(out_dir=str(out_dir), progress=False, save_checkpoint=False, **values)
    return train(config)


def machine() -> str:
    cpu = cpu_model()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"Python {platform.python_version()}; 1-min load average at the end: {load:.1f}")


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


class Stopwatch:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.start:.0f} s"
