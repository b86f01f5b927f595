"""``normfold rotate DIR -o OUT``: a tiny GPT-2 folder rotated, proved, written atomically and reloaded
exactly by ``normfold.from_pretrained``; every refusal one line, exit 2, nothing written."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

import normfold
from normfold.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main
from normfold.hf.inputs import example_inputs_for, read_calibration_file
from normfold.hf.load import CheckpointError, load_model
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.recipe import BASES_FILE, file_sha256
from normfold.hf.rotate_folder import calibration_calls
import sealing

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
    _assert_stock_transformers_refuses(rotated_dir)


def _assert_stock_transformers_refuses(folder):
    """Stock transformers would rebuild LayerNorms, which re-center the rotated stream (0.16 off, silently,
    on main 36efdc1): both the Auto class and the model's own class must refuse the folder loudly."""
    with pytest.raises(ValueError, match="model type `normfold: load with normfold.from_pretrained`"):
        transformers.AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(OSError, match="no file named model.safetensors"):
        transformers.GPT2LMHeadModel.from_pretrained(folder)
    with pytest.raises(CheckpointError, match="for normfold.from_pretrained only"):
        load_model(folder)  # nor does normfold take it for an original


def test_report_says_rotated_with_method_seed_proof_and_the_stock_warning(rotated_dir):
    report = json.loads((rotated_dir / REPORT_JSON).read_text())
    assert report["rotation"]["method"] == "random" and report["rotation"]["seed"] == 3
    assert report["rotation"]["exact"] is True and report["rotation"]["streams"]
    ver = report["verification"]
    assert ver["ok"] is True and 0 < ver["max_rel_error"] <= 1e-9
    assert report["stock_compatible"] is False
    assert "normfold.from_pretrained" in report["stock_warning"] and "LayerNorm" in report["stock_warning"]
    assert report["saved_dtype"] == "float32"


def test_the_model_card_says_rotated_and_that_only_normfold_loads_it(rotated_dir):
    card = (rotated_dir / "README.md").read_text()
    assert card.startswith("## Folded by normfold") and "rotated (random, seed 3)" in card
    assert "stock transformers refuses this folder" in card


