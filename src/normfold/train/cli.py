"""``normfold train`` / ``python -m normfold.train``: train the experiment GPT from a config."""
from __future__ import annotations

import argparse
import json
from typing import Sequence

_EPILOG = """\
Any config key can be overridden as --key=value (model and training keys share one namespace), e.g.
  python -m normfold.train --norm=rmsnorm --placement=pre --max_steps=200 --out_dir=runs/rms
  torchrun --nproc_per_node=2 -m normfold.train --config=my.toml
Keys: see normfold.train.TrainConfig and normfold.train.GPTConfig."""


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="a .json or .toml config file (flat, or with a [model] table)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def run(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    """Resolve the config, train, print the summary line; returns the exit status."""
    from .config import resolve_config
    from .trainer import train

    config = resolve_config(args.config, overrides)
    if args.print_config:
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    summary = train(config)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            rank = dist.get_rank()
            dist.destroy_process_group()
            if rank != 0:
                return 0
    except ImportError:  # pragma: no cover
        pass
    final = summary["final_val_loss"]
    tps = summary["tokens_per_s"]
    print(f"{config.model.norm}/{config.model.placement}: {summary['steps']} steps, "
          f"val loss {final if final is None else round(final, 4)}, "
          f"{'n/a' if tps is None else f'{tps:,.0f}'} tokens/s, diverged={summary['diverged']}; "
          f"results in {config.out_dir}")
    return 0


def register_cli(subparsers) -> argparse.ArgumentParser:
    """Add the ``train`` subcommand to an ``argparse`` subparsers object.

    The caller must pass unknown arguments on as overrides: use ``parse_known_args`` and call
    ``args.func(args, unknown)``.
    """
    parser = subparsers.add_parser("train", help="train the experiment GPT (norm variants, placements, CBWC)",
                                   description=__doc__, epilog=_EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m normfold.train", description=__doc__, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    try:
        return run(args, overrides)
    except (ValueError, TypeError, FileNotFoundError) as e:
        parser.error(str(e))
    return 2  # pragma: no cover
