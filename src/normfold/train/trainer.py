"""The training loop: AdamW, warmup + cosine decay, autocast, DDP or FSDP2, torch.compile, gradient
accumulation, CSV (and TensorBoard) log, checkpoint, resume.

One process, or N under ``torchrun --nproc_per_node=N`` (``parallel``: DistributedDataParallel or FSDP2's
``fully_shard``; gloo on CPU, nccl on GPU), taking the steps one process takes with the N ranks' batches
together (:mod:`normfold.train.parallel`). Rank 0 writes the log, the resolved config, the summary, the
resumable state (:mod:`normfold.train.resume`) and the checkpoint.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .._deps import require
from ..engine.errors import CheckpointError
from .cbwc import CenteringIndex, cbwc_, project_centering_
from .checkpoint import save_checkpoint
from .config import TrainConfig, TrainConfigError
from .data import TokenSplits, corpus_sha256, load_documents
from .model import GPT
from .parallel import (Dist, full_model_state, full_optimizer_state, full_tensor, is_sharded, load_full_state,
                       local_rows, no_sync, wrap_for_training)
from .resume import capture_rng, read_state, restore_rng, write_state

_VAL_SEED = 1234  # the validation batches are the same for every run, seed and norm variant


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
    # fused: one kernel per step for all tensors instead of ~10 ops per tensor (on CPU torch's default is that
    # per-tensor loop: 3.5 ms of a 64-wide GPT's ~100 ms step, 1.0 ms fused). The same elementwise update.
    try:
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), fused=True)
    except RuntimeError:  # tensors the fused kernel does not take (a device without it): the per-tensor loop
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def _device(config: TrainConfig, dist: Dist) -> torch.device:
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


def accumulate_gradients(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         config: TrainConfig, index: CenteringIndex | None = None) -> torch.Tensor:
    """Gradients of the mean loss over the micro-batches ``[(x, y), ...]`` (set, not added to): each forward
    under the config's autocast and backward of loss / len(batches) (DDP all-reduces on the last only).
    Returns the detached mean loss (not synchronized with the device). ``index``: the model's CBWC tensors
    (:class:`~normfold.train.cbwc.CenteringIndex`, found anew when None; a training loop keeps one).

    CBWC's centered weights V = P·W depend only on W, which changes at ``optimizer.step()``: they are computed
    once for all micro-batches, all of them by one autograd node (``cbwc.centered_once``; compiled models:
    ``parametrize.cached``), and every micro-batch's backward reaches W through that one V: the centering
    saves no tensors for backward, so its graph can be walked once per micro-batch without ``retain_graph``
    (which would keep each micro-batch's activations alive into the next).
    Not under FSDP2: it reduce-scatters a block's gradients as soon as backward reaches the block's input,
    and autograd runs the newest nodes first, so the gradient through a V made in an earlier micro-batch's
    forward would reach W after the reduce-scatter and be lost. There V is computed in each forward.
    """
    losses = []
    if is_sharded(model):
        once = contextlib.nullcontext()
    elif config.compile:
        once = parametrize.cached()
    else:
        once = (index if index is not None else CenteringIndex(model)).centered_once()
    with once:
        for i, (x, y) in enumerate(batches):
            with _autocast(config, x.device):
                _, loss = model(x, y)
            with no_sync(model, sync=i == len(batches) - 1):
                (loss / len(batches)).backward()
            losses.append(loss.detach())
    return torch.stack(losses).mean()


def apply_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig,
                    index: CenteringIndex | None = None) -> torch.Tensor:
    """Global-norm clipping (``grad_clip`` > 0) and the optimizer step; returns the gradient norm before clipping
    (whole, also when FSDP2 shards it). ``index`` as for :func:`accumulate_gradients`."""
    params = [p for p in model.parameters() if p.grad is not None]
    index = index if index is not None else CenteringIndex(model)
    index.center_gradients_()  # CBWC tensors trained by projection (cbwc.project_centering_): g ↦ P·g
    norm = nn.utils.get_total_norm([p.grad for p in params])
    if config.grad_clip > 0:
        nn.utils.clip_grads_with_norm_(params, config.grad_clip, norm)
    optimizer.step()
    index.center_parameters_()  # and W ↦ P·W after the step
    return full_tensor(norm).detach()


def step_with_norm(model: nn.Module, optimizer: torch.optim.Optimizer,
                   batches: list[tuple[torch.Tensor, torch.Tensor]], config: TrainConfig,
                   index: CenteringIndex | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step over the micro-batches ``[(x, y), ...]`` (:func:`accumulate_gradients`, then
    :func:`apply_gradients`); returns the detached mean loss and the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    index = index if index is not None else CenteringIndex(model)
    loss = accumulate_gradients(model, batches, config, index)
    return loss, apply_gradients(model, optimizer, config, index)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]],
               config: TrainConfig, index: CenteringIndex | None = None) -> torch.Tensor:
    """One optimizer step (:func:`step_with_norm`); returns the detached mean loss (not synchronized with the
    device)."""
    return step_with_norm(model, optimizer, batches, config, index)[0]


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
def estimate_val_loss(model: nn.Module, splits: TokenSplits, config: TrainConfig, device: torch.device,
                      dist: Dist = Dist()) -> float:
    """Mean loss over ``eval_iters`` fixed validation batches of batch_size · world_size windows, each rank
    evaluating its rows (averaged over ranks): the same batches and value as one process with that batch.

    CBWC's centered weights V = P·W do not change between the batches: computed once (``cached``).
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(_VAL_SEED)
    losses = []
    with parametrize.cached():
        for _ in range(config.eval_iters):
            x, y = (local_rows(t, dist).to(device) for t in splits.batch("val", config.batch_size * dist.world_size,
                                                                         generator))
            with _autocast(config, device):
                _, loss = model(x, y)
            losses.append(loss.float())
    model.train(was_training)
    mean = torch.stack(losses).mean()
    if dist.enabled:
        torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
    return mean.item()


RUN_MARKER = ".normfold-run"  # written into every run folder before anything else: what marks it as one
_RUN_KIND = "normfold train run"


def check_out_dir(out_dir: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """``out_dir`` as a Path, or CheckpointError when training would overwrite files it did not write.

    Accepted: a missing or empty folder, a previous run's (it holds the marker ``.normfold-run``
    that every run writes first; a ``log.csv`` or ``summary.json`` alone may be anyone's), or
    anything with ``overwrite``. Each rank checks before the process group starts, so no rank has
    written yet and all of them decide alike.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out-dir must be a folder, got a file: {out}")
    if overwrite or not out.exists() or not any(out.iterdir()) or _is_training_run(out):
        return out
    raise CheckpointError(f"--out-dir {out} is not empty and holds no training run of normfold (no {RUN_MARKER}, "
                          "which every run writes first); pass --overwrite to write into it anyway")


def _is_training_run(folder: Path) -> bool:
    """Whether ``folder`` holds the marker a run of ``normfold train`` writes first (:func:`_mark_run`)."""
    try:
        marker = json.loads((folder / RUN_MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("kind") == _RUN_KIND


def _mark_run(folder: Path) -> None:
    """Make ``folder`` a run's (a resumed run keeps the marker of the run it continues)."""
    folder.mkdir(parents=True, exist_ok=True)
    if not _is_training_run(folder):
        (folder / RUN_MARKER).write_text(json.dumps({"kind": _RUN_KIND, "format": 1,
                                                     "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")


_LOG_COLUMNS = ["step", "tokens", "lr", "train_loss", "val_loss", "elapsed_s", "tokens_per_s", "grad_norm"]


def _draw_batches(splits: TokenSplits, config: TrainConfig, dist: Dist, generator: torch.Generator,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's micro-batches: each the same draw of batch_size · world_size windows on every rank (one
    generator, one seed), of which this rank trains on its own rows: N ranks see one process's global batch."""
    return [tuple(local_rows(t, dist).to(device) for t in splits.batch("train", config.batch_size * dist.world_size,
                                                                         generator))
            for _ in range(config.grad_accum_steps)]


def _summary_writer_class(config: TrainConfig):
    """TensorBoard's ``SummaryWriter`` when ``config.tensorboard`` (an ImportError naming the extra if it is
    missing), else None."""
    if not config.tensorboard:
        return None
    require("tensorboard")
    from torch.utils.tensorboard import SummaryWriter  # not at the top: needs the optional tensorboard package

    return SummaryWriter


def _fresh_history() -> dict[str, Any]:
    """What a run accumulates and a resumed run continues: the curves, the CSV rows and the timing."""
    return {"train_losses": [], "grad_norms": [], "val_losses": [], "log_rows": [], "train_time": 0.0,
            "timed_steps": 0}


def _save_state(folder: Path, step: int, raw_model: nn.Module, optimizer: torch.optim.Optimizer,
                generator: torch.Generator, history: dict[str, Any], config: TrainConfig, dist: Dist,
                corpus: str) -> None:
    """Every rank's part of the resumable state; rank 0 writes it (a collective: every rank calls it)."""
    model_state, optimizer_state = full_model_state(raw_model), full_optimizer_state(raw_model, optimizer)
    rng = [capture_rng(generator)]
    if dist.enabled:
        rng = [None] * dist.world_size
        torch.distributed.all_gather_object(rng, capture_rng(generator))
    if dist.rank == 0:
        write_state(folder, {"step": step, "config": config.to_dict(), "world_size": dist.world_size,
                             "corpus_sha256": corpus, "model": model_state, "optimizer": optimizer_state,
                             "rng": rng, "history": history})


def train(config: TrainConfig, model: nn.Module | None = None, *, overwrite: bool = False) -> dict[str, Any]:
    """Train and return a summary (also written to ``out_dir/summary.json`` by rank 0).

    ``out_dir`` must be new, empty or a previous run's unless ``overwrite`` (:func:`check_out_dir`).
    ``checkpoint_interval`` > 0 saves the resumable state (``out_dir/train_state.pt``) every that many steps
    and at the end; ``resume`` continues the run saved in that folder exactly where it stopped (refused with
    a ResumeError naming what differs if the config, world size or corpus changed), so the curves equal an
    uninterrupted run's.

    The summary holds ``train_losses`` (every step, averaged over ranks), ``grad_norms`` (before clipping),
    ``val_losses`` (``(step, loss)`` pairs), ``final_val_loss``, ``tokens_per_s``, ``train_time_s``,
    ``resumed_from`` (the step a resumed run started at, else None) and ``diverged`` (a non-finite loss stops
    the run).
    """
    out_dir = check_out_dir(config.out_dir, overwrite=overwrite)
    dist = Dist.from_env()
    documents = load_documents(config.data)
    corpus = corpus_sha256(documents)
    # refusals before any work: a state that does not continue this run, a missing optional package
    resumed = read_state(config.resume, config.to_dict(), dist.world_size, corpus) if config.resume else None
    summary_writer_class = _summary_writer_class(config)
    if dist.enabled and not torch.distributed.is_initialized():
        backend = "nccl" if (config.device != "cpu" and torch.cuda.is_available()) else "gloo"
        torch.distributed.init_process_group(backend)
    device = _device(config, dist)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    is_main = dist.rank == 0
    raw_model = model if model is not None else build_model(config, device)  # may refuse: nothing written yet
    try:
        splits = TokenSplits.from_documents(documents, config.model.block_size, config.val_fraction)
    except ValueError as err:  # too little text for this block_size: the user's data, said before any write
        raise TrainConfigError(f"--data: {err}") from err
    if not (dist.enabled and config.parallel == "fsdp2"):  # CBWC by projection (FSDP2 shards the centered dim)
        project_centering_(raw_model)
    train_model = wrap_for_training(raw_model, config.parallel, dist, device)
    index = CenteringIndex(train_model)  # after FSDP2: the tensors the step centers, found once for the run
    optimizer = make_optimizer(raw_model, config)  # after FSDP2 sharded the parameters in place
    if config.compile:  # after DDP, as torch.compile's DDP support expects; evaluation stays eager
        train_model = torch.compile(train_model)
    generator = torch.Generator().manual_seed(config.seed * 100_003)  # the batch order; the same on every rank
    history, start = _fresh_history(), 0
    if resumed is not None:
        load_full_state(raw_model, optimizer, resumed["model"], resumed["optimizer"])
        restore_rng(resumed["rng"][dist.rank], generator)
        history, start = resumed["history"], resumed["step"]
    tokens_per_step = config.batch_size * config.grad_accum_steps * config.model.block_size * dist.world_size

    if is_main:  # every refusal is behind us: the first writes
        _mark_run(out_dir)
        (out_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
    log_file = open(out_dir / "log.csv", "w", newline="") if is_main else None
    writer = csv.writer(log_file) if log_file else None
    if writer:
        writer.writerows([_LOG_COLUMNS, *history["log_rows"]])
    board = summary_writer_class(str(out_dir / "tensorboard"), purge_step=start + 1 if start else None) \
        if summary_writer_class is not None and is_main else None
    progress = _Progress(config.max_steps, config.progress and is_main)
    train_losses, grad_norms, val_losses = history["train_losses"], history["grad_norms"], history["val_losses"]
    diverged = False
    try:
        for step in range(start, config.max_steps):
            lr = lr_at(step, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = _draw_batches(splits, config, dist, generator, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss, grad_norm = step_with_norm(train_model, optimizer, batches, config, index)
            if dist.enabled:
                torch.distributed.all_reduce(loss, op=torch.distributed.ReduceOp.AVG)
            loss_value, grad_norm_value = loss.item(), grad_norm.item()  # synchronizes with the device
            if step > 0:  # step 0 pays for allocation and warm-up: not timed
                history["train_time"] += time.perf_counter() - t0
                history["timed_steps"] += 1
            train_losses.append(loss_value)
            grad_norms.append(grad_norm_value)
            diverged = not math.isfinite(loss_value)
            last = step == config.max_steps - 1 or diverged
            val_loss = None
            if (step + 1) % config.eval_interval == 0 or last:
                val_loss = estimate_val_loss(raw_model, splits, config, device, dist) if not diverged else float("nan")
                val_losses.append((step + 1, val_loss))
            train_time = history["train_time"]
            tps = history["timed_steps"] * tokens_per_step / train_time if train_time > 0 else float("nan")
            log_line = (step + 1) % config.log_interval == 0 or val_loss is not None
            if log_line:
                row = [step + 1, (step + 1) * tokens_per_step, f"{lr:.6g}", f"{loss_value:.6f}",
                       "" if val_loss is None else f"{val_loss:.6f}", f"{train_time:.3f}", f"{tps:.1f}",
                       f"{grad_norm_value:.6g}"]
                history["log_rows"].append(row)
                if writer:
                    writer.writerow(row)
            if board is not None:
                _log_scalars(board, step + 1, lr=lr, loss=loss_value, grad_norm=grad_norm_value, val_loss=val_loss,
                             tokens_per_s=tps)
            info = f"loss {loss_value:.4f}" + (f" val {val_loss:.4f}" if val_loss is not None else "") + f" {tps:,.0f} tok/s"
            progress.update(step + 1, info, log_line)
            if diverged:
                break
            if config.checkpoint_interval and ((step + 1) % config.checkpoint_interval == 0 or last):
                if log_file:
                    log_file.flush()
                _save_state(out_dir, step + 1, raw_model, optimizer, generator, history, config, dist, corpus)
    finally:
        progress.close()
        if log_file:
            log_file.close()
        if board is not None:
            board.close()

    train_time, timed_steps = history["train_time"], history["timed_steps"]
    summary: dict[str, Any] = {
        "norm": config.model.norm, "placement": config.model.placement, "seed": config.seed,
        "num_parameters": raw_model.num_parameters() if hasattr(raw_model, "num_parameters") else None,
        "world_size": dist.world_size, "parallel": config.parallel if dist.enabled else None,
        "steps": len(train_losses), "tokens": len(train_losses) * tokens_per_step,
        "train_time_s": train_time, "tokens_per_s": timed_steps * tokens_per_step / train_time if train_time else None,
        "final_train_loss": train_losses[-1], "final_val_loss": val_losses[-1][1] if val_losses else None,
        "diverged": diverged, "resumed_from": start if resumed is not None else None, "train_losses": train_losses,
        "grad_norms": grad_norms, "val_losses": val_losses, "checkpoint": None,
        "validation_split": splits.description,  # which documents were held out (or the tail fallback)
    }
    if config.save_rank_weights:  # this rank's replica (DDP), or the gathered weights (FSDP2: a collective)
        torch.save({k: full_tensor(v).detach().cpu() for k, v in raw_model.state_dict().items()},
                   out_dir / f"weights_rank{dist.rank}.pt")
    save = config.save_checkpoint and not diverged and isinstance(raw_model, GPT)  # the same on every rank
    weights = full_model_state(raw_model) if save else None  # a collective; rank 0 receives it
    if is_main:
        if save:
            summary["checkpoint"] = save_checkpoint(raw_model, out_dir / "checkpoint", state=weights)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if dist.enabled:
        torch.distributed.barrier()
    return summary


def _log_scalars(board, step: int, **values: float | None) -> None:
    """One TensorBoard scalar per value (``val_loss`` under ``val/``, the rest under ``train/``); None skipped."""
    for name, value in values.items():
        if value is not None:
            board.add_scalar("val/loss" if name == "val_loss" else f"train/{name}", value, step)
