"""Tests' helper for the scripts under benchmarks/ (not a package): one loaded by its path as a module."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/``name``.py as the module ``_name`` (registered in sys.modules: its dataclasses need it)."""
    spec = importlib.util.spec_from_file_location(f"_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
