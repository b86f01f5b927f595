"""The ``normfold`` command, run in-process through ``main(argv)``."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from normfold.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main
from normfold.hf import default_model_path

pytest.importorskip("transformers")
pytest.importorskip("rich")

# reuse the tiny-model fixtures of tests/hf (tests/ put on sys.path: works in any pytest import mode)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf.conftest import minilm_dir, tiny_dirs  # noqa: E402,F401


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _leftovers(parent, name):
    """Temporary siblings the atomic writer might have left next to ``name``."""
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.normfold-")]


@pytest.fixture(params=["gpt2", "opt", "bert", "minilm"])
def model_dir(request, tiny_dirs):  # noqa: F811
    if request.param == "minilm":
        return request.getfixturevalue("minilm_dir")
    return tiny_dirs[request.param]


def test_fold_json_then_verify_then_analyze_on_each_model(capsys, tmp_path, model_dir):
    code, out, _ = _run(capsys, "fold", model_dir, "-o", tmp_path / "out", "--json")
    assert code == EXIT_OK
    report = json.loads(out)  # --json: stdout is the JSON report and nothing else
    assert {"num_norms", "num_foldable", "norms", "verification"} <= set(report)
    assert report["verification"]["ok"] and len(report["norms"]) == report["num_norms"]

    code, out, _ = _run(capsys, "verify", model_dir, tmp_path / "out")
    assert code == EXIT_OK and "passed" in out

    code, out, _ = _run(capsys, "analyze", model_dir, "--json")
    assert code == EXIT_OK and json.loads(out)["num_norms"] == report["num_norms"]


def test_analyze_prints_a_table_with_every_norm(capsys, tiny_dirs):  # noqa: F811
    code, out, _ = _run(capsys, "analyze", tiny_dirs["gpt2"])
    assert code == EXIT_OK
    for name in ("h.0.ln_1", "h.1.ln_2", "ln_f"):
        assert name in out


def test_analyze_defaults_to_the_bundled_model_and_fold_takes_it_with_bundled(capsys, tmp_path):
    code, out, _ = _run(capsys, "analyze", "--json")
    assert code == EXIT_OK and json.loads(out)["model"]["source"] == str(default_model_path().absolute())
    code, out, _ = _run(capsys, "fold", "--bundled", "-o", tmp_path / "out", "--json")
    assert code == EXIT_OK and json.loads(out)["num_foldable"] == 9


def test_demo_folds_the_bundled_model_and_reports_verification(capsys):
    code, out, _ = _run(capsys, "demo")
    assert code == EXIT_OK
    assert "9 of 9" in out and "verification: passed" in out and "normfold_report.md" in out


def test_verify_exits_1_when_the_folded_model_differs(capsys, tiny_dirs, tmp_path):  # noqa: F811
    out_dir = tmp_path / "out"
    assert _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out_dir)[0] == EXIT_OK
    from safetensors.torch import load_file, save_file
    state = load_file(out_dir / "model.safetensors")
    state["transformer.h.0.attn.c_proj.bias"] += 1.0
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    code, out, _ = _run(capsys, "verify", tiny_dirs["gpt2"], out_dir)
    assert code == EXIT_VERIFY_FAILED and "FAILED" in out


def _one_clear_line(err: str) -> bool:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    return len(lines) == 1 and lines[0].startswith("normfold: error:") and "Traceback" not in err


def test_missing_folder_is_a_usage_error(capsys, tmp_path):
    code, _, err = _run(capsys, "analyze", tmp_path / "nope")
    assert code == EXIT_USAGE and _one_clear_line(err) and "not found" in err


def test_folder_without_config_is_a_usage_error(capsys, tmp_path):
    code, _, err = _run(capsys, "fold", tmp_path, "-o", tmp_path / "out")
    assert code == EXIT_USAGE and _one_clear_line(err) and "config.json" in err
    assert not (tmp_path / "out").exists()


def test_corrupt_safetensors_is_a_usage_error(capsys, tiny_dirs, tmp_path):  # noqa: F811
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_dirs["gpt2"] / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}...")
    code, _, err = _run(capsys, "fold", broken, "-o", tmp_path / "out")
    assert code == EXIT_USAGE and _one_clear_line(err) and "corrupt" in err
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_a_usage_error(capsys, tmp_path):
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no_such_model", "architectures": ["NoSuchModel"]}))
    code, _, err = _run(capsys, "analyze", odd)
    assert code == EXIT_USAGE and _one_clear_line(err) and "no_such_model" in err


def test_a_model_without_a_norm_normfold_folds_is_refused_as_nothing_to_fold(capsys, tmp_path):
    """A tiny ResNet (BatchNorms only, no LayerNorm or RMSNorm): exit 2, one line, nothing written."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    transformers.ResNetModel(config).save_pretrained(tmp_path / "resnet")
    capsys.readouterr()  # transformers' own progress bar while saving the original
    code, out, err = _run(capsys, "fold", tmp_path / "resnet", "-o", tmp_path / "out")
    assert code == EXIT_USAGE and _one_clear_line(err), err
    assert "normfold: error: nothing to fold: ResNetModel has no LayerNorm" in err
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path, "out")


