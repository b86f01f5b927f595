"""``normfold_report.json`` carries a schema version, and every reader refuses another one by name
(``normfold.hf.report.read_folder_report``): a report is never read by guessing what its keys meant."""
from __future__ import annotations

import json
import shutil

import pytest

import normfold
from normfold.hf import CheckpointError, fold_folder
from normfold.hf.output_dir import REPORT_JSON
from normfold.hf.report import REPORT_SCHEMA, read_folder_report, read_report_json

import sealing

pytest.importorskip("safetensors")


@pytest.fixture(scope="module")
def folded(tmp_path_factory, tiny_dirs):
    out = tmp_path_factory.mktemp("schema") / "gpt2-folded"
    fold_folder(tiny_dirs["gpt2"], out)
    return out


def test_every_folder_report_records_the_schema_it_was_written_with(folded, tiny_dirs, tmp_path):
    assert read_report_json(folded)["schema_version"] == REPORT_SCHEMA
    model = normfold.hf.load_model(tiny_dirs["gpt2"])
    folded_model, _ = normfold.fold(model, normfold.hf.example_inputs_for(model))
    folded_model.save_pretrained(tmp_path / "saved")  # the save_pretrained habit writes a folder report too
    assert json.loads((tmp_path / "saved" / REPORT_JSON).read_text())["schema_version"] == REPORT_SCHEMA


@pytest.mark.parametrize("schema", [None, REPORT_SCHEMA + 1, "1"])
def test_a_report_of_another_schema_is_refused_by_every_reader(folded, tiny_dirs, tmp_path, schema):
    changed = tmp_path / "changed"
    shutil.copytree(folded, changed)

    def set_schema(report):
        if schema is None:
            del report["schema_version"]
        else:
            report["schema_version"] = schema
    sealing.reseal(changed, set_schema)  # sealed again: only the schema stands between it and a load
    with pytest.raises(CheckpointError, match=f"report schema {schema!r}; this normfold reads schema {REPORT_SCHEMA}"):
        normfold.from_pretrained(changed)
    with pytest.raises(CheckpointError, match="this normfold reads schema"):
        normfold.verify_folder(tiny_dirs["gpt2"], changed)


def test_a_folder_without_a_report_is_named_not_normfolds(tmp_path):
    with pytest.raises(CheckpointError, match="is not a folder normfold wrote"):
        read_folder_report(tmp_path)
