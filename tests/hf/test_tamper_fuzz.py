"""The tamper fuzzer's instrument (benchmarks/tamper_fuzz.py), not verify's detection rate (that moves
as verify is rewritten): a change that leaves what loads alone is classified inert, and only then;
every change it generates alters the folder; a trial records the exit code verify really gave; the
controls stop a run whose untouched folders fail; the CSV and markdown hold every trial and miss."""
from __future__ import annotations

import csv
import importlib
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest

from normfold.cli import main as normfold_main

pytest.importorskip("transformers")
pytest.importorskip("rich")
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tamper_fuzz")]  # one worker builds the pool once

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the fuzzer is a script there


@pytest.fixture(scope="module")
def fuzz():
    return importlib.import_module("tamper_fuzz")


@pytest.fixture(scope="module")
def pools(fuzz, tmp_path_factory):
    """The exact fold of the tiny GPT-2 and that of its sharded copy, as the fuzzer builds them."""
    return fuzz.build_pool(tmp_path_factory.mktemp("tamper_pool"), kinds=["fold:gpt2", "fold-sharded:gpt2"])


@pytest.fixture(scope="module")
def pool(pools):
    return pools[:1]


def _padded_safetensors_header(fuzz):
    """A change re-serialising model.safetensors with 8 spaces after its header JSON: other bytes, the
    same tensors and metadata."""
    def tamper(folder, rng, pool):
        path = folder / "model.safetensors"
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        path.write_bytes(struct.pack("<Q", length + 8) + data[8:8 + length] + b" " * 8 + data[8 + length:])
        return fuzz.Change("weight file", "header padded", "8 spaces after the header")
    return tamper


def _nothing(fuzz):
    return lambda folder, rng, pool: fuzz.Change("side-file byte", "nothing", "nothing changed")


def _set_first_element(fuzz, folder: Path, value: float) -> None:
    path = folder / "model.safetensors"
    tensors, metadata = fuzz._read_safetensors(path)
    tensors[min(tensors)].view(-1)[0] = value
    fuzz._write_safetensors(path, tensors, metadata)


def test_a_no_op_is_inert_and_a_reserialised_weight_file_with_the_same_tensors_is_inert(fuzz, pool, tmp_path):
    row = fuzz.run_trial(0, 0, pool, tmp_path, tamper=_nothing(fuzz))
    assert (row["alters_load"], row["inert_reason"]) == ("no", "no file changed")
    assert row["outcome"] in ("inert", "inert, flagged")  # never counted as detected or missed

    row = fuzz.run_trial(1, 0, pool, tmp_path, keep=True, tamper=_padded_safetensors_header(fuzz))
    copy = tmp_path / "trial00001" / pool[0].path.name
    assert (copy / "model.safetensors").read_bytes() != (pool[0].path / "model.safetensors").read_bytes()
    assert row["alters_load"] == "no"
    assert row["inert_reason"] == "model.safetensors: the same tensors, bit for bit, and metadata"


def test_what_can_load_differently_is_never_inert(fuzz, pool, tmp_path):
    pristine = pool[0].path
    folder = tmp_path / "copy"
    shutil.copytree(pristine, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))  # whitespace only: inert
    assert fuzz.inert_reason(pristine, folder) == "config.json: JSON equal once parsed"
    config["n_layer"] = float(config["n_layer"])  # 2 -> 2.0: equal in Python, another type in the file
    (folder / "config.json").write_text(json.dumps(config))
    assert fuzz.inert_reason(pristine, folder) is None
    shutil.copy(pristine / "config.json", folder / "config.json")
    (folder / "extra.txt").write_text("")  # a new file, however empty
    assert fuzz.inert_reason(pristine, folder) is None
    (folder / "extra.txt").unlink()
    tensors, metadata = fuzz._read_safetensors(folder / "model.safetensors")
    fuzz._write_safetensors(folder / "model.safetensors", tensors, {**(metadata or {}), "format": "tf"})
    assert fuzz.inert_reason(pristine, folder) is None  # metadata is part of what loads

    positive, negative = tmp_path / "positive_zero", tmp_path / "negative_zero"
    for copy, zero in ((positive, 0.0), (negative, -0.0)):
        shutil.copytree(pristine, copy)
        _set_first_element(fuzz, copy, zero)
    assert fuzz.inert_reason(positive, negative) is None  # equal as numbers, not bit for bit


