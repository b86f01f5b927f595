"""Configuration checks around normalization layers: the mistakes seed 001 warns about.

    findings = check(model, example_inputs, training_config={"per_device_train_batch_size": 1})

- ``batchnorm-train-mode``: a BatchNorm in train mode while the model serves inference. It
  normalizes with the statistics of the batch it is given (a batch of one collapses to β; a
  batch's neighbours change each sample's output) and overwrites its running statistics.
- ``batchnorm-batch-size-1``: BatchNorm with a training batch size of 1: no batch statistics
  (PyTorch raises for one value per channel; with H·W > 1 it silently becomes an InstanceNorm).
  Gradient accumulation does not help: statistics come from the forward pass's real batch.
- ``bias-before-norm``: a Linear/Conv bias feeding a norm directly. Before a BatchNorm or an
  InstanceNorm it is fully redundant: the norm subtracts a per-channel mean, which removes any
  per-channel constant. Before a LayerNorm only its mean b̄ is removed: LN(Wx + b) = LN(Wx + b − b̄·1),
  so it is redundant only when b is constant across features (seed 001's "redundant" is the
  BatchNorm case). Before an RMSNorm nothing is removed (no mean subtraction: b moves the
  vector's direction and its RMS), so no finding is raised for it.
- ``post-ln-no-warmup``: a Post-LN model (a norm reads a residual add one of whose operands is
  another norm's output: LN(x + F(x)) with x = LN(...)) trained with no learning-rate warmup.
  Post-LN gradients pass through every norm on the way down; without warmup the first large
  updates usually diverge. Pre-LN trains without it.

The structural checks read the ``torch.export`` graph (``normfold.engine.graph.capture``), so they
need ``example_inputs``; without them, or if export fails, they are skipped and an ``info``
finding says so.
"""
from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
from torch import fx, nn

from ..engine.errors import FoldError
from ..engine.graph import capture, module_path, op_packet, owner_path
from ..engine.op_kinds import LINEAR_PRODUCER_OPS, norm_node_kind, through_value_copies
from ..nn.kinds import norm_modules

_aten = torch.ops.aten
_BATCH_SIZE_KEYS = ("per_device_train_batch_size", "train_batch_size", "micro_batch_size", "batch_size")
_FULLY_CENTERING = ("BatchNorm", "InstanceNorm")  # subtract a per-channel mean: any per-channel bias vanishes


@dataclass
class Finding:
    code: str          # machine-readable name of the check
    severity: str      # "warning" (likely a bug or waste) or "info"
    path: str          # module path the finding is about ("" for the whole model)
    message: str

    def __str__(self) -> str:
        where = f" {self.path}:" if self.path else ""
        return f"[{self.severity}] {self.code}:{where} {self.message}"


def _norm_output_source(node) -> fx.Node | None:
    """The norm node whose output ``node`` is (directly or as item 0 of a multi-output norm)."""
    node = through_value_copies(node, casts=True)
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function" and node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]
    return node if norm_node_kind(node) else None


def _norm_path(captured, node: fx.Node) -> str:
    weight = node.args[2] if op_packet(node) in (_aten.layer_norm, _aten.group_norm) and len(node.args) > 2 else (
        node.args[1] if len(node.args) > 1 else None)
    return owner_path(captured, weight) or module_path(node) or node.name


def _structural(model: nn.Module, example_inputs) -> tuple[list[tuple[str, str, str, float]], list[str]]:
    """(norm path, norm kind, producer path, |bias| spread) for biased producers feeding a norm,
    and the paths of Post-LN norms."""
    captured = capture(model, example_inputs)
    biased, post_ln = [], []
    for node in captured.graph.nodes:
        kind = norm_node_kind(node)
        if kind is None:
            continue
        x = through_value_copies(node.args[0], casts=True)  # copies, casts, eval dropout
        if isinstance(x, fx.Node) and op_packet(x) in LINEAR_PRODUCER_OPS and len(x.args) > 2 and x.args[2] is not None:
            producer = owner_path(captured, x.args[1]) or x.name
            biased.append((_norm_path(captured, node), kind, producer))
        if isinstance(x, fx.Node) and op_packet(x) == _aten.add and kind in ("LayerNorm", "RMSNorm"):
            if any(_norm_output_source(a) is not None for a in x.args[:2]):
                post_ln.append(_norm_path(captured, node))
    return biased, post_ln


