"""The test tree's own rule: pytest imports test modules by basename (no __init__.py), so two test
files with the same name in different folders break collection of the whole suite."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_a_unique_basename():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert len(names) > 50
    assert [name for name, count in names.items() if count > 1] == []
