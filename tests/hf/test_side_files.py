"""Side files: ``normfold fold`` (in memory and streaming) carries every non-weight file of the input
folder over, subfolders included, and never follows a link (``copy_side_files``)."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from normfold.hf import fold_folder
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.streaming import fold_checkpoint

pytest.importorskip("transformers")


def _folder_with_side_files(source, root):
    """``source`` (a tiny model) plus the files of a real sentence-transformers folder, a nested folder,
    files that must not be copied, and links: to a secret outside, to a file inside, to a folder outside."""
    model = root / "model"
    shutil.copytree(source, model)
    (root / "secret.txt").write_text("TOKEN=hunter2")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "notes.txt").write_text("TOKEN=hunter2")
    side = {"README.md": "# tiny", "tokenizer.json": "{}", "generation_config.json": '{"do_sample": false}',
            "modules.json": json.dumps([{"idx": 0, "name": "0", "path": "", "type": "T"},
                                        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "P"},
                                        {"idx": 2, "name": "2", "path": "2_Dense", "type": "D"}]),
            "config_sentence_transformers.json": "{}", "sentence_bert_config.json": "{}",
            "1_Pooling/config.json": '{"pooling_mode_mean_tokens": true}', "2_Dense/config.json": "{}",
            "2_Dense/model.safetensors": "dense weights", "docs/deeper/notes.txt": "notes", ".gitattributes": "*"}
    for name, text in side.items():
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_text(text)
    for name in ("pytorch_model.bin", "onnx/model.onnx", "normfold_report.md"):  # never carried over
        (model / name).parent.mkdir(parents=True, exist_ok=True)
        (model / name).write_text("unfolded weights")
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref")
    os.symlink("../secret.txt", model / "LICENSE")
    os.symlink("tokenizer.json", model / "tokenizer_copy.json")
    os.symlink(root / "elsewhere", model / "linked_folder")
    os.mkfifo(model / "pipe")
    return model, side


_FOLDS = {"in memory": fold_folder, "streaming": fold_checkpoint}


@pytest.mark.parametrize("path", _FOLDS)
def test_fold_carries_every_side_file_over_and_skips_links_and_weights(tiny_dirs, tmp_path, path):
    model, side = _folder_with_side_files(tiny_dirs["gpt2"], tmp_path)
    out = tmp_path / "out"
    report = _FOLDS[path](model, out)
    for name, text in side.items():
        if name == "README.md":  # the model card: the original's, then normfold's section
            card = (out / name).read_text()
            assert card.startswith(text + "\n\n## Folded by normfold\n"), card
        elif name != "generation_config.json":  # the fold writes its own
            assert (out / name).read_text() == text, name
    for name in ("LICENSE", "tokenizer_copy.json", "linked_folder", "pipe", "pytorch_model.bin", "onnx", ".git"):
        assert not os.path.lexists(out / name), name
    assert "unfolded weights" not in (out / "normfold_report.md").read_text()  # the fold's own report, not the stale one
    assert not any("hunter2" in p.read_text(errors="ignore") for p in out.rglob("*") if p.is_file())
    skipped = {s["path"]: s["reason"] for s in report["skipped_files"]}
    assert skipped == {"LICENSE": "symbolic link, not followed", "tokenizer_copy.json": "symbolic link, not followed",
                       "linked_folder": "symbolic link, not followed", "pipe": "not a regular file",
                       ".git/": "hidden folder", "onnx/model.onnx": "weight file of the unfolded model"}
    assert json.loads((out / REPORT_JSON).read_text())["skipped_files"] == report["skipped_files"]


def test_fold_command_warns_about_each_skipped_file_on_stderr(tiny_dirs, tmp_path, capsys):
    from normfold.cli import main

    model, _ = _folder_with_side_files(tiny_dirs["gpt2"], tmp_path)
    assert main(["fold", str(model), "-o", str(tmp_path / "out"), "--json"]) == 0
    captured = capsys.readouterr()
    assert "not copied from the input folder: LICENSE (symbolic link, not followed)" in captured.err
    assert json.loads(captured.out)["skipped_files"]  # --json: stdout stays JSON, the list is in it


def _hub_snapshot(source, root):
    """``source`` laid out as the Hugging Face hub cache does: ``models--org--name/snapshots/<rev>/``
    whose files are links into the repository's ``blobs/``, plus one link that leaves ``blobs/``."""
    repo = root / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    files = {p.relative_to(source).as_posix(): p.read_bytes() for p in sorted(source.rglob("*")) if p.is_file()}
    files.update({"tokenizer.json": b'{"tok": 1}', "modules.json": b"[]", "1_Pooling/config.json": b'{"mean": true}'})
    for i, (name, data) in enumerate(files.items()):
        (blobs / f"blob{i:03d}").write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blobs / f"blob{i:03d}", (snapshot / name).parent), snapshot / name)
    (root / "secret.txt").write_text("TOKEN=hunter2")
    os.symlink(os.path.relpath(root / "secret.txt", snapshot), snapshot / "README.md")
    return snapshot


@pytest.mark.parametrize("path", _FOLDS)
def test_a_hub_cache_snapshot_folds_with_its_side_files_read_through_its_own_blob_links(tiny_dirs, tmp_path, path):
    """In the hub cache every file is a link into blobs/: those are the folder's own files and are copied
    (as regular files); a link leaving blobs/ is still skipped, and the weights are folded, not copied."""
    snapshot = _hub_snapshot(tiny_dirs["gpt2"], tmp_path)
    out = tmp_path / "out"
    report = _FOLDS[path](snapshot, out)
    assert (out / "tokenizer.json").read_text() == '{"tok": 1}'
    assert (out / "1_Pooling" / "config.json").read_text() == '{"mean": true}'
    assert not any(p.is_symlink() for p in out.rglob("*"))
    card = out / "README.md"  # the link was not followed: the card is normfold's section alone
    assert not card.is_symlink() and card.read_text().startswith("## Folded by normfold") and "hunter2" not in card.read_text()
    assert {s["path"]: s["reason"] for s in report["skipped_files"]} == {"README.md": "symbolic link, not followed"}
    assert report["verification"]["ok"]