def test_seed_and_method_change_the_written_weights(tiny_dirs, rotated_dir, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "hadamard"
    code, printed, err = _run(capsys, tiny_dirs["gpt2"], "-o", out, "--seed", "3")
    assert code == EXIT_OK and "wrote" in printed and "normfold.from_pretrained" in err
    assert "exact rotation: max relative error" in " ".join(printed.split()) and "exact fold" not in printed
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
    assert (out / "README.md").read_text().startswith("model card\n\n## Folded by normfold\n")  # the card, and ours
    code, _, err = _run(capsys, source, "-o", out)
    assert code == EXIT_USAGE and "output folder exists" in err
    assert _run(capsys, source, "-o", out, "--overwrite", "--seed", "1")[0] == EXIT_OK
    assert json.loads((out / REPORT_JSON).read_text())["rotation"]["seed"] == 1


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
    assert "not supported for folders yet" not in text and "shard by shard" in text  # --stream
    assert "--calibration" in text and "--slice" in text and "SliceGPT" in text


def test_verify_remakes_a_rotated_folder_and_compares_every_tensor(tiny_dirs, rotated_dir, capsys):  # noqa: F811
    code = main(["verify", str(tiny_dirs["gpt2"]), str(rotated_dir)])
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert code == EXIT_OK
    assert "verification: passed (random rotation, seed 3)" in text
    assert f"weights: {len(_stored(rotated_dir))} tensors, all bit-identical" in text  # rotated folders too
    assert "exact rotation:" in text and "exact fold" not in text  # the rule names what was checked
    assert "skipped" not in text and "outputs only" not in text


def _stored(folder) -> list[str]:
    """The names of the tensors the folder's weights file holds."""
    with pytest.importorskip("safetensors").safe_open(sealing.weights_file(folder), framework="pt") as f:
        return list(f.keys())


def _tampered(folder, to, edit, *, reseal: bool = True):
    """A copy of ``folder`` at ``to`` whose weights file was changed in place by ``edit(tensors)``."""
    safetensors = pytest.importorskip("safetensors.torch")
    shutil.copytree(folder, to)
    file = sealing.weights_file(to)
    weights = safetensors.load_file(file)
    edit(weights)
    safetensors.save_file(weights, file, metadata={"format": "pt"})
    if reseal:
        sealing.reseal(to)
    return to


def _rows_the_check_tokens_never_reach(weights):
    """Issue 29's rotated folder that passed verify: positions >= 8 zeroed, the upper half of the tokens negated."""
    weights["transformer.wpe.weight"][8:] = 0.0
    weights["transformer.wte.weight"][48:] *= -1.0


def test_verify_fails_a_rotated_folder_changed_where_the_check_inputs_never_reach(tiny_dirs, rotated_dir,  # noqa: F811
                                                                                  tmp_path, capsys):
    bad = _tampered(rotated_dir, tmp_path / "bad", _rows_the_check_tokens_never_reach)
    assert main(["verify", "--json", str(tiny_dirs["gpt2"]), str(bad)]) == EXIT_VERIFY_FAILED
    result = json.loads(capsys.readouterr().out)["verification"]
    weights = result["files"]["weights"]
    assert weights["ok"] is False and weights["worst"]["name"] in ("transformer.wpe.weight", "transformer.wte.weight")
    assert result["why"].startswith("stored weights: transformer.w") and "1 more tensor(s) off" in result["why"]


def test_a_rotated_folder_changed_without_recomputing_the_seal_fails_the_seal(tiny_dirs, rotated_dir,  # noqa: F811
                                                                           tmp_path, capsys):
    bad = _tampered(rotated_dir, tmp_path / "bad", _rows_the_check_tokens_never_reach, reseal=False)
    assert main(["verify", str(tiny_dirs["gpt2"]), str(bad)]) == EXIT_VERIFY_FAILED
    err = capsys.readouterr().err
    assert "verification failed: normfold_model.safetensors was changed after normfold wrote it" in err


# ------------------------------------------------------------------ --method pca --calibration FILE [--slice F]

def _char_tokenizer(vocab_size: int):
    """A character tokenizer built offline: character chr(32 + i) is token i (the tiny GPT-2's 96 ids)."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {chr(32 + i): i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?", eos_token=" ", pad_token=" ")


@pytest.fixture(scope="module")
def gpt2_with_tokenizer(tiny_dirs, tmp_path_factory):  # noqa: F811
    """The tiny GPT-2 folder with a character tokenizer, and a calibration file of 24 lines."""
    root = tmp_path_factory.mktemp("pca")
    folder = root / "gpt2"
    shutil.copytree(tiny_dirs["gpt2"], folder)
    _char_tokenizer(96).save_pretrained(folder)
    calibration = root / "calibration.txt"
    calibration.write_text("\n".join(f"The {i}th LAYER folds, {i * 7 % 13} times OVER." for i in range(24)) + "\n\n")
    return folder, calibration


@pytest.fixture(scope="module")
def sliced_dir(gpt2_with_tokenizer, tmp_path_factory):
    """``normfold rotate gpt2 -o OUT --method pca --calibration FILE --slice 0.25 --json``."""
    folder, calibration = gpt2_with_tokenizer
    out = tmp_path_factory.mktemp("sliced") / "sliced"
    code = main(["rotate", str(folder), "-o", str(out), "--method", "pca", "--calibration", str(calibration),
                 "--slice", "0.25", "--json"])
    assert code == EXIT_OK
    return out


def _in_memory(folder, calibration, **options):
    original = load_model(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    calls = calibration_calls(original, tokenizer, read_calibration_file(calibration))
    return original, normfold.rotate(original, example_inputs_for(original), method="pca", calibration=calls,
                                     **options)


def test_sliced_folder_reloads_to_the_in_memory_sliced_model_with_its_narrower_widths(gpt2_with_tokenizer,
                                                                                     sliced_dir):
    folder, calibration = gpt2_with_tokenizer
    original, (in_memory, report) = _in_memory(folder, calibration, slice_fraction=0.25)
    reloaded = normfold.from_pretrained(sliced_dir)
    assert reloaded.transformer.wte.weight.shape == (96, 24)  # ⌊0.75 · 32⌋ directions kept
    assert reloaded.transformer.h[0].attn.c_proj.weight.shape == (32, 24)  # heads' width unchanged, stream sliced
    assert reloaded.transformer.h[0].attn.c_proj.nf == 24 and reloaded.transformer.ln_f.normalized_shape == (24,)
    fresh = torch.randint(0, 96, (3, 13), generator=torch.Generator().manual_seed(7))
    assert _rel(_logits(reloaded, fresh), _logits(in_memory, fresh)) <= 1e-5
    assert _rel(_logits(reloaded, fresh), _logits(original, fresh)) > 1e-4  # sliced: approximate, not the original
    assert json.loads((sliced_dir / "config.json").read_text())["n_embd"] == 32  # the config is the original's
    _assert_stock_transformers_refuses(sliced_dir)  # stock would re-initialise the narrower tensors at random


def test_sliced_report_records_method_calibration_fraction_and_the_proof_of_the_whole_rotation(
        gpt2_with_tokenizer, sliced_dir):
    _, calibration = gpt2_with_tokenizer
    report = json.loads((sliced_dir / REPORT_JSON).read_text())
    rotation = report["rotation"]
    sha256 = hashlib.sha256(calibration.read_bytes()).hexdigest()
    assert rotation["method"] == "pca" and rotation["seed"] == 0 and rotation["exact"] is False
    assert report["plan"]["rotation"] == {"method": "pca", "seed": 0, "slice_fraction": 0.25, "kept": [24],
                                          "calibration_sha256": sha256}
    # the calibration text is the user's: only what identifies it is kept, never the sentences
    record = {"sha256": sha256, "num_sentences": 24, "path": str(calibration.absolute())}
    assert report["calibration"] == {**record, "num_batches": 2}
    assert report["recipe"]["calibration"] == record
    assert report["recipe"]["rotation"] == {"method": "pca", "seed": 0, "slice_fraction": 0.25}
    slicing = rotation["slicing"]
    assert slicing["fraction"] == 0.25 and 0.5 < slicing["min_cosine"] < 1.0
    (loss_before, loss_after), = slicing["losses"].values()  # a causal LM: its next-token loss, before and after
    assert math.isfinite(loss_before) and loss_before != loss_after
    assert report["verification"]["ok"] is True and report["verification"]["max_rel_error"] <= 1e-9
    assert {e["name"] for e in report["resized"]} >= {"transformer.wte.weight", "lm_head.weight"}
    assert "sliced: approximate" in report["stock_warning"]


def test_no_calibration_sentence_is_written_into_the_rotated_folder(gpt2_with_tokenizer, sliced_dir):
    _, calibration = gpt2_with_tokenizer
    sentences = read_calibration_file(calibration)
    written = b"".join(path.read_bytes() for path in sliced_dir.iterdir())
    assert len(sentences) == 24 and not [s for s in sentences if s.encode() in written]


def test_pca_without_slicing_is_exact_and_reloads_to_the_original(gpt2_with_tokenizer, tmp_path, capsys):
    folder, calibration = gpt2_with_tokenizer
    out = tmp_path / "pca"
    code, printed, _ = _run(capsys, folder, "-o", out, "--method", "pca", "--calibration", calibration)
    assert code == EXIT_OK and "sliced" not in printed
    report = json.loads((out / REPORT_JSON).read_text())
    assert report["rotation"]["exact"] is True and report["resized"] == []
    fresh = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    assert _rel(_logits(normfold.from_pretrained(out), fresh), _logits(load_model(folder), fresh)) <= 1e-5


def _verify(capsys, *argv) -> tuple[int, str, str]:
    code = main(["verify", *map(str, argv)])
    captured = capsys.readouterr()
    return code, " ".join(captured.out.split()), captured.err


def test_verify_of_a_sliced_folder_needs_the_calibration_file_it_was_made_from(gpt2_with_tokenizer, sliced_dir,
                                                                              tmp_path, capsys):
    folder, calibration = gpt2_with_tokenizer
    code, _, err = _verify(capsys, folder, sliced_dir, "--min-cosine", 0.5)
    assert code == EXIT_VERIFY_FAILED and "made from a calibration text (24 sentences read from" in err
    assert "pass it with --calibration FILE" in err and len(err.strip().splitlines()) == 1
    other = tmp_path / "other.txt"
    other.write_text(calibration.read_text() + "one more line\n")
    code, _, err = _verify(capsys, folder, sliced_dir, "--calibration", other, "--min-cosine", 0.5)
    assert code == EXIT_VERIFY_FAILED and f"the calibration file {other} is not the one this folder was made" in err
    code, _, err = _verify(capsys, folder, sliced_dir, "--calibration", tmp_path / "missing.txt")
    assert code == EXIT_USAGE and "--calibration: file not found" in err


def test_verify_of_a_sliced_folder_judges_the_cosine_by_the_verifiers_bar_and_never_says_exact(
        gpt2_with_tokenizer, sliced_dir, capsys):
    folder, calibration = gpt2_with_tokenizer
    measured = json.loads((sliced_dir / REPORT_JSON).read_text())["rotation"]["slicing"]["min_cosine"]
    code, text, _ = _verify(capsys, folder, sliced_dir, "--calibration", calibration, "--min-cosine", measured - 1e-4)
    assert code == EXIT_OK and "verification: passed (pca rotation, seed 0, 0.25 sliced (approximate))" in text
    assert f"sliced rotation (approximate): cosine {measured:.4g} ≥ {measured - 1e-4:g} on 24 calibration" in text
    assert "exact" not in text and "None" not in text
    assert f"weights: {len(_stored(sliced_dir))} tensors, all bit-identical" in text  # re-made, then compared
    code, text, err = _verify(capsys, folder, sliced_dir, "--calibration", calibration, "--min-cosine",
                              measured + 1e-4)  # a bar the folder does not keep fails, whatever it recorded
    assert code == EXIT_VERIFY_FAILED and f"< {measured + 1e-4:g} on 24 calibration sentences" in text
    assert f"is below the bar {measured + 1e-4!r} on the 24 calibration sentences" in err
    code, _, err = _verify(capsys, folder, sliced_dir, "--calibration", calibration)  # no bar given: 0.999
    assert code == EXIT_VERIFY_FAILED and "is below the bar 0.999" in err


def test_verify_of_a_sliced_folder_fails_weights_changed_afterwards(gpt2_with_tokenizer, sliced_dir, tmp_path, capsys):
    folder, calibration = gpt2_with_tokenizer
    key = "transformer.h.1.mlp.c_proj.weight"

    def tripled(weights):
        weights[key] *= 3.0

    tampered = _tampered(sliced_dir, tmp_path / "tampered", tripled)
    code, _, err = _verify(capsys, folder, tampered, "--calibration", calibration, "--min-cosine", 0.5)
    assert code == EXIT_VERIFY_FAILED and f"verification failed: stored weights: {key} differs" in err


@pytest.mark.parametrize("options, message", [
    (["--method", "pca", "--calibration", "{cal}", "--slice", "1.0"], r"--slice must be in [0, 1)"),
    (["--method", "pca", "--calibration", "{cal}", "--slice", "-0.1"], r"--slice must be in [0, 1)"),
    (["--method", "pca", "--calibration", "{cal}", "--slice", "nan"], r"--slice must be in [0, 1)"),
    (["--slice", "0.2"], "needs --method pca"),
    (["--method", "random", "--calibration", "{cal}", "--slice", "0.2"], "needs --method pca"),
    (["--method", "pca"], "--method pca needs --calibration FILE"),
    (["--calibration", "{cal}"], "used only by --method pca"),
    (["--method", "pca", "--calibration", "{missing}"], "calibration file not found"),
    (["--method", "pca", "--calibration", "{empty}"], "is empty"),
    (["--method", "pca", "--calibration", "{cal}", "--slice", "0.96"], "fewer than the model's 2 attention heads"),
])
def test_bad_pca_and_slice_options_are_refused_in_one_line_before_anything_is_written(
        gpt2_with_tokenizer, tmp_path, capsys, options, message):
    folder, calibration = gpt2_with_tokenizer
    (tmp_path / "empty.txt").write_text("\n  \n")
    paths = {"cal": calibration, "missing": tmp_path / "missing.txt", "empty": tmp_path / "empty.txt"}
    out = tmp_path / "out"
    code, printed, err = _run(capsys, folder, "-o", out, *(o.format(**paths) for o in options))
    assert code == EXIT_USAGE and printed == ""
    assert err.startswith("normfold: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_pca_on_a_folder_without_tokenizer_is_refused(tiny_dirs, gpt2_with_tokenizer, tmp_path, capsys):  # noqa: F811
    _, calibration = gpt2_with_tokenizer
    out = tmp_path / "out"
    code, _, err = _run(capsys, tiny_dirs["gpt2"], "-o", out, "--method", "pca", "--calibration", calibration)
    assert code == EXIT_USAGE and "no tokenizer" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


# ------------------------------------------------------------------ --method learned: bases stored, verify re-makes

LEARNING = ["--method", "learned", "--steps", "3", "--lr", "0.01", "--calibration-count", "8"]


@pytest.fixture(scope="module")
def learned_dir(gpt2_with_tokenizer, tmp_path_factory):
    """``normfold rotate gpt2 -o OUT --method learned --calibration FILE --steps 3 --lr 0.01 --calibration-count 8``."""
    folder, calibration = gpt2_with_tokenizer
    out = tmp_path_factory.mktemp("learned") / "learned"
    code = main(["rotate", str(folder), "-o", str(out), *LEARNING, "--calibration", str(calibration), "--json"])
    assert code == EXIT_OK
    return out


def _bases(folder) -> list[torch.Tensor]:
    tensors = pytest.importorskip("safetensors.torch").load_file(folder / BASES_FILE)
    return [tensors[f"stream.{i}"] for i in range(len(tensors))]


def test_a_learned_folder_stores_its_bases_by_sha_and_reloads_to_the_original(gpt2_with_tokenizer, learned_dir):
    folder, calibration = gpt2_with_tokenizer
    report = json.loads((learned_dir / REPORT_JSON).read_text())
    rotation = report["recipe"]["rotation"]
    assert rotation["method"] == "learned" and rotation["bases_sha256"] == file_sha256(learned_dir / BASES_FILE)
    assert report["recipe"]["calibration"] is None  # verify does not learn again: it needs no calibration text
    learning = report["rotation"]["learning"]
    assert learning["steps"] == 3 and learning["lr"] == 0.01 and learning["returned"] in ("learned", "start")
    assert learning["calibration_file"]["num_sentences"] == 8
    assert learning["calibration_file"]["sha256"] == file_sha256(calibration)
    (q,) = _bases(learned_dir)
    assert q.dtype == torch.float64 and (q.T @ q - torch.eye(32, dtype=torch.float64)).abs().max() <= 1e-12
    assert report["verification"]["ok"] is True and report["verification"]["max_rel_error"] <= 1e-9
    fresh = torch.randint(0, 96, (3, 13), generator=torch.Generator().manual_seed(7))
    assert _rel(_logits(normfold.from_pretrained(learned_dir), fresh), _logits(load_model(folder), fresh)) <= 1e-5


def test_verify_remakes_a_learned_folder_from_its_stored_bases_without_learning(gpt2_with_tokenizer, learned_dir,
                                                                               capsys):
    folder, _ = gpt2_with_tokenizer
    code, text, err = _verify(capsys, folder, learned_dir)
    assert code == EXIT_OK, err
    assert "verification: passed (learned rotation, seed 0)" in text
    assert f"weights: {len(_stored(learned_dir))} tensors, all bit-identical" in text and "exact rotation:" in text


def _with_bases(learned_dir, to, bases, *, record_sha: bool):
    """A copy of ``learned_dir`` at ``to`` whose stored bases are ``bases``; ``record_sha``: the recipe's
    SHA-256 updated to them and the report sealed again (as someone who means it would)."""
    shutil.copytree(learned_dir, to)
    pytest.importorskip("safetensors.torch").save_file({f"stream.{i}": q.contiguous() for i, q in enumerate(bases)},
                                                       to / BASES_FILE)
    if record_sha:
        sha = file_sha256(to / BASES_FILE)
        sealing.reseal(to, lambda report: report["recipe"]["rotation"].update(bases_sha256=sha))
    return to


def test_verify_refuses_stored_bases_that_are_not_the_recipes(gpt2_with_tokenizer, learned_dir, tmp_path, capsys):
    folder, _ = gpt2_with_tokenizer
    (q,) = _bases(learned_dir)
    other = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))[0]
    bad = _with_bases(learned_dir, tmp_path / "bad", [other], record_sha=False)
    code, _, err = _verify(capsys, folder, bad)
    assert code == EXIT_VERIFY_FAILED
    assert "normfold_rotation/bases.safetensors is not the file the recipe names: its SHA-256" in err


def test_verify_refuses_stored_bases_that_are_not_orthogonal_even_when_recorded_and_sealed(
        gpt2_with_tokenizer, learned_dir, tmp_path, capsys):
    folder, _ = gpt2_with_tokenizer
    (q,) = _bases(learned_dir)
    bad = _with_bases(learned_dir, tmp_path / "bad", [q * 1.001], record_sha=True)
    code, _, err = _verify(capsys, folder, bad)
    assert code == EXIT_VERIFY_FAILED
    assert "could not re-make the folder from the original with its recipe (learned rotation, seed 0)" in err
    assert "bases[0] is not orthogonal: max|QᵀQ − I| = 0.002 > 1e-12" in err


def test_verify_fails_a_learned_folder_rotated_by_other_bases_than_it_stores(gpt2_with_tokenizer, learned_dir,
                                                                            tmp_path, capsys):
    # an orthogonal Q recorded and sealed, but the weights were rotated by the learned one: re-made with
    # the stored Q from the original, the weights differ
    folder, _ = gpt2_with_tokenizer
    other = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))[0]
    bad = _with_bases(learned_dir, tmp_path / "bad", [other], record_sha=True)
    code, _, err = _verify(capsys, folder, bad)
    assert code == EXIT_VERIFY_FAILED and "stored weights: transformer." in err


@pytest.mark.parametrize("options, message", [
    (["--method", "learned"], "--method learned needs --calibration FILE"),
    (["--method", "learned", "--calibration", "{cal}", "--steps", "0"], "--steps must be at least 1, got 0"),
    (["--method", "learned", "--calibration", "{cal}", "--lr", "nan"], "--lr must be a positive finite number"),
    (["--method", "learned", "--calibration", "{cal}", "--calibration-count", "0"],
     "--calibration-count must be at least 1, got 0"),
    (["--method", "learned", "--calibration", "{cal}", "--calibration-count", "25"],
     "the calibration count 25 exceeds the 24 sentences of"),
    (["--method", "learned", "--calibration", "{cal}", "--stream"], "--method learned needs the whole model in memory"),
    (["--steps", "3"], "--steps apply only to --method learned, got --method hadamard"),
    (["--method", "pca", "--calibration", "{cal}", "--lr", "0.1", "--calibration-count", "2"],
     "--lr, --calibration-count apply only to --method learned, got --method pca"),
])
def test_bad_learned_options_are_refused_in_one_line_before_anything_is_written(
        gpt2_with_tokenizer, tmp_path, capsys, options, message):
    folder, calibration = gpt2_with_tokenizer
    out = tmp_path / "out"
    code, printed, err = _run(capsys, folder, "-o", out, *(o.format(cal=calibration) for o in options))
    assert code == EXIT_USAGE and printed == ""
    assert err.startswith("normfold: error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out*"))