def test_existing_output_folder_is_refused_without_overwrite(capsys, tiny_dirs, tmp_path):  # noqa: F811
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out_dir)
    assert code == EXIT_USAGE and _one_clear_line(err) and "--overwrite" in err
    assert (out_dir / "keep.txt").read_text() == "mine"
    # --overwrite replaces only an empty folder or an earlier normfold output (tests/hf/test_atomic.py)
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out_dir, "--overwrite")
    assert code == EXIT_USAGE and _one_clear_line(err) and "normfold_report.json" in err
    assert (out_dir / "keep.txt").read_text() == "mine" and _leftovers(tmp_path, "out") == []


def test_output_inside_the_model_folder_is_refused(capsys, tiny_dirs):  # noqa: F811
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", tiny_dirs["gpt2"], "--overwrite")
    assert code == EXIT_USAGE and _one_clear_line(err) and "input model folder" in err


def test_fold_without_output_and_unknown_dtype_are_usage_errors(capsys, tiny_dirs):  # noqa: F811
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"])
    assert code == EXIT_USAGE and "-o/--output" in err
    assert _run(capsys, "fold", tiny_dirs["gpt2"], "-o", "x", "--dtype", "int8")[0] == EXIT_USAGE
    assert _run(capsys)[0] == EXIT_USAGE


@pytest.mark.parametrize("interruption", [KeyboardInterrupt, OSError])
def test_an_interrupted_save_leaves_nothing_behind(capsys, monkeypatch, tiny_dirs, tmp_path, interruption):  # noqa: F811
    import normfold.hf.folder as folder

    def save_half_then_fail(model, out_dir, **kwargs):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise interruption("disk full")

    monkeypatch.setattr(folder, "save_folded", save_half_then_fail)
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", tmp_path / "out")
    if interruption is KeyboardInterrupt:
        assert code == 130
    else:  # the system's own words in one line; the traceback only when asked for
        assert code == EXIT_USAGE and _one_clear_line(err) and "disk full" in err and "NORMFOLD_TRACEBACK=1" in err
        monkeypatch.setenv("NORMFOLD_TRACEBACK", "1")
        with pytest.raises(OSError, match="disk full"):
            main(["fold", str(tiny_dirs["gpt2"]), "-o", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


def _disk_full(kind: str, path):
    """What a full disk looks like from each writer: the system's OSError, safetensors' own error that only
    carries the system's text, or another library's error caused by an EDQUOT (quota) OSError."""
    import errno
    import os

    if kind == "OSError ENOSPC":
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    if kind == "SafetensorError":
        from safetensors import SafetensorError

        return SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                               'message: "No space left on device" })')
    err = RuntimeError("could not save")
    err.__cause__ = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(path))
    return err


@pytest.mark.parametrize("kind", ["OSError ENOSPC", "SafetensorError", "EDQUOT in the cause chain"])
def test_a_full_disk_is_named_in_one_line_and_the_output_stays_as_it_was(capsys, monkeypatch, tiny_dirs, tmp_path,  # noqa: F811
                                                                         kind):
    import normfold.hf.folder as folder

    out = tmp_path / "out"
    assert _run(capsys, "fold", tiny_dirs["opt"], "-o", out)[0] == EXIT_OK  # an earlier output that --overwrite replaces
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def save_half_then_the_disk_is_full(model, out_dir, **kwargs):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise _disk_full(kind, out_dir / "model.safetensors")

    monkeypatch.setattr(folder, "save_folded", save_half_then_the_disk_is_full)
    code, _, err = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out, "--overwrite")
    assert code == EXIT_USAGE and _one_clear_line(err), err
    assert f"no space left on device while writing {out}: free space or pick another -o" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and _leftovers(tmp_path, "out") == []


