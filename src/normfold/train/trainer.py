"""The training loop: AdamW, warmup + cosine decay, autocast, DDP, torch.compile, CSV log, checkpoint.

One process, or N under ``torchrun --nproc_per_node=N`` (DistributedDataParallel; gloo on CPU,
nccl on GPU). Rank 0 writes the log, the resolved config, the summary and the checkpoint.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..hf.load import CheckpointError
from .cbwc import cbwc_
from .checkpoint import save_checkpoint
from .config import TrainConfig
from .data import TokenSplits, load_documents
from .model import GPT

_VAL_SEED = 1234  # the validation batches are the same for every run, seed and norm variant


@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> "_Dist":
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK (absent: one process)."""
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - config.min_lr)


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on tensors of rank >= 2 (matrices, embeddings), none on biases and
    norm gains. Under CBWC the decayed tensor is the free W, exactly as in the LayerNorm twin."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def _device(config: TrainConfig, dist: _Dist) -> torch.device:
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and dist.enabled:
        return torch.device("cuda", dist.local_rank)
    return torch.device(name)


def _autocast(config: TrainConfig, device: torch.device):
    """bf16 autocast when asked, or by default on a bf16-capable GPU; otherwise a no-op."""
    use_bf16 = config.precision == "bf16" or (
        config.precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    if use_bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def build_model(config: TrainConfig, device: torch.device | str = "cpu") -> GPT:
    """The model for ``config`` (seeded); ``cbwc_rmsnorm`` is the LayerNorm model under ``cbwc_``."""
    torch.manual_seed(config.seed)
    model = GPT(config.model)
    if config.precision == "fp64":
        model = model.double()
    model = model.to(device)
    if config.model.norm == "cbwc_rmsnorm":
        example = torch.zeros(1, min(8, config.model.block_size), dtype=torch.long, device=device)
        cbwc_(model, (example,), allow_partial=config.allow_partial_cbwc)
    return model


def _no_sync(model: nn.Module, sync: bool):
    """DDP's ``no_sync`` (gradients accumulate locally) unless ``sync``; a no-op for other models."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if sync or not isinstance(inner, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return inner.no_sync()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]],
               config: TrainConfig) -> torch.Tensor:
    """One optimizer step over the micro-batches ``[(x, y), ...]``: each forward under the config's autocast
    and backward of loss / len(batches) (the gradient of the mean loss; DDP all-reduces on the last only),
    then global-norm clipping and AdamW. Returns the detached mean loss (not synchronized with the device).

    CBWC's centered weights V = P·W depend only on W, which changes at ``optimizer.step()``: they are computed
    once for all micro-batches (``parametrize.cached``), and every micro-batch's backward reaches W through
    that one V: the centering saves no tensors for backward, so its graph can be walked once per micro-batch
    without ``retain_graph`` (which would keep each micro-batch's activations alive into the next).
    """
    optimizer.zero_grad(set_to_none=True)
    losses = []
    with parametrize.cached():
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with _autocast(config, x.device):
                _, loss = model(x, y)
            with _no_sync(model, sync=last):
                (loss / len(batches)).backward()
            losses.append(loss.detach())
    if config.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return torch.stack(losses).mean()


class _Progress:
    """A rich progress bar on a terminal, plain lines elsewhere, nothing when disabled."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.bar, self.task = enabled, None, None
        if enabled and sys.stdout.isatty():
            try:
                from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            except ImportError:
                pass
            else:
                self.bar = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                    TextColumn("{task.fields[info]}"), TimeRemainingColumn())
                self.task = self.bar.add_task("train", total=total, info="")
                self.bar.start()

    def update(self, step: int, info: str, log_line: bool) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.enabled and log_line:
            print(f"step {step}: {info}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@torch.no_grad()
def estimate_val_loss(model: nn.Module, splits: TokenSplits, config: TrainConfig, device: torch.device) -> float:
    """Mean loss over ``eval_iters`` fixed validation batches.

    CBWC's centered weights V = P·W do not change between the batches: computed once (``cached``).
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(_VAL_SEED)
    losses = []
    with parametrize.cached():
        for _ in range(config.eval_iters):
            x, y = splits.batch("val", config.batch_size, generator)
            with _autocast(config, device):
                _, loss = model(x.to(device), y.to(device))
            losses.append(loss.item())
    model.train(was_training)
    return sum(losses) / len(losses)


def check_out_dir(out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """``out_dir`` as a Path, or CheckpointError when training would overwrite files it did not write.

    Accepted: a missing or empty folder, a previous run's (it holds ``log.csv``, ``summary.json``
    or a training ``config.json``), or anything with ``overwrite``. Each rank checks before the
    process group starts, so no rank has written yet and all of them decide alike.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out_dir must be a folder, got a file: {out}")
    if overwrite or not out.exists() or not any(out.iterdir()) or _is_training_output(out):
        return out
    raise CheckpointError(f"--out_dir {out} is not empty and holds no training run of normfold (no log.csv, "
                          "summary.json or training config.json); pass --overwrite to write into it anyway")


def _is_training_output(folder: Path) -> bool:
    if (folder / "log.csv").is_file() or (folder / "summary.json").is_file():
        return True
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and {"model", "out_dir", "max_steps"} <= config.keys()


def train(config: TrainConfig, model: nn.Module | None = None, *, overwrite: bool = False) -> dict[str, Any]:
    """Train and return a summary (also written to ``out_dir/summary.json`` by rank 0).

    ``out_dir`` must be new, empty or a previous run's unless ``overwrite`` (:func:`check_out_dir`).

    The summary holds ``train_losses`` (every step, averaged over ranks), ``val_losses``
    (``(step, loss)`` pairs), ``final_val_loss``, ``tokens_per_s``, ``train_time_s`` and
    ``diverged`` (a non-finite loss stops the run).
    """
    out_dir = check_out_dir(config.out_dir, overwrite=overwrite)
    dist = _Dist.from_env()
    if dist.enabled and not torch.distributed.is_initialized():
        backend = "nccl" if (config.device != "cpu" and torch.cuda.is_available()) else "gloo"
        torch.distributed.init_process_group(backend)
    device = _device(config, dist)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    is_main = dist.rank == 0
    raw_model = model if model is not None else build_model(config, device)  # may refuse: nothing written yet
    out_dir.mkdir(parents=True, exist_ok=True)
    if is_main:
        (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))

    splits = TokenSplits.from_documents(load_documents(config.data), config.model.block_size, config.val_fraction)
    optimizer = make_optimizer(raw_model, config)
    train_model: nn.Module = raw_model
    if dist.enabled:
        ids = [device.index] if device.type == "cuda" else None
        train_model = nn.parallel.DistributedDataParallel(raw_model, device_ids=ids)
    if config.compile:  # after DDP, as torch.compile's DDP support expects; evaluation stays eager
        train_model = torch.compile(train_model)
    # each rank draws its own batches; the seed makes the sequence reproducible
    generator = torch.Generator().manual_seed(config.seed * 100_003 + dist.rank)
    tokens_per_step = config.batch_size * config.grad_accum_steps * config.model.block_size * dist.world_size

    log_file = open(out_dir / "log.csv", "w", newline="") if is_main else None
    writer = csv.writer(log_file) if log_file else None
    if writer:
        writer.writerow(["step", "tokens", "lr", "train_loss", "val_loss", "elapsed_s", "tokens_per_s"])
    progress = _Progress(config.max_steps, config.progress and is_main)
    train_losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    train_time, timed_steps, diverged = 0.0, 0, False
    try:
        for step in range(config.max_steps):
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = [tuple(t.to(device) for t in splits.batch("train", config.batch_size, generator))
                       for _ in range(config.grad_accum_steps)]
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss_value = train_step(train_model, optimizer, batches, config)
            if dist.enabled:
                torch.distributed.all_reduce(loss_value, op=torch.distributed.ReduceOp.AVG)
            loss_value = loss_value.item()  # synchronizes with the device
            if step > 0:  # step 0 pays for allocation and warm-up: not timed
                train_time += time.perf_counter() - t0
                timed_steps += 1
            train_losses.append(loss_value)
            if not math.isfinite(loss_value):
                diverged = True
            last = step == config.max_steps - 1 or diverged
            val_loss = None
            if (step + 1) % config.eval_interval == 0 or last:
                val_loss = estimate_val_loss(raw_model, splits, config, device) if not diverged else float("nan")
                val_losses.append((step + 1, val_loss))
            tps = timed_steps * tokens_per_step / train_time if train_time > 0 else float("nan")
            log_line = (step + 1) % config.log_interval == 0 or val_loss is not None
            if writer and log_line:
                writer.writerow([step + 1, (step + 1) * tokens_per_step, f"{lr:.6g}", f"{loss_value:.6f}",
                                 "" if val_loss is None else f"{val_loss:.6f}", f"{train_time:.3f}", f"{tps:.1f}"])
            info = f"loss {loss_value:.4f}" + (f" val {val_loss:.4f}" if val_loss is not None else "") + f" {tps:,.0f} tok/s"
            progress.update(step + 1, info, log_line)
            if diverged:
                break
    finally:
        progress.close()
        if log_file:
            log_file.close()

    summary: dict[str, Any] = {
        "norm": config.model.norm, "placement": config.model.placement, "seed": config.seed,
        "num_parameters": raw_model.num_parameters() if hasattr(raw_model, "num_parameters") else None,
        "world_size": dist.world_size, "steps": len(train_losses), "tokens": len(train_losses) * tokens_per_step,
        "train_time_s": train_time, "tokens_per_s": timed_steps * tokens_per_step / train_time if train_time else None,
        "final_train_loss": train_losses[-1], "final_val_loss": val_losses[-1][1] if val_losses else None,
        "diverged": diverged, "train_losses": train_losses, "val_losses": val_losses, "checkpoint": None,
    }
    if config.save_rank_weights:
        torch.save({k: v.detach().cpu() for k, v in raw_model.state_dict().items()},
                   out_dir / f"weights_rank{dist.rank}.pt")
    if is_main:
        if config.save_checkpoint and not diverged and isinstance(raw_model, GPT):
            summary["checkpoint"] = save_checkpoint(raw_model, out_dir / "checkpoint")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if dist.enabled:
        torch.distributed.barrier()
    return summary
