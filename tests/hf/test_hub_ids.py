"""Hugging Face model ids wherever a model folder goes (``normfold analyze|fold|rotate|verify ID``,
``normfold.from_pretrained(ID, revision=...)``), resolved through ``huggingface_hub.snapshot_download``:
tested offline, on a hub cache built here in the hub's own layout from tiny saved models."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import normfold
from normfold.cli import EXIT_OK, EXIT_USAGE, main
from normfold.hf.inputs import example_inputs_for
from normfold.hf.load import CheckpointError, load_model, resolve_model

hub = pytest.importorskip("huggingface_hub")
pytest.importorskip("rich")

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # a snapshot's folder is named by its commit


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """``folder`` as the hub cache holds a download of ``repo_id`` at ``commit`` on branch main:
    ``models--org--name/snapshots/<commit>/...`` and ``refs/main`` naming the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny_dirs):
    """An offline hub cache holding the tiny GPT-2 as ``org/tiny-gpt2``. huggingface_hub reads
    HF_HUB_CACHE / HF_HUB_OFFLINE when imported: set both in the environment and in its constants."""
    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    add_to_hub_cache(cache, "org/tiny-gpt2", tiny_dirs["gpt2"])
    return cache


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_fold_and_verify_take_a_hub_id_and_from_pretrained_loads_one(capsys, offline_cache, tmp_path):
    out = tmp_path / "folded"
    code, text, _ = _run(capsys, "fold", "org/tiny-gpt2", "-o", out, "--json")
    assert code == EXIT_OK
    assert json.loads(text)["model"]["source"] == str(offline_cache / "models--org--tiny-gpt2" / "snapshots" / COMMIT)
    code, text, _ = _run(capsys, "verify", "org/tiny-gpt2", out, "--revision", COMMIT)
    assert code == EXIT_OK and "passed" in text
    add_to_hub_cache(offline_cache, "org/tiny-gpt2-folded", out)
    loaded = normfold.from_pretrained("org/tiny-gpt2-folded", revision=COMMIT)
    assert isinstance(loaded.transformer.h[1].ln_1, normfold.RMSNorm)
    original = load_model(resolve_model("org/tiny-gpt2"))
    inputs = example_inputs_for(original)
    torch.testing.assert_close(loaded(**inputs).logits, original(**inputs).logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("argv, says", [
    (["fold", "org/missing", "-o", "{tmp}/out"],
     "normfold: error: model 'org/missing' is neither a folder nor in the hub cache (offline): "),
    (["fold", "org/tiny-gpt2", "--revision", "v9", "-o", "{tmp}/out"],
     "normfold: error: model 'org/tiny-gpt2' at revision 'v9' is neither a folder nor in the hub cache (offline)"),
    (["analyze", "{tmp}", "--revision", "v9"], "a revision ('v9') applies to a hub model id, not to the folder"),
    (["verify", "org/missing", "{tmp}"], "model 'org/missing' is neither a folder nor in the hub cache"),
])
def test_an_id_that_cannot_be_fetched_is_one_line_naming_it(capsys, offline_cache, tmp_path, argv, says):
    code, _, err = _run(capsys, *[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == EXIT_USAGE and says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_from_pretrained_of_an_id_not_in_the_cache_is_a_checkpoint_error(offline_cache):
    with pytest.raises(CheckpointError, match=r"^model 'org/missing' is neither a folder nor in the hub cache"):
        normfold.from_pretrained("org/missing")


def test_a_folder_wins_over_an_id_of_the_same_spelling(offline_cache, tmp_path, monkeypatch, tiny_dirs):
    shutil.copytree(tiny_dirs["gpt2"], tmp_path / "org" / "tiny-gpt2")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny-gpt2") == Path("org/tiny-gpt2")


@pytest.mark.parametrize("command", ["fold", "rotate"])
def test_fold_and_rotate_need_a_model_or_bundled(capsys, tmp_path, command):
    code, _, err = _run(capsys, command, "-o", tmp_path / "out")
    assert code == EXIT_USAGE and f"{command} needs MODEL_DIR: a folder or a Hugging Face model id" in err
    assert "--bundled" in err and not (tmp_path / "out").exists()
    code, _, err = _run(capsys, command, "org/x", "--bundled", "-o", tmp_path / "out")
    assert code == EXIT_USAGE and "give MODEL_DIR (org/x) or --bundled, not both" in err


def test_the_command_line_honours_hf_home_and_hf_hub_offline_from_the_environment(tmp_path, tiny_dirs):
    """As a user runs it: a fresh process, the cache found through HF_HOME alone, offline."""
    add_to_hub_cache(tmp_path / "home" / "hub", "org/tiny-gpt2", tiny_dirs["gpt2"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(Path(normfold.__file__).parents[1]), env.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "normfold", "analyze", "org/tiny-gpt2", "--json"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_norms"] == 5