@pytest.mark.parametrize("kind", ["OSError ENOSPC", "SafetensorError"])
def test_a_full_disk_outside_an_output_folder_is_named_too(capsys, monkeypatch, tiny_dirs, tmp_path, kind):  # noqa: F811
    """A command that writes a file of its own (inspect --plot, bench's tables, train's log)."""
    import normfold.cli.lab as lab

    def plot_on_a_full_disk(args):
        raise _disk_full(kind, tmp_path / "plot.png")

    monkeypatch.setattr(lab, "_run_inspect", plot_on_a_full_disk)
    code, _, err = _run(capsys, "inspect", tiny_dirs["gpt2"], "--plot", tmp_path / "plot.png")
    assert code == EXIT_USAGE and _one_clear_line(err) and "no space left on device" in err, err
    assert "not a known refusal" not in err and "free space or write elsewhere" in err
    assert (f"while writing {tmp_path / 'plot.png'}" in err) == (kind == "OSError ENOSPC")  # the path, where known


def test_the_model_folder_is_never_modified(capsys, tiny_dirs, tmp_path):  # noqa: F811
    src = tiny_dirs["opt"]
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    assert _run(capsys, "fold", src, "-o", tmp_path / "out")[0] == EXIT_OK
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_a_sharded_folder_is_streamed_and_verified_block_by_block(capsys, tiny_dirs, tmp_path):  # noqa: F811
    from normfold.hf import load_model

    sharded = tmp_path / "sharded"
    load_model(tiny_dirs["opt"]).save_pretrained(sharded, max_shard_size="30KB", safe_serialization=True)
    code, out, _ = _run(capsys, "fold", sharded, "-o", tmp_path / "out", "--json")
    assert code == EXIT_OK
    report = json.loads(out)
    assert "streaming" in report and [b["block"] for b in report["verification"]["blocks"]] == \
        ["model.decoder.layers.0", "model.decoder.layers.1"]
    code, out, _ = _run(capsys, "verify", sharded, tmp_path / "out")
    assert code == EXIT_OK and "blocks model.decoder.layers.0" in out


def test_verify_prints_the_exact_rule_in_words_and_numbers_to_four_digits(capsys, tiny_dirs, tmp_path):  # noqa: F811
    out_dir = tmp_path / "out"
    assert _run(capsys, "fold", tiny_dirs["gpt2"], "-o", out_dir)[0] == EXIT_OK
    code, out, _ = _run(capsys, "verify", tiny_dirs["gpt2"], out_dir)
    assert code == EXIT_OK
    rule = [line for line in out.splitlines() if line.startswith("exact fold:")]
    assert len(rule) == 1 and " ≤ tolerance " in rule[0]
    assert "own error in float32" in rule[0] and "unit roundoff" in rule[0]
    code, out_json, _ = _run(capsys, "verify", tiny_dirs["gpt2"], out_dir, "--json")
    ver = json.loads(out_json)["verification"]["outputs"]  # --json: full precision
    assert f"{ver['max_rel_error']:.4g}" in rule[0] and f"{ver['tolerance']:.4g}" in rule[0]
    assert repr(ver["max_rel_error"]) != f"{ver['max_rel_error']:.4g}"  # the text rounded it, the JSON did not


def _every_parser():
    from normfold.cli import build_parser, subcommand_parsers

    return [build_parser(), *subcommand_parsers(build_parser()).values()]


def test_every_argument_of_every_command_has_help():
    missing = [f"{parser.prog}: {action.option_strings or action.dest}" for parser in _every_parser()
               for action in parser._actions if not action.help]
    assert not missing, missing


def test_every_option_is_spelled_with_dashes_and_the_underscore_form_is_a_hidden_alias(capsys):
    underscored = [f"{parser.prog} {s}" for parser in _every_parser() for action in parser._actions
                   for s in action.option_strings if s.startswith("--") and "_" in s]
    assert not underscored, underscored
    from normfold.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["train", "--max_steps=7"]).max_steps == "7"
    assert parser.parse_args(["train", "--max-steps", "7"]).max_steps == "7"
    assert parser.parse_args(["fold", "-o", "x", "--no_fold_affine"]).no_fold_affine
    code, help_text, _ = _run(capsys, "train", "--help")
    options = help_text.split("examples:")[0]  # the epilog's examples are free text
    assert code == EXIT_OK and "--max-steps" in options and "--max_steps" not in options


