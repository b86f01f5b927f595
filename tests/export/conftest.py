"""The export tests reuse the model zoo of tests/engine (tiny random GPT-2, OPT, BLOOM, ViT and the real
MiniLM) and the tiny Hugging Face folders of tests/hf (tests/ put on sys.path, as tests/fuse does)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine.conftest import zoo  # noqa: E402,F401
from hf.conftest import tiny_dirs  # noqa: E402,F401
