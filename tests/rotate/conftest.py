"""The rotate tests start from the model zoo of tests/engine: its fixtures, reused (tests/ put on sys.path,
as tests/fuse/conftest.py does, so this works in any pytest import mode)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.conftest import single_thread, zoo  # noqa: E402,F401
