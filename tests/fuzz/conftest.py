"""``fold_fuzz`` and ``centering_oracle`` are plain modules beside the tests (``benchmarks/fuzz_fold.py``
and ``benchmarks/hf_zoo.py`` import them too):
put this folder on sys.path so it imports under any pytest import mode. Every test here runs tiny float64
models on one thread."""
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny float64 models: torch's thread pool only adds contention (100x slower on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)
