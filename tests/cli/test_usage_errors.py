"""Command-line mistakes, said precisely: a wrong option named under its subcommand (never the top-level
usage, never hidden behind a missing ``-o``), ``train``'s messages in the options' own dashed spelling
with the real cause, help text without RST markup, and ``train --help``'s examples the README's."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from normfold.cli import EXIT_USAGE, build_parser, main, subcommand_parsers
from normfold.train import cli as train_cli

README = Path(__file__).resolve().parents[2] / "README.md"
TINY_RUN = ["--n-layer=1", "--n-head=2", "--n-embd=16", "--block-size=16", "--batch-size=2", "--max-steps=1",
            "--eval-interval=1", "--eval-iters=1", "--progress=false", "--save-checkpoint=false"]


def _run(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, usage, message", [
    (["fold", "--wrongflag"], "usage: normfold fold", "normfold fold: error: unrecognized arguments: --wrongflag"),
    (["fold", "some/model", "-o", "out", "--keep-all"], "usage: normfold fold",
     "normfold fold: error: unrecognized arguments: --keep-all"),
    (["rotate", "--seeed=3", "-o", "out"], "usage: normfold rotate",
     "normfold rotate: error: unrecognized arguments: --seeed=3"),
    (["verify", "a", "b", "-q"], "usage: normfold verify", "normfold verify: error: unrecognized arguments: -q"),
    (["train", "--nosuch=1"], "usage: normfold train", "normfold train: error: unrecognized arguments: --nosuch=1"),
])
def test_a_wrong_option_is_named_under_its_subcommand(capsys, argv, usage, message):
    code, err = _run(capsys, *argv)
    assert code == EXIT_USAGE
    assert err.startswith(usage) and err.strip().splitlines()[-1] == message


def test_other_usage_errors_are_left_as_argparse_says_them(capsys):
    code, err = _run(capsys, "verify", "a")  # nothing misspelled: the missing argument is the error
    assert code == EXIT_USAGE and err.strip().endswith("normfold verify: error: the following arguments are required: "
                                                       "FOLDED_DIR")
    code, err = _run(capsys, "rotate", "-o", "out", "--seed", "-1", "--bundled", "x")  # -1 is a value, not an option
    assert "unrecognized" not in err


@pytest.mark.parametrize("options, says", [
    (["--max-steps=abc"], "normfold: error: --max-steps expects an int, got 'abc'"),
    (["--checkpoint-interval=-1"], "normfold: error: --checkpoint-interval must be >= 0 (0: no resumable state), got -1"),
    (["--resume={tmp}/nosuchdir"], "normfold: error: --resume={tmp}/nosuchdir: the run folder does not exist"),
    (["--resume={tmp}"], "normfold: error: --resume={tmp}: not a training run folder (it holds no config.json"),
])
def test_train_messages_use_the_dashed_spelling_and_name_the_real_cause(capsys, tmp_path, options, says):
    code, err = _run(capsys, "train", *[o.replace("{tmp}", str(tmp_path)) for o in options], "--print-config")
    assert code == EXIT_USAGE and err.strip().startswith(says.replace("{tmp}", str(tmp_path)))
    assert len(err.strip().splitlines()) == 1


def test_train_into_a_file_says_out_dir_with_a_dash(capsys, tmp_path):
    (tmp_path / "a_file").write_text("mine")
    code, err = _run(capsys, "train", *TINY_RUN, f"--out-dir={tmp_path / 'a_file'}")
    assert code == EXIT_USAGE and f"--out-dir must be a folder, got a file: {tmp_path / 'a_file'}" in err


def test_no_help_text_carries_rst_markup(capsys):
    parser = build_parser()
    texts = [parser.format_help()] + [sub.format_help() for sub in subcommand_parsers(parser).values()]
    for text in texts:
        assert "`" not in text and not re.search(r":(func|class|mod):", text), text[:200]


def test_train_help_gives_the_readmes_examples_and_the_readme_the_help_ones():
    readme_lines = [line.strip() for line in README.read_text().splitlines()
                    if re.match(r"\s*(torchrun .*)?normfold train ", line)]
    assert sorted(readme_lines) == sorted(train_cli.EXAMPLES)
    help_text = subcommand_parsers(build_parser())["train"].format_help()
    assert all(example in help_text for example in train_cli.EXAMPLES)


def test_a_config_its_class_validators_reject_is_one_line_naming_the_validators_reason(capsys, tmp_path):
    """Fails on main af93d81: huggingface_hub's StrictDataclassClassValidationError is no ValueError, so the
    CLI said "fold cannot handle this model (not a known refusal)" with a first line naming only the validator."""
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text('{"model_type": "gemma3_text", "num_hidden_layers": 2, '
                                          '"layer_types": ["full_attention", "full_attention", "full_attention"]}')
    code, err = _run(capsys, "analyze", tmp_path)
    assert code == EXIT_USAGE and err.strip().splitlines() == [
        f"normfold: error: unsupported or unreadable config in {tmp_path}: Class validation error for validator "
        "'validate_layer_type': ValueError: `num_hidden_layers` (2) must be equal to the number of `layer_types` (3)"]
