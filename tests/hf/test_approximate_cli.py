"""``normfold fold --approximate --calibration FILE`` and ``normfold verify --calibration FILE`` of its
folder: a tiny random BERT with its own WordPiece tokenizer."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch

from normfold.cli import EXIT_OK, EXIT_USAGE, EXIT_VERIFY_FAILED, main

import sealing
from tiny_models import nontrivial_layer_norms

transformers = pytest.importorskip("transformers")
pytest.importorskip("rich")

MIN_COSINE = 0.9  # low enough that random weights let some Post-LN norms go
_WORDS = ("the a cat dog sat ran on under mat house big small red blue fast slow and with tree "
          "bird sang sky river flows over stone green old new").split()


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A 2-layer, hidden-32 random BertModel folder with a WordPiece tokenizer built offline."""
    root = tmp_path_factory.mktemp("approx_bert")
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *_WORDS]) + "\n")
    folder = root / "bert"
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(vocab))
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = nontrivial_layer_norms(transformers.BertModel(config))  # non-trivial γ/β, as a trained model has
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def sentences():
    gen = torch.Generator().manual_seed(0)
    return [" ".join(_WORDS[i] for i in torch.randint(0, len(_WORDS), (int(n),), generator=gen))
            for n in torch.randint(3, 9, (20,), generator=gen)]


@pytest.fixture
def calibration(tmp_path, sentences):
    path = tmp_path / "calibration.txt"
    path.write_text("\n\n".join(sentences) + "\n\n", encoding="utf-8")  # blank lines are skipped
    return path


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _embeddings(model, tokenizer, sentences):
    from normfold.lab import mean_pooled

    batch = dict(tokenizer(sentences, padding=True, return_tensors="pt"))
    with torch.no_grad():
        return mean_pooled(model, batch)  # (N, C)


def test_approximate_fold_replaces_norms_and_from_pretrained_rebuilds_them(capsys, tmp_path, bert_dir, calibration,
                                                                           sentences):
    out_dir = tmp_path / "out"
    code, out, err = _run(capsys, "fold", bert_dir, "-o", out_dir, "--approximate", "--calibration", calibration,
                          "--min-cosine", MIN_COSINE, "--json")
    assert code == EXIT_OK, err
    report = json.loads(out)  # stdout stays pure JSON; the warning goes to stderr
    assert report["num_approximate"] >= 1
    assert report["calibration_min_cosine"] >= MIN_COSINE
    assert f"{report['num_approximate']} norm" in err and "normfold.from_pretrained" in err

    saved = json.loads((out_dir / "normfold_report.json").read_text())
    approximate = {e["path"] for e in saved["swapped"] if e["approximate"]}
    assert len(approximate) == saved["num_approximate"] == report["num_approximate"]
    markdown = (out_dir / "normfold_report.md").read_text()
    assert "NOT exact" in markdown and f"## Replaced approximately ({saved['num_approximate']}): NOT exact" in markdown
    assert all(f"| `{path}` | cosine " in markdown for path in approximate)  # each replaced norm with its cosine
    copied = transformers.AutoTokenizer.from_pretrained(out_dir, local_files_only=True)  # the tokenizer came along
    assert copied("the cat sat")["input_ids"] == \
        transformers.AutoTokenizer.from_pretrained(bert_dir, local_files_only=True)("the cat sat")["input_ids"]

    import normfold
    from normfold.nn import RMSNorm

    reloaded = normfold.from_pretrained(out_dir)
    assert all(isinstance(reloaded.get_submodule(p), RMSNorm) for p in approximate)
    with pytest.raises(OSError, match="no file named model.safetensors"):  # stock would rebuild LayerNorms there
        transformers.BertModel.from_pretrained(out_dir)

    tokenizer = transformers.AutoTokenizer.from_pretrained(bert_dir, local_files_only=True)
    original = transformers.BertModel.from_pretrained(bert_dir, attn_implementation="eager").eval()
    cos = torch.nn.functional.cosine_similarity(_embeddings(original, tokenizer, sentences).double(),
                                                _embeddings(reloaded, tokenizer, sentences).double(), dim=-1)
    assert cos.min().item() >= MIN_COSINE - 1e-4  # float32 save/reload rounding on top of the measured cosine
    assert cos.min().item() == pytest.approx(report["calibration_min_cosine"], abs=1e-4)

    # the calibration text is the user's: the report keeps only its SHA-256, count and path
    assert saved["recipe"]["calibration"] == {"sha256": hashlib.sha256(calibration.read_bytes()).hexdigest(),
                                              "num_sentences": len(sentences), "path": str(calibration.absolute())}
    written = b"".join(path.read_bytes() for path in out_dir.iterdir() if path.is_file())
    assert [s for s in sentences if s.encode() in written] == []

    # verify re-makes the folder from the same file and measures it against the verifier's bar
    code, out, _ = _run(capsys, "verify", bert_dir, out_dir, "--calibration", calibration, "--min-cosine", MIN_COSINE)
    assert code == EXIT_OK, out
    (line,) = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("outputs: approximate fold:")]
    assert f" ≥ {MIN_COSINE:g} on {len(sentences)} calibration sentences (mean-pooled sentence embeddings" in line
    code, out, _ = _run(capsys, "verify", bert_dir, out_dir, "--calibration", calibration, "--min-cosine", MIN_COSINE,
                        "--json")
    ver = json.loads(out)["verification"]  # full precision; the same cosine the fold measured, up to float32 noise
    assert code == EXIT_OK and ver["ok"] and ver["kind"] == f"approximate fold (fitted to cosine {MIN_COSINE:g})"
    assert ver["files"]["weights"]["ok"] and ver["files"]["weights"]["worst"] is None  # re-made bit for bit
    outputs = ver["outputs"]
    assert outputs["promised_min_cosine"] == MIN_COSINE
    assert outputs["min_cosine"] == pytest.approx(report["calibration_min_cosine"], abs=1e-4)
    assert f"cosine {outputs['min_cosine']:.4g} ≥" in line


