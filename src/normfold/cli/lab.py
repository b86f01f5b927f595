"""The lab's commands: ``inspect`` (what each norm receives) and ``check`` (configuration warnings).

    normfold inspect [MODEL_DIR] [--text FILE|STRING] [--plot PNG] [--json] [--batch B --seq T]
    normfold check   [MODEL_DIR] [--train-config FILE|JSON] [--json] [--strict]

The lab's functions take a model and inputs; loading a Hugging Face folder and reading the
command line happen here.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .._deps import require
from ..hf.inputs import calibration_batches, example_inputs_for, load_tokenizer, max_positions, read_calibration_file
from ..hf.load import load_config, load_model
from ..lab.check import check, findings_to_dict
from ..lab.diagnostics import inspect
from ._common import EXIT_OK, UsageError, add_model_dir, add_trust_remote_code, model_dir, positive_int

EXIT_FINDINGS = 1  # check --strict: there are warnings


def _inputs(args, model, source: Path) -> list:
    """Batches for the model: ``--text`` tokenized by the folder's tokenizer, else seeded random ids."""
    if getattr(args, "text", None) is None:
        return [example_inputs_for(model, batch=args.batch, seq=args.seq)]
    texts = read_calibration_file(args.text) if Path(args.text).is_file() else [_inline_text(args.text)]
    return calibration_batches(model, load_tokenizer(source, trust_remote_code=args.trust_remote_code), texts,
                               batch_size=args.batch)


DEFAULT_SEQ = 32


def _sequence_length(args, source: Path) -> int:
    """The length of the generated inputs, read before the model is loaded: ``--seq``, refused when
    the config gives the model fewer positions (the inputs would be cut to them); the default is
    cut to them, since nobody asked for it."""
    config = load_config(source, trust_remote_code=args.trust_remote_code)
    limit = max_positions(config.get_text_config())
    if args.seq is None:
        return DEFAULT_SEQ if limit is None else min(DEFAULT_SEQ, limit)
    if limit is not None and args.seq > limit:
        raise UsageError(f"--seq {args.seq} is more than the {limit} positions the model in {source} takes "
                         f"(max_position_embeddings / n_positions in its config.json): expected 1 to {limit}")
    return args.seq


def _inline_text(value: str) -> str:
    """``--text`` that names no file is the text itself, unless it reads as a path (one word with a folder
    or a text-file suffix): then a mistyped file name is refused instead of being inspected as text."""
    path = Path(value)
    if not value.split() or (len(value.split()) == 1 and ("/" in value or path.suffix in {".txt", ".text", ".md"})):
        raise UsageError(f"--text names no file: {value!r} (give a UTF-8 file, one text per line, or the text itself)")
    return value


def _run_inspect(args) -> int:
    source = model_dir(args)
    if args.text is None:
        args.seq = _sequence_length(args, source)
    model = load_model(source, trust_remote_code=args.trust_remote_code)
    result = inspect(model, _inputs(args, model, source))
    linear_outputs = sum(point.role == "linear output" for point in result.scale)
    if args.plot:
        result.plot(args.plot)
    if args.json:
        print(json.dumps({"model": str(source), "num_linear_outputs": linear_outputs, **result.to_dict()}, indent=2))
        return EXIT_OK
    if sys.stdout.isatty():
        require("rich.console").Console().print(result.rich_table())
    else:  # pipes and logs get the plain table: rich would squeeze it to 80 columns
        print(result.table())
    print(f"{linear_outputs} linear-like outputs traced (Linear, Conv1D, Conv) over {result.num_batches} batch(es)")
    if args.plot:
        print(f"wrote {args.plot}")
    return EXIT_OK


def training_config(value: str) -> dict[str, Any]:
    """``--train-config``: inline JSON (``'{"warmup_steps": 0}'``) or the path of a JSON file, holding an object."""
    inline = value.lstrip().startswith("{")
    if inline:
        text = value
    else:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise UsageError(f"--train-config must be a JSON file or an inline JSON object, got {value!r}: "
                             f"{getattr(err, 'strerror', None) or err}") from err
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        where = "inline JSON" if inline else f"the JSON file {value}"
        raise UsageError(f"--train-config: {where} does not parse: {err}") from err
    if not isinstance(config, dict):
        raise UsageError(f"--train-config must hold a JSON object, got {type(config).__name__}")
    return config


def _run_check(args) -> int:
    config = training_config(args.train_config) if args.train_config is not None else None
    source = model_dir(args)
    args.seq = _sequence_length(args, source)
    model = load_model(source, trust_remote_code=args.trust_remote_code)
    findings = check(model, _inputs(args, model, source)[0], training_config=config)
    if args.json:
        print(json.dumps({"model": str(source), "findings": findings_to_dict(findings)}, indent=2))
    else:
        print(f"{source}: {sum(f.severity == 'warning' for f in findings)} warning(s)")
        for f in findings:
            print(f"  {f}")
    has_warnings = any(f.severity == "warning" for f in findings)
    return EXIT_FINDINGS if (args.strict and has_warnings) else EXIT_OK


def _add_parser(subparsers, name: str, summary: str, run):
    """A lab command's parser with the options both share: MODEL_DIR, --json, the inputs' size."""
    parser = subparsers.add_parser(name, help=summary)
    add_model_dir(parser)
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")
    parser.add_argument("--batch", type=positive_int, default=2, help="batch size of the inputs (default 2)")
    parser.add_argument("--seq", type=positive_int, default=None,
                        help=f"sequence length of the generated inputs, without --text; at most the model's positions "
                             f"(default {DEFAULT_SEQ}, or the model's positions if fewer)")
    add_trust_remote_code(parser)
    parser.set_defaults(run=run)
    return parser


def add_commands(subparsers) -> None:
    """Add ``inspect`` and ``check`` to the ``normfold`` command's subparsers."""
    inspect_parser = _add_parser(subparsers, "inspect", "statistics of every norm's input and the activation scale "
                                                        "per layer", _run_inspect)
    inspect_parser.add_argument("--text", metavar="FILE|STRING",
                                help="real text instead of random token ids: a UTF-8 file (one text per line) or the "
                                     "text itself, tokenized with the folder's tokenizer")
    inspect_parser.add_argument("--plot", metavar="PNG", help="also draw the statistics into this PNG file")

    check_parser = _add_parser(subparsers, "check", "warnings about the model's norms and its training configuration",
                               _run_check)
    check_parser.add_argument("--train-config", metavar="FILE|JSON",
                              help='training hyper-parameters (batch size, warmup_steps, warmup_ratio): a JSON file '
                                   'or an inline JSON object, e.g. \'{"per_device_train_batch_size": 2}\'')
    check_parser.add_argument("--strict", action="store_true", help="exit with status 1 when there are warnings")
