"""``normfold rotate DIR -o OUT``: a tiny GPT-2 folder rotated, proved, written atomically and reloaded
exactly by ``normfold.from_pretrained``; every refusal one line, exit 2, nothing written."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import normfold
from normfold.cli import EXIT_OK, EXIT_USAGE, main
from normfold.hf.inputs import example_inputs_for
from normfold.hf.load import load_model
from normfold.hf.output_dir import REPORT_JSON

transformers = pytest.importorskip("transformers")
pytest.importorskip("rich")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny folders of tests/hf
from hf.conftest import tiny_dirs  # noqa: E402,F401


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["rotate", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def rotated_dir(tiny_dirs, tmp_path_factory):  # noqa: F811
    """``normfold rotate gpt2 -o OUT --method random --seed 3 --json``: (OUT, the printed JSON)."""
    out = tmp_path_factory.mktemp("rotate") / "rotated"
    code = main(["rotate", str(tiny_dirs["gpt2"]), "-o", str(out), "--method", "random", "--seed", "3", "--json"])
    assert code == EXIT_OK
    return out


def test_from_pretrained_rebuilds_the_rotated_model_exactly(tiny_dirs, rotated_dir, capsys):  # noqa: F811
    original = load_model(tiny_dirs["gpt2"])
    in_memory, _ = normfold.rotate(original, example_inputs_for(original), method="random", seed=3)
    reloaded = normfold.from_pretrained(rotated_dir)
    fresh = torch.randint(0, 96, (3, 13), generator=torch.Generator().manual_seed(7))  # not the proof's inputs
    expected = _logits(in_memory, fresh)
    assert _rel(_logits(reloaded, fresh), expected) <= 1e-5
    assert _rel(_logits(reloaded, fresh), _logits(original, fresh)) <= 1e-5  # the same function as the original
    # what the report warns about: stock transformers rebuilds LayerNorms, which re-center the rotated stream
    stock = transformers.GPT2LMHeadModel.from_pretrained(rotated_dir)
    assert _rel(_logits(stock, fresh), expected) > 1e-3


def test_report_says_rotated_with_method_seed_proof_and_the_stock_warning(rotated_dir):
    report = json.loads((rotated_dir / REPORT_JSON).read_text())
    assert report["rotation"]["method"] == "random" and report["rotation"]["seed"] == 3
    assert report["rotation"]["exact"] is True and report["rotation"]["streams"]
    ver = report["verification"]
    assert ver["ok"] is True and 0 < ver["max_rel_error"] <= 1e-9
    assert report["stock_compatible"] is False
    assert "normfold.from_pretrained" in report["stock_warning"] and "LayerNorm" in report["stock_warning"]
    assert report["saved_dtype"] == "float32"


def test_seed_and_method_change_the_written_weights(tiny_dirs, rotated_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "hadamard"
    code, printed, err = _run(capsys, tiny_dirs["gpt2"], "-o", out, "--seed", "3")
    assert code == EXIT_OK and "wrote" in printed and "normfold.from_pretrained" in err
    assert json.loads((out / REPORT_JSON).read_text())["rotation"]["method"] == "hadamard"
    a = normfold.from_pretrained(out).transformer.wte.weight
    b = normfold.from_pretrained(rotated_dir).transformer.wte.weight
    assert not torch.allclose(a, b)


def test_side_files_are_copied_and_overwrite_replaces_an_earlier_output(tiny_dirs, tmp_path, capsys):  # noqa: F811
    source = tmp_path / "gpt2"
    shutil.copytree(tiny_dirs["gpt2"], source)
    (source / "README.md").write_text("model card\n")
    out = tmp_path / "out"
    assert _run(capsys, source, "-o", out)[0] == EXIT_OK
    assert (out / "README.md").read_text() == "model card\n"
    code, _, err = _run(capsys, source, "-o", out)
    assert code == EXIT_USAGE and "output folder exists" in err
    assert _run(capsys, source, "-o", out, "--overwrite", "--seed", "1")[0] == EXIT_OK
    assert json.loads((out / REPORT_JSON).read_text())["rotation"]["seed"] == 1


@pytest.mark.parametrize("option", [["--method", "pca"], ["--slice", "0.2"], ["--stream"]])
def test_options_folders_do_not_support_yet_are_refused_in_one_line(tiny_dirs, tmp_path, capsys, option):  # noqa: F811
    out = tmp_path / "out"
    code, printed, err = _run(capsys, tiny_dirs["gpt2"], "-o", out, *option)
    assert code == EXIT_USAGE and printed == ""
    assert err.startswith("normfold: error: ") and "not supported for folders yet" in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_sharded_folder_is_refused_before_loading(tiny_dirs, tmp_path, capsys):  # noqa: F811
    sharded = tmp_path / "sharded"
    transformers.GPT2LMHeadModel.from_pretrained(tiny_dirs["gpt2"]).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    code, _, err = _run(capsys, sharded, "-o", out)
    assert code == EXIT_USAGE and "not supported for folders yet" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_post_ln_bert_is_refused_and_nothing_is_written(tiny_dirs, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "out"
    code, printed, err = _run(capsys, tiny_dirs["bert"], "-o", out)
    assert code == EXIT_USAGE and printed == ""
    assert err.startswith("normfold: error: cannot rotate") and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # no temporary sibling left either


def test_output_inside_the_input_is_refused(tiny_dirs, tmp_path, capsys):  # noqa: F811
    source = tmp_path / "gpt2"
    shutil.copytree(tiny_dirs["gpt2"], source)
    code, _, err = _run(capsys, source, "-o", source / "rotated")
    assert code == EXIT_USAGE and "input model folder" in err
    assert not (source / "rotated").exists()


def test_help_says_what_folders_do_not_support_yet(capsys):
    assert main(["rotate", "--help"]) == EXIT_OK
    text = " ".join(capsys.readouterr().out.split())
    assert "--method" in text and "--seed" in text and "--overwrite" in text and "--json" in text
    assert text.count("not supported for folders yet") == 3  # --method pca, --slice, --stream


def test_verify_checks_a_rotated_folder_through_its_outputs_and_says_why_not_its_weights(
        tiny_dirs, rotated_dir, capsys):  # noqa: F811
    code = main(["verify", str(tiny_dirs["gpt2"]), str(rotated_dir)])
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == EXIT_OK
    assert "a rotated folder (random, seed 3)" in text and "checked through the outputs only" in text
    assert "older normfold" not in text  # the reason given before: the report looked like an old one
