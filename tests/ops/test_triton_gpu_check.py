"""benchmarks/gpu_check.sh keeps working: its --dry-run runs the GPU check's code path on the
CPU (Triton interpreter, tiny shapes) and writes both result files."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_checks_times_and_writes_tables(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "configurations pass" in done.stdout
    with (tmp_path / "gpu_check.csv").open() as f:
        rows = list(csv.DictReader(f))
    contenders = {r["contender"] for r in rows}
    assert {"normfold rms", "torch rms_norm", "normfold ln", "torch layer_norm", "normfold add+rms"} <= contenders
    assert {r["phase"] for r in rows} == {"fwd", "fwd+bwd"}
    assert all(float(r["median_us"]) > 0 for r in rows)
    report = (tmp_path / "gpu_check.md").read_text()
    assert "## Correctness" in report and "FAIL " not in report.split("## Targets")[0]
    assert "## Speed" in report


def test_gpu_check_refuses_to_run_without_a_gpu_unless_dry_run(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    env = {**os.environ, "OUT": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
    assert not any(tmp_path.iterdir())


def _load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_normfold_gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_timing_drops_a_contender_that_raises_and_times_the_rest():
    gpu_check = _load_gpu_check()
    calls = {"ok": 0}

    def ok():
        calls["ok"] += 1

    def broken():
        raise RuntimeError("no kernel image")

    failed: list[str] = []
    medians = gpu_check.interleaved_medians({"ok": ok, "broken": broken}, reps=3, warmup=1,
                                            timer=gpu_check.Timer(cuda=False), failed=failed)
    assert set(medians) == {"ok"} and medians["ok"] >= 0
    assert calls["ok"] == 4  # one warm-up, three timed
    assert failed == ["broken: RuntimeError: no kernel image"]
