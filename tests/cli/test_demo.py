"""``normfold demo``: what it says it wrote is there afterwards with ``-o DIR``; without, it says the
temporary folder is gone."""
from __future__ import annotations

import re

import pytest

from normfold.cli import EXIT_OK, main

pytest.importorskip("transformers")
pytest.importorskip("rich")


def _listed(out: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.startswith("wrote ")]
    return [name.strip() for name in line[len("wrote "):].split(",")]


def test_demo_with_output_keeps_every_file_it_lists(capsys, tmp_path):
    code = main(["demo", "-o", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    listed = _listed(out)
    assert code == EXIT_OK and "normfold_zero_mean_graph.png" in listed and "model.safetensors" in listed
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == sorted(listed)
    assert re.search(r"\(into .*demo\)", out)


def test_demo_without_output_says_the_files_are_gone_and_how_to_keep_them(capsys):
    assert main(["demo"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "into a temporary folder, removed now; `normfold demo -o DIR` keeps them" in " ".join(out.split())
