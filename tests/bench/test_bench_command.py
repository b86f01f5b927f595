"""normfold.bench.cli: the ``normfold bench`` command on a saved folder."""
from __future__ import annotations

import argparse

from normfold.bench.cli import add_commands


def test_bench_command_runs_on_a_folder(tiny_gpt2, tmp_path):
    model = tiny_gpt2()
    model.save_pretrained(tmp_path / "model")
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", str(tmp_path / "model"), "--quick", "--rounds", "2", "--seq", "1",
                              "--no-profile", "--out", str(tmp_path / "out"), "--no-plot"])
    assert args.run(args) == 0
    assert (tmp_path / "out.csv").exists() and (tmp_path / "out.md").exists()
