"""Option spelling shared by every command line of normfold: dashes, with the underscore form accepted.

A leaf module (it imports nothing of normfold), so ``normfold`` and ``python -m normfold.train`` spell
their options the same way.
"""
from __future__ import annotations

import argparse


def dash_options(parser: argparse.ArgumentParser) -> None:
    """Spell every long option with dashes (``--out-dir``) and accept its underscore spelling (``--out_dir``)
    as a hidden alias (parsed, not shown by ``--help``). ``dest`` is unchanged, so the command reads the same
    attribute."""
    for action in parser._actions:
        action.option_strings = [s.replace("_", "-") if s.startswith("--") else s for s in action.option_strings]
        for dashed in action.option_strings:
            for spelling in {dashed, dashed[:2] + dashed[2:].replace("-", "_")}:
                if parser._option_string_actions.setdefault(spelling, action) is not action:
                    raise ValueError(f"{parser.prog}: {spelling} names two different options")
