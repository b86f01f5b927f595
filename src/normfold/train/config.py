"""Training configuration: a dataclass, a JSON/TOML file, and ``--key=value`` overrides."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .model import GPTConfig, check_positive_ints
from .parallel import PARALLEL

PRECISIONS = ("auto", "fp32", "bf16", "fp64")


class TrainConfigError(ValueError):
    """A config file or value the user gave is wrong, or the data it names cannot train that model;
    raised before training starts."""


@dataclass
class TrainConfig:
    """Everything one training run needs. Defaults: a CPU run of a few minutes."""

    model: GPTConfig = field(default_factory=GPTConfig)
    data: list[str] = field(default_factory=list)  # text files; empty = CPython's pydoc topics
    val_fraction: float = 0.1  # whole documents (seeded draw, the same every run) up to 10% of the bytes are validation
    out_dir: str = "runs/gpt"  # CSV log, resolved config, summary and checkpoint go here
    seed: int = 0  # initial weights and batch order
    batch_size: int = 16  # sequences per micro-batch per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step (gradients accumulated; one CBWC centering)
    max_steps: int = 400  # optimizer steps; tokens = max_steps · batch_size · grad_accum_steps · block_size · world size
    lr: float = 1e-3  # peak learning rate; small models tolerate nanoGPT's Shakespeare-char value
    min_lr: float = 1e-4  # cosine decay floor, lr/10 as in Chinchilla-style schedules
    warmup_steps: int = 40  # linear warmup (10% of the default run); 0 disables it
    weight_decay: float = 0.1  # AdamW decay on matrices and embeddings only (GPT-2/nanoGPT practice)
    beta1: float = 0.9
    beta2: float = 0.95  # nanoGPT/GPT-3 value: steadier second moment for small batches
    grad_clip: float = 1.0  # global-norm clipping; 0 disables it
    precision: str = "auto"  # auto: bf16 autocast on a bf16-capable GPU, else fp32; fp64 for exactness tests
    device: str = "auto"  # auto: cuda if available, else cpu
    eval_interval: int = 50  # steps between validation losses
    eval_iters: int = 10  # validation batches per estimate (fixed batches, same for every eval)
    log_interval: int = 10  # steps between train-loss lines in the CSV
    save_checkpoint: bool = True  # a Hugging Face GPT-2 folder when the architecture matches
    save_rank_weights: bool = False  # every DDP rank saves its final weights (to check they agree)
    progress: bool = True  # rich progress bar on a terminal; plain lines otherwise
    allow_partial_cbwc: bool = False  # cbwc_rmsnorm: train LayerNorms CBWC cannot convert as LayerNorms (else refuse)
    compile: bool = False  # torch.compile the training forward/backward (Inductor); the first steps compile
    parallel: str = "ddp"  # under torchrun: ddp (replicated weights) or fsdp2 (fully_shard: sharded weights)
    checkpoint_interval: int = 0  # steps between resumable states (out_dir/train_state.pt; also at the end); 0: none
    resume: str = ""  # a run folder holding train_state.pt: continue that run where it stopped
    tensorboard: bool = False  # also log to TensorBoard (out_dir/tensorboard; needs the tensorboard extra)

    def __post_init__(self) -> None:
        if isinstance(self.model, dict):
            self.model = GPTConfig(**self.model)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        check_positive_ints(self, ("batch_size", "grad_accum_steps", "max_steps", "eval_interval", "eval_iters",
                                   "log_interval"))
        if self.parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {self.parallel!r}")
        if self.checkpoint_interval < 0:
            raise ValueError("checkpoint_interval must be >= 0 (0: no resumable state), "
                             f"got {self.checkpoint_interval!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr, got min_lr={self.min_lr!r}, lr={self.lr!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_MODEL_KEYS = {f.name: f for f in dataclasses.fields(GPTConfig)}
_TRAIN_KEYS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "model"}


def _parse_value(text: str, current: Any, key: str) -> Any:
    """Parse ``text`` into the type of the field's current value."""
    if isinstance(current, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--{key.replace('_', '-')} expects {_expected(current)}, got {text!r}")
    if isinstance(current, list):
        return [p for p in text.split(",") if p]
    try:
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
    except ValueError:
        raise ValueError(f"--{key.replace('_', '-')} expects {_expected(current)}, got {text!r}") from None
    return text


def _expected(current: Any) -> str:
    """A field's type in words, from its default value."""
    if isinstance(current, bool):
        return "true/false"
    if isinstance(current, list):
        return "a list of strings"
    return {int: "an int", float: "a float", str: "a string"}[type(current)]


def _has_type(value: Any, current: Any) -> bool:
    """Whether ``value`` (from a file or a keyword) fits the type of the field whose default is ``current``:
    a bool is no number, an int is a float, a list holds strings."""
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, list):
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(current))


def _flatten(raw: dict[str, Any]) -> dict[str, Any]:
    """Accept both ``{"model": {...}}`` and model keys at the top level."""
    if not isinstance(raw, dict):
        raise TypeError(f"a config file must hold a table/object of keys, got {type(raw).__name__}")
    raw = dict(raw)
    nested = raw.pop("model", {}) or {}
    if not isinstance(nested, dict):
        raise TypeError(f"'model' in a config file must be a table/object, got {type(nested).__name__}")
    return {**nested, **raw}


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    if path.suffix == ".json":
        return _flatten(json.loads(path.read_text()))
    if path.suffix == ".toml":
        import tomllib  # standard library from Python 3.11, the oldest normfold supports

        return _flatten(tomllib.loads(path.read_text()))
    raise ValueError(f"config file must end in .json or .toml, got {path.name!r}")


def resolve_config(config_file: str | Path | None = None, overrides: Sequence[str] = (),
                   **values: Any) -> TrainConfig:
    """Defaults < config file < keyword ``values`` < ``--key=value`` overrides.

    Model keys (``n_layer``, ``norm``, ...) and training keys share one namespace.
    """
    merged: dict[str, Any] = read_config_file(config_file) if config_file else {}
    merged.update(values)
    defaults = TrainConfig()
    current = {**{k: getattr(defaults.model, k) for k in _MODEL_KEYS}, **{k: getattr(defaults, k) for k in _TRAIN_KEYS}}
    for item in overrides:
        if not item.startswith("--") or "=" not in item:
            raise ValueError(f"overrides must look like --key=value, got {item!r}")
        key, text = item[2:].split("=", 1)
        key = key.replace("-", "_")
        if key not in current:
            raise ValueError(f"unknown config key {key!r}; known: {sorted(current)}")
        merged[key] = _parse_value(text, current[key], key)
    unknown = sorted(set(merged) - set(current))
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; known: {sorted(current)}")
    for key, value in merged.items():  # before the dataclasses compare them: {"lr": "abc"} is named, not a '<=' error
        if not _has_type(value, current[key]):
            raise TypeError(f"config key {key!r} expects {_expected(current[key])}, got {value!r} "
                            f"({type(value).__name__})")
    model = GPTConfig(**{k: v for k, v in merged.items() if k in _MODEL_KEYS})
    return TrainConfig(model=model, **{k: v for k, v in merged.items() if k in _TRAIN_KEYS})
