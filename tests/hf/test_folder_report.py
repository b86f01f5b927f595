"""The folder report is typed (``normfold.hf.folder_report``): what every writer writes reads back as
the same ``FolderReport``, and a report lacking a section, holding a value of another type, counting
its norms wrongly or of another schema version is refused naming what, by every reader."""
from __future__ import annotations

import json
import shutil

import pytest

import normfold
from normfold.hf import CheckpointError, fold_folder
from normfold.hf.card import render_markdown
from normfold.hf.folder_report import REPORT_SCHEMA, FolderReport, FoldSection, Layout, ReportNorm
from normfold.hf.report import read_folder_report, read_report_json
from normfold.hf.streaming import fold_checkpoint

import sealing

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_dirs):
    """Folders of every writer: ``normfold fold`` in memory and streamed, ``save_pretrained`` of a fold."""
    root = tmp_path_factory.mktemp("typed")
    fold_folder(tiny_dirs["gpt2"], root / "fold")
    fold_checkpoint(tiny_dirs["opt"], root / "streamed")
    model = normfold.hf.load_model(tiny_dirs["bert"])
    folded, _ = normfold.fold(model, normfold.hf.example_inputs_for(model))
    folded.save_pretrained(root / "saved")
    return root


@pytest.mark.parametrize("name", ["fold", "streamed", "saved"])
def test_every_written_report_reads_back_typed_and_writes_back_the_same_json(folders, name):
    data = read_report_json(folders / name)
    report = FolderReport.from_json(data)
    assert report.to_json() == data  # write -> read -> write: nothing lost, nothing added
    assert FolderReport.from_json(json.loads(json.dumps(report.to_json()))) == report  # read -> write -> read
    assert report.fold is not None and report.fold.norms and report.layout.swapped
    assert report.recipe is not None and report.digest == data["digest"]


def test_the_typed_fields_are_the_folds(folders, tiny_dirs):
    report = read_folder_report(folders / "fold")
    assert report.model.architecture == "GPT2LMHeadModel" and report.fold_affine is True
    assert report.verification["ok"] and report.fold.counts()["num_foldable"] == len(report.fold.norms) == 5
    assert {n.path for n in report.fold.norms} == {s.path for s in report.layout.swapped}
    assert report.recipe.command == "fold" and report.skipped_files == ()
    assert read_folder_report(folders / "streamed").streaming["bytes_written"] > 0


def _edited(folder, tmp_path, edit):
    """A copy of ``folder`` with its report edited and sealed again (only the edit stands in the way)."""
    changed = tmp_path / "changed"
    shutil.copytree(folder, changed)
    sealing.reseal(changed, edit)
    return changed


@pytest.mark.parametrize("section", ["verification", "swapped", "saved_dtype", "recipe", "plan", "stock_compatible"])
def test_a_report_lacking_a_section_is_refused_naming_it(folders, tmp_path, section):
    """Fails on main f840f32: the report was a dict; normfold.from_pretrained loaded a folder whose
    report lacked any section but "swapped", never reading what was not there."""
    changed = _edited(folders / "fold", tmp_path, lambda report: report.pop(section))
    with pytest.raises(CheckpointError, match=f'is not a normfold report: it lacks "{section}"'):
        normfold.from_pretrained(changed)


@pytest.mark.parametrize("edit, what", [
    (lambda r: r.update(num_foldable=2), '"num_foldable" is 2, but its norms count 5'),
    (lambda r: r["norms"][0].pop("kind"), 'it lacks "norms\\[0\\].kind"'),
    (lambda r: r["norms"][0].update(foldable="yes"), '"norms\\[0\\].foldable" must be true or false, got str'),
    (lambda r: r.update(model=[]), '"model" must be an object, got list'),
    (lambda r: r.update(fuse=3), '"fuse" must be an object or null, got int'),
], ids=["count", "norm kind", "foldable", "model", "section"])
def test_a_report_of_wrong_types_or_counts_is_refused_naming_the_key(folders, tmp_path, edit, what):
    """Fails on main f840f32: every one of these loaded."""
    with pytest.raises(CheckpointError, match=what):
        normfold.from_pretrained(_edited(folders / "fold", tmp_path, edit))


@pytest.mark.parametrize("schema", [None, REPORT_SCHEMA + 1, "1", True])
def test_a_report_of_another_schema_is_refused_by_from_json_with_both_versions(folders, schema):
    data = read_report_json(folders / "fold")
    data["schema_version"] = schema
    with pytest.raises(CheckpointError, match=f"has report schema {schema!r}; this normfold reads schema "
                                              f"{REPORT_SCHEMA}: fold the original again"):
        FolderReport.from_json(data, "the report")


def test_a_report_with_some_fold_keys_but_no_norms_is_refused(folders):
    data = read_report_json(folders / "fold")
    del data["norms"]
    with pytest.raises(CheckpointError, match='lacks "norms" but has'):
        FolderReport.from_json(data)


def test_the_engine_reports_what_blocks_a_norm_and_why_its_affine_stayed_as_fields(tiny_dirs):
    """Fails on main f840f32: both were only inside ``reason``, which the model card parsed."""
    model = normfold.hf.load_model(tiny_dirs["bert"])  # post-LN: every norm reads a residual sum
    _, report = normfold.engine.fold(model, normfold.hf.example_inputs_for(model))
    blocked = [n for n in report.norms if n.blocker is not None]
    assert blocked and all(n.reason.startswith(f"blocked: {n.blocking_path[-1]}: {n.blocker}") for n in blocked)
    kept_affine = [n for n in report.norms if n.affine_kept is not None]
    assert all(n.reason.endswith(f"; affine kept: {n.affine_kept}") for n in kept_affine)


def test_the_report_groups_kept_norms_by_the_blocker_field_not_by_parsing_the_reason():
    """Fails on main f840f32: the card parsed "blocked: WHERE: CAUSE" from the reason, so a reason with
    anything before it (a recognised RMSNorm's note) became a cause of its own with no place."""
    cause = "a residual add whose inputs are not both zero-mean"
    norms = tuple(ReportNorm(f"h.{i}.norm", "RMSNorm", False, False,
                             f"LlamaRMSNorm recognised as an RMSNorm; blocked: aten.add at h.{i}: {cause}",
                             blocking_path=("aten.mul", f"aten.add at h.{i}"), blocker=cause) for i in range(2))
    markdown = render_markdown(FolderReport(Layout(()), "float32", fold=FoldSection(norms)))
    assert f"**2 norms**: {cause}." in markdown and markdown.count(cause) == 1
    assert "| `h.1.norm` | aten.add at h.1 |" in markdown
