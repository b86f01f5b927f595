"""The lab's subcommands for the ``normfold`` command line.

    normfold inspect [MODEL_DIR] [--plot PNG] [--json] [--batch B --seq T]
    normfold check   [MODEL_DIR] [--train-config JSON] [--json] [--strict]

Registered by listing ``"normfold.lab.commands"`` in ``normfold.cli.COMMAND_MODULES``; heavy
imports happen inside the ``run`` functions.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

EXIT_OK, EXIT_FINDINGS = 0, 1


def _load(args):
    """The Hugging Face folder's model (default: the bundled one) and example inputs for it."""
    from ..hf.inputs import example_inputs_for
    from ..hf.load import default_model_path, load_model

    model_dir = Path(args.model_dir) if args.model_dir else default_model_path()
    model = load_model(model_dir, trust_remote_code=args.trust_remote_code)
    return model_dir, model, example_inputs_for(model, batch=args.batch, seq=args.seq)


def _run_inspect(args) -> int:
    from .diagnostics import inspect

    model_dir, model, inputs = _load(args)
    result = inspect(model, inputs)
    if args.plot:
        result.plot(args.plot)
    if args.json:
        print(json.dumps({"model": str(model_dir), **result.to_dict()}, indent=2))
        return EXIT_OK
    try:
        if not sys.stdout.isatty():
            raise ImportError  # pipes and logs get the plain table: rich would squeeze it to 80 columns
        from rich.console import Console

        Console().print(result.rich_table())
    except ImportError:
        print(result.table())
    if args.plot:
        print(f"wrote {args.plot}")
    return EXIT_OK


def _run_check(args) -> int:
    from .check import check, findings_to_dict

    config = None
    if args.train_config:
        try:
            config = json.loads(Path(args.train_config).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--train-config must be a readable JSON file, got {args.train_config}: {err}") from err
        if not isinstance(config, dict):
            raise ValueError(f"--train-config must hold a JSON object, got {type(config).__name__}")
    model_dir, model, inputs = _load(args)
    findings = check(model, inputs, training_config=config)
    if args.json:
        print(json.dumps({"model": str(model_dir), "findings": findings_to_dict(findings)}, indent=2))
    else:
        print(f"{model_dir}: {sum(f.severity == 'warning' for f in findings)} warning(s)")
        for f in findings:
            print(f"  {f}")
    has_warnings = any(f.severity == "warning" for f in findings)
    return EXIT_FINDINGS if (args.strict and has_warnings) else EXIT_OK


def add_commands(subparsers) -> None:
    """Add ``inspect`` and ``check`` to the ``normfold`` command's subparsers."""
    def common(p):
        p.add_argument("model_dir", nargs="?", help="Hugging Face folder (default: the bundled model)")
        p.add_argument("--json", action="store_true", help="print JSON on stdout")
        p.add_argument("--batch", type=int, default=2, help="batch size of the generated inputs (default 2)")
        p.add_argument("--seq", type=int, default=32, help="sequence length of the generated inputs (default 32)")
        p.add_argument("--trust-remote-code", action="store_true", help="allow the folder's own modeling code to run")

    p = subparsers.add_parser("inspect", help="statistics of every norm's input and the activation scale per layer")
    common(p)
    p.add_argument("--plot", metavar="PNG", help="also draw the statistics into this PNG file")
    p.set_defaults(run=_run_inspect)

    p = subparsers.add_parser("check", help="warnings about the model's norms and its training configuration")
    common(p)
    p.add_argument("--train-config", metavar="JSON",
                   help="training hyper-parameters (batch size, warmup_steps, warmup_ratio) as a JSON object")
    p.add_argument("--strict", action="store_true", help="exit with status 1 when there are warnings")
    p.set_defaults(run=_run_check)


register_cli = add_commands
