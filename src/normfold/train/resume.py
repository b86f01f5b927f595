"""Resumable training state: ``train_state.pt`` holds all a run needs to continue as if never stopped.

Saved: the model and optimizer (full state dicts: the same file for one process, DDP and FSDP2), the
step (the learning-rate schedule is a pure function of it, :func:`normfold.train.trainer.lr_at`, so the
step *is* the scheduler's state), every rank's random streams (torch's global generator, CUDA's when
used, Python's ``random``, and the batch generator: the data position), the history of the curves and
CSV rows, and what must not change: the config, the world size and the corpus hash. numpy's generator
is not saved: nothing in training draws from it.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch

from ..engine.errors import CheckpointError

STATE_FILE = "train_state.pt"
STATE_FORMAT = 1

# config fields a resumed run may change: where and how it reports, never what it computes
MAY_CHANGE_ON_RESUME = frozenset({"out_dir", "resume", "progress", "save_checkpoint", "save_rank_weights",
                                  "checkpoint_interval", "tensorboard"})


class ResumeError(CheckpointError):
    """A run cannot be resumed from the given folder (no state, another config, world size or corpus);
    raised before training starts."""


def capture_rng(batches: torch.Generator) -> dict[str, Any]:
    """This rank's random streams: torch's (CPU, CUDA when initialised), Python's and the batch generator's."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "batches": batches.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], batches: torch.Generator) -> None:
    """Put back what :func:`capture_rng` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    batches.set_state(state["batches"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _flat(config: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {...}, ...}`` with the model keys at the top level (names are unique across both)."""
    return {**config.get("model", {}), **{k: v for k, v in config.items() if k != "model"}}


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"key: run x, now y"`` for every key that differs and may not change on resume."""
    saved, current = _flat(saved), _flat(current)
    keys = sorted((saved.keys() | current.keys()) - MAY_CHANGE_ON_RESUME)
    missing = object()
    return [f"{key}: run {saved.get(key, missing)!r}, now {current.get(key, missing)!r}".replace(
        repr(missing), "(absent)") for key in keys if saved.get(key, missing) != current.get(key, missing)]


def read_state(folder: str | os.PathLike, config: dict[str, Any], world_size: int, corpus: str) -> dict[str, Any]:
    """The state saved in ``folder``, checked against this run; ResumeError naming every mismatch."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise ResumeError(f"--resume {folder}: no {STATE_FILE} there (a run saves it every "
                          "--checkpoint-interval steps)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: torch raises several types
        raise ResumeError(f"--resume {folder}: {STATE_FILE} is unreadable ({type(err).__name__}: {err})") from err
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise ResumeError(f"--resume {folder}: {STATE_FILE} has format {found!r}, expected {STATE_FORMAT}")
    problems = config_differences(state["config"], config)
    if state["world_size"] != world_size:
        problems.append(f"world size: run {state['world_size']}, now {world_size}")
    if state["corpus_sha256"] != corpus:
        problems.append(f"corpus SHA-256: run {state['corpus_sha256'][:12]}…, now {corpus[:12]}…")
    if problems:
        raise ResumeError(f"--resume {folder}: the run would not continue as it started; it differs in "
                          f"{'; '.join(problems)} (only {', '.join(sorted(MAY_CHANGE_ON_RESUME))} may change)")
    return state


def write_state(folder: str | os.PathLike, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``folder/train_state.pt`` atomically: an interruption leaves the previous one whole."""
    path = Path(folder) / STATE_FILE
    partial = path.with_name(f".{STATE_FILE}.partial")
    torch.save({**state, "format": STATE_FORMAT}, partial)
    os.replace(partial, path)
    return path