def test_every_generated_change_alters_the_folder_and_only_json_whitespace_is_inert(fuzz, pools, tmp_path):
    seen = set()
    for trial in range(160):
        rng = fuzz.trial_rng(7, trial)
        kind = fuzz.CHANGE_KINDS[trial % len(fuzz.CHANGE_KINDS)]
        output = pools[trial // len(fuzz.CHANGE_KINDS) % len(pools)]
        folder = tmp_path / f"t{trial}"
        shutil.copytree(output.path, folder)
        change = fuzz.TAMPERS[kind](folder, rng, pools)
        seen.add((change.kind, change.op))
        inert = fuzz.inert_reason(output.path, folder)
        assert change.kind == kind and change.description
        assert (inert is not None) == (change.op == "json whitespace"), (change, inert)
        shutil.rmtree(folder)
    weight_ops = set(fuzz._weight_ops(pools[0].path)) | set(fuzz._weight_ops(pools[1].path))
    assert {op for k, op in seen if k == "weight file"} == weight_ops  # single-file and sharded layouts
    assert {k for k, _ in seen} == set(fuzz.CHANGE_KINDS)
    assert {"json whitespace", "same-class byte", "random byte", "scale", "negate", "add", "zero",
            "delete field", "alter field"} <= {op for _, op in seen}


def test_a_trial_records_the_exit_code_verify_gives_for_the_changed_folder(fuzz, pool, tmp_path, capsys):
    def truncate_weights(folder, rng, pool):
        path = folder / "model.safetensors"
        path.write_bytes(path.read_bytes()[:100])
        return fuzz.Change("weight file", "truncated", "the first 100 bytes kept")

    for trial, tamper in ((0, truncate_weights), (1, _nothing(fuzz))):
        row = fuzz.run_trial(trial, 0, pool, tmp_path, keep=True, tamper=tamper)
        copy = tmp_path / f"trial{trial:05d}" / pool[0].path.name
        capsys.readouterr()
        direct = normfold_main(fuzz.verify_argv(pool[0].source, copy, pool[0].verify_options))
        assert row["exit_code"] == direct
        assert row["outcome"] == {("yes", True): "detected", ("yes", False): "MISSED", ("no", True): "inert, flagged",
                                  ("no", False): "inert"}[row["alters_load"], direct != 0]
    assert fuzz.run_trial(0, 0, pool, tmp_path / "again", tamper=truncate_weights)["exit_code"] != 0  # a torn file


def test_verify_gets_the_folder_s_options_that_its_parser_has_and_no_others(fuzz, monkeypatch):
    options = (("--calibration", "C"), ("--min-cosine", "0.9"))
    monkeypatch.setattr(fuzz, "verify_options", lambda: frozenset({"--calibration", "--json"}))
    assert fuzz.verify_argv("A", "B", options) == ["verify", "A", "B", "--calibration", "C"]
    assert fuzz.verify_argv("A", "B") == ["verify", "A", "B"]
    monkeypatch.setattr(fuzz, "verify_options", lambda: frozenset({"--json"}))
    assert fuzz.verify_argv("A", "B", options) == ["verify", "A", "B"]
    monkeypatch.setattr(fuzz, "verify_options", lambda: frozenset({"--calibration", "--min-cosine"}))
    assert fuzz.verify_argv("A", "B", options)[3:] == ["--calibration", "C", "--min-cosine", "0.9"]


def test_a_failing_control_stops_the_run_before_any_trial(fuzz, pool, tmp_path, monkeypatch):
    monkeypatch.setattr(fuzz, "build_pool", lambda root: pool)
    monkeypatch.setattr(fuzz, "run_verify", lambda output, folder: (1, "verification failed"))
    assert fuzz.main(["--quick", "--out", str(tmp_path / "run"), "--work-dir", str(tmp_path / "w")]) == 2
    assert not (tmp_path / "run.csv").exists() and not (tmp_path / "w" / "trials").exists()


def test_quick_run_writes_one_csv_row_per_trial_and_lists_every_miss(fuzz, pool, tmp_path, monkeypatch):
    monkeypatch.setattr(fuzz, "build_pool", lambda root: pool)
    explanations = tmp_path / "why.json"
    explanations.write_text(json.dumps({"tensor element": "EXPLAINED-TENSOR"}))
    code = fuzz.main(["--quick", "--seed", "1", "--out", str(tmp_path / "run"), "--explanations", str(explanations)])
    with open(tmp_path / "run.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["trial"]) for r in rows] == list(range(8))
    must = [r for r in rows if r["alters_load"] == "yes"]
    assert all(r["outcome"] == ("detected" if int(r["exit_code"]) else "MISSED") for r in must)
    detected = sum(r["outcome"] == "detected" for r in must)
    assert code == (0 if must and detected / len(must) >= fuzz.BAR else 1)
    text = (tmp_path / "run.md").read_text()
    assert "| fold:gpt2 | - | 0 |" in text  # the control: no options for an exact fold, exit 0
    assert f"## Result: {detected}/{len(must)} (" in text
    misses = [r for r in rows if r["outcome"] == "MISSED"]
    assert f"## Misses ({len(misses)})" in text
    for r in misses:
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {r['trial']} | fold:gpt2 | {r['change_kind']}")]
        assert line.endswith("| EXPLAINED-TENSOR |") == (r["change_kind"] == "tensor element")


def test_the_markdown_lists_a_miss_with_its_change_and_explanation(fuzz, tmp_path):
    row = {"trial": 3, "folder": "fold:x", "change_kind": "report field", "op": "delete plan",
           "change": "plan: {...} -> (deleted)", "alters_load": "yes", "inert_reason": "", "exit_code": 0,
           "outcome": "MISSED", "verify_said": "exact fold", "seconds": "0.1"}
    meta = {"command": "c", "machine": "m", "code": "k", "pool_s": 1.0, "trials_s": 1.0, "verify_takes": "v"}
    explanations = {"report field": "KIND", "fold|delete plan": "FAMILY", "_notes": ["NOTE LINE"]}
    _, md = fuzz.write_results([row], {"fold:x": (0, "ok", "")}, tmp_path / "r", meta, explanations)
    text = md.read_text()
    assert "| 3 | fold:x | report field / delete plan | plan: {...} -> (deleted) | exact fold | FAMILY |" in text
    assert "## Result: 0/1 (0.0 %)" in text and "below the 99 % bar" in text
    assert "## Notes\n\nNOTE LINE\n" in text
    _, md = fuzz.write_results([row], {"fold:x": (0, "ok", "")}, tmp_path / "r", meta,
                               {**explanations, "fold:x|delete plan": "FOLDER"})
    assert "| exact fold | FOLDER |" in md.read_text()  # the most specific key wins
