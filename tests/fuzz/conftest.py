"""``fold_fuzz`` is a plain module beside the tests (``benchmarks/fuzz_fold.py`` imports it too):
put this folder on sys.path so it imports under any pytest import mode."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