def _batch_size(config: Mapping) -> int | None:
    for key in _BATCH_SIZE_KEYS:
        if isinstance(config.get(key), int):
            return config[key]
    return None


def _no_warmup(config: Mapping) -> bool:
    """True when the config names a warmup and it is zero (absent keys: unknown, not zero)."""
    steps, ratio = config.get("warmup_steps"), config.get("warmup_ratio")
    if steps is None and ratio is None:
        return False
    return not (steps or 0) and not (ratio or 0)


def check(model: nn.Module, example_inputs=None, *, training_config: Mapping | None = None,
          inference: bool = True) -> list[Finding]:
    """Findings about the model's norms (see the module docstring for each check).

    example_inputs: a tuple of positional or a dict of keyword arguments for one forward pass;
                    needed by the structural checks (bias before a norm, Post-LN).
    training_config: the training hyper-parameters as a mapping (Hugging Face ``TrainingArguments``
                    names work: ``per_device_train_batch_size``, ``warmup_steps``, ``warmup_ratio``).
    inference:      the model is about to serve inference (enables ``batchnorm-train-mode``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if training_config is not None and not isinstance(training_config, Mapping):
        raise TypeError(f"training_config must be a mapping (e.g. a dict), got {type(training_config).__name__}")
    findings: list[Finding] = []
    batch_norms = [(p, m) for p, m, kind in norm_modules(model) if kind == "BatchNorm"]

    if inference:
        for path, bn in batch_norms:
            if bn.training:
                findings.append(Finding(
                    "batchnorm-train-mode", "warning", path,
                    "BatchNorm is in train mode at inference: it normalizes with each batch's own statistics "
                    "(a batch of one collapses to β) and overwrites its running statistics; call model.eval()"))

    config = dict(training_config or {})
    if batch_norms and _batch_size(config) == 1:
        accum = config.get("gradient_accumulation_steps")
        extra = f" (gradient_accumulation_steps={accum} does not help: statistics come from the real batch)" if accum and accum > 1 else ""
        findings.append(Finding(
            "batchnorm-batch-size-1", "warning", batch_norms[0][0],
            f"training batch size 1 with {len(batch_norms)} BatchNorm layer(s): there are no batch statistics"
            f"{extra}; use GroupNorm/LayerNorm or a batch of 32 or more"))

    if example_inputs is None:
        findings.append(Finding("structure-skipped", "info", "",
                                "no example_inputs: bias-before-norm and Post-LN checks were skipped"))
        return findings
    try:
        biased, post_ln = _structural(model, example_inputs)
    except FoldError as err:
        findings.append(Finding("structure-skipped", "info", "", f"graph capture failed, structural checks skipped: {err}"))
        return findings

    for norm_path, kind, producer in biased:
        if kind in _FULLY_CENTERING:
            findings.append(Finding(
                "bias-before-norm", "warning", producer,
                f"its bias is redundant: the {kind} {norm_path} subtracts a per-channel mean, which removes any "
                f"per-channel constant; use bias=False"))
        elif kind == "LayerNorm":
            findings.append(Finding(
                "bias-before-norm", "info", producer,
                f"only the mean of its bias is redundant: the LayerNorm {norm_path} removes b̄·1 but not b − b̄·1; "
                "the bias is redundant only if it is constant across features"))
        # RMSNorm: no mean subtraction, the bias is never redundant. GroupNorm: only per-group means vanish.

    if post_ln and _no_warmup(config):
        findings.append(Finding(
            "post-ln-no-warmup", "warning", post_ln[0],
            f"Post-LN model ({len(post_ln)} norm(s) read a residual add of another norm's output) trained "
            "without learning-rate warmup: Post-LN usually diverges early without it; add warmup or use Pre-LN"))
    return findings


def post_ln_norms(model: nn.Module, example_inputs) -> list[str]:
    """Paths of the norms that read a residual add of another norm's output (the Post-LN pattern)."""
    return _structural(model, example_inputs)[1]


def findings_to_dict(findings: list[Finding]) -> list[dict]:
    return [asdict(f) for f in findings]


__all__ = ["check", "Finding", "post_ln_norms", "findings_to_dict"]