def test_dash_options_refuses_two_options_that_differ_only_in_spelling():
    import argparse

    from normfold._options import dash_options

    parser = argparse.ArgumentParser(prog="p")
    parser.add_argument("--out-dir", help="one")
    parser.add_argument("--out_dir", dest="other", help="another")
    with pytest.raises(ValueError, match="names two different options"):
        dash_options(parser)


def test_help_lists_the_subcommands_of_every_registered_module(capsys):
    from normfold.cli import COMMAND_MODULES, build_parser

    parser = build_parser()
    names = set(parser._subparsers._group_actions[0].choices)
    assert {"analyze", "fold", "verify", "demo"} <= names and len(COMMAND_MODULES) >= 1
    assert _run(capsys, "--help")[0] == EXIT_OK


def test_verify_of_a_folder_normfold_did_not_write_is_a_usage_error(capsys, tiny_dirs):  # noqa: F811
    code, _, err = _run(capsys, "verify", tiny_dirs["gpt2"], tiny_dirs["gpt2"])
    assert code == EXIT_USAGE and _one_clear_line(err) and "not a folder normfold wrote" in err


def test_analyze_plans_with_the_options_fold_takes(capsys, tiny_dirs, tmp_path):  # noqa: F811
    """`analyze --no-fold-affine` reports what `fold --no-fold-affine` does: every γ/β kept, norm by norm."""
    code, out, _ = _run(capsys, "analyze", tiny_dirs["gpt2"], "--no-fold-affine", "--json")
    assert code == EXIT_OK
    analyzed = json.loads(out)["norms"]
    code, out, _ = _run(capsys, "fold", tiny_dirs["gpt2"], "-o", tmp_path / "out", "--no-fold-affine", "--json")
    assert code == EXIT_OK
    assert analyzed == json.loads(out)["norms"] and not any(n["affine_folded"] for n in analyzed)
    code, out, _ = _run(capsys, "analyze", tiny_dirs["gpt2"], "--json")
    assert any(n["affine_folded"] for n in json.loads(out)["norms"])  # the default folds them


@pytest.mark.parametrize("option, says", [
    ("--norm=bogus", "norm must be one of"),
    ("--max-steps=abc", "expects an int, got 'abc'"),
    ("--config=/no/such/config.toml", "/no/such/config.toml"),
])
def test_a_bad_training_config_is_a_known_refusal_in_one_line(capsys, option, says):
    code, _, err = _run(capsys, "train", option, "--print-config")
    assert code == EXIT_USAGE and _one_clear_line(err) and says in err
    assert "not a known refusal" not in err  # the user's mistake, not normfold's


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_rotate_refuses_a_seed_torch_cannot_take_before_loading_anything(capsys, tmp_path, seed):
    """Fails on main (0a5ea51): the seed failed with "Overflow" after the model had loaded."""
    code, _, err = _run(capsys, "rotate", tmp_path / "no-such-folder", "-o", tmp_path / "out", "--seed", seed)
    assert code == EXIT_USAGE and f"--seed must be in [0, {2**63 - 1}]" in err and "got " + seed in err
    assert not (tmp_path / "out").exists()


_TINY_RUN = {"max_steps": 1, "n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16, "progress": False,
             "save_checkpoint": False, "eval_iters": 1}  # should a refusal fail to come, the run is short


@pytest.mark.parametrize("bad, says", [
    ({"lr": "abc"}, "config key 'lr' expects a float, got 'abc' (str)"),
    ({"lr": [1, 2]}, "config key 'lr' expects a float, got [1, 2] (list)"),
    ({"max_steps": 1.5}, "config key 'max_steps' expects an int, got 1.5 (float)"),
    ({"model": {"vocab_size": True}}, "config key 'vocab_size' expects an int, got True (bool)"),
    ({"compile": "yes"}, "config key 'compile' expects true/false, got 'yes' (str)"),
    ({"data": "corpus.txt"}, "config key 'data' expects a list of strings, got 'corpus.txt' (str)"),
    ([1, 2], "a config file must hold a table/object of keys, got list"),
])
def test_a_config_value_of_the_wrong_type_is_named_with_what_was_expected(capsys, tmp_path, bad, says):
    config = tmp_path / "my.json"
    config.write_text(json.dumps({**_TINY_RUN, **bad} if isinstance(bad, dict) else bad))
    code, _, err = _run(capsys, "train", f"--config={config}", f"--out-dir={tmp_path / 'run'}")
    assert code == EXIT_USAGE and _one_clear_line(err) and says in err, err
    assert "not a known refusal" not in err and not (tmp_path / "run").exists()