def _approximate_folder(capsys, tmp_path, bert_dir, calibration) -> tuple:
    out_dir = tmp_path / "out"
    code, _, err = _run(capsys, "fold", bert_dir, "-o", out_dir, "--approximate", "--calibration", calibration,
                        "--min-cosine", MIN_COSINE)
    assert code == EXIT_OK, err
    return out_dir, json.loads((out_dir / "normfold_report.json").read_text())


def test_verify_of_an_approximate_folder_judges_by_the_verifiers_bar_never_the_folders(capsys, tmp_path, bert_dir,
                                                                                      calibration):
    out_dir, saved = _approximate_folder(capsys, tmp_path, bert_dir, calibration)
    measured = saved["calibration_min_cosine"]
    assert saved["recipe"]["approximate_min_cosine"] == MIN_COSINE < measured  # the bar the folder was fitted to
    bar = (1.0 + measured) / 2  # a bar the folder never met, though it keeps its own
    code, out, err = _run(capsys, "verify", bert_dir, out_dir, "--calibration", calibration, "--min-cosine", bar)
    assert code == EXIT_VERIFY_FAILED and "FAILED" in out
    assert f"< {bar:g} on 20 calibration sentences" in out
    assert len(err.strip().splitlines()) == 1 and f"is below the bar {bar!r} on the 20 calibration sentences" in err
    code, out, _ = _run(capsys, "verify", bert_dir, out_dir, "--calibration", calibration, "--json")
    assert json.loads(out)["verification"]["outputs"]["promised_min_cosine"] == 0.999  # no bar given: normfold's


def test_verify_of_an_approximate_folder_needs_the_calibration_file_it_was_made_from(capsys, tmp_path, bert_dir,
                                                                                     calibration):
    out_dir, _ = _approximate_folder(capsys, tmp_path, bert_dir, calibration)
    code, _, err = _run(capsys, "verify", bert_dir, out_dir, "--min-cosine", MIN_COSINE)
    assert code == EXIT_VERIFY_FAILED and len(err.strip().splitlines()) == 1
    assert "made from a calibration text (20 sentences read from" in err and "pass it with --calibration FILE" in err
    other = tmp_path / "other.txt"
    other.write_text(calibration.read_text(encoding="utf-8").replace("\n\n", "\n"), encoding="utf-8")  # same sentences
    code, _, err = _run(capsys, "verify", bert_dir, out_dir, "--calibration", other, "--min-cosine", MIN_COSINE)
    assert code == EXIT_VERIFY_FAILED and f"the calibration file {other} is not the one this folder was made" in err
    code, _, err = _run(capsys, "verify", bert_dir, out_dir, "--calibration", tmp_path / "missing.txt")
    assert code == EXIT_USAGE and "--calibration: file not found" in err


