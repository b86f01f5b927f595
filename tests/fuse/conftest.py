"""The fuse tests fold the model zoo of tests/engine first: its fixtures, reused (tests/ put on sys.path,
as tests/test_cli.py does, so this works in any pytest import mode)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.conftest import zoo  # noqa: E402,F401
