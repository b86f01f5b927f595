"""Training tests run tiny models: one intra-op thread is faster than two when the CPU is shared
(no spinning threads waiting for each other), and keeps xdist workers from oversubscribing."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