@pytest.mark.parametrize("min_cosine", ["0", "-0.5", "1.5", "nan"])
def test_verify_refuses_a_min_cosine_outside_zero_one(capsys, tmp_path, bert_dir, min_cosine):
    code, out, err = _run(capsys, "verify", bert_dir, bert_dir, "--min-cosine", min_cosine)
    assert code == EXIT_USAGE and out == "" and "--min-cosine must be in (0, 1]" in err


def test_an_approximate_folder_whose_report_was_edited_fails_the_seal_or_the_remade_report(capsys, tmp_path, bert_dir,
                                                                                         calibration):
    out_dir, saved = _approximate_folder(capsys, tmp_path, bert_dir, calibration)
    saved["calibration_min_cosine"] = 1.0  # a better cosine than the fold measured
    (out_dir / "normfold_report.json").write_text(json.dumps(saved))
    options = ("--calibration", calibration, "--min-cosine", MIN_COSINE)
    code, _, err = _run(capsys, "verify", bert_dir, out_dir, *options)
    assert code == EXIT_VERIFY_FAILED and "normfold_report.json was changed after normfold wrote it" in err
    sealing.reseal(out_dir)  # sealed again: the re-made report disagrees
    code, _, err = _run(capsys, "verify", bert_dir, out_dir, *options)
    assert code == EXIT_VERIFY_FAILED
    assert "normfold_report.json differs from the report of the re-made folder at calibration_min_cosine (1.0" in err
    for key in ("recipe", "files", "digest"):  # a report stripped of its seal and recipe: nothing to re-make the folder from
        del saved[key]
    (out_dir / "normfold_report.json").write_text(json.dumps(saved))
    code, out, err = _run(capsys, "verify", bert_dir, out_dir, *options, "--json")
    problems = json.loads(out)["verification"]["problems"]
    assert code == EXIT_VERIFY_FAILED and len(problems) == 2
    assert "carries no digest" in problems[0] and "it records no recipe" in problems[1]


def _refused(capsys, *argv):
    code, _, err = _run(capsys, "fold", *argv)
    assert code == EXIT_USAGE
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normfold: error:")
    return lines[0]


def test_approximate_without_calibration_is_refused(capsys, tmp_path, bert_dir):
    assert "--calibration" in _refused(capsys, bert_dir, "-o", tmp_path / "out", "--approximate")
    assert not (tmp_path / "out").exists()


def test_calibration_without_approximate_is_refused(capsys, tmp_path, bert_dir, calibration):
    assert "--approximate" in _refused(capsys, bert_dir, "-o", tmp_path / "out", "--calibration", calibration)


@pytest.mark.parametrize("min_cosine", [0, -0.5, 1.5])
def test_min_cosine_outside_zero_one_is_refused(capsys, tmp_path, bert_dir, calibration, min_cosine):
    line = _refused(capsys, bert_dir, "-o", tmp_path / "out", "--approximate", "--calibration", calibration,
                    "--min-cosine", min_cosine)
    assert "(0, 1]" in line


def test_missing_or_empty_calibration_file_is_refused(capsys, tmp_path, bert_dir):
    assert "not found" in _refused(capsys, bert_dir, "-o", tmp_path / "out", "--approximate", "--calibration",
                                   tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n", encoding="utf-8")
    assert "empty" in _refused(capsys, bert_dir, "-o", tmp_path / "out", "--approximate", "--calibration", empty)
    assert not (tmp_path / "out").exists()


def test_folder_without_tokenizer_is_refused(capsys, tmp_path, tiny_dirs, calibration):
    line = _refused(capsys, tiny_dirs["bert"], "-o", tmp_path / "out", "--approximate", "--calibration", calibration)
    assert "tokenizer" in line
    assert not (tmp_path / "out").exists()

