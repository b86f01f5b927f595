"""``normfold train`` / ``python -m normfold.train``: train the experiment GPT from a config.

Every config key is an option (``--norm=rmsnorm`` or ``--norm rmsnorm``); model and training keys
share one namespace. Precedence: defaults < ``--config`` file < options.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Sequence

from .._options import dash_options
from .config import PRECISIONS, TrainConfig, TrainConfigError, resolve_config
from .model import NORMS, PLACEMENTS, GPTConfig
from .parallel import PARALLEL
from .trainer import train

# --help's text, plain (the module docstring is for the API reference); the examples are the README's
_DESCRIPTION = """\
Train the experiment GPT from a config. Every config key is an option (--norm=rmsnorm or
--norm rmsnorm); model and training keys share one namespace. Precedence: defaults < --config
file < options. 'python -m normfold.train' takes the same options."""
EXAMPLES = (
    "torchrun --nproc-per-node 2 --no-python normfold train --parallel=fsdp2 --norm=cbwc_rmsnorm --out-dir=runs/a",
    "normfold train --checkpoint-interval=50 --out-dir=runs/b  # or --parallel=ddp; --tensorboard",
    "normfold train --resume=runs/b  # after an interruption",
)
_EPILOG = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES)


def _config_keys() -> list[tuple[str, object]]:
    """(name, default) of every GPTConfig and TrainConfig field, model fields first."""
    model, training = GPTConfig(), TrainConfig()
    keys = [(f.name, getattr(model, f.name)) for f in dataclasses.fields(GPTConfig)]
    return keys + [(f.name, getattr(training, f.name)) for f in dataclasses.fields(TrainConfig) if f.name != "model"]


_NOTES = {  # what a key's name does not say
    "data": "comma-separated files; empty: CPython's pydoc topics",
    "allow_partial_cbwc": "cbwc_rmsnorm: train the LayerNorms CBWC cannot convert as LayerNorms, with a warning, "
                          "instead of refusing",
    "grad_accum_steps": "micro-batches of batch_size per optimizer step, gradients accumulated",
    "compile": "torch.compile the model for training (Inductor); the first steps pay for compilation",
    "parallel": "how the processes of torchrun share the model",
    "checkpoint_interval": "steps between resumable states in OUT_DIR/train_state.pt (and at the end); 0: none",
    "resume": "a run folder with train_state.pt: continue that run, writing into that folder unless --out-dir "
              "names another (its config.json is the base config; only where and how it reports may change)",
    "tensorboard": "also log to TensorBoard in OUT_DIR/tensorboard (pip install 'normfold[tensorboard]')",
}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="a .json or .toml config file (flat, or with a [model] table)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out-dir that holds no earlier training run (replaces its files)")
    choices = {"norm": NORMS, "placement": PLACEMENTS, "precision": PRECISIONS, "parallel": PARALLEL}
    keys = parser.add_argument_group("config keys (values are checked by TrainConfig / GPTConfig)")
    for name, default in _config_keys():
        shown = ",".join(default) if isinstance(default, list) else default
        extra = f" (one of {', '.join(choices[name])})" if name in choices else ""
        extra += f" ({_NOTES[name]})" if name in _NOTES else ""
        if isinstance(default, bool):  # a flag alone means true: --compile, --allow-partial-cbwc
            keys.add_argument(f"--{name}", default=argparse.SUPPRESS, metavar="V", nargs="?", const="true",
                              help=f"true/false, alone: true; default: {shown!s}{extra}")
        else:
            keys.add_argument(f"--{name}", default=argparse.SUPPRESS, metavar="V", help=f"default: {shown!s}{extra}")


def _resolve(args: argparse.Namespace) -> TrainConfig:
    """The config from defaults, ``--config`` and the options; TrainConfigError naming what is wrong."""
    overrides = [f"--{name}={getattr(args, name)}" for name, _ in _config_keys() if hasattr(args, name)]
    config_file = args.config
    if getattr(args, "resume", ""):
        _check_run_folder(Path(args.resume))
        if config_file is None:  # the resumed run's own config, options on top
            config_file = Path(args.resume) / "config.json"
        if not hasattr(args, "out_dir"):  # never the out_dir its config.json recorded: the run may have moved
            overrides.append(f"--out_dir={args.resume}")
    try:
        return resolve_config(config_file, overrides)
    except (ValueError, TypeError, OSError) as err:
        raise TrainConfigError(_as_option(str(err))) from err


def _check_run_folder(run: Path) -> None:
    """TrainConfigError unless ``--resume`` names a run folder: one that exists and holds its config."""
    if not run.is_dir():
        raise TrainConfigError(f"--resume={run}: the run folder does not exist" if not run.exists()
                               else f"--resume={run}: expected a run folder, got a file")
    if not (run / "config.json").is_file():
        raise TrainConfigError(f"--resume={run}: not a training run folder (it holds no config.json; "
                               "give the --out-dir of an earlier run)")


def _as_option(message: str) -> str:
    """A config check's message as the command line spells it: its leading key as the option
    (``checkpoint_interval must be >= 0`` -> ``--checkpoint-interval must be >= 0``)."""
    key = message.split(" ", 1)[0]
    if key in {name for name, _ in _config_keys()}:
        return f"--{key.replace('_', '-')}{message[len(key):]}"
    return message


def run(args: argparse.Namespace) -> int:
    """Resolve the config, train, print a summary line; returns the exit status."""
    config = _resolve(args)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    summary = train(config, overwrite=args.overwrite)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        # every rank done communicating before any tears its group down: a rank whose peer left first aborted at
        # exit under FSDP2 ("terminate called without an active exception", exit -6; CI of 46636d6)
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    final, tps = summary["final_val_loss"], summary["tokens_per_s"]
    print(f"{config.model.norm}/{config.model.placement}: {summary['steps']} steps, "
          f"val loss {'n/a' if final is None else f'{final:.4f}'}, "
          f"{'n/a' if tps is None else f'{tps:,.0f}'} tokens/s, diverged={summary['diverged']}; "
          f"results in {config.out_dir}")
    return 0


def add_commands(subparsers) -> None:
    """Add ``train`` to the ``normfold`` command (``normfold.cli``'s ``COMMAND_MODULES`` protocol)."""
    parser = subparsers.add_parser("train", help="train the experiment GPT (norm variants, placements, CBWC)",
                                   description=_DESCRIPTION, epilog=_EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(run=run, on_interrupt=_on_interrupt)


def _on_interrupt(args) -> str:
    """What an interrupted run left: its log and, with a checkpoint interval, a state to resume from."""
    out = getattr(args, "out_dir", None) or getattr(args, "resume", None) or "the --out-dir folder"
    if str(getattr(args, "checkpoint_interval", "0")).strip() not in ("", "0") or getattr(args, "resume", None):
        return f"interrupted; {out} keeps the last saved state: continue with --resume={out}"
    return f"interrupted; {out} keeps the log so far (with --checkpoint-interval=K, --resume could continue it)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normfold.train", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    dash_options(parser)  # --max-steps, as `normfold train` spells it; --max_steps still parses
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))
    return 2  # pragma: no cover
