"""``fold_fuzz`` and ``centering_oracle`` are plain modules beside the tests (``benchmarks/fuzz_fold.py``
and ``benchmarks/hf_zoo.py`` import them too):
put this folder on sys.path so it imports under any pytest import mode."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
