"""benchmarks/bench_norm.py --quick runs end to end and writes its tables (so the script cannot rot)."""
import csv
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_norm.py"


def test_quick_benchmark_writes_csv_and_markdown(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--quick", "--rounds", "2", "--results-dir", str(tmp_path)],
                   check=True, capture_output=True, timeout=300)
    rows = list(csv.DictReader(open(tmp_path / "bench_norm_quick.csv")))
    contenders = {r["contender"] for r in rows}
    assert {"copy_", "normfold.rms_norm", "nn.LayerNorm", "nn.RMSNorm", "hand-written RMSNorm"} <= contenders
    assert {r["mode"] for r in rows} == {"fwd", "fwd+bwd"}
    assert all(float(r["median_us"]) > 0 for r in rows)
    markdown = (tmp_path / "bench_norm_quick.md").read_text()
    assert "Command: `python" in markdown and "| torch |" in markdown
