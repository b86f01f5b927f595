"""Suite-wide settings; tests/ on sys.path for the helpers shared across test folders (``sealing``),
in any pytest import mode."""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    """Share the cores among pytest-xdist workers: two workers with two intra-op threads each on a
    2-core machine oversubscribe it, and tiny tensors then run several times slower."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

