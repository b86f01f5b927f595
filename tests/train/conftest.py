"""Training tests run tiny models: one intra-op thread is faster than two when the CPU is shared
(no spinning threads waiting for each other), and keeps xdist workers from oversubscribing."""
import pytest
import torch

from normfold.train import trainer


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def interrupt_at_step(monkeypatch):
    """``interrupt_at_step(k)``: the optimizer step of step ``k`` (1-based) of the next runs raises
    KeyboardInterrupt, as a preemption would; ``interrupt_at_step(None)`` lifts it."""
    real = trainer.apply_gradients

    def interrupt(step: int | None) -> None:
        if step is None:
            monkeypatch.setattr(trainer, "apply_gradients", real)
            return
        calls = []

        def apply_gradients(*args, **kwargs):
            calls.append(1)
            if len(calls) == step:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(trainer, "apply_gradients", apply_gradients)

    return interrupt
